"""What a source file is, cheaply enough to check on every run: its size, modification time, the
sha256 of its safetensors header and the xxh3-128 of a few blocks sampled across its data.

``--resume`` reuses a finished output file only if every source file it was built from still has
the identity recorded when it was written: a different checkpoint, a re-downloaded shard or a
single edited byte (which changes the modification time) redoes exactly the output files that
read it. Hashing every byte would be a second full read of a 350 GiB source; this reads a
header and ``SAMPLES`` blocks per file (about 0.5 MiB), and ``mtime`` catches what sampling can
miss. A copy of the source (new mtimes) is treated as changed: its files are redone, not trusted.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any

SAMPLES = 8
SAMPLE_BYTES = 64 << 10


def file_identity(path: pathlib.Path) -> dict[str, Any]:
    """The identity of one file (safetensors or not: a small side file is hashed whole)."""
    import xxhash

    st = os.stat(path)
    ident: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if not path.name.endswith(".safetensors"):
            h = xxhash.xxh3_128()
            for off in range(0, st.st_size, 1 << 24):
                h.update(os.pread(fd, 1 << 24, off))
            ident["xxh3_128"] = h.hexdigest()
            return ident
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        n = min(n, max(0, st.st_size - 8))  # a damaged header is the reader's error to report
        ident["header_sha256"] = hashlib.sha256(os.pread(fd, n, 8)).hexdigest()
        start, span = 8 + n, max(0, st.st_size - 8 - n)
        h = xxhash.xxh3_128()
        for i in range(SAMPLES if span else 0):
            h.update(os.pread(fd, SAMPLE_BYTES, start + (span - SAMPLE_BYTES) * i // max(1, SAMPLES - 1)
                              if span > SAMPLE_BYTES else start))
        ident["samples_xxh3_128"] = h.hexdigest()
        return ident
    finally:
        os.close(fd)


def changed_files(recorded: dict[str, Any], current: dict[str, dict[str, Any]]) -> list[str]:
    """Names in ``recorded`` (name -> identity) whose identity differs from ``current``'s."""
    return [name for name, ident in recorded.items() if current.get(name) != ident]


def side_file_changed(path: pathlib.Path, recorded: Any) -> str | None:
    """Why the side file at ``path`` no longer holds what the conversion copied from the source
    (``recorded``: its ``source.files`` entry, a size and, from this prep on, an xxh3-128;
    :func:`layouts.loader.side_file_difference`), in one line naming the fix; None where it still does."""
    from layouts.loader import side_file_difference

    diff = side_file_difference(path, recorded.size, recorded.xxh3_128)
    if diff is None:
        return None
    kind, have = diff
    what = {"missing": "missing", "size": f"{have} bytes, the source's was {recorded.size}",
            "bytes": "its bytes differ from the source's (same size, another hash)"}[kind]
    return f"{path}: {what}: changed since the conversion; put the source's {path.name} back"
