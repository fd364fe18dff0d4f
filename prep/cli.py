"""The ``prep`` command line: inspect, convert, verify, revert, run, compare.

Every command turns a :class:`PrepError` into one line on stderr and exit code 1; ``--json``
prints the result as one JSON object for scripts.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import sys
from typing import Any, Callable

import click

from . import __version__
from .errors import PrepError
from .progress import Progress


_DEBUG = {"on": bool(os.environ.get("PREP_DEBUG"))}


def error_line(e: BaseException) -> str:
    """One line that says what went wrong and what to do, for any error that reaches the CLI."""
    import errno

    from layouts.compat import CompatibilityError
    from layouts.errors import LayoutsError

    if isinstance(e, (PrepError, LayoutsError, CompatibilityError)):
        msg = str(e)
    elif isinstance(e, OSError):
        where = e.filename or "a file"
        if e.errno == errno.ENOSPC:
            msg = f"{where}: disk full; free space or write elsewhere"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            msg = f"{where}: cannot write or read it ({e.strerror}); choose another folder or fix its permissions"
        else:
            msg = f"{where}: {e.strerror or e}"
    elif isinstance(e, MemoryError):
        msg = "out of memory; the input asks for more than this machine has (a damaged or hostile file?)"
    elif isinstance(e, RecursionError):
        msg = "input nested too deeply to be a checkpoint file; the file is damaged or hostile"
    else:
        msg = (f"internal error ({type(e).__name__}: {e}); rerun with prep --debug for the traceback and report it")
    return " ".join(msg.split())  # one line, whatever the message held


_INTERRUPTED = {  # what to tell the user after Ctrl-C, by command
    "convert": "finished files are kept in the hidden folder .OUT.prep beside OUT; rerun the same command "
               "with --resume to continue (or without it to start over and discard them)",
    "revert": "nothing was written to DEST; its partial copy was removed",
}


def _fail_cleanly(fn: Callable) -> Callable:
    """Every error becomes one line (``error: ...`` on stderr, or a JSON object on stdout with
    ``--json``) and exit code 1; Ctrl-C exits 130. ``prep --debug`` shows the traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            msg = getattr(e, "hint", None) or _INTERRUPTED.get(fn.__name__, "stopped")
            if as_json:
                click.echo(json.dumps({"ok": False, "error": msg, "code": 130, "interrupted": True}))
            else:
                click.echo(f"interrupted: {msg}", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # Whoever read prep's output went away (`prep inspect X | head -1`): no error line about
            # "a file", but the quiet end of a process its reader closed: 128 + SIGPIPE, and the
            # rest of its output (and Python's flush at exit) into nothing.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(141)
        except Exception as e:
            if _DEBUG["on"]:
                raise
            line = error_line(e)
            if as_json:
                click.echo(json.dumps({**(getattr(e, "result", None) or {}), "ok": False, "error": line, "code": 1}))
            else:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)

    return wrapper


def _emit(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    """The verb's result: one JSON object with ``"ok": true`` (an error is one object with
    ``"ok": false``, see :func:`_fail_cleanly`), or its lines."""
    if as_json:
        click.echo(json.dumps({"ok": True, **result}, indent=1))
    else:
        for line in lines:
            click.echo(line)


class _FromLayouts(click.Choice):
    """A choice among names that ``layouts`` states (the layout registry, the engine profile),
    read when click first needs them rather than when the CLI is imported: importing layouts
    (torch) takes seconds, which ``prep --help`` and ``prep --version`` should not pay."""

    def __init__(self, names: Callable[[], list[str]]):
        self._names = names
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())

    @choices.setter
    def choices(self, _eager: Any) -> None:  # click.Choice.__init__ assigns the empty list given above
        pass


class _Default:
    """An option default read when used (click calls it) or shown in ``--help`` (``str``), for
    the same reason."""

    def __init__(self, value: Callable[[], str]):
        self._value = value

    def __call__(self) -> str:
        return self._value()

    def __str__(self) -> str:
        return self._value()


def _layout_names(kind: str) -> Callable[[], list[str]]:
    def names() -> list[str]:
        import layouts

        return layouts.layout_names(kind)

    return names


