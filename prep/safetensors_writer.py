"""A safetensors writer that streams: the header is computed from the planned names, dtypes and
shapes, then each tensor's bytes are appended in order, in chunks if need be, so a rank file of
any size is written holding only a few chunks in memory. The bytes go out through
:class:`prep.directio.AlignedFileWriter` (``O_DIRECT`` where allowed), whose own thread hashes
each tensor (xxh3-128) and writes while the caller builds the next chunk."""

from __future__ import annotations

import json
import pathlib

import torch

from layouts.safetensors_file import ITEMSIZE, TORCH_DTYPES

from .directio import AlignedFileWriter

DTYPES = {t: s for s, t in TORCH_DTYPES.items()}
DATA_ALIGN = 4096  # where a written file's data section starts: a page, O_DIRECT's unit


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
    stacked MoE tensor of several GiB never has to exist in memory at once. A chunk can be
    built in place: ``reserve`` returns the next bytes of the output's staging memory, and
    writing that same view appends it without a copy. On a clean exit the file is complete
    and fsynced and ``hashes`` holds every tensor's xxh3-128; an error in the output's thread
    (a full disk, say) is raised in the caller unchanged.
    """

    def __init__(self, path: pathlib.Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, staging_bytes: int | None = None,
                 write_depth: int | None = None):
        self.path = path
        self.staging_bytes = staging_bytes
        self.write_depth = write_depth  # writes in flight (directio's default when None)
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
        # Spaces (valid JSON, as safetensors pads) so the data starts on a DATA_ALIGN boundary:
        # each tensor then starts at its offset's alignment in the data, in the file and in the
        # writer's staging memory (which mirrors file offsets), and prep's tensors are whole
        # 16-byte multiples, so every one is 16-byte aligned: W16 shuffles into staging as
        # 16-byte runs, 4x the speed of the 8-aligned staging of an 8-byte pad (docs/BENCHMARKS.md).
        raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
        self._header = raw
        self.size = 8 + len(raw) + offset
        base = 8 + len(raw)
        self._spans = [(name, base + a, base + b) for name, (a, b) in
                       ((n, header[n]["data_offsets"]) for n, _, _ in entries)]
        self._next = 0  # index of the tensor being written
        self._done_bytes = 0  # bytes of it written so far
        self._out: AlignedFileWriter | None = None

    @property
    def hashes(self) -> dict[str, str]:
        return self._out.hashes if self._out is not None else {}

    def __enter__(self) -> "StreamingSafetensorsWriter":
        self._out = AlignedFileWriter(self.path, self._spans, staging_bytes=self.staging_bytes,
                                      depth=self.write_depth)
        try:
            self._out.write_bytes(len(self._header).to_bytes(8, "little") + self._header)
        except BaseException:
            self._out.abort()
            raise
        return self

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write the whole tensor ``name`` (its shape must be the planned one)."""
        want_name, want_dtype, want_shape = self.entries[self._next] if self._next < len(self.entries) else (None,) * 3
        if self._done_bytes or tuple(t.shape) != tuple(want_shape or ()):
            raise RuntimeError(f"writer: expected {want_name} {want_dtype} {list(want_shape or ())}, "
                               f"got {name} {DTYPES.get(t.dtype)} {list(t.shape)}")
        self.write(name, t)

    def reserve(self, name: str, nbytes: int) -> torch.Tensor | None:
        """Room for the next ``nbytes`` of tensor ``name`` in the output's own memory (a uint8
        view), to build a chunk in and then ``write``; None when the chunk is too large to
        stage (build it elsewhere)."""
        self._check_next(name, nbytes)
        return self._out.reserve(nbytes)

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append ``chunk``'s bytes to tensor ``name``, which is the one in progress or the next."""
        n = chunk.numel() * chunk.element_size()
        self._check_next(name, n)
        want_dtype = self.entries[self._next][1]
        if DTYPES.get(chunk.dtype) != want_dtype:
            raise RuntimeError(f"writer: {name} is {want_dtype}, got a {DTYPES.get(chunk.dtype)} chunk")
        self._out.write(chunk.detach().contiguous().reshape(-1).view(torch.uint8))
        self._done_bytes += n
        if self._done_bytes == self._sizes[self._next]:
            self._next += 1
            self._done_bytes = 0

    def _check_next(self, name: str, n: int) -> None:
        if self._next >= len(self.entries) or name != self.entries[self._next][0]:
            if self._done_bytes:
                raise RuntimeError(f"writer: {self.entries[self._next][0]} got {self._done_bytes} of "
                                   f"{self._sizes[self._next]} bytes before {name} began")
            want = self.entries[self._next][0] if self._next < len(self.entries) else "nothing more"
            raise RuntimeError(f"writer: expected {want}, got {name}")
        if self._done_bytes + n > self._sizes[self._next]:
            raise RuntimeError(f"writer: {name} overflows its {self._sizes[self._next]} bytes")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._out.abort()
            return
        if self._next != len(self.entries):
            self._out.abort()
            raise RuntimeError(f"writer: {self.path.name} got {self._next} of {len(self.entries)} tensors")
        self._out.close()
