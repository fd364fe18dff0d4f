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
and the merged-column ``gate_up_proj`` of a BF16 dense MLP. Not yet: BF16 experts (the R1-0528
MTP layer), which stay pass-through, as do the replicated tensors (norms, router, its bias,
``eh_proj``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator

import torch

from .errors import PrepError

Reader = Callable[..., torch.Tensor]  # read(name, rows=None, cols=None, out=None) -> tensor
Piece = tuple[str, tuple[slice, slice], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A window of one 2-D source tensor and where it lands in the stored tensor.

    ``dim`` is the source dim the window cuts (None: the whole tensor), ``[start, stop)`` its
    range; the window lands at ``dest_row`` rows into the stored tensor (merged tensors stack
    their parts along rows), all its columns (a column window fills the stored tensor's width).
    """

    source: str
    shape: tuple[int, int]  # the source tensor's shape
    dim: int | None
    start: int
    stop: int
    dest_row: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop) if self.dim == 0 else slice(0, self.shape[0])

    @property
    def cols(self) -> slice:
        return slice(self.start, self.stop) if self.dim == 1 else slice(0, self.shape[1])

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.rows.stop - self.rows.start, self.cols.stop - self.cols.start


@dataclasses.dataclass(frozen=True)
class Bf16Group:
    """One stored BF16 (or other non-MXFP4) tensor of one rank, built from its placements."""

    name: str  # stored tensor name: the engine parameter, e.g. model.layers.3.self_attn.fused_qkv_a_proj.weight
    rank: int
    tp: int
    dtype: str  # safetensors dtype of the sources, kept as is
    placements: tuple[Placement, ...]
    kind = "bf16"

    @property
    def key(self) -> str:
        return self.name

    @property
    def shape(self) -> tuple[int, int]:
        width = {p.out_shape[1] for p in self.placements}
        if len(width) != 1:
            raise PrepError(f"{self.name}: merged parts have different widths {sorted(width)}")
        return max(p.dest_row + p.out_shape[0] for p in self.placements), width.pop()

    def sources(self) -> list[str]:
        return [p.source for p in self.placements]

    def output_sources(self) -> list[list[str]]:
        return [self.sources()]

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(self.name, "bf16_shard", self.shape)]

    def check(self) -> None:
        rows = sorted((p.dest_row, p.dest_row + p.out_shape[0]) for p in self.placements)
        if rows[0][0] != 0 or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
            raise PrepError(f"{self.name} (rank {self.rank}): its parts do not tile the rows {rows}")
        self.shape  # noqa: B018 -- the widths agree

    def build_chunks(self, read: Reader, chunk_bytes: int = 32 << 20, alloc=None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, block of whole rows) in file order, each about ``chunk_bytes`` (an embedding at
        TP 1 is 1.8 GiB), read straight into ``alloc``'s memory when it gives some."""
        n, k = self.shape
        itemsize = _ITEMSIZE[self.dtype]
        step = max(1, chunk_bytes // max(1, k * itemsize)) if chunk_bytes else n
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            out = alloc(self.name, (r1 - r0, k), self.dtype) if alloc else None
            if out is None:
                out = torch.empty((r1 - r0, k), dtype=_TORCH[self.dtype])
            for p in self.placements:
                lo, hi = max(r0, p.dest_row), min(r1, p.dest_row + p.out_shape[0])
                if lo >= hi:
                    continue
                first = p.rows.start + lo - p.dest_row
                read(p.source, slice(first, first + hi - lo), p.cols, out=out[lo - r0:hi - r0])
            yield self.name, out

    def build(self, read: Reader) -> list[torch.Tensor]:
        return [torch.cat([t for _, t in self.build_chunks(read, 0)])]

    def invert(self, tensors: list[torch.Tensor]) -> Iterator[Piece]:
        (t,) = tensors
        if tuple(t.shape) != self.shape:
            raise PrepError(f"{self.name} (rank {self.rank}): stored shape {list(t.shape)}, expected "
                            f"{list(self.shape)}; the file is not this manifest's: convert again")
        for p in self.placements:
            yield p.source, (p.rows, p.cols), t[p.dest_row:p.dest_row + p.out_shape[0]]

    def transforms(self) -> list[dict[str, Any]]:
        chain: list[dict[str, Any]] = [{"op": "tp_split", "source": p.source, "dim": p.dim, "tp": self.tp,
                                        "rank": self.rank} for p in self.placements if p.dim is not None]
        if len(self.placements) > 1:
            chain.append({"op": "concat_rows", "parts": self.sources()})
        return chain

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "rank": self.rank, "tp": self.tp, "dtype": self.dtype,
                "placements": [{**dataclasses.asdict(p), "shape": list(p.shape)} for p in self.placements]}


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def group_from_record(rec: dict[str, Any]) -> Bf16Group:
    if rec.get("kind") != "bf16":
        raise PrepError(f"manifest: group {rec.get('name')!r} is not a bf16 group")
    ps = tuple(Placement(p["source"], tuple(p["shape"]), p["dim"], p["start"], p["stop"], p["dest_row"])
               for p in rec["placements"])
    return Bf16Group(rec["name"], rec["rank"], rec["tp"], rec["dtype"], ps)


# ---------------------------------------------------------------------------------- planning
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head|model\.layers\.\d+\.(embed_tokens|shared_head\.head))\.weight$")
_COLUMN = re.compile(r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_QKV_A = re.compile(r"^(.*\.self_attn\.)(q_a_proj|kv_a_proj_with_mqa)\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp\.)(gate_proj|up_proj)\.weight$")  # a dense MLP (not experts: no digit before)


def plan_bf16_groups(tensors: dict[str, Any], config: dict[str, Any], tp: int
                     ) -> tuple[list[list[Bf16Group]], list[str]]:
    """For each rank, the BF16 groups it holds, and the names left whole (replicated: every rank
    holds all of them). ``tensors``: the source's non-MXFP4 tensors, name -> info with ``dtype``
    and ``shape``, in source order. Expert parallel changes nothing here: it splits experts only.

    Refuses (naming the tensor and the fix) a split that does not divide: ATOM pads nothing."""
    per_rank: list[list[Bf16Group]] = [[] for _ in range(tp)]
    whole: list[str] = []
    merged: dict[str, dict[str, Any]] = {}  # engine name -> {part: info}

    def part(name, info, dim, rank):
        size = info.shape[dim]
        if size % tp:
            raise PrepError(f"{name}: dim {dim} of {size} does not split over tp={tp} (the engine splits it and pads "
                            "nothing); choose a tp that divides it")
        n = size // tp
        return Placement(name, tuple(info.shape), dim if tp > 1 else None, rank * n, (rank + 1) * n)

    q_lora = config.get("q_lora_rank")
    for name, info in tensors.items():
        two_d = len(info.shape) == 2
        if two_d and (_VOCAB.match(name) or _COLUMN.search(name) or _ROW.search(name)):
            dim = 1 if _ROW.search(name) else 0
            for r in range(tp):
                p = part(name, info, dim, r)
                per_rank[r].append(Bf16Group(name, r, tp, info.dtype, (p,)))
        elif two_d and q_lora is not None and (m := _QKV_A.match(name)):
            merged.setdefault(f"{m.group(1)}fused_qkv_a_proj.weight", {})[m.group(2)] = (name, info)
        elif two_d and ".experts." not in name and ".shared_experts." not in name and (m := _GATE_UP.match(name)):
            merged.setdefault(f"{m.group(1)}gate_up_proj.weight", {})[m.group(2)] = (name, info)
        else:
            whole.append(name)
    for target, parts in merged.items():
        order = ("q_a_proj", "kv_a_proj_with_mqa") if target.endswith("fused_qkv_a_proj.weight") else \
            ("gate_proj", "up_proj")
        if set(parts) != set(order):
            raise PrepError(f"{parts[next(iter(parts))][0]}: its partner of {target} is missing or not BF16; "
                            "the engine merges the two, so both must be BF16 (re-download the checkpoint)")
        column = order[0] == "gate_proj"  # MergedColumnParallelLinear; fused_qkv_a_proj is replicated
        for r in range(tp):
            row, ps = 0, []
            for key in order:
                name, info = parts[key]
                p = part(name, info, 0, r) if column else Placement(name, tuple(info.shape), None, 0, info.shape[0])
                ps.append(dataclasses.replace(p, dest_row=row))
                row += p.out_shape[0]
            per_rank[r].append(Bf16Group(target, r, tp, parts[order[0]][1].dtype, tuple(ps)))
    return per_rank, whole