# What --engine means when omitted: the CLI is where the engine is chosen, and passes its profile
# on; nothing below it has a default engine. ``prep run`` reads a source with its GEMM paths.
DEFAULT_ENGINE = "atom"


def _default_engine() -> "layouts.EngineProfile":
    import layouts

    return layouts.get_engine(DEFAULT_ENGINE)


@functools.cache
def _default_target() -> "layouts.manifest.Target":
    """The conversion target of the CLI's default engine (its default configuration)."""
    from .deepseek import target_for

    return target_for(_default_engine())


def _target_default(field: str) -> _Default:
    return _Default(lambda: getattr(_default_target(), field))


def _gemm_paths() -> list[str]:
    return list(_default_engine().gemm_paths)


class _PrepGroup(click.Group):
    """click's group, with its usage errors (a bad option, a missing argument) printed as
    every other error of prep: one line, ``error: ...`` on stderr or a JSON object on stdout
    when ``--json`` was given; the exit status stays click's 2 (a usage error, not a failed run)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:  # Ctrl-C while click itself was reading the command line
            click.echo("interrupted: stopped", err=True)
            sys.exit(130)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = f" (see {' '.join(['prep', *ctx.command_path.split()[1:]])} --help)" if ctx is not None else ""
            line = " ".join(e.format_message().split()) + where
            if "--json" in argv:
                click.echo(json.dumps({"ok": False, "error": line, "code": e.exit_code}))
            else:
                click.echo(f"error: {line}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)  # --help and --version return 0


def _existing_dir(path: str, what: str) -> str:
    """``path`` if it is a folder; else the one-line error every verb gives for a missing input."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        from .outdir import WORK_SUFFIX

        if p.with_name(f".{p.name}{WORK_SUFFIX}").is_dir():  # an interrupted convert's work folder
            raise PrepError(f"{path}: no such directory yet: a `prep convert` into it was interrupted (its work is in "
                            f".{p.name}{WORK_SUFFIX} beside it); run the same convert command again with --resume")
        raise PrepError(f"{path}: no such directory; {what}")
    if not p.is_dir():
        raise PrepError(f"{path}: not a directory; {what}")
    return path


_CONVERTED = "give the folder prep convert wrote"


def _checkpoint_dir(src: str) -> str:
    """A folder to run: ``src`` itself, or a Hugging Face repo id (``org/name``, not a path
    that exists) resolved through huggingface_hub's cache as ``convert`` resolves its source."""
    p = pathlib.Path(src).expanduser()
    if not p.exists() and src.count("/") == 1 and not src.startswith((".", "/", "~")):
        from .source import resolve

        return str(resolve(src)[0])
    return _existing_dir(src, "give a Quark source folder (or its Hugging Face repo id) or a folder prep convert wrote")


def _quiet_option(fn: Callable) -> Callable:
    return click.option("-q", "--quiet", is_flag=True,
                        help="No progress on stderr: neither the bar (on a terminal, not with --json) nor the "
                             "line every 10 s (PREP_PROGRESS_SECONDS) where stderr is a file or pipe.")(fn)


@click.group(cls=_PrepGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="prep")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (also: PREP_DEBUG=1).")
def main(debug: bool) -> None:
    """Rewrite MXFP4 (AMD Quark) and FP8 DeepSeek checkpoints into the exact layouts AMD's kernels read.

    \b
    Typical use:
      prep inspect amd/DeepSeek-R1-0528-MXFP4
      prep convert amd/DeepSeek-R1-0528-MXFP4 -o r1-tp8 --layout preshuffle --tp 8
      prep verify r1-tp8 --source amd/DeepSeek-R1-0528-MXFP4
      prep revert r1-tp8 -o r1-roundtrip
    """
    if debug:
        _DEBUG["on"] = True


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
    from .deepseek import engine_of
    from .describe import inspect_path

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
    from .convert import convert as run, keep_freed_memory
    from .deepseek import engine_of, target_for

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
        from .outdir import OutputFolder

        work = OutputFolder(out, inputs=[], force=False).work
        e.hint = getattr(e, "hint", None) or (f"finished files are kept in {work}; rerun the same command with "
                                              "--resume to continue (without it, they are discarded)")
        raise
    finally:
        bar.close()
    from layouts import load_manifest

    from .describe import folder_config

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
    from .verify import verify as run

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
    from .revert import revert as run

    bar = Progress.shown("revert", as_json, quiet)
    try:
        r = run(_existing_dir(out, _CONVERTED), dest, force=force, verify=verify, progress=bar, on_total=bar.total)
    finally:
        bar.close()
    for line in r["notes"] if not as_json else ():
        click.echo(f"note: {line}", err=True)
    _emit(r, as_json, [f"wrote {r['dest']}: {r['tensors']} tensors in {r['files']} files, {r['bytes'] / 2**30:.3f} GiB"])


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise PrepError(f"--prompt-ids {text!r}: give comma-separated integer token ids, e.g. 1,2,3") from None


