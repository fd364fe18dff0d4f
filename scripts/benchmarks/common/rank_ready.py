"""One definition of "rank ready" on the CPU, shared by the load and manifest benchmarks."""

from __future__ import annotations

import pathlib

import layouts as L


def load_and_touch(conv: pathlib.Path, rank: int) -> int:
    """``load_rank`` (each of the rank's files mapped once), then every page touched so that the
    bytes are really in memory. Returns the bytes mapped."""
    ranked = L.load_rank(conv, rank)
    for t in ranked.buffers:
        int(t[::4096].sum())
    return sum(t.numel() for t in ranked.buffers)
