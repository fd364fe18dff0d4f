"""ATOM's and aiter's source trees at the commits prep is checked against, for the checks that run
the engines' real code on the CPU (``python -m harness check-engine`` and its tests).

ATOM is not on PyPI, and aiter's Python at the commit ATOM was pinned with is not either, so the
sources come from one of, in this order:

* ``$PREP_ORACLES``: a folder holding ``atom-*.tar.gz`` and ``aiter-*.tar.gz`` (trees under one
  top folder each), or the folders ``atom-*`` and ``aiter-*`` (git checkouts);
* ``shared/oracles`` beside the checkout or beside a folder above it (where prep is developed);
* ``.cache/engine-sources`` in the checkout, which ``python -m harness sources fetch`` fills
  with git checkouts of the two pinned commits (about 40 MB of git objects, shallow).

    .venv/bin/python -m harness sources          # where they are found, or how to get them
    .venv/bin/python -m harness sources fetch    # git clone both pinned commits (needs github.com)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile

from harness import REPO

FETCHED = REPO / ".cache" / "engine-sources"
# (name prefix, repository, commit): what prep's ATOM door and the engines' checks were checked against
PINNED = (("atom", "https://github.com/ROCm/ATOM", "ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21"),
          ("aiter", "https://github.com/ROCm/aiter", "e4048607a535ace3a2b51ded31b1c8c2d45c0879"))
HOW_TO_GET = ("ATOM's and aiter's pinned sources not found ($PREP_ORACLES unset, no shared/oracles beside the "
              "checkout, .cache/engine-sources empty): run `.venv/bin/python -m harness sources fetch` "
              "(git checkouts of ROCm/ATOM ffdf3bb5 and ROCm/aiter e4048607) or set PREP_ORACLES (docs/testing.md)")


def _holds_both(folder: pathlib.Path) -> bool:
    return all(any(folder.glob(f"{name}-*")) for name, _, _ in PINNED)


def find() -> pathlib.Path | None:
    """The folder the sources are taken from, or None where there is none (see the module's text).
    ``$PREP_ORACLES``, where set, is the only place looked at."""
    if os.environ.get("PREP_ORACLES"):
        folder = pathlib.Path(os.environ["PREP_ORACLES"])
        return folder if _holds_both(folder) else None
    for folder in REPO.parents:
        if _holds_both(folder / "shared" / "oracles"):
            return folder / "shared" / "oracles"
    return FETCHED if _holds_both(FETCHED) else None


def require() -> pathlib.Path:
    """:func:`find`, or exit with the one line that says how to get them."""
    folder = find()
    if folder is None:
        raise SystemExit(f"error: {HOW_TO_GET}")
    return folder


def trees(folder: pathlib.Path, work: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """ATOM's and aiter's source trees from ``folder``: a checkout is used where it is, a tarball
    unpacked once under ``work``."""
    found = []
    for name, _, _ in PINNED:
        checkouts = sorted(p for p in folder.glob(f"{name}-*") if p.is_dir())
        if checkouts:
            found.append(checkouts[-1])
            continue
        tars = sorted(folder.glob(f"{name}-*.tar.gz"))
        if not tars:
            raise SystemExit(f"error: {folder}: neither a folder {name}-* nor {name}-*.tar.gz; {HOW_TO_GET}")
        dest = work / "oracles" / tars[-1].name.removesuffix(".tar.gz")
        if not dest.is_dir():
            work.mkdir(parents=True, exist_ok=True)
            tmp = pathlib.Path(tempfile.mkdtemp(dir=work))
            with tarfile.open(tars[-1]) as t:
                t.extractall(tmp, filter="data")
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(next(tmp.iterdir()), dest)
            tmp.rmdir()
        found.append(dest)
    return found[0], found[1]


class Scratch:
    """A check's work folder: the one given (kept), or a temporary one that :meth:`done` removes
    when the check passed and keeps, saying where, when it failed (what is in it explains why)."""

    def __init__(self, given: pathlib.Path | None, prefix: str):
        self.temporary = given is None
        self.path = pathlib.Path(tempfile.mkdtemp(prefix=prefix)) if given is None else given
        self.path.mkdir(parents=True, exist_ok=True)

    def done(self, ok: bool) -> str:
        """Clean up; what to say about the folder ("" where nothing is left of it)."""
        if self.temporary and ok:
            shutil.rmtree(self.path, ignore_errors=True)
            return ""
        return f"records under {self.path}"


def fetch(into: pathlib.Path = FETCHED) -> None:
    """Shallow git checkouts of the pinned commits into ``into``/{atom,aiter}-<commit>; each made
    under a temporary name and renamed when complete, so an interrupted fetch leaves none half."""
    into.mkdir(parents=True, exist_ok=True)
    for name, url, commit in PINNED:
        dest = into / f"{name}-{commit[:8]}"
        if dest.is_dir():
            print(f"{dest}: present")
            continue
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=into))
        for cmd in (["git", "init", "-q"], ["git", "fetch", "-q", "--depth", "1", url, commit],
                    ["git", "checkout", "-q", "FETCH_HEAD"]):
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if r.returncode:
                subprocess.run(["rm", "-rf", "--", str(tmp)])
                raise SystemExit(f"error: {' '.join(cmd)} ({url}): {r.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, dest)
        print(f"{dest}: {url} at {commit}")


def main(fetch_them: bool) -> int:
    """``python -m harness sources [fetch]``: where the sources are found (exit 1 where nowhere), or
    fetch them."""
    if fetch_them:
        fetch()
        return 0
    folder = find()
    print(folder if folder else HOW_TO_GET)
    return 0 if folder else 1
