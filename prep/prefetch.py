"""Source bytes read into the page cache ahead of the builders, in file order, on a thread.

Why: the builders read a MoE layer a block of experts at a time, projection by projection, in
expert order, which is not the order of the file (names sort ``experts.1``, ``experts.10``,
``experts.100``, ...), and the scales in reads of a few KiB to a few hundred. From a cold disk
that ran at a third of a sequential read: an R1-shaped 4.93 GiB checkpoint at TP 4 took 20-21 s
to convert on the 2-core VM, 14.5 s of it the main thread waiting in reads, where `cat` of the
same files takes 4.4 s. With the next group's bytes faulted in, in file order, while this group
is built: 8.4-9.4 s (docs/BENCHMARKS.md, "Reading a cold source ahead"). ``verify --source``
reads the source in the same order and reads it ahead the same way.

How: each span of a group's source tensors (:meth:`SourceCheckpoint.spans`) is mapped a window
at a time and faulted in with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14): the kernel reads it
in large requests, nothing is copied, and the pages leave this process once the window is
unmapped (the page cache keeps them; RSS holds one window at most). The calls go through ctypes,
which lets go of the GIL (Python's ``mmap.madvise`` keeps it, and the builders would stall).
Where the kernel lacks it, the window is read into a scratch block instead.
``posix_fadvise(WILLNEED)`` is no substitute: the kernel caps what it reads per call (20 MiB
of a 440 MiB request here).

A page-cached source costs only the page-table walk (measured: no change warm). ``PREP_PREFETCH=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Protocol

# How far ahead of the group being built the reads may run, beyond the next group: a group of
# small tensors (an attention layer) is read ahead together with the groups after it.
AHEAD_BYTES = 1 << 30
WINDOW = 16 << 20  # mapped and faulted in at a time (in RSS until unmapped); the prefetch stops between windows
_MADV_POPULATE_READ = 22  # linux/mman.h


class _Spans(Protocol):
    def spans(self, names: list[str]) -> list[tuple[int, int, int]]: ...

    def info(self, name: str): ...


class Prefetch:
    """Read ``steps`` (the source tensor names of each group, in the order they are built) into
    the page cache on a thread, the next group while one is built (:meth:`at`), and further
    ahead while the groups in between come to less than :data:`AHEAD_BYTES`. A context manager:
    leaving it stops the thread after its current window."""

    def __init__(self, src: _Spans, steps: list[list[str]], ahead: int = AHEAD_BYTES):
        self._src = src
        self._steps = [sorted(set(names)) for names in steps]  # a TP set's ranks share their sources
        self._sizes = [sum(src.info(n).nbytes for n in names) for names in self._steps]
        self._ahead = ahead
        self._cv = threading.Condition()
        self._now = -1
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="prep-prefetch", daemon=True)

    def __enter__(self) -> "Prefetch":
        if os.environ.get("PREP_PREFETCH", "1") != "0":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()

    def at(self, i: int) -> None:
        """Group ``i`` is being built now."""
        with self._cv:
            self._now = i
            self._cv.notify()

    def _may_read(self, i: int) -> bool:
        return i <= self._now + 1 or sum(self._sizes[max(0, self._now):i]) <= self._ahead

    def _run(self) -> None:
        try:
            for i, names in enumerate(self._steps):
                with self._cv:
                    while not self._stop and not self._may_read(i):
                        self._cv.wait()
                if not names:
                    continue
                for fd, start, stop in self._src.spans(names):
                    for w in range(start // mmap.PAGESIZE * mmap.PAGESIZE, stop, WINDOW):
                        if self._stop:
                            return
                        populate(fd, w, min(stop, w + WINDOW) - w)
        except OSError:
            return  # only a hint: the builders' own reads report what is wrong with the file


class _Libc:
    _it = None

    @classmethod
    def get(cls):
        if cls._it is None:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int64]
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            cls._it = lib
        return cls._it


_scratch = threading.local()


def populate(fd: int, start: int, length: int, advice: int = _MADV_POPULATE_READ) -> str:
    """Bring ``length`` bytes of ``fd`` from ``start`` (page-aligned) into the page cache and
    wait for them. Returns how: ``"mapped"`` (faulted in through a mapping) or ``"read"``."""
    lib = _Libc.get()
    addr = lib.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr not in (None, ctypes.c_void_p(-1).value):
        try:
            if lib.madvise(addr, length, advice) == 0:
                return "mapped"
        finally:
            lib.munmap(addr, length)
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(16 << 20))
    end = start + length
    while start < end:
        got = os.preadv(fd, [buf[:min(len(buf), end - start)]], start)
        if got <= 0:
            break
        start += got
    return "read"
