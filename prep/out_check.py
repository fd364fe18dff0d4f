"""Whether prep may write OUT, checked before anything is read or planned (and again under the
lock, just before the swap: :mod:`prep.outdir`):

* OUT is not the input, does not contain it and does not lie inside it, nor does its work folder
  hold the input;
* OUT is absent, an empty folder, or (with ``--force``) a folder holding only files a previous
  prep run wrote there (its manifest or revert marker lists them: :mod:`prep.ownership`), where
  the previous output's files can be deleted: never a folder with one file prep did not write;
* OUT is a folder (not a file, not a link) and not a mount point (the new output is built
  beside it and renamed over it).
"""

from __future__ import annotations

import os
import pathlib

from .errors import PrepError
# which files of a folder are prep's (what --force may replace): prep.ownership
from .ownership import PROBE_PREFIX, foreign_entry, prep_files_in, side_files

WORK_SUFFIX = ".prep"


def _resolve(path: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(os.path.expanduser(str(path))))


def _inside(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (both resolved)."""
    return a == b or b in a.parents


class OutputPath:
    """OUT as given and resolved, the name of its work folder beside it, and the checks that refuse
    an OUT prep may not write; :class:`prep.outdir.OutputFolder` adds the lock, the staging and the
    swap."""

    def __init__(self, out: str | pathlib.Path, *, inputs: list[pathlib.Path], force: bool, flag: str = "-o"):
        self.given = str(out)
        self.path = _resolve(out)
        if self.path == self.path.parent:
            raise PrepError(f"{flag} {out}: the filesystem root cannot be an output folder; choose a folder below it")
        self.inputs = [_resolve(p) for p in inputs]
        self.force = force
        self.flag = flag
        self.work = self.path.with_name(f".{self.path.name}{WORK_SUFFIX}")

    # ------------------------------------------------------------------ checks
    def check(self, resuming: bool = False) -> None:
        """Refuse, before anything is written, an OUT that would overwrite or delete what prep
        did not write. Checked again under the lock, just before the swap. ``resuming``: a
        previous output of prep is let through without --force (a ``--resume`` may find it to be
        its own run's, finished; the caller checks again under the lock)."""
        for src in self.inputs:
            if self.path == src:
                raise PrepError(f"{self.flag} {self.given}: is the input {src} itself; choose another output folder")
            if _inside(src, self.path):
                raise PrepError(f"{self.flag} {self.given}: contains the input {src}; choose an output folder "
                                "outside it")
            if _inside(self.path, src):
                raise PrepError(f"{self.flag} {self.given}: lies inside the input {src}; choose an output folder "
                                "outside it")
            if _inside(src, self.work):
                raise PrepError(f"{self.flag} {self.given}: its work folder {self.work} holds the input {src}; "
                                "choose another output folder")
        self.check_replaceable(resuming)

    def check_replaceable(self, resuming: bool = False) -> None:
        p = self.path
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            raise PrepError(f"{self.flag} {self.given}: exists and is not a folder; choose another output folder")
        if os.path.ismount(p):  # the new OUT is staged beside it and renamed over it: a mount point cannot be
            raise PrepError(f"{self.flag} {self.given}: is a mount point; prep builds the output beside OUT and swaps "
                            f"it in, which a mount point cannot take: write into a folder on it, e.g. "
                            f"{self.flag} {os.path.join(str(self.given), 'OUT')}")
        if not p.exists() or not any(os.scandir(p)):
            return
        own = prep_files_in(p)
        if resuming and own is not None:
            return
        if not self.force:
            what = "a previous output of prep" if own is not None else "not empty"
            raise PrepError(f"{self.flag} {self.given}: exists and is {what}; choose another output folder"
                            + (" or pass --force to replace it" if own is not None else ""))
        foreign = foreign_entry(p)
        if foreign is not None:
            why = ("prep did not write it" if own is not None else
                   "the folder is not an output of prep (no prep-manifest.json or prep-revert.json)")
            if own is not None and foreign in side_files():
                why = "prep did not write it, or it was edited since prep wrote it (its bytes are not the ones prep wrote)"
            raise PrepError(f"{self.flag} {self.given}: --force replaces only a folder prep wrote, but it holds "
                            f"{foreign!r} and {why}; move it away or choose another output folder")
        self._check_deletable(p)

    def _check_deletable(self, p: pathlib.Path) -> None:
        """--force deletes the previous output's files once the new one is in place: refuse now,
        not after converting, a folder where that cannot happen (no write permission, immutable,
        read-only filesystem). A probe file is made and removed: the folder holds only prep's files."""
        probe = p / f"{PROBE_PREFIX}{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
            os.unlink(probe)
        except OSError as e:
            raise PrepError(f"{self.flag} {self.given}: --force must delete the previous output's files there, but "
                            f"the folder is not writable ({e.strerror}); fix its permissions or choose another "
                            "output folder") from None
