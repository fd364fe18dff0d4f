#!/usr/bin/env python
"""Check a converted folder against an engine's own load of its source, on the CPU: every rank
of OUT, loaded through the engine's door, must leave the engine's model byte for byte as the
engine's own loader leaves it from SRC. One line per rank; exit status 0 only if every rank
matches.

    python scripts/check_engine_install.py --engine sglang --source SRC --converted OUT
    python scripts/check_engine_install.py --engine atom --source SRC --converted OUT

* ``sglang`` (run it with .venv-sglang's Python, which ``bash scripts/setup_env.sh --sglang``
  makes; this script switches to it by itself): SGLang 0.5.23's real ``DeepseekV3ForCausalLM``
  per rank (scripts/sglang_on_cpu.py says what is real and what is a stand-in). Reference:
  SGLang's ``DefaultModelLoader`` on SRC (its weight loaders, ``process_weights_after_loading``,
  ``post_load_weights``). Converted: SGLang's ``ShardedStateLoader`` on OUT, as the serve
  command prep printed asks for it (``--load-format sharded_state`` with prep's file names).
  Compared: every state-dict tensor, and the MLA ``w_kc`` / ``w_vc`` (and scales) SGLang derives
  after loading. SGLang is told the shared-expert fusion and EP size the manifest records. The two
  loads fill uninitialised memory with different bytes (0xA5, 0x5A), so a byte neither writes
  shows as a difference.
* ``atom``: scripts/check_atom_install.py's comparison of one configuration (ATOM's reference
  load of SRC against the adapter's install of OUT, both models, and the MLA derivation), ATOM's
  GEMM path and MoE back end being those that read OUT's layouts.

SGLang matches a Quark ``exclude`` entry only exactly or as a ``re:`` pattern; a shell wildcard
(``*self_attn*``, which prep's generated checkpoints write) matches nothing there, so SGLang
would build those modules as MXFP4 and fail on their BF16 weights. Where config.json has one,
the serve command prep prints passes the excludes as ``re:`` patterns
(``--json-model-override-args``), and so do both loads here (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
ENGINE_PYTHON = {"sglang": REPO / ".venv-sglang" / "bin" / "python", "vllm": REPO / ".venv-vllm" / "bin" / "python"}
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import stand_ins  # noqa: E402

# Stand-ins SGLang calls while building its model, each used only in the forward pass (so a
# stand-in skips no loading work); any other stand-in call fails the check.
SGLANG_BUILD_ONLY = {
    "aiter.rotary_embedding.get_rope": "builds each layer's RoPE module (forward only; its cos/sin caches are not "
                                       "persistent, so not in the state dict)",
    "aiter.get_hip_quant": "looked up when SGLang's MXFP4 linear module is imported (the activation quant of its "
                           "forward)",
    "aiter.jit.core.compile_ops": "decorates aiter's JIT kernels as SGLang imports them",
}


# Stand-ins vLLM calls in both loads alike that do no loading work: decorators and the log line of
# aiter's config lookup as vLLM imports its kernels, the padded-M helper of the ASM GEMM probe, and
# the tuned-shape probes where no aiter tables are given (vllm_on_cpu's docstring).
# numba.njit: the decorator of vLLM's Kimi-K2.5 image preprocessing (kimi_k25_vision_fused.py), applied
# as the module is imported; no weight passes through it
VLLM_ALLOWED = ("aiter.jit.core.compile_ops", "aiter.jit.utils.torch_guard.torch_compile_guard", "aiter.logger",
                "aiter.ops.gemm_op_common.get_padded_m", "aiter tuned-shape table (absent)", "numba.njit")


def _shuffled(model) -> dict[str, bool]:
    """``is_shuffled`` of every parameter (absent read as False, as aiter reads it): what aiter's
    kernels take the bytes' order from."""
    return {n: bool(getattr(p, "is_shuffled", False)) for n, p in model.named_parameters()}


