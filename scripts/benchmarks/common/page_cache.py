"""A cold start: files out of the page cache, so that the next read comes from the disk.
Standard library only (the replicated benchmark runs where prep and torch are not installed)."""

from __future__ import annotations

import os
import pathlib


def evict(paths) -> None:
    """Drop these files' pages from the page cache (``posix_fadvise(DONTNEED)``; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_all() -> bool:
    """As root, the whole page cache dropped (some sandboxed kernels ignore the advice above);
    whether it could be."""
    try:
        os.sync()
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
