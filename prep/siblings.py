"""One group built for all its tensor-parallel ranks at once.

Rank r of a TP split holds a window of each source tensor: rows of gate/up and of most BF16
tensors, but columns of down_proj and o_proj, whose rows are each rank's only in part. Built rank
by rank, every rank read those tensors whole to cut its columns: at TP 8 the down projections
(a third of the expert bytes) were read 8 times, and each expert cost 6 reads per rank (121,249
reads and 54% of a TP 4 conversion on the 2-core VM, measured with cProfile). Built together,
each source byte is read once:

- a MoE layer split over TP: a block of experts' whole source tensors is read into one stack per
  projection, and each rank's window of the whole block is one strided copy (6 reads per
  expert in all, not per rank);
- anything else (BF16 tensors, experts under EP): the ranks' own builds advance a chunk each in
  turn and share their reads: a column window is cut from rows read once (:class:`SharedReads`).

Bytes are those of each rank's own build (pinned by test_fileset)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator

import torch

import layouts

from .groups import Alloc, MoEGroup, Reader, _alloc, _zero_pads


def _moe_tp_siblings(groups: list) -> bool:
    """Whether ``groups`` are the TP ranks' parts of one MoE layer: same experts, sizes and
    layout, split over the intermediate dimension, each of whose blocks of experts transforms
    as its part of the whole (so blocks of a few experts can be built)."""
    g0 = groups[0]
    if not all(isinstance(g, MoEGroup) for g in groups) or g0.ep > 1:
        return False
    same = all(dataclasses.replace(g, rank=g0.rank) == g0 for g in groups)
    return same and len({g.rank for g in groups}) == len(groups) and g0.blocks_exact(0) and g0.blocks_exact(2)


def build_together(groups: list, read: Reader, cuts_columns: Callable[[str, slice | None], bool], chunk_bytes: int,
                   allocs: list[Alloc | None]) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(index into ``groups``, output name, chunk) for every chunk of every group, each group's
    chunks in its file order (``build_chunks``'); ``allocs[i]`` gives group i's chunks room.
    ``cuts_columns(name, cols)``: whether ``cols`` is a proper column window of source tensor ``name``."""
    if len(groups) > 1 and _moe_tp_siblings(groups):
        yield from _moe_tp_chunks(groups, read, chunk_bytes, allocs)
        return
    shared = SharedReads(read, cuts_columns, budget=max(chunk_bytes, 1) * 2) if len(groups) > 1 else None
    # Each rank's chunk a share of the whole, so that the rows read for all of them (a column
    # window's) stay about one chunk.
    per = max(1, chunk_bytes // len(groups)) if chunk_bytes else 0
    gens = collections.deque((i, g.build_chunks(shared or read, per, alloc=allocs[i])) for i, g in enumerate(groups))
    while gens:
        i, gen = gens.popleft()
        try:
            name, chunk = next(gen)
        except StopIteration:
            continue
        yield i, name, chunk
        gens.append((i, gen))


class SharedReads:
    """A reader whose column windows are cut from whole rows read once: the TP ranks of one
    tensor ask for the same rows, one after the other. Keeps the rows most recently read, up
    to ``budget`` bytes; row windows (each rank's own rows) are read straight through."""

    def __init__(self, read: Reader, cuts_columns: Callable[[str, slice | None], bool], budget: int):
        self._read = read
        self._cuts_columns = cuts_columns
        self._budget = budget
        self._rows: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._bytes = 0

    def __call__(self, name: str, rows: slice | None = None, cols: slice | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if not self._cuts_columns(name, cols):
            return self._read(name, rows, None, out=out)  # the whole width: a plain row read
        key = (name, None if rows is None else (rows.start, rows.stop))
        whole = self._rows.get(key)
        if whole is None:
            whole = self._read(name, rows)
            n = whole.numel() * whole.element_size()
            if n <= self._budget:
                while self._rows and self._bytes + n > self._budget:
                    _, old = self._rows.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
                self._rows[key] = whole
                self._bytes += n
        else:
            self._rows.move_to_end(key)
        got = whole[:, cols]
        if out is None:
            return got.contiguous()
        out.copy_(got)
        return out


def _fills_rows(transform: layouts.transforms.Transform, placements: list, shape: tuple[int, ...]) -> bool:
    """Whether ``placements`` (one expert's, of one output of ``shape``) fill that output whole,
    each a band of whole rows whose bounds are multiples of ``transform.row_block``: then each
    band transforms on its own, straight from its source window (``Transform.row_block``). Not
    where the output has padding (left to ``_zero_pads``) or the transform mixes rows."""
    block = transform.row_block
    rows, cols = shape[-2:]
    if block is None or transform.output_shape(tuple(shape)) != tuple(shape):
        return False
    bands = sorted((p.dest[0].start, p.dest[0].stop) for p in placements)
    if not bands or any(p.dest[1] != slice(0, cols) for p in placements):
        return False
    edges = [0] + [b for band in bands for b in band] + [rows]
    return all(a == b for a, b in zip(edges[::2], edges[1::2])) and all(e % block == 0 for e in edges)


def _moe_tp_chunks(groups: list[MoEGroup], read: Reader, chunk_bytes: int, allocs: list[Alloc | None]
                   ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """The TP ranks' stacked experts of one MoE layer, from one read of each source tensor.

    Per output pair (w13 and its scale, then w2 and its scale): the weights block by block of
    whole experts, every rank's block cut from the same source stack; then the scales, read
    again block by block (a sixteenth of the bytes), so no rank's scales wait in memory for its
    weights to be written."""
    g0 = groups[0]
    lay = g0.layout
    e_total = len(g0.experts)
    shapes = g0.local_shapes()
    outs = [n for n, _, _ in g0.outputs()]
    # One expert's placements per rank, whose windows hold for every expert of a block.
    first = [list(dataclasses.replace(g, experts=g.experts[:1]).placements()) for g in groups]
    # Per rank and weight output: built window by window straight into the output's buffer
    # (no copy of each window first), where the layout's weight transform keeps to its rows.
    direct = [{o: _fills_rows(lay.weight, [p for p in ps if p.output == o], shapes[o]) for o in (0, 2)}
              for ps in first]
    prefix = len(g0.experts[0]) + 1
    src_shape = {"gate_proj": (g0.inter, g0.hidden), "up_proj": (g0.inter, g0.hidden),
                 "down_proj": (g0.hidden, g0.inter)}

    def stored(proj: str, kind: str) -> tuple[int, int]:
        """Rows and stored columns of one expert's ``proj.kind`` (``weight`` or ``weight_scale``)."""
        rows, k = src_shape[proj]
        return (rows, k // 2) if kind == "weight" else (rows, -(-k // layouts.mxfp4.BLOCK_SIZE))

    for o in (0, 2):
        projs = ("gate_proj", "up_proj") if o == 0 else ("down_proj",)
        (wname, sname), wshape, sshape = outs[o:o + 2], shapes[o], shapes[o + 1]
        for kind, dest_out in (("weight", o), ("weight_scale", o + 1)):
            per_expert = sum(a * b for a, b in (stored(p, kind) for p in projs))
            step = max(1, min(e_total, chunk_bytes // per_expert)) if chunk_bytes else e_total
            for e0 in range(0, e_total, step):
                experts = g0.experts[e0:e0 + step]
                n = len(experts)
                stacks = {}
                for proj in projs:
                    t = _alloc((n, *stored(proj, kind)))
                    for j, e in enumerate(experts):
                        read(f"{e}.{proj}.{kind}", None, None, out=t[j])
                    stacks[f"{proj}.{kind}"] = t
                for i, g in enumerate(groups):
                    block = dataclasses.replace(g, experts=g.experts[e0:e0 + n])
                    shape = (n, *(wshape if kind == "weight" else sshape)[1:])
                    if kind == "weight":  # its shapes checked once, when the group was planned
                        room = allocs[i](wname, lay.weight.output_shape(shape)) if allocs[i] else None
                        if direct[i][o]:
                            out = room if room is not None else _alloc(shape)
                            for p in first[i]:
                                if p.output == dest_out:
                                    rows, cols = p.window
                                    lay.weight.forward(stacks[p.source[prefix:]][:, rows, cols],
                                                       out=out[:, p.dest[0], p.dest[1]])
                            yield i, wname, out
                            continue
                        local = room if room is not None and lay.weight.name == "identity" else _alloc(shape)
                    else:
                        local = _alloc(shape)
                    for p in first[i]:
                        if p.output == dest_out:
                            rows, cols = p.window
                            local[:, p.dest[0], p.dest[1]] = stacks[p.source[prefix:]][:, rows, cols]
                    _zero_pads(block, {dest_out: local})
                    if kind == "weight":
                        yield i, wname, lay.weight.forward(local, room)
                    else:
                        yield i, sname, lay.scale.forward(local)
                del stacks