def _compare(ref: dict, got: dict) -> list[str]:
    import torch

    bad = [f"{k}: only in the engine's own load" for k in ref.keys() - got.keys()]
    bad += [f"{k}: only after loading OUT" for k in got.keys() - ref.keys()]
    for k in sorted(ref.keys() & got.keys()):
        a, b = ref[k], got[k]
        if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            bad.append(f"{k}: {a.dtype} {list(a.shape)} in the engine's own load, {b.dtype} {list(b.shape)} from OUT")
        elif not torch.equal(*(x.contiguous().reshape(-1).view(torch.uint8) for x in (a, b))):
            bad.append(f"{k}: bytes differ")
    return bad


def _manifest(out: pathlib.Path, engine: str, label: str):
    """OUT's manifest, which must be of a conversion for ``engine``."""
    import layouts

    m = layouts.load_manifest(out)
    if m.target.engine != engine:
        raise SystemExit(f"{out}: converted for {m.target.engine}, not {label}; convert with --engine {engine}")
    return m


def _exclude_override(out: pathlib.Path, flag: str) -> dict | None:
    """What the serve command passes for OUT's config.json (wildcard Quark excludes as ``re:``
    patterns, DeepSeek-V3 keys a transformers-5 config lacks: ``layouts.engines._config``), given
    to both loads alike; None where it passes nothing."""
    from layouts.engines import _config

    override = _config.override(json.loads((out / "config.json").read_text()))
    if override and "quantization_config" in override:
        print(f"both loads: {flag} with the Quark excludes as re: patterns: "
              f"{override['quantization_config']['exclude']}")
    if override and set(override) - {"quantization_config"}:
        print(f"both loads: {flag} with DeepSeek-V3's {', '.join(sorted(set(override) - {'quantization_config'}))}, "
              "which config.json lacks")
    return override


def _rank_row(rank: int, ref: dict, bad: list[str], *more: int) -> bool:
    """Print one rank's row (tensors, bytes, ``more`` columns, result) and its first problems;
    True when it matched."""
    size = sum(x.numel() * x.element_size() for x in ref.values())
    cols = "".join(f" {m:>9}" for m in more)
    print(f"{rank:>4} {len(ref):>7} {size:>10}{cols}  {'ok' if not bad else 'FAIL'}", flush=True)
    for line in bad[:10]:
        print(f"    {line}")
    return not bad


def check_sglang(src: pathlib.Path, out: pathlib.Path, work: pathlib.Path, aiter_src: pathlib.Path,
                 ranks: list[int] | None = None) -> bool:
    import sglang_on_cpu as s

    t = _manifest(out, "sglang", "SGLang").target
    s.WORK["dir"] = work
    s.install(aiter_src)
    kw = {"enforce_shared_experts_fusion": True} if t.fuse_shared_expert else {"disable_shared_experts_fusion": True}
    override = _exclude_override(out, "--json-model-override-args")
    if override:
        kw["json_model_override_args"] = json.dumps(override)
    pattern = json.dumps({"pattern": f"model-tp{t.tp}-rank{{rank}}-{{part}}.safetensors"})
    print(f"{'rank':>4} {'tensors':>7} {'bytes':>10} {'w_kc/w_vc':>9}  result")
    ok = True
    for rank in ranks if ranks is not None else range(t.tp):
        s.CALLS.clear()
        ref = s.default_load(src, t.tp, rank, ep=t.ep, **kw)
        ref_extra = dict(s.EXTRAS)
        # Uninitialised memory holds another byte than in the reference load: a byte loading never
        # writes differs, whichever load left it.
        got = s.sharded_state_load(out, t.tp, rank, ep=t.ep, fill=0x5A, model_loader_extra_config=pattern, **kw)
        bad = _compare(ref, got) + _compare(ref_extra, dict(s.EXTRAS))
        called = sorted({c for c in s.CALLS if c not in SGLANG_BUILD_ONLY})
        bad += [f"stand-in called while loading: {c}" for c in called]
        ok &= _rank_row(rank, ref, bad, len(ref_extra))
    return ok


