"""Append-only file output that bypasses the page cache (``O_DIRECT``) where the filesystem allows,
and hashes named byte ranges on their way to the disk.

Why: a buffered ``write`` copies every byte into the page cache, and the disk gets them later
(or at ``fsync``). For a converter that already copies each byte in user space, that kernel copy
was the slowest stage: on the 2-core bench machine the writer thread spent ~3 s of a 3.6 s
conversion in ``write`` and ``fsync``, while an ``O_DIRECT`` stream of the same bytes reached
the disk in 1.4 s, durable, with almost no CPU (the device reads user memory by DMA). It also
keeps a 350 GB conversion from pushing everything else out of memory.

``O_DIRECT`` needs the buffer address, the file offset and the length aligned to the device's
block size, so bytes are gathered into page-aligned staging blocks; a thread of its own hashes
and writes full blocks while the producer fills the next. A producer that can build its bytes in
place (read a tensor, or write a shuffle's output) asks for room with :meth:`reserve` and so
skips the copy into staging. The last block is written padded and the file is truncated to its
true size. Where the filesystem refuses ``O_DIRECT`` (at open or at the first write) the same
blocks are written buffered, with writeback started every ``WRITEBACK_BYTES``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import pathlib
import queue
import threading

import torch

from layouts.safetensors_file import SpanHasher

ALIGN = 4096  # a multiple of every block size O_DIRECT asks for (512 or 4096)
STAGING_BYTES = 40 << 20  # one staging block: room for a whole 32 MiB conversion chunk plus a carried tail
# Writes in flight per file: a disk that only reaches its speed with several requests queued
# (virtio disks, arrays) gets them from one file. PREP_WRITE_DEPTH overrides it.
WRITE_DEPTH = 1
STAGING_SPARE = 2  # blocks beyond the writes in flight: one being filled, one being hashed
STAGING_BLOCKS = WRITE_DEPTH + STAGING_SPARE  # at the default depth
WRITEBACK_BYTES = 256 << 20  # buffered fallback: hand dirty pages to the disk this often
O_DIRECT = getattr(os, "O_DIRECT", 0)


def write_depth(default: int = WRITE_DEPTH) -> int:
    """Writes in flight per file: ``PREP_WRITE_DEPTH`` (1 to 16) when set, else ``default``."""
    try:
        return max(1, min(16, int(os.environ.get("PREP_WRITE_DEPTH", default))))
    except ValueError:
        return default

Span = tuple[str, int, int]  # (name, start, stop): a byte range of the stream to hash


class AlignedFileWriter:
    """Write a new file at ``path`` as one stream of bytes.

    :meth:`write` appends a copy; :meth:`reserve` hands out the next bytes of staging memory to
    build in, and a following :meth:`write` of exactly that view appends it without a copy.
    :meth:`close` completes the file (pads, truncates, fsyncs); :meth:`abort` gives up. Each
    ``(name, start, stop)`` of ``spans`` (ascending, not overlapping) is hashed (xxh3-128) as
    the bytes go out: ``hashes[name]`` after close. Write errors (a full disk) are raised in the
    producer on its next call. One producer thread.
    """

    def __init__(self, path: pathlib.Path, spans: list[Span] = (), direct: bool = True,
                 staging_bytes: int | None = None, depth: int | None = None):
        self.path = path
        self.depth = write_depth(depth or WRITE_DEPTH)  # writes in flight (PREP_WRITE_DEPTH wins)
        self.staging_bytes = staging_bytes or STAGING_BYTES  # a multiple of ALIGN
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(direct and O_DIRECT)
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, flags | O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        self._fd = fd if fd >= 0 else os.open(path, flags, 0o644)
        try:
            self._setup(spans)
        except BaseException:
            self._cancel_threads()
            self._close_fd()
            raise

    def _setup(self, spans) -> None:
        # Page-aligned, private anonymous memory (Python's default for -1 is shared, which the
        # kernel accounts as shmem).
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        depth = self.depth
        n_blocks = depth + STAGING_SPARE
        self._blocks = [mmap.mmap(-1, self.staging_bytes, flags=flags) if flags else mmap.mmap(-1, self.staging_bytes)
                        for _ in range(n_blocks)]
        self._views = [torch.frombuffer(b, dtype=torch.uint8) for b in self._blocks]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(1, n_blocks):
            self._free.put(i)
        self._cur, self._fill = 0, 0  # the block being filled and its bytes so far
        self._block_offset = 0  # where that block goes in the file
        self.size = 0  # bytes appended
        self._error: BaseException | None = None
        self._cancelled = False  # set on abort: the threads skip what is still queued
        self._spans = list(spans)
        self._hasher = SpanHasher(self._spans)  # fed by the hash thread only
        self.hashes: dict[str, str] = {}
        self._written_back = 0  # buffered fallback: the file up to here was handed to the disk
        # Each submitted block goes to both threads: one hashes it while the other writes it
        # (both only read it); it is free again when both are done with it.
        self._todo: queue.Queue = queue.Queue()
        self._hash_todo: queue.Queue = queue.Queue()
        self._users = [0] * n_blocks
        self._users_lock = threading.Lock()
        # ``depth`` writers share the write queue (each block has its own offset: order does not
        # matter); one hasher takes the blocks in order.
        self._threads = [threading.Thread(target=self._run, args=(self._todo, self._write_block), name=f"write {self.path.name}",
                                          daemon=True) for _ in range(depth)]
        self._threads.append(threading.Thread(target=self._run, args=(self._hash_todo, self._hash),
                                              name=f"hash {self.path.name}", daemon=True))
        self._queues = [self._todo] * depth + [self._hash_todo]
        for t in self._threads:
            t.start()

    # -- the producer's side
    def write(self, data: torch.Tensor) -> None:
        """Append ``data``'s bytes (a contiguous uint8 tensor of any length, or the view the
        last :meth:`reserve` returned, filled: then nothing is copied)."""
        self._raise_error()
        data = data.reshape(-1)
        view = self._views[self._cur]
        if data.numel() and data.data_ptr() == view.data_ptr() + self._fill and self._fill + data.numel() <= self.staging_bytes:
            self._fill += data.numel()  # built in place
            self.size += data.numel()
            if self._fill == self.staging_bytes:
                self._submit_full()
            return
        done = 0
        while done < data.numel():
            n = min(data.numel() - done, self.staging_bytes - self._fill)
            self._views[self._cur][self._fill:self._fill + n].copy_(data[done:done + n])  # releases the GIL
            self._fill += n
            done += n
            if self._fill == self.staging_bytes:
                self._submit_full()
        self.size += data.numel()

    def write_bytes(self, raw: bytes) -> None:
        if raw:
            self.write(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """The next ``nbytes`` of the stream as a uint8 view of staging memory, to be filled and
        then passed to :meth:`write`; None when ``nbytes`` is too large to stage whole (write a
        tensor of your own then). Nothing is appended until that write."""
        self._raise_error()
        if nbytes > self.staging_bytes - ALIGN:
            return None
        if self._fill + nbytes > self.staging_bytes:
            # Send the block's aligned part now and carry its unaligned tail (< ALIGN bytes) to
            # the front of the next block, so the reserved bytes are contiguous.
            keep = self._fill % ALIGN
            cut = self._fill - keep
            nxt = self._next_free()
            if keep:
                self._views[nxt][:keep].copy_(self._views[self._cur][cut:self._fill])
            self._send(self._cur, self._block_offset, cut)
            self._block_offset += cut
            self._cur, self._fill = nxt, keep
        return self._views[self._cur][self._fill:self._fill + nbytes]

    def close(self) -> None:
        """Write what is left, cut the file to its true size and fsync it; then close."""
        try:
            if self._fill:
                pad = -self._fill % ALIGN
                self._views[self._cur][self._fill:self._fill + pad].zero_()
                self._send(self._cur, self._block_offset, self._fill + pad)
                self._fill = 0
            self._stop()
            self._raise_error()
            unfinished = [name for name, _, stop in self._spans if stop > self.size]
            if unfinished:
                raise RuntimeError(f"{self.path.name}: closed after {self.size} bytes, before the end of {unfinished[0]}")
            self.hashes = self._hasher.finish()
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            self._cancel_threads()  # a no-op when they finished; after an interrupt they must stop before the fd closes
            self._close_fd()

    def abort(self) -> None:
        """Stop without completing (what is queued is dropped); the caller removes the file."""
        try:
            self._cancel_threads()
        finally:
            self._close_fd()

    def _submit_full(self) -> None:
        self._send(self._cur, self._block_offset, self.staging_bytes)
        self._block_offset += self.staging_bytes
        self._cur, self._fill = self._next_free(), 0

    def _send(self, block: int, offset: int, length: int) -> None:
        self._users[block] = 2
        self._todo.put((block, offset, length))
        self._hash_todo.put((block, offset, length))

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _next_free(self) -> int:
        while True:
            self._raise_error()
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue

    def _stop(self) -> None:
        """Let the threads finish what is queued, and wait for them."""
        self._end_threads(self._queues, self._threads)

    def _cancel_threads(self) -> None:
        """Make the threads drop what is queued and end, and wait for them."""
        self._cancelled = True
        self._end_threads(getattr(self, "_queues", ()), getattr(self, "_threads", ()))

    @staticmethod
    def _end_threads(queues: list[queue.Queue], threads: list[threading.Thread]) -> None:
        # One end marker per thread, alive or not: the writers share one queue, so a marker put
        # for one may end another; skipping the threads already ended (as this once did) then
        # left a live one without its marker, and join() waited forever (seen under load). A
        # marker no thread takes is harmless.
        for q in queues:
            q.put(None)
        for t in threads:
            t.join()

    def _close_fd(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        # Drop the staging blocks; they are unmapped once nothing refers to them (an error's
        # traceback may still hold a view, so they are not closed here).
        self._views, self._blocks = [], []

    # -- the write and hash threads
    def _run(self, todo: queue.Queue, work) -> None:
        while (item := todo.get()) is not None:
            block, offset, length = item
            if self._error is None and not self._cancelled:
                try:
                    work(memoryview(self._blocks[block])[:length], offset)
                except BaseException as e:  # noqa: BLE001 - raised in the producer
                    self._error = e
            with self._users_lock:
                self._users[block] -= 1
                if self._users[block] == 0:
                    self._free.put(block)

    def _write_block(self, buf: memoryview, offset: int) -> None:
        self._pwrite_all(buf, offset)

    def _hash(self, buf: memoryview, start: int) -> None:
        self._hasher.feed(buf, start)  # a tail's pad lies past every span

    def _pwrite_all(self, buf: memoryview, offset: int) -> None:
        while buf:
            try:
                n = os.pwrite(self._fd, buf, offset)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                # The filesystem took O_DIRECT at open but not these writes: go buffered.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: write made no progress at offset {offset}")
            buf, offset = buf[n:], offset + n
            if not self.direct and offset - self._written_back >= WRITEBACK_BYTES and hasattr(os, "posix_fadvise"):
                # Start the disk on the window written since (DONTNEED writes back, then drops
                # what is clean), so the final fsync has little left and memory stays free.
                os.posix_fadvise(self._fd, self._written_back, offset - self._written_back, os.POSIX_FADV_DONTNEED)
                self._written_back = offset
