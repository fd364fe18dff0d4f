"""``prep inspect``: what a checkpoint is, and what it can be converted to."""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
import pathlib
import tempfile
from typing import Any, Callable

from layouts.engines import EngineProfile, engine_names, get_engine
from layouts.errors import LayoutsError
from layouts.families import language_config
from layouts.manifest import MANIFEST_NAME

from .file_plan import plan_files
from .converted import ConvertedCheckpoint
from .deepseek import classify, convertible_engines, plan_bf16, plan_groups, split_bf16, target_for
from .errors import PrepError
from .safetensors_writer import nbytes
from .source import SourceCheckpoint, hub_offline, looks_like_repo_id

TP_CANDIDATES = (1, 2, 4, 8, 16)


def inspect_path(src: str, revision: str | None = None, progress: Callable[[int], None] | None = None,
                 on_total: Callable[[int], None] | None = None,
                 engines: list[EngineProfile] | None = None) -> tuple[dict[str, Any], list[str]]:
    """What ``src`` is; for a source, which layouts and TP sizes each of ``engines`` (default:
    every engine prep converts for) can be converted to. ``on_total`` gets the number of
    (engine, layouts, TP) checks and ``progress`` one per check done (each plans every group:
    seconds on a large model)."""
    if (pathlib.Path(src) / MANIFEST_NAME).is_file():
        return _inspect_converted(src)
    return _inspect_source(src, revision, progress, on_total, engines or convertible_engines())


def _inspect_source(spec: str, revision: str | None, progress: Callable[[int], None] | None,
                    on_total: Callable[[int], None] | None,
                    engines: list[EngineProfile]) -> tuple[dict[str, Any], list[str]]:
    if not _remote_repo(spec):
        return _describe_source(SourceCheckpoint.open(spec, revision), spec, progress, on_total, engines)
    from .hub_headers import cached_snapshot, mirror_headers

    local = cached_snapshot(spec, revision)
    if local is not None:  # all of it is in the hub cache already
        return _describe_source(SourceCheckpoint.open(spec, revision), spec, progress, on_total, engines)
    with tempfile.TemporaryDirectory(prefix="prep-inspect-") as tmp:
        fetched = mirror_headers(spec, revision, pathlib.Path(tmp))
        src = SourceCheckpoint(pathlib.Path(tmp), {"kind": "hf-headers", "repo_id": spec,
                                                   "revision": revision or "main"})
        result, lines = _describe_source(src, f"{spec} (read from the hub: config, index and "
                                              f"{fetched['shards']} shard headers, "
                                              f"{fetched['header_bytes'] / 2**20:.1f} MiB; nothing downloaded)",
                                         progress, on_total, engines)
    result["path"] = spec
    result["read_from_hub"] = fetched
    return result, lines


def _remote_repo(spec: str) -> bool:
    """Whether ``spec`` names a hub repo (not a local folder) that may be read over the network."""
    return not pathlib.Path(spec).expanduser().exists() and looks_like_repo_id(spec) and not hub_offline()


def _status(src: SourceCheckpoint, cls, engine: EngineProfile, layout: str, moe: str, tp: int,
            split: dict[tuple[str, int], str]) -> str:
    """"ok", "ok with --ep N" (the MoE converts only with whole experts per rank: the refusal says
    so, :func:`prep.deepseek.plan_groups`), or why not. FP8 block-scaled weights split by whole
    blocks (:func:`prep.deepseek.plan_bf16`, the same for every layout: ``split`` remembers it per
    engine and TP size)."""
    try:
        plan_groups(src, cls, target_for(engine, layout=layout, moe_layout=moe, tp=tp), engine)
    except (PrepError, LayoutsError) as e:  # a constraint this target breaks: say which, and the fix
        ep = getattr(e, "converts_with_ep", None)
        return f"ok with --ep {ep}" if ep else str(e)
    if not cls.fp8_block:
        return "ok"
    if (engine.name, tp) not in split:
        split[engine.name, tp] = _block_status(src, cls, engine, tp)
    return split[engine.name, tp]


