"""The verbs on checkpoints: ``inspect``, ``convert``, ``verify``, ``revert``."""

from __future__ import annotations

import pathlib

import click

from ..errors import PrepError
from ..progress import Progress
from .app import (DEFAULT_ENGINE, _CONVERTED, _FromLayouts, _default_target, _emit, _existing_dir, _fail_cleanly,
                  _layout_names, _quiet_option, _target_default, main)


@main.command()
@click.argument("src")
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@click.option("--engine", "engine_name", metavar="NAME",
              help="Show the layouts and TP sizes this engine's conversions allow (default: every engine prep "
                   "converts for: atom, sglang, vllm).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_quiet_option
@_fail_cleanly
def inspect(src: str, revision: str | None, engine_name: str | None, as_json: bool, quiet: bool) -> None:
    """Describe a Quark MXFP4 checkpoint (or a converted one): format, architecture, which tensors
    are MXFP4 GEMM weights by module kind, and, for each engine, which layouts and TP sizes the
    shapes allow ("with --ep N" where only whole experts per rank convert).

    \b
    Examples:
      prep inspect ./DeepSeek-R1-0528-MXFP4
      prep inspect ./DeepSeek-R1-0528-MXFP4 --engine vllm
      prep inspect r1-tp8 --json
    """
    from ..deepseek import engine_of
    from ..describe import inspect_path

    engines = [engine_of(engine_name)] if engine_name else None  # resolved once, here
    bar = Progress.shown("inspect", as_json, quiet, unit="check")
    try:
        result, lines = inspect_path(src, revision, progress=bar, on_total=bar.total, engines=engines)
    finally:
        bar.close()
    _emit(result, as_json, lines)


@main.command()
@click.argument("src")
@click.option("-o", "--out", metavar="OUT",
              help="Output folder (created; see --force). Default: SRC-LAYOUT[-MOE_LAYOUT]-tpN[-epN] next to a "
                   "source folder, or in the current folder for a repo id.")
@click.option("--layout", type=_FromLayouts(_layout_names("dense")), default=_target_default("layout"),
              show_default=True, help="Dense linears: the layout your engine's GEMM path reads (which path reads "
                                      "which, and the switch that picks it: docs/engines.md). Without it: what "
                                      "--engine's default configuration reads (ATOM's shown).")
@click.option("--moe-layout", type=_FromLayouts(_layout_names("moe")), default=_target_default("moe_layout"),
              show_default=True, help="Stacked experts: the layout your engine's MoE back end reads on your GPU "
                                      "(docs/engines.md). Without it: --engine's default (ATOM's shown).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size: one set of files per rank.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel size: 1, or equal to --tp (each rank holds a block of whole experts plus the shared one).")
@click.option("--fuse-shared-expert/--no-fuse-shared-expert", default=True, show_default=True,
              help="Put the shared expert into expert slot n_routed of the stacked tensors. Without it: "
                   "what --engine does (ATOM's shown).")
@click.option("--engine", default=DEFAULT_ENGINE, show_default=True,
              help="The engine whose ranks the files are written for: its merged module names, TP splits and "
                   "expert map (its profile's sharding rules). The manifest records it and another engine "
                   "refuses the output. Omitted, it is ATOM: the one place prep assumes an engine.")
@click.option("--common-bf16", is_flag=True,
              help="Write the BF16 tensors whole into common files every rank reads (the layout of prep's first "
                   "manifests, still written in today's format), for "
                   "an engine that slices them itself. Default: each rank's files hold its BF16 slices, split "
                   "as the engine holds them, and a copy of the replicated tensors (docs/rank-exact.md).")
@click.option("--workers", type=click.IntRange(min=1),
              help="Sets of output files (the TP ranks' files at one place) written at once, in threads. "
                   "Default: one per four CPU cores, as many as 1.5 GiB of memory holds (the writes in flight "
                   "are shared among them); 1 on a 2-core machine.")
@click.option("--force", is_flag=True,
              help="Replace OUT when it holds a previous output of prep (and nothing else); the old one is "
                   "swapped out atomically once the new one is complete. A folder with any file prep did not "
                   "write is never replaced.")
@click.option("--resume", is_flag=True,
              help="Reuse the files an interrupted run with the same options finished, after re-checking their "
                   "hashes; files whose source files changed since are written again. On an OUT the same run already "
                   "finished, it checks the hashes and writes nothing.")
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@click.option("--no-space-check", is_flag=True,
              help="Write even when OUT's filesystem reports less free space than the output needs (it is "
                   "refused before a byte is written otherwise; e.g. a filesystem that under-reports).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary.")
@_quiet_option
@_fail_cleanly
def convert(src, out, layout, moe_layout, tp, ep, fuse_shared_expert, engine, common_bf16, workers, force, resume,
            revision, no_space_check, as_json, quiet):
    """Convert SRC (a folder or a Hugging Face repo id) into per-rank, kernel-layout files in OUT.

    Each rank's tensors are exactly what that rank's engine holds after its own load-time
    processing: TP split, merged fused_qkv_a_proj / gate_up_proj, experts stacked into w13/w2
    (intermediate padded to 256), then shuffled. BF16 tensors are split and merged the same way
    (bytes unchanged) and the replicated ones copied into every rank's files, so a rank reads
    only its own files. FP8 linears (Quark's per-channel attention; DeepSeek's own FP8 release,
    128x128 block scales, split by whole blocks and shuffled as the engine holds them) likewise.
    prep-manifest.json records every tensor; prep-complete.json is written last.

    Memory stays flat whatever the checkpoint's size: each file is built in blocks of whole
    experts or rows of about 32 MiB and written through six 40 MiB buffers, four writes in
    flight (per file; the TP ranks' files written together get 8 MiB ones): 0.6 GiB measured
    on a 13 GiB checkpoint of DeepSeek's real widths with one write in flight, 0.75 GiB peak on
    a 5 GiB R1-shaped one with four (docs/BENCHMARKS.md).

    \b
    Examples:
      prep convert amd/DeepSeek-R1-0528-MXFP4 -o r1-tp8 --tp 8
      prep convert ./model --layout preshuffle          # writes ./model-preshuffle-tp1
      prep convert ./src -o out --layout non-shuffle --moe-layout triton --tp 4 --workers 4
    """
    from ..convert import convert as run, keep_freed_memory
    from ..deepseek import engine_of, target_for

    keep_freed_memory()
    profile = engine_of(engine)  # the engine, resolved once: everything below takes its profile
    # The engine's own defaults where --layout / --moe-layout / --[no-]fuse-shared-expert were not given.
    ctx = click.get_current_context()
    given = {k: v for k, v in (("layout", layout), ("moe_layout", moe_layout),
                               ("fuse_shared_expert", fuse_shared_expert))
             if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}
    target = target_for(profile, tp=tp, ep=ep, rank_exact=not common_bf16, **given)
    layout, moe_layout = target.layout, target.moe_layout
    note = None
    if out is None:
        out = default_out(src, layout, moe_layout, tp, ep)
        note = None if as_json else f"note: writing to {out} (choose another folder with -o)"
    # Once the source opened and OUT passed its checks: never before an error about them.
    started = (lambda: click.echo(note, err=True)) if note else None
    bar = Progress.shown("convert", as_json, quiet)
    try:
        s = run(src, out, target, force=force, resume=resume, workers=workers, revision=revision, progress=bar,
                on_total=bar.total, notify=lambda line: click.echo(f"note: {line}", err=True), on_start=started,
                space_check=not no_space_check)
    except KeyboardInterrupt as e:
        from ..outdir import OutputFolder

        work = OutputFolder(out, inputs=[], force=False).work
        e.hint = getattr(e, "hint", None) or (f"finished files are kept in {work}; rerun the same command with "
                                              "--resume to continue (without it, they are discarded)")
        raise
    finally:
        bar.close()
    from layouts import load_manifest

    from ..describe import folder_config

    config = folder_config(s["out"])
    manifest = None if common_bf16 else load_manifest(s["out"])
    serve = None if common_bf16 else profile.serve_command(s["out"], tp, ep, layout, moe_layout,
                                                           manifest.shared_expert_stacked, config)
    draft = profile.mtp_draft_hint(manifest, config) if serve else None
    s = {**s, "tp": tp, "ep": ep, "layout": layout, "moe_layout": moe_layout, "serve": serve,
         "serve_mtp_draft": profile.mtp_draft_flags if serve and profile.mtp_draft(manifest, config) else None}
    held = s["layouts_held"]
    what = f"layout {layout}, MoE layout {moe_layout}" if {layout, moe_layout} & set(held) \
        else f"no MXFP4 tensor, layouts {', '.join(held) or 'none'}"
    lines = [f"wrote {s['out']}: TP {tp}, EP {ep}, {what}: {s['tensors']} tensors "
             f"from {s['source_tensors']} source tensors, {s['files']} files ({s['reused_files']} reused), "
             f"{s['bytes'] / 2**30:.3f} GiB"]
    if serve:
        lines.append(f"serve it with {profile.display_name}: {serve}")
        if draft:
            lines.append(f"  {draft}")
    elif not profile.has_door():
        lines.append(f"serve it: prep has no door for {engine} yet; its ranks load with layouts.open_rank "
                     "(docs/engines.md)")
    else:
        lines.append(f"serve it with {profile.display_name}: prep's door does not serve "
                     + ("--common-bf16 conversions" if common_bf16 else f"layout {layout} with MoE layout {moe_layout} yet")
                     + " (docs/engines.md)")
    _emit(s, as_json, lines)
    if click.get_current_context().get_parameter_source("tp") == click.core.ParameterSource.DEFAULT and not as_json:
        # Per-rank files are cut for one TP size: say so now, not when an engine at TP 8 refuses them.
        click.echo("note: no --tp given, so these files are for TP 1 (one GPU); an engine at another TP size "
                   "refuses them: convert with --tp N to serve on N GPUs", err=True)


def default_out(src: str, layout: str, moe_layout: str, tp: int, ep: int) -> str:
    """``SRC-LAYOUT[-MOE_LAYOUT]-tpN[-epN]``: beside a source folder, or in the current folder
    for a Hugging Face repo id or a snapshot folder of the hub's cache (named after the repo). The
    MoE layout is named when it is not the default engine's default one."""
    path = pathlib.Path(src).expanduser()
    base = path.resolve() if path.is_dir() else pathlib.Path.cwd() / src.rstrip("/").split("/")[-1]
    repo = base.parent.parent.name
    if base.parent.name == "snapshots" and repo.startswith("models--"):
        # A Hugging Face cache snapshot (models--ORG--NAME/snapshots/REVISION): beside it is inside the
        # cache, which the hub's tools prune; name it after the repo, in the current folder.
        base = pathlib.Path.cwd() / repo.split("--")[-1]
    if not base.name or base.parent == base:
        raise PrepError(f"{src}: has no folder name to name an output folder after; pass -o OUT")
    named = moe_layout != _default_target().moe_layout
    name = f"{base.name}-{layout}" + (f"-{moe_layout}" if named else "") + f"-tp{tp}"
    return str(base.with_name(name + (f"-ep{ep}" if ep > 1 else "")))


@main.command()
@click.argument("out")
@click.option("--source", help="Also invert every tensor and compare bytes with this source checkpoint.")
@click.option("--deep", is_flag=True, help="Also invert every group (checks padding) without a source.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary.")
@_quiet_option
@_fail_cleanly
def verify(out, source, deep, as_json, quiet):
    """Check a converted checkpoint: manifest, completion marker, file sizes, every tensor's hash,
    and the source tensor table revert needs (prep-source.json).

    Exit status 1 names the first file or tensor that does not match.

    Memory stays flat whatever the checkpoint's size: files are hashed in 64 MiB reads, and with
    --source every tensor is inverted and compared a block of rows, or of whole experts from all
    ranks, of about 32 MiB at a time (PREP_STREAM_BYTES sets it), a dense linear whole (DeepSeek's
    largest is 0.13 GiB per rank): 0.6 GiB measured at TP 1 and TP 8 on DeepSeek's real widths,
    0.5 GiB at R1's 90,910 tensors (docs/BENCHMARKS.md). Where there are two cores, two files are
    hashed at once, and two groups inverted at once sharing those 32 MiB: 1.4x on 16 cores,
    0.82 GiB at TP 8 (PREP_VERIFY_WORKERS sets how many; 4: 1.6x, 0.89 GiB).

    \b
    Examples:
      prep verify r1-tp8
      prep verify r1-tp8 --source amd/DeepSeek-R1-0528-MXFP4
    """
    from ..verify import verify as run

    bar = Progress.shown("verify", as_json, quiet)
    try:
        r = run(_existing_dir(out, _CONVERTED), source=source, deep=deep, progress=bar, on_total=bar.total)
    finally:
        bar.close()
    _emit(r, as_json, [
        f"ok: {r['files']} files, {r['tensors_hashed']} tensors match the manifest"
        + (f", {r['source_tensors_compared']} source tensors byte-identical after inversion" if source else "")])


@main.command()
@click.argument("out")
@click.option("-o", "--dest", required=True, metavar="DEST", help="Folder for the rebuilt source (created; see --force).")
@click.option("--force", is_flag=True, help="Replace DEST when it holds a previous output of prep (and nothing else).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check every tensor against its manifest hash as it is read (a damaged file stops the revert).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary.")
@_quiet_option
@_fail_cleanly
def revert(out, dest, force, verify, as_json, quiet):
    """Rebuild the original Quark checkpoint from a converted one: same tensor names, dtypes,
    shapes and bytes (shard boundaries may differ).

    Memory stays flat whatever the checkpoint's size: every tensor is rebuilt and written a
    block of rows, or of whole experts from all ranks, of about 32 MiB at a time
    (PREP_STREAM_BYTES sets it), a dense linear whole, through three 40 MiB write buffers:
    0.6-0.7 GiB measured at TP 1 and TP 8 on DeepSeek's real widths (docs/BENCHMARKS.md). The
    source's config and tokenizer files are copied as it had them (one changed since the
    conversion is refused, naming it).

    \b
    Example:
      prep revert r1-tp8 -o r1-roundtrip
    """
    from ..revert import revert as run

    bar = Progress.shown("revert", as_json, quiet)
    try:
        r = run(_existing_dir(out, _CONVERTED), dest, force=force, verify=verify, progress=bar, on_total=bar.total)
    finally:
        bar.close()
    for line in r["notes"] if not as_json else ():
        click.echo(f"note: {line}", err=True)
    _emit(r, as_json, [f"wrote {r['dest']}: {r['tensors']} tensors in {r['files']} files, {r['bytes'] / 2**30:.3f} GiB"])