_RUN_OPTIONS = [
    click.option("--prompt-ids", required=True, help="Comma-separated token ids, e.g. 0,17,42."),
    click.option("--layers", type=int, help="Run only the first N decoder layers."),
    click.option("--device", default="cpu", show_default=True, help="cpu or cuda (the fused op uses prep's Triton kernel there)."),
    click.option("--act-quant/--no-act-quant", default=True, show_default=True,
                 help="Quantize GEMM inputs to MXFP4 as the kernels do (off: weight-only emulation)."),
    click.option("--gemm-path", type=_FromLayouts(_gemm_paths),
                 help="Emulate this GEMM path's activation flags (default: the one that reads the checkpoint: of "
                      "the engine it was converted for; a source is read as ATOM, prep's default engine, reads it)."),
    click.option("--gemm", type=click.Choice(["torch", "aiter-triton"]), default="torch", show_default=True,
                 help="Who computes the dense MXFP4 GEMMs: torch (dequantize and matmul in float32) or aiter-triton "
                      "(aiter's own Triton GEMM for the checkpoint's dense layout, on its stored bytes, rank by rank; "
                      "interpreted on the CPU, needs triton >= 3.8 and aiter's files, see --aiter-dir). MoE experts "
                      "always run on torch."),
    click.option("--aiter-dir", type=click.Path(file_okay=False),
                 help="Folder of the amd-aiter wheel's files for --gemm aiter-triton (default: $PREP_AITER_DIR, else "
                      ".cache/aiter-oracle, filled by `python scripts/fetch_aiter_oracle.py`; an installed aiter "
                      "is used on a ROCm GPU)."),
    click.option("--verify/--no-verify", "verify", default=True, show_default=True,
                 help="Check the hash of every tensor of a converted checkpoint that the forward reads, before it "
                      "runs (a damaged file stops the run, naming the tensor)."),
    click.option("--max-memory", type=click.FloatRange(min=0.25), default=8.0, show_default=True, metavar="GIB",
                 help="Bound on this process's memory (resident set, GiB): dequantized matrices are kept while the "
                      "process, activations and torch included, stays under it, least recently used dropped first; a "
                      "matrix over 64 MiB in float32 is made and multiplied in row blocks, an embedding read at the "
                      "prompt's rows only; room is kept for the block being made and the position map it may derive. "
                      "On DeepSeek's real widths at TP 1 the process peaked at 0.94 GiB with --max-memory 1, 1.93 with "
                      "2, 7.49 with 8 (docs/BENCHMARKS.md). Below a floor (torch, the block being made: ~0.8 GiB "
                      "there) it cannot hold; the run prints its peak and says so. The logits do not depend on it."),
    click.option("--prefill", type=click.IntRange(min=1), metavar="K",
                 help="Decode as an engine does: the first K prompt ids as one prefill, then each other id as one "
                      "decode step (teacher-forced: the logits of every id, as without it), against the cache "
                      "--kv-cache says."),
    click.option("--kv-cache", type=click.Choice(["latent", "none"]), default="latent", show_default=True,
                 help="With --prefill or --generate: latent keeps per token and layer only the compressed KV and the "
                      "rope key (kv_lora_rank + qk_rope_head_dim values) and absorbs kv_b_proj into the query and "
                      "the output, as engines decode MLA; none computes every step again from its whole prefix."),
    click.option("--generate", type=click.IntRange(min=0), default=0, metavar="N",
                 help="After the prompt, N greedy tokens (decode steps), printed with the argmax."),
    click.option("--latent-kv", is_flag=True,
                 help="Compute the full forward's keys and values as the latent decode does (BF16 normed KV, no "
                      "MXFP4 quant, float32 keys): the two then agree to float32 precision, which checks the latent "
                      "path; without it they differ by the prefill's own rounding."),
    click.option("--mla-order", type=click.Choice(["reference", "sglang"]), default="reference", show_default=True,
                 help="How a latent decode multiplies by kv_b_proj's halves: reference (float32 W_UK/W_UV, BF16 "
                      "queries and cache) or sglang (SGLang's ROCm MXFP4 decode: the query and the attention output "
                      "quantized to MXFP4, W_UK and W_UV re-quantized to MXFP4, W_UK along its nope dim)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON summary."),
    _quiet_option,
]