def _block_status(src: SourceCheckpoint, cls, engine: EngineProfile, tp: int) -> str:
    """Whether FP8 block-scaled weights split over ``tp`` by whole blocks, else with whole experts."""
    try:
        plan_bf16(src, cls, target_for(engine, tp=tp), engine)
        return "ok"
    except PrepError as e:
        try:
            plan_bf16(src, cls, target_for(engine, tp=tp, ep=tp), engine)
            return f"ok with --ep {tp}"
        except PrepError:
            return str(e)


def _describe_source(src: SourceCheckpoint, label: str, progress: Callable[[int], None] | None,
                     on_total: Callable[[int], None] | None,
                     engines: list[EngineProfile]) -> tuple[dict[str, Any], list[str]]:
    cls = classify(src)
    kinds = collections.Counter(cls.modules.values())
    bf16 = collections.Counter(src.tensors[n].dtype for n in cls.passthrough)
    # every pair of layouts some configuration of each engine reads, at each TP size
    targets = {e.name: e.inspect_targets() for e in engines}
    if on_total:
        on_total(sum(map(len, targets.values())) * len(TP_CANDIDATES))
    support: dict[str, dict[str, dict[str, str]]] = {}
    split: dict[tuple[str, int], str] = {}
    for engine in engines:
        table = support[engine.name] = {}
        for layout, moe in targets[engine.name]:
            row = table[f"{layout}+{moe}"] = {}
            for tp in TP_CANDIDATES:
                row[str(tp)] = _status(src, cls, engine, layout, moe, tp, split)
                if progress:
                    progress(1)
    result = {
        "path": str(src.root), "format": "deepseek-fp8" if cls.fp8_block else "quark-mxfp4", "arch": cls.arch, "num_layers": cls.num_layers,
        "mtp_layers": cls.mtp_layers, "files": len(src.files), "tensors": len(src.tensors), "bytes": src.nbytes(),
        "mxfp4_modules_by_kind": dict(sorted(kinds.items())), "passthrough_by_dtype": dict(sorted(bf16.items())),
        "exclude": src.quant_config.get("exclude", []), "layouts_by_tp": support,
        "fp8_channel_linears": len(cls.fp8), "fp8_block_linears": len(cls.fp8_block),
    }
    # As the user named it, as every other line of prep does (a repo id: and where its snapshot is).
    if src.origin.get("kind") == "hf":
        label = f"{label} ({src.root})"
    # MTP layers as the checkpoint holds them: an amd-quark export made with transformers 5 says
    # num_nextn_predict_layers 1 in config.json and has no tensor of it.
    held_mtp = [i for i in cls.mtp_layers if any(n.startswith(f"model.layers.{i}.") for n in src.tensors)]
    missing = sorted(set(cls.mtp_layers) - set(held_mtp))
    mtp = " + MTP " + str(held_mtp) if held_mtp else ", no MTP layer"
    if missing:
        mtp += f" (config.json names {cls.mtp_layers}; the checkpoint holds no tensor of {missing})"
    result["mtp_layers_held"] = held_mtp
    # What each engine would read from config.json otherwise than the checkpoint means (its profile's notes).
    notes = {e.display_name: e.source_notes(src.config) for e in map(get_engine, engine_names())}
    result["engine_notes"] = {k: v for k, v in notes.items() if v}
    what = "DeepSeek FP8 (128x128 block scales)" if cls.fp8_block else "Quark MXFP4"
    fam = cls.family
    sizes = ", ".join(f"{v} {k}" for k, v in (("routed experts", src.config.get("n_routed_experts")),
                                             ("heads", src.config.get("num_attention_heads"))) if v)
    result["family"] = fam.name
    lines = [f"{label}: {what}, {fam.label} ({', '.join(x for x in (sizes, fam.twist) if x)}), {cls.arch}, "
             f"{cls.num_layers} layers{mtp}",
             f"  {len(src.files)} shards, {len(src.tensors)} tensors, {src.nbytes() / 2**30:.3f} GiB",
             "  MXFP4 GEMM weights by module kind: " + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"),
             "  not MXFP4 (split per rank as the engine holds them): "
             + ", ".join(f"{v} {k}" for k, v in sorted(bf16.items()))]
    if cls.fp8_block:  # DeepSeek's own FP8 release
        able = [e.display_name for e in engines if e.fp8_block_linears]
        lines.append(f"  FP8 block-scaled linears and experts: {len(cls.fp8_block)} ({cls.fp8_block[0]}, ...), each "
                     "weight_scale_inv split by whole 128x128 blocks with its weight, the weights in the engine's "
                     "FP8 layout" + (f"; served by {', '.join(able)}" if able else "; no engine's door serves them yet"))
    if cls.fp8:  # Quark's FP8 per-channel override (MTP-MoEFP4, the AttnFP8 checkpoints)
        able = [e.display_name for e in engines if e.fp8_channel_linears]
        unable = [e.display_name for e in engines if not e.fp8_channel_linears]
        fix = " or ".join(f"--engine {e.name}" for e in convertible_engines() if e.fp8_channel_linears)
        lines.append(f"  FP8 per-channel linears: {len(cls.fp8)} ({cls.fp8[0]}, ...), each weight_scale split with its "
                     "weight's rows, padded and shuffled as the engine holds them where it has FP8 layouts (else the "
                     "source's bytes, which its door lays out)"
                     + (f"; served by {', '.join(able)}" if able else "")
                     + (f"; not by {', '.join(unable)} (refused: convert for {fix})" if unable else ""))
    for engine in engines:
        lines.append(f"  {engine.display_name} (--engine {engine.name}), layouts by TP size:")
        for combo, row in support[engine.name].items():
            ok = [tp if r == "ok" else f"{tp} (with --ep {tp})" for tp, r in row.items() if r.startswith("ok")]
            bad = {tp: r for tp, r in row.items() if not r.startswith("ok")}
            lines.append(f"    {combo}: tp {', '.join(ok) or 'none'}"
                         + (f"; tp {min(bad, key=int)} refused: {bad[min(bad, key=int)]}" if bad else ""))
    lines += [f"  note for {engine}: {line}" for engine, said in notes.items() for line in said]
    # What a conversion with the first engine's default layouts writes, against the free space where
    # a default OUT goes (the current folder): planned from the headers alone, no byte of data read.
    default = target_for(engines[0])
    written = {}
    for tp in (1, 2, 4, 8):
        status = support[engines[0].name].get(f"{default.layout}+{default.moe_layout}", {}).get(str(tp), "")
        if status.startswith("ok"):
            ep = tp if status != "ok" else 1
            jobs, _ = plan_files(src, dataclasses.replace(default, tp=tp, ep=ep), engines[0])
            written[str(tp)] = sum(j.nbytes for j in jobs)
    free = shutil.disk_usage(pathlib.Path.cwd()).free
    result.update(output_bytes_by_tp=written, free_bytes_here=free)
    if written:
        lines.append(f"  a conversion for {engines[0].display_name} with {default.layout}+{default.moe_layout} writes "
                     + ", ".join(f"{n / 2**30:.2f} GiB at tp {tp}" for tp, n in written.items())
                     + f"; {free / 2**30:.1f} GiB free here (where a default output folder goes)")
        # Measured, not guessed at: convert ran at 0.47-1.02x of `cp -r; sync` of the same bytes
        # (docs/BENCHMARKS.md); a rate for this machine's disks is not known without timing them.
        lo, hi = min(written.values()) / 2**30, max(written.values()) / 2**30
        amount = f"{hi:.1f} GiB" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f} GiB by tp"
        lines.append(f"  time: about that of copying what it writes ({amount}) on this disk, up to twice "
                     "it on a small machine (convert ran at 0.5-1x of `cp -r; sync`)")
    return result, lines


