"""The records of a rank's groups (a manifest's ``groups`` entries): the dense linear's parts, a
placement of a source window, the stacked BF16 experts' template, and the group itself."""

from __future__ import annotations

import dataclasses
from typing import Any

from .format import ManifestError
from .values import _is_count, _object, _string_list


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """One source linear of a dense group (a ``parts`` entry): prep's ``groups.Part``."""

    src: str  # source module prefix (``...q_a_proj``)
    n: int  # logical rows
    k: int  # logical columns (values, not bytes)
    split: str  # "rows", "cols" or "none": how tensor parallelism cuts it

    @classmethod
    def from_json(cls, p: Any) -> "PartRecord":
        p = _object(p, "part")
        src, n, k, split = p.get("src"), p.get("n"), p.get("k"), p.get("split")
        if type(src) is not str or split not in ("rows", "cols", "none") or not _is_count(n) or not _is_count(k):
            raise ManifestError(f"part {src!r} needs a string src, integers n and k, split rows, cols or none")
        return cls(src, n, k, split)

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "n": self.n, "k": self.k, "split": self.split}


def _window_problem(shape: Any, dim: Any, start: Any, stop: Any, row: Any) -> bool:
    """Whether a source window is malformed: ``shape`` [rows, cols], ``dim`` null, 0 or 1, and
    ``[start, stop)`` inside that dim, landing at an integer ``dest_row`` (a placement's and a
    stack window's fields)."""
    ok = (type(shape) is list and len(shape) == 2 and all(_is_count(d) for d in shape) and dim in (None, 0, 1)
          and type(dim) is not bool and _is_count(start) and _is_count(stop) and _is_count(row))
    return not ok or start > stop or stop > shape[0 if dim is None else dim]


@dataclasses.dataclass(frozen=True)
class Placement:
    """One window of one source tensor and where it lands in a group's local tensors: the one
    placement type of every group (prep's MXFP4 linears and experts compute theirs from the
    group's parameters; a BF16 group's are its manifest's ``placements`` entries, which this is).

    ``shape`` is the source tensor's stored ``[rows, cols]`` (columns count stored units: bytes
    of a packed MXFP4 weight, entries of a scale), ``dim`` the dim the window cuts (null: whole),
    ``[start, stop)`` its range. It lands in local tensor ``output`` (``outputs()`` order; 0 for a
    BF16 group, which has one), ``dest_row`` rows in (merged tensors stack their parts along
    rows) and from column 0, in stacked expert ``slot`` (None: not stacked)."""

    source: str
    shape: tuple[int, int]
    dim: int | None
    start: int
    stop: int
    dest_row: int = 0
    slot: int | None = None
    output: int = 0  # not in the manifest: a BF16 group has one output

    @classmethod
    def from_json(cls, p: Any) -> "Placement":
        p = _object(p, "placement")
        source, shape, dim, start, stop, row, slot = (p.get(k) for k in ("source", "shape", "dim", "start", "stop",
                                                                          "dest_row", "slot"))
        if type(source) is not str or _window_problem(shape, dim, start, stop, row) or not (slot is None
                                                                                              or _is_count(slot)):
            raise ManifestError(f"placement of {source!r} needs a string source, a [rows, cols] shape, dim null, 0 "
                                "or 1, a window [start, stop) inside that dim, an integer dest_row and slot")
        return cls(source, tuple(shape), dim, start, stop, row, slot)

    @classmethod
    def of_window(cls, source: str, shape: tuple[int, int], rows: slice, cols: slice, dest_row: int = 0,
                  slot: int | None = None, output: int = 0) -> "Placement":
        """The placement of window ``(rows, cols)`` of a ``shape`` source tensor, which cuts one
        dim at most (every engine's TP split cuts one)."""
        whole_rows, whole_cols = (rows.start, rows.stop) == (0, shape[0]), (cols.start, cols.stop) == (0, shape[1])
        if whole_rows and whole_cols:
            return cls(source, tuple(shape), None, 0, shape[0], dest_row, slot, output)
        if whole_cols or whole_rows:
            dim, cut = (0, rows) if whole_cols else (1, cols)
            return cls(source, tuple(shape), dim, cut.start, cut.stop, dest_row, slot, output)
        raise ValueError(f"{source}: window {rows}, {cols} of {shape} cuts both dims")

    @property
    def rows(self) -> slice:
        """The source rows the window takes."""
        return slice(self.start, self.stop) if self.dim == 0 else slice(0, self.shape[0])

    @property
    def cols(self) -> slice:
        """The source columns the window takes (a column window fills the stored tensor's width)."""
        return slice(self.start, self.stop) if self.dim == 1 else slice(0, self.shape[1])

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.rows.stop - self.rows.start, self.cols.stop - self.cols.start

    @property
    def window(self) -> tuple[slice, slice]:
        """``(rows, cols)`` of the source tensor."""
        return self.rows, self.cols

    @property
    def dest(self) -> tuple[slice, slice]:
        """``(rows, cols)`` of the local tensor (of its expert ``slot``) the window fills."""
        rows, cols = self.out_shape
        return slice(self.dest_row, self.dest_row + rows), slice(0, cols)

    @property
    def expert(self) -> int | None:
        return self.slot

    def region(self, local: Any) -> Any:
        """The view of ``local`` (output ``output``'s local tensor: for stacked experts, the
        stack of the group that yielded this placement, experts leading) that it fills."""
        return local[self.dest] if self.slot is None else local[self.slot][self.dest]

    @classmethod
    def whole(cls, source: str, shape: tuple[int, ...], dest_row: int = 0, slot: int | None = None
              ) -> "Placement":
        """The whole tensor, as an uncut window is recorded: rows [0, shape[0]) (its columns are the
        tensor's too: a [0, cols) range would not fit a tensor wider than tall)."""
        return cls(source, tuple(shape), None, 0, shape[0], dest_row, slot)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "shape": list(self.shape), "dim": self.dim, "start": self.start,
                "stop": self.stop, "dest_row": self.dest_row, "slot": self.slot}