def _run_options(fn: Callable) -> Callable:
    for opt in reversed(_RUN_OPTIONS):
        fn = opt(fn)
    return fn


def _with_run_bars(fn: Callable, as_json: bool, quiet: bool, *args, **kwargs) -> dict[str, Any]:
    """``fn`` (run or compare) with a bar over the bytes it hashes and one over the layers it runs."""
    check, layers = Progress.shown("check", as_json, quiet), Progress.shown("forward", as_json, quiet, unit="layer")
    try:
        return fn(*args, **kwargs, progress={"check": check, "forward": layers})
    finally:
        check.close()
        layers.close()


def _hashes_line(checked: int | None, converted: bool, short: bool = False) -> str:
    """What the run checked: ``checked`` tensors' hashes, or why none (a source, --no-verify)."""
    if not converted:
        what = "a source (no manifest hashes)"
    elif checked is None:
        what = "not checked (--no-verify)"
    else:
        what = f"{checked} tensors read match the manifest"
    return what if short else f"hashes: {what}"


@main.command(name="run")
@click.argument("model_dir")
@_run_options
@click.option("--save-logits", type=click.Path(dir_okay=False), help="Write the logits of every position to this .safetensors file.")
@click.option("--assume-layout", help="Read MXFP4 tensors as this layout, skipping the compatibility check (to see "
                                      "a mismatch: the logits are garbage by design, and a warning says so).")
@_fail_cleanly
def run_cmd(model_dir, prompt_ids, layers, device, act_quant, gemm_path, gemm, aiter_dir, verify, max_memory, prefill,
            kv_cache, generate, latent_kv, mla_order, as_json, quiet, save_logits, assume_layout):
    """Run the reference DeepSeek-V3 forward on MODEL_DIR (a Quark source, as a folder or a
    Hugging Face repo id, or a converted checkpoint at any layout and TP; ranks are combined
    in-process) and print the logits' argmax.

    Converted checkpoints are loaded through the runtime module (manifest and compatibility
    checks, load_rank), and each MXFP4 weight is read in its stored layout.

    \b
    Examples:
      prep run r1-tp8 --prompt-ids 0,100,200 --save-logits logits.safetensors
      prep run ./tiny --prompt-ids 1,2,3 --layers 2 --no-act-quant
      prep run r1-tp2 --prompt-ids 1,2,3 --gemm aiter-triton
    """
    import torch

    from .reference.run import run

    model_dir = _checkpoint_dir(model_dir)
    if save_logits and not os.path.isdir(os.path.dirname(os.path.abspath(save_logits))):
        raise PrepError(f"--save-logits {save_logits}: its folder does not exist")
    r = _with_run_bars(run, as_json, quiet, model_dir, _ids(prompt_ids), layers=layers, device=device,
                       act_quant=act_quant, gemm_path=gemm_path, source_engine=_default_engine(),
                       assume_layout=assume_layout, verify=verify,
                       gemm=gemm, aiter_dir=aiter_dir, max_memory=int(max_memory * 2**30), prefill=prefill,
                       kv_cache=kv_cache, generate=generate, latent_kv=latent_kv, mla_order=mla_order)
    if assume_layout:
        # On stderr even with --json (stdout stays one JSON object), just before the results: a
        # reader of the argmax must not mistake it for the model's output.
        click.echo(f"WARNING: --assume-layout {assume_layout}: the checkpoint's bytes were read as a layout they are "
                   "not in, past the compatibility check; these logits are GARBAGE BY DESIGN (they show what a "
                   "layout mismatch does; never serve or compare them)", err=True)
        r["warning"] = f"--assume-layout {assume_layout}: logits are garbage by design"
    logits = r.pop("logits")
    bad = (~torch.isfinite(logits)).nonzero()
    if bad.numel() and not assume_layout:  # an argmax of NaN is no answer (--assume-layout says so itself)
        raise PrepError(f"{model_dir}: the forward gave non-finite logits (NaN or inf) from position "
                        f"{int(bad[0, 0])} of {logits.shape[0]}: the weights or config.json hold values it cannot "
                        "compute with; nothing reported or written")
    if save_logits:
        from safetensors.torch import save_file

        tmp = save_logits + ".tmp"
        save_file({"logits": logits.contiguous()}, tmp, metadata={"model": str(model_dir), "prompt_ids": prompt_ids})
        os.replace(tmp, save_logits)
    r["argmax"] = logits.argmax(-1).tolist()
    _emit(r, as_json, [f"{r['weights']}: {r['layers']} layers, gemm path {r['gemm_path']}, act quant {r['act_quant']}"
                       f"{', dense GEMMs on aiter-triton' if gemm == 'aiter-triton' else ''}",
                       _hashes_line(r["hashes_checked"], r["converted"]),
                       f"load {r['load_s']:.2f} s, forward {r['forward_s']:.2f} s; argmax per position: {r['argmax']}",
                       *_decode_lines(r), *_memory_line(r)]
          + ([f"logits written to {save_logits}"] if save_logits else []))