def _inspect_converted(path: str) -> tuple[dict[str, Any], list[str]]:
    ck = ConvertedCheckpoint(path)
    m = ck.manifest
    t = m.target
    roles = collections.Counter(x.role for x in m.tensors)
    tool = m.tool.to_json() if m.tool else None
    result = {"path": path, "format": "prep-converted", "target": t.to_json(), "tool": tool, "files": len(m.files),
              "tensors_by_role": dict(roles), "source": dict(m.source.origin) if m.source else {}}
    # What each rank reads (the files load_rank opens) and keeps (what its engine holds).
    kept = _kept_bytes(ck)
    ranks = []
    for r in range(t.tp):
        own = [f for f in m.files.values() if f.rank == r]
        moe = next((x.runtime_attrs for x in m.tensors if x.rank == r and x.name.endswith("w13_weight")), {})
        read = m.rank_files(r)  # its own, and the common files it reads (format 1; a vision tower the engine loads)
        ranks.append({"rank": r, "files": len(own), "bytes": sum(m.files[f].size for f in read),
                      "common_files": len(read) - len(own),
                      "bytes_kept": kept[r] if kept else None,
                      "tensors": sum(f.tensors for f in own), "local_experts": moe.get("num_local_experts"),
                      "global_routed_experts": moe.get("global_routed_experts")})
    result["ranks"] = ranks
    lines = [f"{path}: converted by prep {tool['version'] if tool else '?'} (manifest v{m.format_version})",
             f"  target: {t.arch} for {t.engine}, layout {t.layout}, moe layout {t.moe_layout}, tp {t.tp}, ep {t.ep}",
             f"  {len(m.files)} files; tensors: " + ", ".join(f"{v} {k}" for k, v in sorted(roles.items()))]
    for x in ranks:
        experts = "" if x["local_experts"] is None else f", {x['local_experts']} experts per MoE layer" + (
            f" (routed {x['global_routed_experts'][0]}..{x['global_routed_experts'][1] - 1} + shared)"
            if x["global_routed_experts"] else "")
        common = f" + {x['common_files']} common" if x["common_files"] else ""
        keeps = "" if x["bytes_kept"] is None else f", keeps {x['bytes_kept'] / 2**30:.3f} GiB"
        lines.append(f"  rank {x['rank']}: reads {x['bytes'] / 2**30:.3f} GiB ({x['files']} own files{common}){keeps}, "
                     f"{x['tensors']} own tensors{experts}")
    try:
        engine = get_engine(t.engine)
    except KeyError:  # converted for an engine this prep has no profile of: nothing to serve it with
        engine = None
    config = folder_config(path)
    serve = engine.serve_command(path, t.tp, t.ep, t.layout, t.moe_layout, m.shared_expert_stacked,
                                 config) if engine and t.rank_exact else None
    result["serve"] = serve
    draft = engine.mtp_draft_hint(m, config) if serve else None
    result["serve_mtp_draft"] = engine.mtp_draft_flags if serve and engine.mtp_draft(m, config) else None
    if serve:
        lines.append(f"  serve it with {engine.display_name}: {serve}")
        if draft:
            lines.append(f"    {draft}")
    return result, lines


