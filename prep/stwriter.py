"""A safetensors writer that streams: the header is computed from the planned names, dtypes and
shapes, then each tensor's bytes are appended in order and hashed on the way (xxh3-128), so a
rank file of any size is written holding one tensor in memory at a time."""

from __future__ import annotations

import json
import os
import pathlib

import torch
import xxhash

# safetensors dtype strings and the torch dtypes they are read into; the other tables derive from it.
TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool, "BF16": torch.bfloat16,
                "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I16": torch.int16,
                "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPES = {t: s for s, t in TORCH_DTYPES.items()}
ITEMSIZE = {s: t.itemsize for s, t in TORCH_DTYPES.items()}


def nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of safetensors ``dtype`` and ``shape``."""
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes (little-endian, as safetensors stores them), without a copy when contiguous."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_128(tensor_bytes(t)).hexdigest()


class StreamingSafetensorsWriter:
    """Write ``entries`` = [(name, dtype string, shape)] to ``path`` in that order.

    Use as a context manager; ``add`` each tensor in order; on a clean exit the file is complete.
    """

    def __init__(self, path: pathlib.Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = path
        self.entries = entries
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            n = nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self._header = raw
        self.size = 8 + len(raw) + offset
        self._next = 0
        self.hashes: dict[str, str] = {}
        self._f = None

    def __enter__(self) -> "StreamingSafetensorsWriter":
        self._f = open(self.path, "wb")
        self._f.write(len(self._header).to_bytes(8, "little"))
        self._f.write(self._header)
        return self

    def add(self, name: str, t: torch.Tensor) -> str:
        want_name, want_dtype, want_shape = self.entries[self._next]
        if name != want_name or DTYPES.get(t.dtype) != want_dtype or tuple(t.shape) != tuple(want_shape):
            raise RuntimeError(f"writer: expected {want_name} {want_dtype} {list(want_shape)}, "
                               f"got {name} {DTYPES.get(t.dtype)} {list(t.shape)}")
        data = tensor_bytes(t)
        self._f.write(data)
        self._next += 1
        self.hashes[name] = xxhash.xxh3_128(data).hexdigest()
        return self.hashes[name]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self._next != len(self.entries):
                    raise RuntimeError(f"writer: {self.path.name} got {self._next} of {len(self.entries)} tensors")
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