STACK_PROJECTIONS = ("gate", "up", "down")  # an expert's source tensors: ``...{proj}_proj.{tensor}``
# Which tensor of each projection a stack holds: its weight, or the 128x128 block scales of an FP8
# block-quantized one (DeepSeek's own FP8 release names them ``weight_scale_inv``)
STACK_TENSORS = ("weight", "weight_scale_inv")


@dataclasses.dataclass(frozen=True)
class WindowRecord:
    """The window every expert of a stacked BF16 group takes of one projection (a ``windows``
    entry): a :class:`Placement` without its source and slot, which the expert gives."""

    proj: str  # "gate", "up" or "down"
    shape: tuple[int, int]
    dim: int | None
    start: int
    stop: int
    dest_row: int = 0

    @classmethod
    def from_json(cls, w: Any) -> "WindowRecord":
        w = _object(w, "window")
        proj, shape, dim, start, stop, row = (w.get(k) for k in ("proj", "shape", "dim", "start", "stop", "dest_row"))
        if proj not in STACK_PROJECTIONS or _window_problem(shape, dim, start, stop, row):
            raise ManifestError(f"window of {proj!r} needs a proj {', '.join(STACK_PROJECTIONS)}, a [rows, cols] "
                                "shape, dim null, 0 or 1, a window [start, stop) inside that dim and an integer "
                                "dest_row")
        return cls(proj, tuple(shape), dim, start, stop, row)

    @property
    def out_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        return (self.stop - self.start if self.dim == 0 else rows), (self.stop - self.start if self.dim == 1 else cols)

    def to_json(self) -> dict[str, Any]:
        return {"proj": self.proj, "shape": list(self.shape), "dim": self.dim, "start": self.start,
                "stop": self.stop, "dest_row": self.dest_row}


