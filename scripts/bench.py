#!/usr/bin/env python3
"""prep's benchmarks, one tool:

    python scripts/bench.py SUBCOMMAND [options]
    python scripts/bench.py SUBCOMMAND --help     (what it measures, its baseline, an example)

Every subcommand times its candidates against a baseline measured in the same run, alternating
them (these machines are noisy: compare the ratios, not absolute numbers between runs), and
prints one kind of table: candidate, time, "x BASELINE" = the baseline's time over the
candidate's (> 1: faster). Results and the commands that produced them: docs/BENCHMARKS.md.
Never timed tests: a benchmark is run by hand, on the machine it is about.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pathlib
import sys
import textwrap

HERE = pathlib.Path(__file__).resolve().parent
# This checkout's prep and layouts, whatever is installed; tests/ for the stand-ins and oracles
# some benchmarks share with the tests (tests/atom_like.py, tests/aiter_oracle.py).
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]


def subcommands() -> dict[str, pathlib.Path]:
    """Subcommand name -> its module: every module of scripts/benchmarks/ (gpu_load.py: gpu-load)."""
    return {p.stem.replace("_", "-"): p for p in sorted((HERE / "benchmarks").glob("*.py")) if p.stem != "__init__"}


def summary(path: pathlib.Path) -> str:
    """The first line of a module's docstring, read without importing it (a subcommand's module
    may import torch, or need the environment set first)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


class Tee:
    """stdout, also appended to a file line by line (a run cut short still leaves its report)."""

    def __init__(self, stream, path: str):
        self.stream, self.file = stream, open(path, "a")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    commands = subcommands()
    listing = "\n".join(textwrap.fill(f"{name:16} {summary(path)}", 100, initial_indent="  ",
                                       subsequent_indent=" " * 19) for name, path in commands.items())
    ap = argparse.ArgumentParser(prog="bench.py", description=__doc__, epilog="subcommands:\n" + listing,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("subcommand", choices=commands, metavar="SUBCOMMAND", help="one of the subcommands below")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's options (see its --help)")
    top = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show as they come, through a pipe too
    if "--cpu-smoke" in top.args:
        # Triton picks the interpreter when a kernel is decorated, at import: set before any is.
        os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module("benchmarks." + top.subcommand.replace("-", "_"))
    sub = argparse.ArgumentParser(prog=f"bench.py {top.subcommand}", description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("--out", metavar="FILE", help="also append everything printed to FILE")
    module.add_arguments(sub)
    args = sub.parse_args(top.args)
    if args.out:
        sys.stdout = Tee(sys.stdout, args.out)
    return module.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
