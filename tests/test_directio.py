"""prep.directio.AlignedFileWriter: the bytes on disk are exactly the bytes appended, whatever
the piece sizes, with O_DIRECT or buffered, and write errors reach the producer."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import prep.directio as dio
from prep.directio import AlignedFileWriter


def _pieces(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


def _write(path, pieces, **kw):
    w = AlignedFileWriter(path, **kw)
    for p in pieces:
        w.write(p)
    w.close()
    return w


def _expected(pieces) -> bytes:
    return b"".join(p.numpy().tobytes() for p in pieces)


def _direct_supported(tmp_path) -> bool:
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | dio.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return bool(dio.O_DIRECT)


@pytest.mark.parametrize("sizes", [
    [0], [1], [4095], [4096], [4097],
    [3, 5000, 1, 0, 77777],  # unaligned pieces, a zero-length one
    [dio.STAGING_BYTES - 1, 2, dio.STAGING_BYTES + 5],  # pieces straddling staging blocks
    [dio.STAGING_BYTES * dio.STAGING_BLOCKS * 2 + 123],  # one piece larger than all the staging
])
@pytest.mark.parametrize("direct", [True, False])
def test_file_holds_exactly_the_appended_bytes(tmp_path, sizes, direct):
    pieces = _pieces(sizes)
    w = _write(tmp_path / "f", pieces, direct=direct)
    assert (tmp_path / "f").read_bytes() == _expected(pieces)
    assert w.size == sum(sizes)


@pytest.mark.parametrize("depth", ["2", "5"])
def test_several_writes_in_flight_give_the_same_file_and_hashes(tmp_path, monkeypatch, depth):
    pieces = _pieces([3, dio.STAGING_BYTES - 1, 2, dio.STAGING_BYTES * 3 + 5, 4097])
    spans = [("a", 0, 3), ("b", 3, dio.STAGING_BYTES + 4), ("c", dio.STAGING_BYTES + 4, dio.STAGING_BYTES * 4 + 9)]
    one = AlignedFileWriter(tmp_path / "one", spans)
    for p in pieces:
        one.write(p)
    one.close()
    monkeypatch.setenv("PREP_WRITE_DEPTH", depth)
    w = AlignedFileWriter(tmp_path / "f", spans)
    assert sum(t.name.startswith("write") for t in w._threads) == int(depth)
    for p in pieces:
        w.write(p)
    w.close()
    assert (tmp_path / "f").read_bytes() == _expected(pieces) and w.hashes == one.hashes


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path):
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT; the fallback tests cover it")  # tmpfs on old kernels
    w = _write(tmp_path / "f", _pieces([dio.STAGING_BYTES + 4097]))
    assert w.direct


def test_falls_back_to_buffered_when_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & dio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(dio.os, "open", no_direct)
    pieces = _pieces([5000, dio.STAGING_BYTES])
    w = _write(tmp_path / "f", pieces)
    assert not w.direct and (tmp_path / "f").read_bytes() == _expected(pieces)


def test_falls_back_to_buffered_when_a_direct_write_is_refused(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open; covered by the open fallback")
    real_pwrite, refused = os.pwrite, []

    def picky(fd, buf, offset):  # a filesystem that opens with O_DIRECT but rejects the writes
        if dio.fcntl.fcntl(fd, dio.fcntl.F_GETFL) & dio.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(dio.os, "pwrite", picky)
    pieces = _pieces([3 * dio.STAGING_BYTES + 10])
    w = _write(tmp_path / "f", pieces)
    assert refused == [0] and not w.direct
    assert (tmp_path / "f").read_bytes() == _expected(pieces)


def test_a_write_error_reaches_the_producer(tmp_path, monkeypatch):
    def full(fd, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dio.os, "pwrite", full)
    w = AlignedFileWriter(tmp_path / "f")
    with pytest.raises(OSError) as e:
        for p in _pieces([dio.STAGING_BYTES] * (dio.STAGING_BLOCKS + 2)):
            w.write(p)
        w.close()
    assert e.value.errno == errno.ENOSPC
    w.abort()


def test_short_writes_are_continued(tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def short(fd, buf, offset):  # the kernel may write less than asked (buffered mode)
        return real_pwrite(fd, buf[:max(1, len(buf) // 3)], offset)

    monkeypatch.setattr(dio.os, "pwrite", short)
    pieces = _pieces([100_000, 3])
    _write(tmp_path / "f", pieces, direct=False)
    assert (tmp_path / "f").read_bytes() == _expected(pieces)


def _xxh(b: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128(b).hexdigest()


@pytest.mark.parametrize("sizes", [
    [10, 0, 5000, 3],
    [dio.STAGING_BYTES - 7, 20, dio.STAGING_BYTES * 2 + 1, 0],  # spans across blocks; an empty one at the very end
])
def test_spans_are_hashed_on_the_way_out(tmp_path, sizes):
    pieces = _pieces([17, *sizes])  # a 17-byte "header" that no span covers
    spans, pos = [], 17
    for i, n in enumerate(sizes):
        spans.append((f"t{i}", pos, pos + n))
        pos += n
    w = AlignedFileWriter(tmp_path / "f", spans)
    for p in pieces:
        w.write(p)
    w.close()
    data = (tmp_path / "f").read_bytes()
    assert w.hashes == {name: _xxh(data[a:b]) for name, a, b in spans}


def test_reserved_room_is_written_in_place_and_carries_the_unaligned_tail(tmp_path):
    pieces = _pieces([dio.STAGING_BYTES - 100, 5000, 3, 1 << 20])
    w = AlignedFileWriter(tmp_path / "f", [("all", 0, sum(p.numel() for p in pieces))])
    w.write(pieces[0])
    for p in pieces[1:]:  # the first reservation does not fit the block: its tail moves on
        room = w.reserve(p.numel())
        room.copy_(p)
        w.write(room)
    w.close()
    assert (tmp_path / "f").read_bytes() == _expected(pieces)
    assert w.hashes["all"] == _xxh(_expected(pieces))


def test_reserve_declines_what_cannot_be_staged_whole(tmp_path):
    w = AlignedFileWriter(tmp_path / "f")
    assert w.reserve(dio.STAGING_BYTES) is None
    room = w.reserve(100)  # a reservation not used: the next write copies over it
    room.fill_(1)
    pieces = _pieces([300])
    w.write(pieces[0])
    w.close()
    assert (tmp_path / "f").read_bytes() == _expected(pieces)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_setup_leaves_no_open_file(tmp_path, monkeypatch):
    before = _open_fds()

    def no_memory(*a, **k):
        raise MemoryError("staging")

    monkeypatch.setattr(dio.mmap, "mmap", no_memory)
    with pytest.raises(MemoryError):
        AlignedFileWriter(tmp_path / "f")
    assert _open_fds() == before


def test_abort_drops_queued_blocks_and_closes(tmp_path, monkeypatch):
    import threading

    gate = threading.Event()
    real, writes = os.pwrite, []

    def slow(fd, buf, offset):  # the disk stalls until the producer has given up
        gate.wait(5)
        writes.append(offset)
        return real(fd, buf, offset)

    monkeypatch.setattr(dio.os, "pwrite", slow)
    before = _open_fds()
    w = AlignedFileWriter(tmp_path / "f")
    for p in _pieces([dio.STAGING_BYTES] * (dio.STAGING_BLOCKS - 1)):
        w.write(p)
    threading.Timer(0.2, gate.set).start()
    w.abort()
    assert len(writes) <= 1 and _open_fds() == before  # the write in progress may finish; the rest is dropped


def test_closing_before_a_span_is_complete_is_an_error(tmp_path):
    w = AlignedFileWriter(tmp_path / "f", [("t", 0, 100)])
    w.write(_pieces([50])[0])
    with pytest.raises(RuntimeError, match="before the end of t"):
        w.close()


def test_writers_sharing_a_queue_all_get_their_end_marker_whoever_takes_which():
    # The write threads share one queue, so the marker put for one may end another. Here B takes
    # the first marker and ends before its own is looked at, while A has not read the queue yet:
    # ending only the threads still alive then gave A no marker, and close() waited forever.
    import queue
    import threading

    shared = queue.Queue()
    a_may_read = threading.Event()

    def read_until_marker():
        while shared.get() is not None:
            pass

    a = threading.Thread(target=lambda: (a_may_read.wait(), read_until_marker()), daemon=True)
    b = threading.Thread(target=read_until_marker, daemon=True)

    class B:  # B, looked at only once it has taken the first marker and ended
        def is_alive(self):
            threading.Thread.join(b, timeout=5)
            return b.is_alive()

        def join(self):
            threading.Thread.join(b, timeout=5)

    class A:
        def is_alive(self):
            return a.is_alive()

        def join(self):
            a_may_read.set()
            threading.Thread.join(a, timeout=5)

    a.start()
    b.start()
    AlignedFileWriter._end_threads([shared, shared], [A(), B()])
    assert not a.is_alive() and not b.is_alive()
