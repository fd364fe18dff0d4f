"""Output groups: what one rank's engine holds for one MXFP4 linear (or one MoE layer's experts),
built from source tensors by TP split, merge, padding and layout, with the exact inverse.

A group's geometry is written once, in its ``placements()``: where each window of each source
tensor sits in the rank's local (merged, stacked, padded, not yet laid out) tensors, as
:class:`layouts.manifest.Placement` s, the one placement type (a BF16 group's placements are its
manifest records of the same type). The build
reads every placement into place and zeroes what no placement covers (the pads); the inverse,
the streamed inverse (``prep/converted.py``) and the reference engine's reassembly
(``prep/reference/weights.py``) cut the same placements back out.

Every transform runs after the tensor-parallel split, on the rank's local tensor (the layouts do
not commute with merged tensors). A group records all its parameters, so the manifest alone is
enough to invert it (``prep revert``, ``prep verify --source``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator

import torch

import layouts
from layouts.manifest import GroupRecord, LayoutRecord, PartRecord, Placement
from layouts.sizes import ceil_div, pad_to

from .errors import PrepError

BLOCK = layouts.mxfp4.BLOCK_SIZE
Reader = Callable[..., torch.Tensor]  # read(name, rows=None, cols=None, out=None) -> tensor
# alloc(output name, shape) -> a contiguous uint8 tensor to build that chunk in (the writer's own
# memory, so it is written without another copy), or None to build it in a fresh one.
Alloc = Callable[[str, tuple[int, ...]], "torch.Tensor | None"]
# A piece of a source tensor: (source tensor name, (row slice, col slice), bytes).
Piece = tuple[str, tuple[slice, slice], torch.Tensor]
Window = tuple[slice, slice]  # (rows, cols) of a 2-D tensor, explicit integer bounds


def _mxfp4(prefix: str, shape: tuple[int, int], rows: slice, cols: slice, output: int, dest_row: int,
           expert: int | None = None) -> Iterator[Placement]:
    """The two placements of one MXFP4 module's window: its weight into ``output``, its scale
    into the next one. ``shape`` is the module's ``(N, K)``; ``cols`` counts values (K); the
    weight holds two a byte, the scale one per 32-value block (a trailing partial block counts
    whole). The window lands ``dest_row`` rows in, from column 0."""
    n, k = shape
    for name, out, per in ((f"{prefix}.weight", output, 2), (f"{prefix}.weight_scale", output + 1, BLOCK)):
        yield Placement.of_window(name, (n, ceil_div(k, per)), rows, _stored(cols, per), dest_row, expert, out)


def _stored(cols: slice, per: int) -> slice:
    """Value columns as stored columns, ``per`` values each (a partial last one counts whole)."""
    return slice(cols.start // per, ceil_div(cols.stop, per))


def _uncovered(shape: tuple[int, int], rects: Iterable[Window]) -> list[Window]:
    """The windows of a 2-D ``shape`` that none of ``rects`` (which do not overlap) covers: the
    tensor is cut into row bands at every rectangle edge, and each band's column gaps are kept."""
    rects = list(rects)
    cuts = sorted({0, shape[0], *(r.start for r, _ in rects), *(r.stop for r, _ in rects)})
    gaps = []
    for r0, r1 in zip(cuts, cuts[1:]):
        spans = sorted((c.start, c.stop) for r, c in rects if r.start <= r0 and r1 <= r.stop)
        col = 0
        for c0, c1 in spans + [(shape[1], shape[1])]:
            if c0 > col:
                gaps.append((slice(r0, r1), slice(col, c0)))
            col = max(col, c1)
    return gaps


def _pads(group: "LinearGroup | MoEGroup") -> list[list[Window]]:
    """For each output, the windows of its local tensor (of each expert, for stacked experts)
    that no placement fills: the padding, zero bytes. Every expert is placed alike, so the
    first expert's placements say it for all."""
    first = itertools.takewhile(lambda p: p.expert in (None, 0), group.placements())
    rects: dict[int, list[Window]] = {}
    for p in first:
        rects.setdefault(p.output, []).append(p.dest)
    return [_uncovered(shape[-2:], rects.get(o, [])) for o, shape in enumerate(group.local_shapes())]