def check_vllm(src: pathlib.Path, out: pathlib.Path, work: pathlib.Path, aiter_src: pathlib.Path,
               asm_tuned: bool = False, ranks: list[int] | None = None) -> bool:
    import vllm_on_cpu as v
    from layouts.engines.vllm.door import LOAD_FORMAT

    m = _manifest(out, "vllm", "vLLM")
    t = m.target
    v.WORK["dir"] = work
    v.install(aiter_src)
    # prep's loader is not registered here: vLLM's own plugin loading must find the package's
    # vllm.general_plugins entry point, as it does in every vLLM process (checked below)
    override = _exclude_override(out, "--hf-overrides")
    kw = {"hf_overrides": override} if override else {}
    if asm_tuned:
        v.force_asm_tuned()
        print("aiter's tuned-shape probes answer yes for every shape (--asm-tuned): vLLM runs each dense linear whose "
              "scale it can swizzle on the ASM FP4 GEMM, each FP8 per-channel linear on aiter's preshuffled FP8 GEMM")
    elif not v.TABLES["present"]:
        print("aiter's tuned-shape tables: none given ($PREP_AITER_TABLES), so vLLM shuffles no dense linear "
              "(what aiter answers for every tiny shape)")
    # With an MTP layer, vLLM's MTP draft too (--speculative-config), loaded after the model. Not
    # where config.json says one and the checkpoint has none (an amd-quark export made with
    # transformers 5): vLLM's own load leaves such a draft unwritten, prep's door refuses it.
    layers = json.loads((src / "config.json").read_text()).get("num_hidden_layers")
    draft = any(n.startswith(f"model.layers.{layers}.") for n in m.source.tensors)
    if draft:
        print(f"both loads: --speculative-config '{json.dumps(v.MTP_SPECULATIVE)}', the MTP draft compared too")
    print(f"{'rank':>4} {'tensors':>7} {'bytes':>10} {'draft':>9}  result")
    ok = True

    def load(folder: pathlib.Path, load_format: str, fill: int) -> tuple[dict, dict, type]:
        model, loader = v.build_and_load(folder, t.tp, rank, t.ep, load_format, fill=fill, draft=draft, **kw)
        held, flags = v._state_dict(model), _shuffled(model)
        kernels.update(v.dense_kernels(model))
        if draft:
            m = v.MODEL.pop("draft")
            held.update({f"draft:{k}": x for k, x in v._state_dict(m).items()})
            flags.update({f"draft:{k}": x for k, x in _shuffled(m).items()})
            kernels.update({f"draft {k}": n for k, n in v.dense_kernels(m).items()})
        return held, flags, type(loader)

    for rank in ranks if ranks is not None else range(t.tp):
        v.CALLS.clear()
        kernels: dict[str, int] = {}
        ref, ref_flags, _ = load(src, "auto", 0xA5)
        ref_kernels = dict(kernels)
        kernels.clear()
        got, got_flags, loader = load(out, LOAD_FORMAT, 0x5A)
        v.MODEL.clear()
        bad = _compare(ref, got)
        bad += [f"{n}: is_shuffled {ref_flags[n]} in vLLM's own load, {got_flags.get(n)} through the door"
                for n in ref_flags if ref_flags[n] != got_flags.get(n)]
        bad += [f"vLLM loaded OUT with {loader.__name__}, not prep's loader"] * (loader.__name__ != "PrepModelLoader")
        called = [c for c in stand_ins.skipped(v.CALLS) if not c.startswith(VLLM_ALLOWED)]
        bad += [f"stand-in called while loading: {c}" for c in called]
        bad += [f"vLLM chose other GEMMs for OUT ({kernels}) than for SRC ({ref_kernels})"] * (kernels != ref_kernels)
        ok &= _rank_row(rank, ref, bad, sum(k.startswith("draft:") for k in ref))
        print(f"    dense linears by vLLM's GEMM: {', '.join(f'{k} {n}' for k, n in ref_kernels.items()) or 'none'}")
        note = stand_ins.computed_note(v.CALLS)  # torch math for a GPU kernel, the same in both loads
        if note:
            print(f"    {note}")
    return ok