@dataclasses.dataclass(frozen=True)
class StackRecord:
    """A stacked BF16 expert group (the R1-0528 MTP layer's ``w13``/``w2``) by its template (a
    ``stack`` entry): the routed expert ids it holds, as ascending ``[start, stop)`` ranges, in
    slot order, the fused shared expert in the slot after them, and the window each expert takes
    of each projection. prep's ``bf16.group_from_record`` expands it into one placement per
    expert and window, the ones the conversion built (a few hundred bytes instead of 257 x 3
    placements per rank)."""

    experts: tuple[tuple[int, int], ...]
    shared: bool
    windows: tuple[WindowRecord, ...]
    tensor: str = "weight"  # of each projection (STACK_TENSORS); written only when not "weight"

    @classmethod
    def from_json(cls, s: Any) -> "StackRecord":
        s = _object(s, "stack")
        experts, shared, windows = s.get("experts"), s.get("shared"), s.get("windows")
        tensor = s.get("tensor", "weight")
        if tensor not in STACK_TENSORS:
            raise ManifestError(f"stack: tensor is {tensor!r}, not one of {', '.join(STACK_TENSORS)}")
        ranges = experts if type(experts) is list and experts else [None]
        if not all(type(r) is list and len(r) == 2 and _is_count(r[0]) and _is_count(r[1], r[0] + 1) for r in ranges):
            raise ManifestError(f"stack: experts is {experts!r}, not a non-empty list of [start, stop) ranges")
        if any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:])):
            raise ManifestError(f"stack: expert ranges {experts!r} overlap, touch or are out of order")
        if type(shared) is not bool:
            raise ManifestError(f"stack: shared is {shared!r}, not true or false")
        if type(windows) is not list or not windows:
            raise ManifestError("stack: windows is not a non-empty list")
        wins = tuple(WindowRecord.from_json(w) for w in windows)
        if len({w.proj for w in wins}) != len(wins):
            raise ManifestError(f"stack: windows name a projection twice: {[w.proj for w in wins]}")
        return cls(tuple(tuple(r) for r in ranges), shared, wins, tensor)

    @property
    def slots(self) -> int:
        return sum(b - a for a, b in self.experts) + self.shared

    @property
    def stored_shape(self) -> tuple[int, int, int]:
        """[slots, rows, cols] of the stored tensor its windows fill."""
        return (self.slots, max(w.dest_row + w.out_shape[0] for w in self.windows),
                max(w.out_shape[1] for w in self.windows))

    def to_json(self) -> dict[str, Any]:
        out = {"experts": [list(r) for r in self.experts], "shared": self.shared,
               "windows": [w.to_json() for w in self.windows]}
        return out if self.tensor == "weight" else {**out, "tensor": self.tensor}