def _zero_pads(group: "LinearGroup | MoEGroup", locals_: dict[int, torch.Tensor]) -> None:
    """Zero the padding of the given outputs' local tensors (blocks of experts lead the dims)."""
    for o, gaps in enumerate(_pads(group)):
        t = locals_.get(o)
        for rows, cols in gaps if t is not None else ():
            t[..., rows, cols].zero_()


def _invert_placements(group: "LinearGroup | MoEGroup", local: list[torch.Tensor]) -> Iterator[Piece]:
    """Each placement's bytes cut back out of the local tensors, after checking that every pad
    byte is still zero (anything else means the file is not what prep wrote)."""
    for o, gaps in enumerate(_pads(group)):
        if any(local[o][..., rows, cols].any() for rows, cols in gaps):
            raise PrepError(f"{group.name} (rank {group.rank}): padding bytes are not zero; the file is corrupt")
    for p in group.placements():
        yield p.source, p.window, p.region(local[p.output])


def _check_layout(layout: layouts.Layout, shapes, tensor: str) -> None:
    try:
        layout.check(*shapes, tensor=tensor)
    except layouts.shuffle.LayoutConstraintError as e:
        raise layouts.shuffle.LayoutConstraintError(f"{e}; choose a smaller --tp or another --layout") from None


@dataclasses.dataclass(frozen=True)
class Part:
    """One source linear feeding a group: its module prefix, logical [N, K], and TP split.

    ``split``: "rows" (column-parallel, N split), "cols" (row-parallel, K split), "none" (replicated).
    """

    src: str
    n: int
    k: int
    split: str

    def local(self, tp: int) -> tuple[int, int]:
        if self.split == "rows":
            return self.n // tp, self.k
        if self.split == "cols":
            return self.n, self.k // tp
        return self.n, self.k

    def check(self, tp: int) -> None:
        name = f"{self.src}.weight"
        if self.split == "rows" and self.n % tp:
            raise PrepError(f"{name}: {self.n} output rows do not split over tp={tp}; choose a tp that divides {self.n}")
        if self.split == "cols" and self.k % (tp * BLOCK):
            raise PrepError(f"{name}: K={self.k} does not split over tp={tp} in whole 32-element scale blocks "
                            f"(needs K % {tp * BLOCK} == 0); choose a smaller tp")

    def window(self, tp: int, rank: int) -> tuple[slice, slice]:
        """(row slice, value-column slice) of this rank in the source module's [N, K]."""
        n, k = self.local(tp)
        rows = slice(rank * n, (rank + 1) * n) if self.split == "rows" else slice(0, self.n)
        cols = slice(rank * k, (rank + 1) * k) if self.split == "cols" else slice(0, self.k)
        return rows, cols


