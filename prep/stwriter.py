"""A safetensors writer that streams: the header is computed from the planned names, dtypes and
shapes, then each tensor's bytes are appended in order, in chunks if need be, and hashed on the
way (xxh3-128), so a rank file of any size is written holding only a few chunks in memory. The
bytes go to disk through :class:`prep.directio.AlignedFileWriter` (``O_DIRECT`` where allowed)."""

from __future__ import annotations

import json
import pathlib
import queue
import threading

import torch
import xxhash

from layouts.safetensors_file import TORCH_DTYPES, tensor_bytes

from .directio import AlignedFileWriter

DTYPES = {t: s for s, t in TORCH_DTYPES.items()}
ITEMSIZE = {s: t.itemsize for s, t in TORCH_DTYPES.items()}


def nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of safetensors ``dtype`` and ``shape``."""
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


class StreamingSafetensorsWriter:
    """Write ``entries`` = [(name, dtype string, shape)] to ``path`` in that order.

    Use as a context manager. Either ``add`` each whole tensor in order, or ``write`` a tensor's
    bytes in consecutive chunks (any shapes; the byte count must come out exact), so that a
    stacked MoE tensor of several GiB never has to exist in memory at once. A background thread
    hashes and stages the bytes (the output's own thread writes them), so the caller builds the
    next chunk meanwhile; at most ``max_pending`` chunks wait in between, which bounds the
    memory this adds. On a clean exit the file is complete and fsynced; an error in either
    thread (a full disk, say) is raised in the caller unchanged.
    """

    def __init__(self, path: pathlib.Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, max_pending: int = 2):
        self.path = path
        self.entries = entries
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._sizes = []
        for name, dtype, shape in entries:
            n = nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes.append(n)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self._header = raw
        self.size = 8 + len(raw) + offset
        self._next = 0  # index of the tensor being written
        self._done_bytes = 0  # bytes of it written so far
        self.hashes: dict[str, str] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._out: AlignedFileWriter | None = None

    def __enter__(self) -> "StreamingSafetensorsWriter":
        self._out = AlignedFileWriter(self.path)
        self._out.write_bytes(len(self._header).to_bytes(8, "little") + self._header)
        self._thread = threading.Thread(target=self._drain, name=f"write {self.path.name}", daemon=True)
        self._thread.start()
        return self

    # -- the caller's side
    def add(self, name: str, t: torch.Tensor) -> None:
        """Write the whole tensor ``name`` (its shape must be the planned one)."""
        want_name, want_dtype, want_shape = self.entries[self._next] if self._next < len(self.entries) else (None,) * 3
        if self._done_bytes or tuple(t.shape) != tuple(want_shape or ()):
            raise RuntimeError(f"writer: expected {want_name} {want_dtype} {list(want_shape or ())}, "
                               f"got {name} {DTYPES.get(t.dtype)} {list(t.shape)}")
        self.write(name, t)

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append ``chunk``'s bytes to tensor ``name``, which is the one in progress or the next."""
        if self._done_bytes == 0 or name != self.entries[self._next][0]:
            if self._done_bytes:
                raise RuntimeError(f"writer: {self.entries[self._next][0]} got {self._done_bytes} of "
                                   f"{self._sizes[self._next]} bytes before {name} began")
            if self._next >= len(self.entries) or name != self.entries[self._next][0]:
                want = self.entries[self._next][0] if self._next < len(self.entries) else "nothing more"
                raise RuntimeError(f"writer: expected {want}, got {name}")
        want_dtype, size = self.entries[self._next][1], self._sizes[self._next]
        if DTYPES.get(chunk.dtype) != want_dtype:
            raise RuntimeError(f"writer: {name} is {want_dtype}, got a {DTYPES.get(chunk.dtype)} chunk")
        n = chunk.numel() * chunk.element_size()
        if self._done_bytes + n > size:
            raise RuntimeError(f"writer: {name} overflows its {size} bytes")
        if self._done_bytes == 0:
            self._put(("begin", name))
        self._put(("data", chunk.detach().contiguous()))
        self._done_bytes += n
        if self._done_bytes == size:
            self._put(("end", name))
            self._next += 1
            self._done_bytes = 0

    def _put(self, item) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # -- the writer thread
    def _drain(self) -> None:
        hasher = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # keep draining so the caller never blocks on a dead writer
            try:
                kind, arg = item
                if kind == "begin":
                    hasher = xxhash.xxh3_128()
                elif kind == "data":
                    hasher.update(tensor_bytes(arg))
                    self._out.write(arg.reshape(-1).view(torch.uint8))
                else:
                    self.hashes[arg] = hasher.hexdigest()
            except BaseException as e:  # noqa: BLE001 - handed to the caller as is
                self._error = e

    def __exit__(self, exc_type, exc, tb) -> None:
        completed = False
        try:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            if exc_type is None:
                if self._error is not None:
                    raise self._error
                if self._next != len(self.entries):
                    raise RuntimeError(f"writer: {self.path.name} got {self._next} of {len(self.entries)} tensors")
                self._out.close()
                completed = True
        finally:
            if not completed:
                self._out.abort()