def _decode_lines(r: dict) -> list[str]:
    """What a --prefill / --generate run decoded, and the cache it held."""
    if "kv_cache" not in r:
        return []
    steps, made = len(r["argmax"]) - r["prefill"], len(r["generated"])
    cache = (f"a latent cache of {r['kv_cache_bytes_per_token']} bytes per token (per-head keys and values would be "
             f"{r['per_head_kv_bytes_per_token']})" if r["kv_cache"] == "latent" else "no cache (each step recomputed)")
    return [f"decode: prefill of {r['prefill']}, then {steps} steps" + (f" and {made} generated" if made else "")
            + f", with {cache}"] + \
        ([f"generated: {r['generated']}"] if r["generated"] else [])


def _memory_line(r: dict) -> list[str]:
    """The process's peak memory against --max-memory; over it, what the floor is made of."""
    if r.get("peak_rss") is None:
        return []
    peak, bound = r["peak_rss"] / 2**30, r["max_memory"] / 2**30
    if peak <= bound:
        return [f"peak memory {peak:.2f} GiB (--max-memory {bound:g})"]
    return [f"peak memory {peak:.2f} GiB: over --max-memory {bound:g}, below what this checkpoint needs at least "
            "(torch, the prompt's activations, the block of rows being made and its position map); "
            f"give --max-memory {math.ceil(peak * 4) / 4:g} or more"]


@main.command()
@click.argument("a")
@click.argument("b")
@_run_options
@click.option("--tolerance", type=float, default=0.0, show_default=True, help="Largest |logit difference| that passes.")
@click.option("--rtol", type=float, default=0.0, show_default=True,
              help="Also pass differences up to RTOL times A's largest |logit| (torch vs aiter-triton: 0.00390625, "
                   "one BF16 rounding step; docs/consumer-kernels.md derives it).")
@click.option("--gemm-a", type=click.Choice(["torch", "aiter-triton"]), help="--gemm for A only.")
@click.option("--gemm-b", type=click.Choice(["torch", "aiter-triton"]), help="--gemm for B only.")
@click.option("--prefill-b", type=click.IntRange(min=1), metavar="K",
              help="--prefill for B only: A's full forward against B decoded with --kv-cache (e.g. the same checkpoint "
                   "twice, to see what decoding against a latent cache changes).")