@dataclasses.dataclass(frozen=True)
class LinearGroup:
    """A dense MXFP4 linear on one rank: parts split, stacked along rows, then ``layout``."""

    name: str  # engine module prefix, e.g. model.layers.3.self_attn.fused_qkv_a_proj
    rank: int
    tp: int
    parts: tuple[Part, ...]
    layout: layouts.Layout
    kind = "linear"
    dtype = "U8"  # stored tensors: MXFP4 bytes and E8M0 scales

    @property
    def key(self) -> str:
        return self.name

    def runtime_attrs(self) -> dict[str, Any]:
        """The attributes an engine sets on each of this group's tensors: its layout's."""
        return dict(self.layout.runtime_attrs)

    def sources(self) -> list[str]:
        """The source tensors this group is built from."""
        return [f"{p.src}.{s}" for p in self.parts for s in ("weight", "weight_scale")]

    def output_sources(self) -> list[list[str]]:
        """For each output (``outputs()`` order), the source tensors its bytes come from."""
        return [[f"{p.src}.{s}" for p in self.parts] for s in ("weight", "weight_scale")]

    def local_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        n = sum(p.local(self.tp)[0] for p in self.parts)
        k = self.parts[0].local(self.tp)[1]
        return (n, k // 2), (n, ceil_div(k, BLOCK))

    def placements(self) -> Iterator[Placement]:
        """Each part's window of this rank, stacked along rows in source order: the weight into
        output 0, the scale into output 1."""
        row = 0
        for p in self.parts:
            rows, cols = p.window(self.tp, self.rank)
            yield from _mxfp4(p.src, (p.n, p.k), rows, cols, 0, row)
            row += p.local(self.tp)[0]

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(tensor name, role, shape) of what this group writes, in order."""
        lw, ls = self.layout.output_shapes(*self.local_shapes())
        return [(f"{self.name}.weight", "mxfp4_weight", lw), (f"{self.name}.weight_scale", "e8m0_scale", ls)]

    def check(self) -> None:
        for p in self.parts:
            p.check(self.tp)
        if len({p.local(self.tp)[1] for p in self.parts}) != 1:
            raise PrepError(f"{self.name}: merged parts have different K ({[p.src for p in self.parts]})")
        _check_layout(self.layout, self.local_shapes(), f"{self.name}.weight (rank {self.rank})")

    def build_chunks(self, read: Reader, chunk_bytes: int = 0, alloc: Alloc | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(output name, tensor) in file order. A dense linear is at most a few hundred MiB per
        rank, so it is built whole (``chunk_bytes`` is accepted for a uniform interface); the
        weight is built in ``alloc``'s tensor when it gives one."""
        (wname, _, wshape), (sname, _, _) = self.outputs()
        w, s = self._merged(read)
        out = alloc(wname, wshape) if alloc else None
        w, s = self.layout.forward(w, s, weight_out=out)  # its shapes checked once, by check()
        yield wname, w
        yield sname, s

    def build(self, read: Reader) -> list[torch.Tensor]:
        """The output tensors, whole, in ``outputs()`` order."""
        return list(self.layout.forward(*self._merged(read)))

    def _merged(self, read: Reader) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's local weight and scale: every placement read into place."""
        w, s = local = [_alloc(shape) for shape in self.local_shapes()]
        for p in self.placements():
            read(p.source, *p.window, out=p.region(local[p.output]))
        _zero_pads(self, dict(enumerate(local)))
        return w, s

    def invert(self, tensors: list[torch.Tensor]) -> Iterator[Piece]:
        wshape, sshape = self.local_shapes()
        local = self.layout.invert(tensors[0], tensors[1], wshape, sshape)
        yield from _invert_placements(self, list(local))

    def transforms(self) -> list[dict[str, Any]]:
        chain: list[dict[str, Any]] = []
        for p in self.parts:
            if p.split != "none":
                chain.append({"op": "tp_split", "source": p.src, "dim": 0 if p.split == "rows" else 1,
                              "tp": self.tp, "rank": self.rank})
        if len(self.parts) > 1:
            chain.append({"op": "concat_rows", "parts": [p.src for p in self.parts]})
        chain.append({"op": "layout", **LayoutRecord.of(self.layout).to_json()})
        return chain

    def record(self, file: str) -> GroupRecord:
        """Its manifest record (the ``groups`` entry), its tensors held in ``file``."""
        return GroupRecord(self.kind, self.name, self.rank, self.tp, self.layout.name, file,
                           parts=tuple(PartRecord(p.src, p.n, p.k, p.split) for p in self.parts))


@dataclasses.dataclass(frozen=True)
class MoEGroup:
    """One MoE layer's experts on one rank, stacked: ``w13 [E, 2*I_pad, H_pad/2]`` (gate rows,
    zero pad, up rows, zero pad) and ``w2 [E, H_pad, I_pad/2]``, each with its E8M0 scale, then
    ``layout``. Padding is zero weight bytes and 0x00 scale bytes (scale 2^-127)."""

    name: str  # e.g. model.layers.3.mlp.experts
    rank: int
    tp: int
    experts: tuple[str, ...]  # source prefixes with gate_proj/up_proj/down_proj below them
    inter: int  # per-expert intermediate size (I)
    hidden: int  # H
    layout: layouts.Layout
    inter_pad_to: int = 256
    hidden_pad_to: int = 256
    ep: int = 1  # expert parallel: this rank holds ``experts`` whole (no intermediate split)
    routed: tuple[int, int] | None = None  # with ep > 1: the global routed expert ids [start, stop)
    kind = "moe"
    dtype = "U8"

    @property
    def moe_tp(self) -> tuple[int, int]:
        """(size, rank) the intermediate dimension is split over: the TP group, or none under EP."""
        return (1, 0) if self.ep > 1 else (self.tp, self.rank)

    @property
    def key(self) -> str:
        return self.name

    def sources(self) -> list[str]:
        """The source tensors this group is built from."""
        return [f"{e}.{p}.{s}" for e in self.experts for p in ("gate_proj", "up_proj", "down_proj")
                for s in ("weight", "weight_scale")]

    def output_sources(self) -> list[list[str]]:
        """For each output (``outputs()`` order), the source tensors its bytes come from."""
        return [[f"{e}.{p}.{s}" for p in projs for e in self.experts]
                for projs in (("gate_proj", "up_proj"), ("down_proj",)) for s in ("weight", "weight_scale")]

    @property
    def i_local(self) -> int:
        return self.inter // self.moe_tp[0]

    @property
    def i_pad(self) -> int:
        return pad_to(self.i_local, self.inter_pad_to)

    @property
    def h_pad(self) -> int:
        return pad_to(self.hidden, self.hidden_pad_to)

    def local_shapes(self) -> list[tuple[int, ...]]:
        e, ip, hp = len(self.experts), self.i_pad, self.h_pad
        return [(e, 2 * ip, hp // 2), (e, 2 * ip, hp // BLOCK), (e, hp, ip // 2), (e, hp, ip // BLOCK)]

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        lay = self.layout
        w13, s13, w2, s2 = self.local_shapes()
        o13, o13s = lay.output_shapes(w13, s13)
        o2, o2s = lay.output_shapes(w2, s2)
        return [(f"{self.name}.w13_weight", "mxfp4_weight", o13), (f"{self.name}.w13_weight_scale", "e8m0_scale", o13s),
                (f"{self.name}.w2_weight", "mxfp4_weight", o2), (f"{self.name}.w2_weight_scale", "e8m0_scale", o2s)]

    def check(self) -> None:
        src = f"{self.experts[0]}.down_proj.weight"
        tp = self.moe_tp[0]
        if self.inter % tp:
            raise PrepError(f"{src}: moe intermediate {self.inter} does not split over tp={tp}; "
                            "choose a tp that divides it (or --ep equal to --tp)")
        if self.i_local % BLOCK:
            raise PrepError(f"{src}: moe intermediate per rank {self.i_local} is not a multiple of 32 "
                            f"(tp={tp} too large for whole scale blocks; try --ep equal to --tp)")
        if self.hidden % BLOCK:
            raise PrepError(f"{src}: hidden size {self.hidden} is not a multiple of 32")
        w13, s13, w2, s2 = self.local_shapes()
        _check_layout(self.layout, (w13, s13), f"{self.name}.w13_weight (rank {self.rank})")
        _check_layout(self.layout, (w2, s2), f"{self.name}.w2_weight (rank {self.rank})")

    def placements(self) -> Iterator[Placement]:
        """Expert by expert (stack order): gate's and up's rows of this rank at rows 0 and I_pad
        of w13 (outputs 0, 1), down's columns of this rank at the left of w2 (outputs 2, 3);
        every other byte of the stack is padding."""
        r, il, ip, h = self.moe_tp[1], self.i_local, self.i_pad, self.hidden
        mine, hidden = slice(r * il, (r + 1) * il), slice(0, h)
        for e, src in enumerate(self.experts):
            for half, proj in enumerate(("gate_proj", "up_proj")):
                yield from _mxfp4(f"{src}.{proj}", (self.inter, h), mine, hidden, 0, half * ip, e)
            yield from _mxfp4(f"{src}.down_proj", (h, self.inter), hidden, mine, 2, 0, e)

    def blocks_exact(self, output: int) -> bool:
        """Whether the stacked output ``output`` (and its scale, which has as many rows per
        expert) transforms a block of experts at a time as the whole would: the layout says."""
        return self.layout.experts_transform_independently(self.local_shapes()[output][1])

    def build(self, read: Reader) -> list[torch.Tensor]:
        """The output tensors, whole, in ``outputs()`` order (tests and small models)."""
        return _whole(self, self.build_chunks(read))

    def build_chunks(self, read: Reader, chunk_bytes: int = 64 << 20, alloc: Alloc | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(output name, chunk) in file order: each stacked weight in blocks of whole experts of
        about ``chunk_bytes``, then its scale. Where the layout transforms experts independently
        (:meth:`blocks_exact`: W16 tiles and S32x8 bands never cross an expert when rows per
        expert are a multiple of 256), the blocks, laid end to end, are byte for byte the
        transformed whole tensor, which then never exists in memory (a V3 layer at TP 1 is
        3.7 GiB of w13); otherwise the tensor is built whole.

        Each weight block is transformed into ``alloc``'s tensor when it gives one; under an
        identity weight transform the experts are read straight into it."""
        e_total = len(self.experts)
        shapes = self.local_shapes()
        outs = [n for n, _, _ in self.outputs()]
        lay = self.layout

        for o in (0, 2):  # w13 and its scale, then w2 and its scale
            (wname, sname), wshape, sshape = outs[o:o + 2], shapes[o], shapes[o + 1]
            per_expert = wshape[1] * wshape[2]
            step = max(1, min(e_total, chunk_bytes // per_expert)) if chunk_bytes else e_total
            if not self.blocks_exact(o):
                step = e_total
            scales = []
            for e0 in range(0, e_total, step):
                block = dataclasses.replace(self, experts=self.experts[e0:e0 + step])
                bshape = (len(block.experts), *wshape[1:])
                out = alloc(wname, lay.weight.output_shape(bshape)) if alloc else None
                w = out if out is not None and lay.weight.name == "identity" else _alloc(bshape)
                s = _alloc((len(block.experts), *sshape[1:]))
                # Each expert's bytes are read straight into their place in the block
                # (read(..., out=)); only the padding is zeroed, not the whole block.
                for p in block.placements():
                    if p.output in (o, o + 1):
                        read(p.source, *p.window, out=p.region(w if p.output == o else s))
                _zero_pads(block, {o: w, o + 1: s})
                # checked once, by check(): a block of whole experts transforms as the whole (blocks_exact)
                w, s = lay.forward(w, s, weight_out=out)
                yield wname, w
                scales.append(s)
                del w
            for s in scales:
                yield sname, s

    def invert(self, tensors: list[torch.Tensor]) -> Iterator[Piece]:
        lay = self.layout
        shapes = self.local_shapes()
        local = [t for o in (0, 2) for t in lay.invert(tensors[o], tensors[o + 1], shapes[o], shapes[o + 1])]
        yield from _invert_placements(self, local)

    def transforms(self) -> list[dict[str, Any]]:
        tp, tp_rank = self.moe_tp
        split = ({"op": "ep_split", "ep": self.ep, "rank": self.rank, "routed": list(self.routed or ()),
                  "shared_replicated": len(self.experts) - (self.routed[1] - self.routed[0]) if self.routed else 0}
                 if self.ep > 1 else {"op": "tp_split", "dim": "intermediate", "tp": tp, "rank": tp_rank})
        return [
            split,
            {"op": "stack_experts", "experts": len(self.experts), "w13": "[gate ; up] rows per expert"},
            {"op": "pad", "intermediate": [self.i_local, self.i_pad], "hidden": [self.hidden, self.h_pad],
             "weight_byte": 0, "scale_byte": 0},
            {"op": "layout", **LayoutRecord.of(self.layout).to_json()},
        ]

    def record(self, file: str) -> GroupRecord:
        """Its manifest record (the ``groups`` entry), its tensors held in ``file``."""
        return GroupRecord(self.kind, self.name, self.rank, self.tp, self.layout.name, file, experts=self.experts,
                           inter=self.inter, hidden=self.hidden, inter_pad_to=self.inter_pad_to,
                           hidden_pad_to=self.hidden_pad_to, ep=self.ep, routed=self.routed)

    def runtime_attrs(self) -> dict[str, Any]:
        """Its layout's attributes, and the padding and expert map the MoE kernel needs."""
        attrs = {**self.layout.runtime_attrs, "intermediate_pad": self.i_pad - self.i_local,
                 "hidden_pad": self.h_pad - self.hidden, "num_local_experts": len(self.experts)}
        if self.ep > 1:
            start, stop = self.routed
            attrs.update({"ep_size": self.ep, "ep_rank": self.rank, "global_routed_experts": [start, stop],
                          "shared_expert_slot": stop - start if len(self.experts) > stop - start else None})
        return attrs


def _alloc(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor (every byte is then read in or zeroed; tests fill it with garbage)."""
    return torch.empty(shape, dtype=torch.uint8)


def _whole(group: "MoEGroup", chunks: Iterator[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Join a group's chunks back into its whole output tensors (blocks stack along dim 0)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name, t in chunks:
        parts.setdefault(name, []).append(t)
    out = []
    for name, _, shape in group.outputs():
        ts = parts[name]
        out.append((ts[0] if len(ts) == 1 else torch.cat(ts)).reshape(shape))
    return out


LayoutOf = Callable[[str], "layouts.Layout"]
"""A layout by name, as the checkpoint being read records it (``Manifest.recorded_layout``: its
version and parameters); the registry's own (``layouts.get_layout``) for records of this prep."""
