"""Per-rank BF16 groups: the part of the checkpoint's BF16 weights one rank's engine holds, split
and merged as ATOM's layer classes hold them (``docs/rank-exact.md`` gives each rule and where it
is in ATOM), so a rank reads only its own slice instead of every BF16 tensor whole.

A :class:`Bf16Group` is one stored tensor of one rank, made of :class:`Placement` s: a window of a
source tensor (whole, or a range along one dim) and where it lands in the stored tensor. The
bytes are copied, never converted, so the inverse is exact: each placement's region of the
stored tensor is its source window again (``invert``).

Covered: vocabulary-parallel embeddings and heads (rows), column-parallel attention (``q_b_proj``,
``q_proj``, ``kv_b_proj``: rows), row-parallel ``o_proj`` and a BF16 dense ``down_proj``
(columns), the merged-replicated ``fused_qkv_a_proj`` of BF16 ``q_a_proj`` + ``kv_a_proj_with_mqa``
the merged-column ``gate_up_proj`` of a BF16 dense MLP, and BF16 experts (the R1-0528 MTP
layer) stacked into ``w13``/``w2`` split by TP or by expert parallel. The replicated tensors
(norms, router, its bias, ``eh_proj``) are left whole. The stacked BF16 experts are stored in
the layout the engine's unquantized MoE reads (a group's ``layout``: ATOM's ``bf16-preshuffle``,
aiter's ``shuffle_weight`` per expert), so ATOM need not shuffle them after loading; the layout
is undone a block of whole experts at a time when reading back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

import layouts

from .errors import PrepError
from .groups import Reader

from layouts.manifest import GroupRecord, LayoutRecord, Placement, StackRecord, WindowRecord

if TYPE_CHECKING:
    from layouts.manifest import GroupRecord

Piece = tuple[str, tuple[slice, slice], torch.Tensor]



@dataclasses.dataclass(frozen=True)
class Bf16Group:
    """One stored BF16 (or other non-MXFP4) tensor of one rank, built from its placements."""

    name: str  # stored tensor name: the engine parameter, e.g. model.layers.3.self_attn.fused_qkv_a_proj.weight
    rank: int
    tp: int
    dtype: str  # safetensors dtype of the sources, kept as is
    placements: tuple[Placement, ...]
    # The registered layout the stored bytes are in, for stacked BF16 experts the engine would
    # otherwise shuffle after loading; None: as the source holds them (split, unshuffled).
    layout: layouts.Layout | None = None
    # Stored 1-D: a bias or norm weight the engine holds as the source does, 1-D, while its windows
    # are planned as the column [N, 1] every 1-D source is (SGLang's vision tower's biases).
    flat: bool = False
    kind = "bf16"

    @classmethod
    def whole(cls, stored: str, source: str, dtype: str, shape: tuple[int, ...], rank: int, tp: int) -> "Bf16Group":
        """Source tensor ``source`` (of ``shape``) whole on ``rank``, stored as ``stored``: a 1-D one
        (a bias, a norm) stored 1-D, its window planned as every 1-D source's is."""
        return cls(stored, rank, tp, dtype, (Placement.whole(source, as_planned(shape)),), flat=len(shape) == 1)

    @property
    def key(self) -> str:
        return self.name

    def runtime_attrs(self) -> dict[str, Any]:
        """Its layout's attributes (stacked experts stored in one), else none: source bytes."""
        return dict(self.layout.runtime_attrs) if self.layout else {}

    @property
    def stacked(self) -> bool:
        return self.placements[0].slot is not None

    @property
    def shape(self) -> tuple[int, ...]:
        width = {p.out_shape[1] for p in self.placements}
        if len(width) != 1:
            raise PrepError(f"{self.name}: merged parts have different widths {sorted(width)}")
        rows = max(p.dest_row + p.out_shape[0] for p in self.placements)
        if self.stacked:
            return max(p.slot for p in self.placements) + 1, rows, width.pop()
        return rows, width.pop()

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The stored tensor's shape: :attr:`shape`, or what the group's layout makes of it (an
        FP8 per-channel weight's rows padded to 128)."""
        if self.flat:
            return (self.shape[0],)
        return tuple(self.layout.weight.output_shape(self.shape)) if self.layout else self.shape

    def sources(self) -> list[str]:
        return [p.source for p in self.placements]

    def output_sources(self) -> list[list[str]]:
        """Stacked experts: by projection, then expert (as the MXFP4 MoE stacks list theirs), so
        the manifest writes each projection's run of experts once (``compress_names``)."""
        if self.stacked:  # each window of an expert starts at its own row: gate 0, up after it
            return [[p.source for p in sorted(self.placements, key=lambda p: (p.dest_row, p.slot))]]
        return [self.sources()]

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(self.name, "bf16_shard", self.stored_shape)]

    def with_layout(self, layout: layouts.Layout) -> "Bf16Group":
        """This group stored in ``layout`` (a BF16 MoE layout), refused (naming the tensor) where
        the layout cannot take its shape: e.g. aiter's 16-bit shuffle needs 32 columns per expert."""
        try:
            layout.check(self.shape, None, self.name)
        except layouts.shuffle.LayoutConstraintError as e:
            raise PrepError(f"{e} (rank {self.rank}); the engine shuffles these weights the same way and "
                            "would fail too: choose a smaller --tp, or --ep") from None
        return dataclasses.replace(self, layout=layout)

    def to_layout(self, block: torch.Tensor) -> torch.Tensor:
        """A block of whole stored experts put in the group's layout, in place (whole experts
        transform independently in every BF16 MoE and FP8 layout: the registry checks it)."""
        return self.layout.weight.forward(block, block) if self.layout else block

    def from_layout(self, block: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A block of whole stored experts (or an unstacked tensor, whole, of source ``shape``)
        back in source order."""
        return self.layout.weight.inverse(block, shape or tuple(block.shape)) if self.layout else block

    def check(self) -> None:
        slots: dict[int | None, list[tuple[int, int]]] = {}
        for p in self.placements:
            slots.setdefault(p.slot, []).append((p.dest_row, p.dest_row + p.out_shape[0]))
        n = self.shape[-2]
        if self.stacked and sorted(slots) != list(range(self.shape[0])):
            raise PrepError(f"{self.name} (rank {self.rank}): expert slots {sorted(slots)} are not 0..n-1")
        for slot, rows in slots.items():
            rows.sort()
            if rows[0][0] != 0 or rows[-1][1] != n or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
                raise PrepError(f"{self.name} (rank {self.rank}): its parts do not tile the rows {rows}")

    def build_chunks(self, read: Reader, chunk_bytes: int = 32 << 20, alloc=None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, block of whole rows) in file order, each about ``chunk_bytes`` (an embedding at
        TP 1 is 1.8 GiB), read straight into ``alloc``'s memory when it gives some."""
        shape = self.shape
        itemsize = _ITEMSIZE[self.dtype]
        if self.stacked:  # blocks of whole experts
            per = shape[1] * shape[2] * itemsize
            step = max(1, chunk_bytes // per) if chunk_bytes else shape[0]
            by_slot: dict[int, list[Placement]] = {}
            for p in self.placements:
                by_slot.setdefault(p.slot, []).append(p)
            # A layout that keeps to its rows takes each window straight into its rows of the
            # block (one copy); else the block is read as the source has it, then transformed.
            block = self.layout.weight.row_block if self.layout else None
            direct = block is not None and all(p.dest_row % block == 0 and p.out_shape[0] % block == 0
                                               for p in self.placements)
            for e0 in range(0, shape[0], step):
                e1 = min(shape[0], e0 + step)
                out = self._room(alloc, (e1 - e0, *shape[1:]))
                for e in range(e0, e1):
                    for p in by_slot[e]:
                        dest = out[e - e0, p.dest_row:p.dest_row + p.out_shape[0]]
                        if direct:
                            self.layout.weight.forward(read(p.source, p.rows, p.cols), out=dest)
                        else:
                            read(p.source, p.rows, p.cols, out=dest)
                yield self.name, out if direct else self.to_layout(out)
            return
        n, k = shape
        if not self.flat and self.stored_shape != shape:  # a layout that pads (an FP8 per-channel linear): built whole
            rows = torch.empty(shape, dtype=_TORCH[self.dtype])
            for p in self.placements:
                read(p.source, p.rows, p.cols, out=rows[p.dest_row:p.dest_row + p.out_shape[0]])
            yield self.name, self.layout.weight.forward(rows, out=self._room(alloc, self.stored_shape))
            return
        step = max(1, chunk_bytes // max(1, k * itemsize)) if chunk_bytes else n
        if self.layout:  # blocks of whole row bands of the layout (a linear's FP8 weight: 16 rows)
            band = self.layout.weight.row_block or 1
            step = max(band, step // band * band)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            out = self._room(alloc, (r1 - r0, k))
            rows = out if self.layout is None else torch.empty((r1 - r0, k), dtype=_TORCH[self.dtype])
            for p in self.placements:
                lo, hi = max(r0, p.dest_row), min(r1, p.dest_row + p.out_shape[0])
                if lo >= hi:
                    continue
                first = p.rows.start + lo - p.dest_row
                read(p.source, slice(first, first + hi - lo), p.cols, out=rows[lo - r0:hi - r0])
            if self.layout:
                self.layout.weight.forward(rows, out=out)
            yield self.name, out.reshape(-1) if self.flat else out

    def _room(self, alloc, shape: tuple[int, ...]) -> torch.Tensor:
        out = alloc(self.name, shape, self.dtype) if alloc else None
        return torch.empty(shape, dtype=_TORCH[self.dtype]) if out is None else out

    def build(self, read: Reader) -> list[torch.Tensor]:
        return [torch.cat([t for _, t in self.build_chunks(read, 0)])]

    def invert(self, tensors: list[torch.Tensor]) -> Iterator[Piece]:
        (t,) = tensors
        if self.flat:  # inverted as the column its windows are planned in
            yield from dataclasses.replace(self, flat=False).invert([t.reshape(-1, 1)])
            return
        if tuple(t.shape) != self.stored_shape:
            raise PrepError(f"{self.name} (rank {self.rank}): stored shape {list(t.shape)}, expected "
                            f"{list(self.stored_shape)}; the file is not this manifest's: convert again")
        t = self.from_layout(t, None if self.stacked else self.shape)
        for p in self.placements:
            slot = t if p.slot is None else t[p.slot]
            yield p.source, (p.rows, p.cols), slot[p.dest_row:p.dest_row + p.out_shape[0]]

    def stored_rows(self, read: Callable[[slice], torch.Tensor], rows: slice) -> torch.Tensor:
        """Rows ``rows`` of the (unstacked) stored tensor in source order, given ``read`` of a
        range of its stored rows: those rows where the group has no layout, else the whole row
        bands of its layout around them, taken back (a band holds its own rows only)."""
        if self.layout is None:
            return read(rows).reshape(-1, 1) if self.flat else read(rows)
        band = self.layout.weight.row_block or 1
        lo, hi = rows.start // band * band, min(self.stored_shape[0], -(-rows.stop // band) * band)
        held = read(slice(lo, hi))
        return self.layout.weight.inverse(held, tuple(held.shape))[rows.start - lo:rows.stop - lo]

    def window_rows(self, source: str, rows: slice) -> Iterator[tuple[slice, slice, slice]]:
        """For a block ``rows`` of source tensor ``source``: each part of it this group holds, as
        (its rows within the block, its source columns, the stored rows it sits in). An unstacked
        group: a placement is a whole range of the source's rows or columns, stored from
        ``dest_row`` on."""
        if self.stacked:
            raise PrepError(f"{self.name}: stacked experts are read a block of experts at a time, not by rows")
        for p in self.placements:
            lo, hi = max(rows.start, p.rows.start), min(rows.stop, p.rows.stop)
            if p.source == source and lo < hi:
                off = p.dest_row - p.rows.start
                yield slice(lo - rows.start, hi - rows.start), p.cols, slice(lo + off, hi + off)

    def transforms(self) -> list[dict[str, Any]]:
        if self.stacked:  # one entry for the layer's experts, as the MXFP4 stacks have
            p = self.placements[0]
            split = {"op": "tp_split", "dim": "intermediate", "tp": self.tp, "rank": self.rank} if p.dim is not None \
                else {"op": "ep_split", "rank": self.rank, "experts": self.shape[0]}
            chain = [split, {"op": "stack_experts", "experts": self.shape[0], "w13": "[gate ; up] rows per expert"}]
            return chain + ([{"op": "layout", **LayoutRecord.of(self.layout).to_json()}] if self.layout else [])
        chain: list[dict[str, Any]] = [{"op": "tp_split", "source": p.source, "dim": p.dim, "tp": self.tp,
                                        "rank": self.rank} for p in self.placements if p.dim is not None]
        if len(self.placements) > 1:
            chain.append({"op": "concat_rows", "parts": self.sources()})
        return chain + ([{"op": "layout", **LayoutRecord.of(self.layout).to_json()}] if self.layout else [])

    def record(self, file: str) -> GroupRecord:
        """Its manifest record (the ``groups`` entry), its tensors held in ``file``."""
        layout = self.layout.name if self.layout else None
        if self.stacked:  # by its template: 257 experts x 3 placements would be most of the manifest
            return GroupRecord(self.kind, self.name, self.rank, self.tp, layout, file, dtype=self.dtype,
                               stack=self._stack())
        return GroupRecord(self.kind, self.name, self.rank, self.tp, layout, file, dtype=self.dtype,
                           placements=tuple(self.placements), flat=self.flat)

    def _stack(self) -> StackRecord:
        """The stacked experts' template (``layouts.manifest.StackRecord``): routed ids as ranges
        in slot order, whether the shared expert follows them, and slot 0's windows, which every
        expert takes alike. Checked by expanding it again, so a group the template cannot say
        (experts of different shapes) stops here instead of being recorded wrong."""
        ids, windows = [], []
        for p in self.placements:
            m = _EXPERT.match(p.source)
            if m is None or not self.name.startswith(m.group(1)):
                raise PrepError(f"{self.name}: {p.source} is not an expert of {m.group(1) if m else self.name}")
            if p.slot == len(ids):
                ids.append(None if m.group(2) is None else int(m.group(2)))
            if p.slot == 0:
                windows.append(WindowRecord(m.group(3), tuple(p.shape), p.dim, p.start, p.stop, p.dest_row))
        shared = ids[-1] is None
        if None in ids[:len(ids) - shared]:
            raise PrepError(f"{self.name} (rank {self.rank}): the shared expert is not in the last slot")
        ranges: list[list[int]] = []
        for e in ids[:len(ids) - shared]:
            if ranges and ranges[-1][1] == e:
                ranges[-1][1] += 1
            else:
                ranges.append([e, e + 1])
        tensor = _EXPERT.match(self.placements[0].source).group(4)  # weight or FP8 block scales: the check
        if any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:])):  # the record says ascending ranges
            raise PrepError(f"{self.name} (rank {self.rank}): its routed experts are not in ascending order")
        stack = StackRecord(tuple((a, b) for a, b in ranges), shared, tuple(windows), tensor)
        if _expand_stack(self.name, stack) != self.placements:  # below finds a stack of both
            raise PrepError(f"{self.name} (rank {self.rank}): its experts do not all take the same windows; "
                            "re-download the checkpoint (its BF16 experts differ in shape)")
        return stack


_EXPERT = re.compile(r"^(.*\.mlp\.)(?:experts\.(\d+)|shared_experts)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
# ^ a stacked expert's source tensor: (its mlp., expert id or None for the shared one, projection, tensor)

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
# What an FP8 per-channel weight's scale is stored as: F32, or BF16 as amd-quark 0.13 exports it
# (engines convert it to their F32 [N, 1] as they load it).
FP8_SCALE_DTYPES = ("F32", "BF16")
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}


def _expand_stack(name: str, stack: StackRecord) -> tuple[Placement, ...]:
    """The placements a stacked group's template stands for (the one home of that expansion):
    slot by slot, routed experts in range order then the shared one, each taking every window
    of its own ``{mlp}experts.{e}.{proj}_proj.weight`` (``shared_experts`` for the shared), ``mlp``
    the stored name up to its ``.mlp.`` (the engine names the stack below it: ``mlp.experts.w13_weight``,
    vLLM's ``mlp.experts.routed_experts.w13_weight``)."""
    at = name.find(".mlp.")
    if at < 0:
        raise PrepError(f"{name}: stacked experts outside an mlp module; the manifest is damaged: convert again")
    mlp = name[:at + len(".mlp.")]
    ids: list[int | None] = [e for a, b in stack.experts for e in range(a, b)]
    experts = [f"{mlp}experts.{e}." for e in ids] + ([f"{mlp}shared_experts."] if stack.shared else [])
    return tuple(Placement(f"{expert}{w.proj}_proj.{stack.tensor}", w.shape, w.dim, w.start, w.stop, w.dest_row, slot)
                 for slot, expert in enumerate(experts) for w in stack.windows)


def group_from_record(rec: "GroupRecord", layout_of: Callable[[str], layouts.Layout] = layouts.get_layout
                      ) -> Bf16Group:
    """A BF16 group from its manifest record (stacked experts expanded from their template), its
    layout (if any) as ``layout_of`` gives it (``prep.group_records.group_from_record``)."""
    if rec.kind != "bf16":
        raise PrepError(f"manifest: group {rec.name!r} is not a bf16 group")
    ps = _expand_stack(rec.name, rec.stack) if rec.stack is not None else tuple(rec.placements)
    return Bf16Group(rec.name, rec.rank, rec.tp, rec.dtype, ps, None if rec.layout is None else layout_of(rec.layout),
                     flat=rec.flat)


def as_planned(shape) -> tuple[int, ...]:
    """A source tensor's shape as groups plan it: a 1-D tensor (an FP8 linear's per-channel
    scale) as the column ``[N, 1]`` it is stored as, same bytes (:func:`channel_scale`)."""
    return (shape[0], 1) if len(shape) == 1 else tuple(shape)