_GROUP_KINDS = ("linear", "moe", "bf16")


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """What one rank holds of one engine module, with every parameter needed to invert it (a
    ``groups`` entry): a dense linear (``kind`` "linear": its ``parts``) or one MoE layer's
    stacked experts (``kind`` "moe": the fields after ``parts``) or, rank-exact, one split BF16
    tensor (``kind`` "bf16": its ``dtype`` and ``placements``; ``layout`` null unless the bytes
    are in a registered layout). prep's ``group_from_record`` turns ``to_json()`` back into the
    group that builds and inverts the bytes."""

    kind: str  # "linear", "moe" or "bf16"
    name: str  # engine module prefix: ``...fused_qkv_a_proj``, ``...mlp.experts``
    rank: int
    tp: int
    layout: str | None  # null only for a bf16 group stored as the source holds it
    file: str  # the output file that holds its tensors
    parts: tuple[PartRecord, ...] = ()  # linear: the source linears stacked along rows, in order
    experts: tuple[str, ...] = ()  # moe: source expert prefixes, in slot order (shared expert last)
    inter: int = 0  # moe: per-expert intermediate size
    hidden: int = 0  # moe: hidden size
    inter_pad_to: int = 256
    hidden_pad_to: int = 256
    ep: int = 1
    routed: tuple[int, int] | None = None  # moe with ep > 1: global routed expert ids [start, stop)
    dtype: str = ""  # bf16: the stored (and source) safetensors dtype
    placements: tuple[Placement, ...] = ()  # bf16: source windows, in order
    stack: StackRecord | None = None  # bf16 stacked experts: their template, instead of placements
    flat: bool = False  # bf16: stored 1-D (a bias or norm the engine holds 1-D; format 5: a multimodal source's)

    @classmethod
    def from_json(cls, g: Any) -> "GroupRecord":
        g = _object(g, "entry")
        kind, name, rank, tp, layout, file = (g.get(k) for k in ("kind", "name", "rank", "tp", "layout", "file"))
        if kind not in _GROUP_KINDS:
            raise ManifestError(f"kind is {kind!r}, not one of {', '.join(_GROUP_KINDS)}")
        if type(name) is not str or type(file) is not str or not (type(layout) is str
                                                                  or (layout is None and kind == "bf16")):
            raise ManifestError(f"group {name!r}: name, layout and file must be strings")
        if not _is_count(rank) or not _is_count(tp, 1):
            raise ManifestError(f"group {name}: rank {rank!r} and tp {tp!r} must be integers (tp >= 1)")
        if kind == "bf16":
            dtype, placements, stack = g.get("dtype"), g.get("placements"), g.get("stack")
            if type(dtype) is not str:
                raise ManifestError(f"group {name}: dtype is {dtype!r}, not a string")
            if stack is not None and placements is None:
                try:
                    return cls(kind, name, rank, tp, layout, file, dtype=dtype, stack=StackRecord.from_json(stack))
                except ManifestError as e:
                    raise ManifestError(f"group {name}: {e}") from None
            if stack is not None or type(placements) is not list or not placements:
                raise ManifestError(f"group {name}: a bf16 group needs either a non-empty placements list or a stack")
            flat = g.get("flat", False)
            if type(flat) is not bool:
                raise ManifestError(f"group {name}: flat is {flat!r}, not true or false")
            return cls(kind, name, rank, tp, layout, file, dtype=dtype,
                       placements=tuple(Placement.from_json(p) for p in placements), flat=flat)
        if kind == "linear":
            parts = g.get("parts")
            if type(parts) is not list or not parts:
                raise ManifestError(f"group {name}: parts is not a non-empty list")
            return cls(kind, name, rank, tp, layout, file, parts=tuple(PartRecord.from_json(p) for p in parts))
        experts = _string_list(g.get("experts"), f"group {name}: experts")
        inter, hidden, ip, hp, ep, routed = (g.get("inter"), g.get("hidden"), g.get("inter_pad_to"),
                                             g.get("hidden_pad_to"), g.get("ep", 1), g.get("routed"))
        if not all(_is_count(v, 1) for v in (inter, hidden, ip, hp, ep)):
            raise ManifestError(f"group {name}: inter, hidden, inter_pad_to, hidden_pad_to and ep must be "
                                "positive integers")
        if routed is not None and (type(routed) is not list or len(routed) != 2
                                   or not all(_is_count(v) for v in routed)):
            raise ManifestError(f"group {name}: routed is {routed!r}, not null or [start, stop]")
        return cls(kind, name, rank, tp, layout, file, (), experts, inter, hidden, ip, hp, ep,
                   tuple(routed) if routed else None)

    def to_json(self) -> dict[str, Any]:
        head = {"kind": self.kind, "name": self.name, "rank": self.rank, "tp": self.tp, "layout": self.layout}
        if self.kind == "linear":
            return {**head, "parts": [p.to_json() for p in self.parts], "file": self.file}
        if self.kind == "bf16" and self.stack is not None:
            return {**head, "dtype": self.dtype, "stack": self.stack.to_json(), "file": self.file}
        if self.kind == "bf16":
            return {**head, "dtype": self.dtype, "placements": [p.to_json() for p in self.placements],
                    **({"flat": True} if self.flat else {}), "file": self.file}
        return {**head, "experts": list(self.experts), "inter": self.inter, "hidden": self.hidden,
                "inter_pad_to": self.inter_pad_to, "hidden_pad_to": self.hidden_pad_to, "ep": self.ep,
                "routed": list(self.routed) if self.routed else None, "file": self.file}
