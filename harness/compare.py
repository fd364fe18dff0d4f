"""The byte comparison every engine check makes: the tensors the engine holds after loading the
converted folder (its door) against those it holds after its own load of the source."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Compared:
    equal: int = 0  # bytes equal
    unwritten: int = 0  # bytes the engine's own load never writes (its two loads differ there): not compared
    problems: list[str] = dataclasses.field(default_factory=list)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as one flat uint8 tensor (any dtype, any strides)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def compare(own: dict[str, torch.Tensor], door: dict[str, torch.Tensor],
            own_other_fill: dict[str, torch.Tensor] | None = None) -> Compared:
    """``door`` against ``own``, tensor by tensor and byte for byte. ``own_other_fill``: the
    engine's own load again with ``torch.empty`` memory filled with another byte; where given,
    the bytes on which its two loads differ are memory the engine never writes, counted as
    ``unwritten`` and compared nowhere."""
    out = Compared()
    out.problems += [f"{n}: only in the engine's own load" for n in sorted(own.keys() - door.keys())]
    out.problems += [f"{n}: only after loading OUT" for n in sorted(door.keys() - own.keys())]
    for n in sorted(own.keys() & door.keys()):
        a, g = own[n], door[n]
        if (a.shape, a.dtype) != (g.shape, g.dtype):
            out.problems.append(f"{n}: {list(a.shape)} {a.dtype} in the engine's own load, {list(g.shape)} {g.dtype} "
                                "from OUT")
            continue
        a, g = as_bytes(a), as_bytes(g)
        defined = (a == as_bytes(own_other_fill[n]) if own_other_fill is not None
                   else torch.ones_like(a, dtype=torch.bool))
        differ = int((defined & (a != g)).sum())
        out.unwritten += int((~defined).sum())
        out.equal += int((defined & (a == g)).sum())
        if differ:
            out.problems.append(f"{n}: {differ} of {a.numel()} bytes differ")
    return out
