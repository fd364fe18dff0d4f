"""``python -m harness VERB``: the engine checks on the CPU (run from the checkout).

    check-engine {atom,sglang,vllm} --source SRC --converted OUT   the engine's door on OUT against its own load of SRC
    check-atom-matrix                the ATOM install check over prep's generated checkpoints, many configurations
    check-triton-moe                 aiter's Triton MoE GEMMs on a conversion's experts
    check-quark-export               the doors on amd-quark's own exports, and on a flipped byte
    sources [fetch]                  where ATOM's and aiter's pinned sources are, or fetch them

Exit status 0 only when the check passed (``sources``: when they are found).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys
from typing import Iterable

from harness import REPO, pythonpath, quark_export, report, sources

ENGINE_PYTHON = {"sglang": REPO / ".venv-sglang" / "bin" / "python", "vllm": REPO / ".venv-vllm" / "bin" / "python"}


def _ranks(value: str) -> list[int]:
    return [int(x) for x in value.split(",")]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    verbs = ap.add_subparsers(dest="verb", required=True)

    def with_sources(p: argparse.ArgumentParser, work_is: str) -> None:
        p.add_argument("--oracles", type=pathlib.Path,
                       help="folder with ATOM's and aiter's pinned sources (default: where `python -m harness "
                            "sources` finds it)")
        p.add_argument("--work", type=pathlib.Path, help=f"{work_is} (default: a temporary one, removed if it passes)")

    p = verbs.add_parser("check-engine", help="the engine's load of a converted folder against its own load of the "
                                              "source, rank by rank")
    p.add_argument("engine", choices=("atom", "sglang", "vllm"))
    p.add_argument("--source", required=True, type=pathlib.Path, help="the checkpoint OUT was converted from")
    p.add_argument("--converted", required=True, type=pathlib.Path, help="prep convert's output folder")
    with_sources(p, "scratch folder")
    p.add_argument("--ranks", type=_ranks, help="comma-separated ranks to check (default: every rank)")
    p.add_argument("--asm-tuned", action="store_true",
                   help="vllm: both loads as where aiter has tuned its ASM FP4 GEMM for every dense linear's shape "
                        "(vLLM's two probes answer yes), so vLLM runs each on it and the door lays it out at load")
    p.add_argument("--serve", action="store_true",
                   help="atom: ATOM's whole server start-up on both sides (prep-atom-serve on OUT), each rank in a "
                        "worker process, instead of its loader alone; options after `--` go to ATOM's server")
    p.add_argument("--no-mtp", action="store_true", help="atom --serve: serve without the MTP draft model")
    p.add_argument("--gpu-arch", default="gfx950", choices=("gfx950", "gfx942"),
                   help="atom: the GPU ATOM is told it runs on (default %(default)s)")

    p = verbs.add_parser("check-atom-matrix", help="the ATOM install check over prep's generated checkpoints "
                                                   "(harness/atom/matrix.py)")
    p.add_argument("--atom-dir", type=pathlib.Path, help="an ATOM source tree (default: the pinned one, --oracles)")
    p.add_argument("--aiter-dir", type=pathlib.Path, help="an aiter source tree (default: the pinned one, --oracles)")
    with_sources(p, "folder for the trees, checkpoints and conversions")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="run only the configurations whose name contains this (repeatable: any of them)")
    p.add_argument("--preset", default="tiny", help="prep.testing preset of the checkpoints (default tiny; a larger "
                                                     "one wants --only)")
    p.add_argument("--layers", type=int, help="decoder layers of the checkpoints (default: the preset's)")
    p.add_argument("--aiter-triton-dir",
                   help="folder of the amd-aiter wheel's files, for its Triton MXFP4 GEMMs (default: $PREP_AITER_DIR, "
                        "else .cache/aiter-oracle: python scripts/fetch_aiter_oracle.py)")
    p.add_argument("--gpu-arch", default="gfx950", choices=("gfx950", "gfx942"),
                   help="the GPU ATOM is told it runs on (default %(default)s)")

    p = verbs.add_parser("check-triton-moe", help="aiter's Triton MoE GEMMs on a conversion's stacked experts "
                                                  "(harness/triton_moe.py)")
    p.add_argument("--source", required=True, type=pathlib.Path)
    p.add_argument("--converted", required=True, type=pathlib.Path)
    with_sources(p, "folder the sources' tarballs are unpacked in")
    p.add_argument("--layer", type=int, help="the MoE layer to check (default: the first)")
    p.add_argument("--ranks", type=_ranks, help="comma-separated ranks to check (default: every rank)")
    p.add_argument("--tokens", type=int, default=16)

    p = verbs.add_parser("check-quark-export", help="the doors on amd-quark's own exports (harness/quark_export.py)")
    p.add_argument("--engines", default="atom,vllm,sglang")
    p.add_argument("--variants", default=",".join(quark_export.VARIANTS),
                   help=f"exports to check: {', '.join(quark_export.VARIANTS)}")
    p.add_argument("--work", type=pathlib.Path, help="folder for the exports and conversions (default: temporary)")

    p = verbs.add_parser("sources", help="where ATOM's and aiter's pinned sources are found, or how to get them")
    p.add_argument("fetch", nargs="?", choices=("fetch",), help="git clone both pinned commits (needs github.com)")
    return ap


def _in_engine_python(engine: str, argv: list[str]) -> int | None:
    """Where ``engine`` is not importable here and its venv exists, run this command there (its
    exit status); None where this Python has it."""
    if engine not in ENGINE_PYTHON or importlib.util.find_spec(engine) is not None:
        return None
    python = ENGINE_PYTHON[engine]
    if not python.is_file() or pathlib.Path(sys.executable) == python:
        raise SystemExit(f"error: {engine} is not installed in {sys.executable}: run `bash scripts/setup_env.sh "
                         f"--{engine}`, which makes {python.parent.parent.name}")
    path = pythonpath(os.environ.get("PYTHONPATH"))
    return subprocess.call([str(python), "-m", "harness", *argv], env={**os.environ, "PYTHONPATH": path})


def _print_table(items: Iterable[str | report.RankResult], width: int = report.ENGINE_WIDTH) -> bool:
    """Print what a check yields in the one format (:mod:`harness.report`); whether it passed."""
    results, failures, headed = [], [], False
    for item in items:
        if isinstance(item, report.RankResult):
            if not headed:
                print(report.header(width))
                headed = True
            results.append(item)
            print("\n".join(item.lines(width)), flush=True)
        elif isinstance(item, report.Failure):
            failures.append(item)
            print(item, flush=True)
        else:
            print(item, flush=True)
    print(report.verdict(results, failures))
    return not failures and bool(results) and all(r.ok for r in results)


def check_engine(args, extra: list[str], argv: list[str]) -> int:
    for flag, given, allowed, where in (
            ("--asm-tuned", args.asm_tuned, args.engine == "vllm", "check-engine vllm"),
            ("--serve", args.serve, args.engine == "atom", "check-engine atom"),
            ("--no-mtp", args.no_mtp, args.serve, "check-engine atom --serve"),
            ("options after --", bool(extra), args.serve, "check-engine atom --serve")):
        if given and not allowed:
            raise SystemExit(f"error: {flag} is for {where}")
    if args.serve and args.ranks is not None:
        raise SystemExit("error: --ranks: ATOM's server start-up (--serve) loads every rank, each in its worker")
    from layouts.errors import LayoutsError
    from layouts.manifest import load_manifest

    try:  # here, before an engine's interpreter starts: a folder prep did not write is one line
        load_manifest(args.converted)
    except LayoutsError as exc:
        raise SystemExit(f"error: --converted {exc}") from None
    rc = _in_engine_python(args.engine, argv)
    if rc is not None:
        return rc
    scratch = sources.Scratch(args.work, f"{args.engine}-check-")
    atom_dir, aiter_dir = sources.trees(args.oracles or sources.require(), scratch.path)
    if args.engine == "atom" and args.serve:
        from harness.atom import serve

        items = serve.run(args.source, args.converted, (atom_dir, aiter_dir), scratch.path, args.gpu_arch,
                          not args.no_mtp, extra)
    elif args.engine == "atom":
        from harness.atom import install

        items = install.check(args.source, args.converted, (atom_dir, aiter_dir), args.ranks, args.gpu_arch)
    elif args.engine == "sglang":
        from harness import sglang

        items = sglang.check(args.source, args.converted, aiter_dir, args.ranks)
    else:
        from harness import vllm

        items = vllm.check(args.source, args.converted, scratch.path, aiter_dir, args.asm_tuned, args.ranks)
    ok = _print_table(items)
    return _finish(scratch, ok)


def _finish(scratch: sources.Scratch, ok: bool) -> int:
    """A check's exit status, after its work folder is removed (passed) or named (failed)."""
    note = scratch.done(ok)
    if note:
        print(note)
    return 0 if ok else 1