def folder_config(folder: str | pathlib.Path) -> dict:
    """The folder's config.json (what an engine reads with its files), or {} where it is unreadable."""
    try:
        cfg = json.loads((pathlib.Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _kept_bytes(ck: ConvertedCheckpoint) -> list[int] | None:
    """The tensor bytes each rank's engine holds. Rank-exact: its own tensors, which are read
    whole. Format 1: its own tensors plus what the engine keeps of the common ones, by the rules
    rank-exact conversions are split with (``docs/rank-exact.md``; the MTP layer's embedding,
    which ATOM's drafter replaces, counts as not kept). None when config.json cannot say."""
    m = ck.manifest
    own = [0] * m.tp
    for t in m.tensors:
        if t.rank is not None and t.role != "unread":
            own[t.rank] += nbytes(t.dtype, t.shape)
    if m.target.rank_exact:
        return own
    try:
        config = language_config(json.loads((ck.root / "config.json").read_text()))
        common = {t.name: m.source.tensors[t.name] for t in m.tensors if t.rank is None and t.role == "passthrough"}
        split, whole, _ = split_bf16(common, config, config["num_hidden_layers"], m.tp, m.ep,
                                     m.target.fuse_shared_expert, get_engine(m.target.engine).sharding)
    except (OSError, ValueError, KeyError, TypeError, PrepError):
        return None
    replicated = sum(nbytes(common[n].dtype, common[n].shape) for n in whole)
    return [own[r] + replicated + sum(nbytes(g.dtype, g.shape) for g in split[r]) for r in range(m.tp)]