@_fail_cleanly
def compare(a, b, prompt_ids, layers, device, act_quant, gemm_path, gemm, aiter_dir, verify, max_memory, prefill,
            kv_cache, generate, latent_kv, mla_order, as_json, quiet, tolerance, rtol, gemm_a, gemm_b, prefill_b):
    """Run checkpoints A and B on the same tokens and compare their logits (exit 1 above --tolerance).

    A converted checkpoint computes the same model as its source bit for bit: the layouts only
    move bytes. Use this before putting a conversion behind a server. A and B are folders; a
    source may also be a Hugging Face repo id, as for convert. A and B run one after the other,
    each within --max-memory.

    To compare aiter's own GEMMs with prep's on one checkpoint, give it twice with
    --gemm-b aiter-triton (or two checkpoints, each with its --gemm-a / --gemm-b).

    \b
    Examples:
      prep compare amd/DeepSeek-R1-0528-MXFP4 r1-tp8 --prompt-ids 0,100,200 --layers 4
      prep compare r1-tp2 r1-tp2 --gemm-b aiter-triton --prompt-ids 1,2,3 --rtol 0.00390625
    """
    from .reference.run import compare as run

    a, b = _checkpoint_dir(a), _checkpoint_dir(b)
    r = _with_run_bars(run, as_json, quiet, a, b, _ids(prompt_ids), layers=layers, device=device, act_quant=act_quant,
                       gemm_path=gemm_path, source_engine=_default_engine(), verify=verify, gemm=gemm, gemm_a=gemm_a,
                       gemm_b=gemm_b, aiter_dir=aiter_dir,
                       max_memory=int(max_memory * 2**30), prefill=prefill, kv_cache=kv_cache, generate=generate,
                       latent_kv=latent_kv, mla_order=mla_order, prefill_b=prefill_b)
    bad = [k.upper() for k, ok in r["finite"].items() if not ok]
    allowed = tolerance + rtol * r["max_abs_logit"]
    failure = None
    if bad:
        failure = f"logits of {' and '.join(bad)} are not finite (NaN or inf): that checkpoint computes garbage"
    elif r["max_abs_diff"] > allowed:
        failure = (f"logits differ by {r['max_abs_diff']:.6g} > --tolerance {tolerance}"
                   + (f" + --rtol {rtol} x max |logit| {r['max_abs_logit']:.6g}" if rtol else ""))
    if failure and as_json:  # one JSON object, the measurements in it
        raise PrepError(failure, result=r)
    _emit(r, as_json, [f"A: {r['a']}" + (f" (gemm {r['gemm_a']})" if r["gemm_a"] != r["gemm_b"] else ""),
                       f"B: {r['b']}" + (f" (gemm {r['gemm_b']})" if r["gemm_a"] != r["gemm_b"] else ""),
                       f"hashes: A {_hashes_line(r['hashes_checked']['a'], r['converted']['a'], short=True)}, "
                       f"B {_hashes_line(r['hashes_checked']['b'], r['converted']['b'], short=True)}",
                       f"max |logit difference| {r['max_abs_diff']:.6g} (max |logit| {r['max_abs_logit']:.4g}) "
                       f"over {r['tokens']} positions"
                       f"{' (identical bit for bit)' if r['identical'] else ''}; argmax agrees on "
                       f"{100 * r['argmax_agree']:.1f}%", *_memory_line(r)])
    if failure:
        raise PrepError(failure)


def run() -> None:
    """The ``prep`` command (and ``python -m prep``): :data:`main`, then out of the process at
    once, skipping the interpreter's shutdown.

    Why: finalizing torch's modules at exit took 0.25-0.3 s after ``import torch`` alone, and
    0.3-0.45 s after a conversion had written, fsynced and renamed everything (docs/BENCHMARKS.md):
    9% of a 5 GiB conversion on two cores, a third of ``prep convert --help``. By the time
    ``main`` returns, every verb has closed its files and joined its threads (a Ctrl-C or an
    error included: their clean-up runs inside ``main``); stdout and stderr are flushed here.
    An exception ``main`` does not turn into an exit status leaves the normal way, traceback
    and all. Tests call ``main`` (click's runner), never this."""
    try:
        main(prog_name="prep")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): what the interpreter does with it
            print(e.code, file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`prep ... | head -1`) or a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