def check_atom_matrix(args) -> int:
    from harness.atom import matrix

    scratch = sources.Scratch(args.work, "atom-matrix-")
    if args.atom_dir and args.aiter_dir:
        trees = (args.atom_dir, args.aiter_dir)
    else:
        pinned = sources.trees(args.oracles or sources.require(), scratch.path)
        trees = (args.atom_dir or pinned[0], args.aiter_dir or pinned[1])
    ok = _print_table(matrix.run(trees, scratch.path, args.only, args.preset, args.layers, args.aiter_triton_dir,
                                 args.gpu_arch), width=matrix.NAME_WIDTH)
    return _finish(scratch, ok)


def check_triton_moe(args) -> int:
    from harness import triton_moe

    scratch = sources.Scratch(args.work, "triton-moe-check-")
    _, aiter_dir = sources.trees(args.oracles or sources.require(), scratch.path)
    ok, lines = triton_moe.check(args.source, args.converted, aiter_dir, args.layer, args.tokens, ranks=args.ranks)
    print("\n".join(lines))
    print(f"ok: every rank checked ({len(lines)}) within {triton_moe.TOLERANCE}" if ok else
          "FAIL: a GEMM off the reference, or a wrongly labelled read not off")
    return _finish(scratch, ok)


def check_quark_export(args) -> int:
    import tempfile

    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="quark-doors-"))
    ok = True
    for variant in args.variants.split(","):
        ok &= quark_export.check_variant(variant, work, args.engines.split(","))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.verb == "check-engine":
        return check_engine(args, extra, argv)
    if extra:
        raise SystemExit("error: options after -- are for check-engine atom --serve")
    if args.verb == "check-atom-matrix":
        return check_atom_matrix(args)
    if args.verb == "check-triton-moe":
        return check_triton_moe(args)
    if args.verb == "check-quark-export":
        return check_quark_export(args)
    return sources.main(args.fetch == "fetch")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