def check_atom(src: pathlib.Path, out: pathlib.Path, work: pathlib.Path, atom_dir: pathlib.Path,
               aiter_src: pathlib.Path, ranks: list[int] | None = None) -> bool:
    import check_atom_install as c
    from layouts.engines.atom import PROFILE

    t = _manifest(out, "atom", "ATOM").target
    path = PROFILE.gemm_path_reading(t.layout)
    if t.moe_layout != "ck":
        raise SystemExit(f"{out}: MoE layout {t.moe_layout}: the ATOM check runs aiter's CK MoE only (its Triton MoE "
                         "needs triton_kernels)")
    kernels = c.mla_kernels()
    c.atom_on_cpu.install(atom_dir, aiter_src, "gfx950")
    case = c.Case("source", path, t.tp, t.ep)
    cfg = json.loads((out / "config.json").read_text())
    derive = kernels if c.mla_gemm_runs(case, types.SimpleNamespace(kv_lora_rank=cfg.get("kv_lora_rank") or 0)) \
        else None
    print(c.HEADER)
    failed = False
    for rank in ranks if ranks is not None else range(t.tp):
        failed |= c.print_rank(c.check_rank(case, src, out, rank, derive))
    return not failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, choices=("atom", "sglang", "vllm"))
    ap.add_argument("--source", required=True, type=pathlib.Path, help="the Quark checkpoint OUT was converted from")
    ap.add_argument("--converted", required=True, type=pathlib.Path, help="prep convert's output folder")
    ap.add_argument("--oracles", type=pathlib.Path,
                    help="folder with ATOM's and aiter's pinned sources (default: scripts/engine_sources.py finds it)")
    ap.add_argument("--work", type=pathlib.Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--ranks", type=lambda v: [int(x) for x in v.split(",")],
                    help="comma-separated ranks to check (default: every rank)")
    ap.add_argument("--asm-tuned", action="store_true",
                    help="vllm: both loads as where aiter has tuned its ASM FP4 GEMM for every dense linear's shape "
                         "(vLLM's two probes answer yes), so vLLM runs each on it and the door lays it out at load")
    args = ap.parse_args(argv)
    if args.engine in ENGINE_PYTHON:
        import importlib.util

        python = ENGINE_PYTHON[args.engine]
        if importlib.util.find_spec(args.engine) is None:  # not imported here: its harness prepares it first
            if python.is_file() and pathlib.Path(sys.executable) != python:
                return subprocess.call([str(python), __file__, *(argv if argv is not None else sys.argv[1:])])
            raise SystemExit(f"error: {args.engine} is not installed in {sys.executable}: run `bash "
                             f"scripts/setup_env.sh --{args.engine}`, which makes {python.parent.parent.name}")
    import engine_sources

    scratch = engine_sources.Scratch(args.work, f"{args.engine}-check-")
    work = scratch.path
    atom_dir, aiter_src = engine_sources.trees(args.oracles or engine_sources.require(), work)
    if args.engine == "sglang":
        ok = check_sglang(args.source, args.converted, work, aiter_src, args.ranks)
    elif args.engine == "vllm":
        ok = check_vllm(args.source, args.converted, work, aiter_src, args.asm_tuned, args.ranks)
    else:
        ok = check_atom(args.source, args.converted, work, atom_dir, aiter_src, args.ranks)
    note = scratch.done(ok)
    if note:
        print(note)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
