"""``prep verify``: is a converted checkpoint what its manifest says, and (with a source) does it
invert to the source's exact bytes?"""

from __future__ import annotations

from typing import Callable

import torch

from .converted import ConvertedCheckpoint
from .errors import PrepError
from .source import SourceCheckpoint


def verify(out: str, source: str | None = None, deep: bool = False,
           progress: Callable[[int], None] | None = None) -> dict:
    """Check files, sizes and every tensor's hash; ``deep`` also inverts every group (padding
    checks); ``source`` also compares the inverted bytes with the source checkpoint."""
    ck = ConvertedCheckpoint(out)
    m = ck.manifest
    for fname, meta in m.files.items():
        path = ck.root / fname
        if not path.is_file():
            raise PrepError(f"{path}: missing; convert again")
        if path.stat().st_size != meta.size:
            raise PrepError(f"{path}: size {path.stat().st_size} differs from the manifest's {meta.size}; "
                            "the file is truncated or was replaced")
    # The hash check engines run too (one sequential pass per file): a mismatch is a ManifestError
    # naming the file, the tensor and its rank.
    checked = m.verify_hashes(progress=progress)
    compared = 0
    if deep or source:
        src = SourceCheckpoint.open(source) if source else None
        for unit, _ in ck.units():
            for name, got in ck.iter_source_tensors(unit):  # experts a block at a time
                if src is None:
                    continue
                want = src.read(name)
                if want.dtype != got.dtype:
                    got = got.view(want.dtype)
                if want.shape != got.shape or not torch.equal(want, got):
                    raise PrepError(f"{name}: inverted bytes differ from the source")
                compared += 1
    return {"files": len(m.files), "tensors_hashed": checked, "source_tensors_compared": compared}
