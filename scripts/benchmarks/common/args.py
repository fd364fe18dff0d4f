"""Argument conventions every subcommand follows, so that a flag means the same everywhere."""

from __future__ import annotations

import argparse
import os


def add_repeat(ap: argparse.ArgumentParser, default: int, what: str = "alternated rounds") -> None:
    """``--repeat N``: how many times each candidate is timed (the rounds alternate them)."""
    ap.add_argument("--repeat", type=int, default=default, help=f"{what} (default {default})")


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers: ``--ms 1,16,256``."""
    return [int(v) for v in text.split(",") if v]


def add_ms(ap: argparse.ArgumentParser, default: str | None, default_text: str = "") -> None:
    """``--ms 1,16,...``: the activation rows (M) a GPU kernel benchmark times."""
    ap.add_argument("--ms", type=int_list, default=int_list(default) if default else None,
                    help=f"comma-separated M values (default {default or default_text})")


def add_cpu_smoke(ap: argparse.ArgumentParser) -> None:
    """``--cpu-smoke``: a GPU benchmark run on the CPU under Triton's interpreter, tiny shapes,
    wall-clock times (scripts/bench.py sets TRITON_INTERPRET=1 before the module is imported)."""
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="exercise this benchmark on the CPU (TRITON_INTERPRET=1, tiny shapes, wall-clock times)")


def require_compiled_triton(cpu_smoke: bool) -> None:
    """A GPU run must compile its kernels: an interpreter left on in the environment would time it."""
    if not cpu_smoke and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this benchmark compiles kernels for the GPU")
