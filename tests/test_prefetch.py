"""prep.prefetch: a cold source's bytes are read into the page cache ahead of the builders, the
next group while one is built, and no further than allowed; it changes no byte of the output and
never fails a conversion (the builders' own reads report a bad file)."""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib
import threading
import time

import pytest

import prep.prefetch as pf
from prep.convert import convert
from prep.deepseek import target_for
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

PAGE = mmap.PAGESIZE


def resident(path: pathlib.Path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` of a mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        lib = pf._Libc.get()
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        try:
            pages = -(-size // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            assert lib.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in bytes(vec)) / pages
        finally:
            lib.munmap(addr, size)


def evicted(path: pathlib.Path) -> pathlib.Path:
    """``path`` written out and dropped from the page cache (clean pages: no privilege needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    frac = resident(path)
    assert frac < 0.5, f"{path}: {frac:.0%} still cached after POSIX_FADV_DONTNEED (a RAM-backed folder?)"
    return path


@pytest.fixture
def cold_file(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(os.urandom(8 << 20))
    return evicted(p)


@pytest.mark.parametrize("advice, how", [(pf._MADV_POPULATE_READ, "mapped"), (9999, "read")])
def test_populate_brings_an_evicted_file_into_the_page_cache(cold_file, advice, how):
    """Through a mapping (MADV_POPULATE_READ), or by reading where the kernel refuses the advice
    (a kernel before 5.14 answers EINVAL, as it does to the unknown advice 9999)."""
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        assert pf.populate(fd, 0, cold_file.stat().st_size, advice) == how
    finally:
        os.close(fd)
    assert resident(cold_file) == 1.0


def test_a_span_past_the_end_of_a_shortened_file_is_read_as_far_as_it_goes(cold_file):
    """A file truncated since its header was read: the prefetch neither crashes nor raises (a
    mapping past the end would SIGBUS if touched; the advice reports EFAULT instead)."""
    os.truncate(cold_file, 3 << 20)
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        pf.populate(fd, 0, 8 << 20)
    finally:
        os.close(fd)
    assert resident(cold_file) == 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(SynthSpec(variant="r1-0528", n_routed_experts=16),
                            tmp_path_factory.mktemp("src") / "r1")


class Recorder:
    """``populate`` spied on: which (file, window) was asked for, in order."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()
        real = pf.populate

        def spy(fd, start, length, *a):
            with self.lock:
                self.calls.append((os.fstat(fd).st_ino, start, start + length))
            return real(fd, start, length, *a)

        monkeypatch.setattr(pf, "populate", spy)

    def settled(self) -> list[tuple[int, int, int]]:
        """The calls once no new one came for 0.2 s (the thread waits for the builders)."""
        n = -1
        for _ in range(100):
            with self.lock:
                if len(self.calls) == n:
                    return list(self.calls)
                n = len(self.calls)
            time.sleep(0.2)
        raise AssertionError("the prefetch thread never settled")


def covered(calls, src: SourceCheckpoint, names) -> bool:
    """Whether every byte of ``names`` lies in a window that was asked for."""
    for n in names:
        t = src.info(n)
        ino = os.stat(src.root / t.file).st_ino
        if not any(i == ino and a <= t.offset and t.offset + t.nbytes <= b for i, a, b in calls):
            return False
    return True


def test_the_next_group_is_read_while_one_is_built_and_no_further(tiny, monkeypatch):
    src = SourceCheckpoint.open(str(tiny))
    names = sorted(src.tensors)
    steps = [names[i::4] for i in range(4)]  # four groups spread over the files: any order
    rec = Recorder(monkeypatch)
    with pf.Prefetch(src, steps, ahead=0) as ahead:
        ahead.at(0)
        calls = rec.settled()
        assert covered(calls, src, steps[0] + steps[1])
        assert not covered(calls, src, steps[2]) and not covered(calls, src, steps[3])
        ahead.at(2)
        calls = rec.settled()
        assert covered(calls, src, steps[2] + steps[3])


def test_groups_smaller_than_the_allowance_are_read_ahead_together(tiny, monkeypatch):
    src = SourceCheckpoint.open(str(tiny))
    names = sorted(src.tensors)
    steps = [names[i::4] for i in range(4)]
    rec = Recorder(monkeypatch)
    with pf.Prefetch(src, steps, ahead=1 << 30) as ahead:
        ahead.at(0)
        assert covered(rec.settled(), src, names)


def test_leaving_stops_the_thread_after_the_window_it_is_reading(tiny, monkeypatch):
    src = SourceCheckpoint.open(str(tiny))
    monkeypatch.setattr(pf, "WINDOW", PAGE)  # many windows
    started = threading.Event()
    calls = []

    def slow(fd, start, length, *a):
        calls.append(start)
        started.set()
        time.sleep(0.05)

    monkeypatch.setattr(pf, "populate", slow)
    with pf.Prefetch(src, [sorted(src.tensors)]) as ahead:
        ahead.at(0)
        assert started.wait(10)
    n = len(calls)
    time.sleep(0.2)
    assert len(calls) == n and n < sum(b - a for _, a, b in src.spans(sorted(src.tensors))) // PAGE


def test_a_conversion_reads_every_source_tensor_ahead_and_writes_the_same_bytes(tiny, tmp_path, monkeypatch):
    src = SourceCheckpoint.open(str(tiny))
    target = target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2)
    monkeypatch.setenv("PREP_PREFETCH", "0")
    convert(str(tiny), tmp_path / "off", target)
    monkeypatch.setenv("PREP_PREFETCH", "1")
    rec = Recorder(monkeypatch)
    convert(str(tiny), tmp_path / "on", target)
    assert covered(rec.calls, src, list(src.tensors))  # every source tensor is converted or copied through
    off = {p.name: p.read_bytes() for p in (tmp_path / "off").iterdir() if p.suffix == ".safetensors"}
    on = {p.name: p.read_bytes() for p in (tmp_path / "on").iterdir() if p.suffix == ".safetensors"}
    assert off and off == on


def test_a_file_that_fails_under_the_prefetch_leaves_the_error_to_the_builders(tiny, monkeypatch):
    src = SourceCheckpoint.open(str(tiny))

    def broken(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(pf, "populate", broken)
    with pf.Prefetch(src, [sorted(src.tensors)]) as ahead:
        ahead.at(0)
        ahead._thread.join(10)
        assert not ahead._thread.is_alive()


def test_verify_against_the_source_reads_the_source_ahead(tiny, tmp_path, monkeypatch):
    from prep.verify import verify

    convert(str(tiny), tmp_path / "out", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    rec = Recorder(monkeypatch)
    summary = verify(tmp_path / "out", source=str(tiny))
    src = SourceCheckpoint.open(str(tiny))
    assert summary["source_tensors_compared"] == len(src.tensors)
    assert covered(rec.calls, src, list(src.tensors))
