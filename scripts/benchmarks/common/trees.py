"""Checkouts of prep: this one, and a baseline (another revision) to run beside it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]


def prep_in(tree: pathlib.Path) -> list[str]:
    """The command that runs the prep CLI of checkout ``tree``, whatever the working folder and
    whichever prep is installed (``python -m prep.cli`` with PYTHONPATH=tree ran the prep of the
    working folder: ``-m`` puts it first on sys.path, so a baseline tree measured itself)."""
    # What the `prep` command runs: prep.cli.run where the tree has it (it leaves without the
    # interpreter's shutdown), else click's main.
    start = "import prep.cli as c; (getattr(c, 'run', None) or c.main)()"
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); sys.argv[0] = 'prep'; {start}"
    where = subprocess.run([sys.executable, "-c", code.replace(start, "import prep; print(prep.__file__)")],
                           check=True, capture_output=True, text=True, cwd="/").stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"{tree}: its prep is not what runs (got {where})")
    return [sys.executable, "-c", code]


def unpack(rev: str, dest: pathlib.Path) -> pathlib.Path:
    """The files of git revision ``rev`` of this repository, unpacked into ``dest`` (once)."""
    if not (dest / "prep").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def scratch_root() -> pathlib.Path | None:
    """Where large temporary folders go: the checkout's ``out/`` when there is one (a disk with
    room, on the hosts where it is made), else the system's temporary folder."""
    out = REPO / "out"
    return out if out.is_dir() else None
