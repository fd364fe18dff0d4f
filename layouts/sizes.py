"""Integer size arithmetic shared by the numerics and the layouts: how many blocks hold a
length, and a length padded to whole blocks (its own module so that ``mxfp4`` and ``shuffle``,
which imports ``mxfp4``, can both use it)."""

from __future__ import annotations

__all__ = [
    "ceil_div", "pad_to",
]


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up: how many blocks of ``d`` hold ``n``."""
    return -(-n // d)


def pad_to(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return ceil_div(n, multiple) * multiple
