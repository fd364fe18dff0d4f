"""The reference engine's weights: every linear of the DeepSeek model, by its Hugging Face name,
as the logical float32 matrix it computes with, read from any checkpoint prep understands.

* a Quark source: each MXFP4 weight dequantized from its raw bytes;
* a converted checkpoint: every rank loaded through the runtime module (``layouts.load_rank``,
  manifest-checked, files mapped), each stored tensor read in its layout
  (``layouts.dequant``: the layout's own index map; one expert's bytes at a time for stacked
  experts), its pads dropped, and the ranks' pieces put back where the TP/EP split took them
  from (the group records say where). Merged tensors (``[q_a ; kv_a]``, ``[gate ; up]``,
  stacked experts) are split back into their modules.

Matrices are made on first use and kept while the process stays within ``max_memory``, so a
forward over the first layers of a 350 GB checkpoint touches only those layers' bytes
(DeepSeek-R1 in float32 would be 2.8 TB). The bound is the process's resident memory, not a
count of what the cache holds: before a matrix is made, the least recently used ones are
dropped until what the process holds (``/proc/self/statm``: activations, torch, the
dequantizer's index maps, mapped file pages) plus what the making needs fits. What keeps that
true for any checkpoint size: a matrix larger than :data:`ROW_BLOCK_BYTES` in float32 (an
lm_head is 3.7 GB) is made and multiplied in blocks of rows (a converted module's block from
only the bands of rows of its ranks' stored outputs that hold it); an embedding is read only at the
prompt's rows; and the pages of a converted checkpoint's mapped files that a matrix was read
from are dropped from the process once it is made (they stay in the page cache). The blocking
depends on the shape only, so every budget gives the same logits. MXFP4 values are exact in
float32, so every layout and TP size of one source gives the same matrices bit for bit, and the
forward the same logits.

``assume_layout`` reads a converted checkpoint's MXFP4 tensors as if they were in another
layout of the same kind, past every check: it exists to show that the checks are not vacuous.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pathlib
from collections import OrderedDict
from typing import Any, Callable

import torch

import layouts
from layouts.dequant import (clear_position_maps, dequantize_expert, dequantize_stored_rows, fp8_block_scales,
                             read_overhead)
from layouts.families import language_config
from layouts.safetensors_file import TORCH_DTYPES

from ..bf16 import Bf16Group, as_planned
from ..errors import PrepError
from ..group_records import group_from_record
from ..groups import LinearGroup, MoEGroup
from ..source import SourceCheckpoint

MAX_MEMORY = 8 << 30  # the process's default bound (an R1 MoE layer is 45 GB in float32)
# float32 matrices larger than this are made and multiplied a block of rows at a time (an
# expert's 58.7 MB is one block); a shape decides it, never the budget, so logits do not depend on it.
ROW_BLOCK_BYTES = 64 << 20
NEED_FACTOR = 3  # what making a matrix holds at its peak, in matrices (the result, its bytes, the gather)


def process_rss() -> int | None:
    """Resident bytes of this process now (anonymous and mapped file pages), or None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def drop_mapped_pages(buffers: list[torch.Tensor]) -> None:
    """Drop the pages of read-only file mappings from this process (``MADV_DONTNEED``): they
    stay in the page cache and come back on the next touch, but stop counting in its memory.
    Only for buffers that are mappings of files (never anonymous memory: its bytes would go)."""
    libc = _libc()
    if libc is None:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    for buf in buffers:
        if buf.device.type != "cpu" or not buf.numel():
            continue
        start = -(-buf.data_ptr() // page) * page  # whole pages inside the buffer
        stop = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
        if stop > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), 4)  # MADV_DONTNEED


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "madvise") else None
    except OSError:
        return None


class ModelWeights:
    """``matmul(x, prefix)``: float32 ``x @ W.T`` for the module's float32 ``[N, K]`` (MXFP4
    dequantized, or BF16 upcast), made whole or a block of rows at a time; ``linear(prefix)``:
    that matrix whole; ``tensor(name)``: any other tensor (norms, router) as stored;
    ``embedding(name, ids)``: the rows of ``ids``. ``mxfp4(prefix)`` says which is which.

    ``shapes``: name -> stored shape of every tensor, and prefix -> ``(N, K)`` of every MXFP4
    module; ``rows``: name -> reads a block of rows of a tensor; ``linear_rows``: prefix ->
    makes a block of rows of an MXFP4 module's matrix (both loaders give one for every module,
    so none is made whole to be cut); ``mapped``:
    file mappings whose pages are dropped once a matrix is made."""

    def __init__(self, config: dict[str, Any], linears: dict[str, Callable[[], torch.Tensor]],
                 tensors: dict[str, Callable[[], torch.Tensor]], description: str, max_memory: int = MAX_MEMORY, *,
                 shapes: dict[str, tuple[int, ...]] | None = None,
                 rows: dict[str, Callable[[slice], torch.Tensor]] | None = None,
                 linear_rows: dict[str, Callable[[slice], torch.Tensor]] | None = None,
                 mapped: list[torch.Tensor] | None = None, memo: dict | None = None, read_headroom: int = 0,
                 fp8: set[str] | frozenset[str] = frozenset()):
        self.config = config
        self._fp8 = frozenset(fp8)  # FP8 (F8_E4M3) weight tensors: scaled per output channel
        self._linears = linears  # MXFP4 module prefix -> makes its float32 matrix
        self._tensors = tensors  # tensor name -> reads it
        self._shapes = shapes or {}
        self._rows = rows or {}
        self._linear_rows = linear_rows or {}
        self._mapped = mapped or []
        self._memo = memo if memo is not None else {}  # what the makers remember between calls
        self.description = description
        self.device: torch.device | None = None
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.max_memory, self._held = max_memory, 0
        # What a make may hold beyond its own estimate: a stored tensor's position map being
        # derived (``layouts.dequant.read_overhead``; 0 for a source, which has none).
        self._read_headroom = read_headroom
        # The checkpoint's own check of config.json against its tensors, run once the forward's
        # checks of the values themselves passed (``check_config``); nothing for a converted folder,
        # whose config.json the loader checked against the source's recorded hash.
        self.check_config: Callable[[], Any] = lambda: None
        self.evictions = 0

    def __len__(self) -> int:
        """Modules and tensors held (what bounds config.json's counts)."""
        return len(self._linears) + len(self._tensors)

    def to(self, device: str | torch.device) -> "ModelWeights":
        """Hand out every tensor on ``device`` from now on."""
        self.device = torch.device(device)
        self._cache.clear()
        self._held = 0
        return self

    def release(self) -> None:
        """Drop every matrix held (a run is over: the next one, e.g. compare's B, starts empty
        even while something still refers to this object)."""
        self._cache.clear()
        self._held = 0
        self._memo.clear()

    def _make_room(self, need: int, keep: str | None = None) -> None:
        """Drop least recently used matrices until the process, plus ``need`` bytes and what
        reading stored bytes may add, fits; then the dequantizer's position maps."""
        need += self._read_headroom
        while True:
            rss = process_rss()
            if self._held + need <= self.max_memory and (rss is None or rss + need <= self.max_memory):
                return
            if len(self._cache) <= (keep is not None):
                break
            old = self._cache.popitem(last=False)[1]
            self._held -= old.numel() * old.element_size()
            self.evictions += 1
            del old
        if keep is None:
            clear_position_maps()  # resident too, and rebuilt on the next read that needs one

    def _get(self, key: str, make: Callable[[], torch.Tensor], need: int = 0) -> torch.Tensor:
        t = self._cache.get(key)
        if t is not None:
            self._cache.move_to_end(key)
            return t
        self._make_room(need)
        t = make()
        drop_mapped_pages(self._mapped)
        if self.device is not None:
            t = t.to(self.device)
        n = t.numel() * t.element_size()
        if n <= self.max_memory:
            self._cache[key] = t
            self._held += n
            self._make_room(0, keep=key)
        return t

    def shape(self, prefix: str) -> tuple[int, int]:
        """``(N, K)`` of a module's matrix."""
        shape = self._shapes.get(prefix) or self._shapes.get(f"{prefix}.weight")
        if shape is None:
            raise PrepError(f"{prefix}.weight: not in the checkpoint")
        return tuple(shape)

    def matmul(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """float32 ``x @ W.T``; a matrix over :data:`ROW_BLOCK_BYTES` a block of rows at a time."""
        n, k = self.shape(prefix)
        step = max(1, ROW_BLOCK_BYTES // (4 * k))
        if n <= step:
            return x @ self.linear(prefix).to(x.device).T
        out = []
        for r0 in range(0, n, step):
            rows = slice(r0, min(n, r0 + step))
            block = self._get(f"{prefix}:rows{r0}", lambda rows=rows: self._make_rows(prefix, rows),
                              NEED_FACTOR * 4 * (rows.stop - r0) * k)
            out.append(x @ block.to(x.device).T)
            del block
        return torch.cat(out, dim=-1)

    def _make_rows(self, prefix: str, rows: slice) -> torch.Tensor:
        make = self._linear_rows.get(prefix)
        if make is not None:
            return make(rows)
        w = self._read_rows(f"{prefix}.weight", rows).float()
        if self.fp8(prefix):
            w = w * self.tensor(f"{prefix}.weight_scale").float().reshape(-1, 1)[rows]
        elif self.fp8_block(prefix):
            w = w * fp8_block_scales(self.tensor(f"{prefix}.weight_scale_inv"), rows, w.shape[1])
        return w

    def _read_rows(self, name: str, rows: slice) -> torch.Tensor:
        read = self._rows.get(name)
        if read is not None:
            return read(rows)
        return self.tensor(name)[rows]

    def linear(self, prefix: str) -> torch.Tensor:
        n, k = self.shape(prefix)
        need = NEED_FACTOR * 4 * n * k
        make = self._linears.get(prefix)
        if make is not None:
            return self._get(prefix, make, need)
        if self.fp8(prefix):  # FP8 per output channel: its codes times their row's scale
            return self._get(f"{prefix}.weight:float32", lambda: self.tensor(f"{prefix}.weight").float()
                             * self.tensor(f"{prefix}.weight_scale").float().reshape(-1, 1), need)
        if self.fp8_block(prefix):  # FP8 per 128x128 block: its codes times their block's scale
            return self._get(f"{prefix}.weight:float32", lambda: self.tensor(f"{prefix}.weight").float()
                             * fp8_block_scales(self.tensor(f"{prefix}.weight_scale_inv"), slice(0, n), k), need)
        return self._get(f"{prefix}.weight:float32", lambda: self.tensor(f"{prefix}.weight").float(), need)

    def mxfp4(self, prefix: str) -> bool:
        return prefix in self._linears

    def fp8(self, prefix: str) -> bool:
        """Whether ``prefix`` is an FP8 linear with one scale per output channel (Quark's
        per-channel override; its input is quantized per token at run time)."""
        return f"{prefix}.weight" in self._fp8 and f"{prefix}.weight_scale" in self._tensors

    def fp8_block(self, prefix: str) -> bool:
        """Whether ``prefix`` is an FP8 linear with one scale per 128x128 block (DeepSeek's own
        FP8 release; its input is quantized per token and 128-column group at run time)."""
        return f"{prefix}.weight" in self._fp8 and f"{prefix}.weight_scale_inv" in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        read = self._tensors.get(name)
        if read is None:
            raise PrepError(f"{name}: not in the checkpoint")
        shape = self._shapes.get(name)
        return self._get(name, read, 2 * 4 * math.prod(shape) if shape else 0)

    def embedding(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of tensor ``name``, read one row at a time (an embedding is 1.8 GiB)."""
        if name not in self._tensors:
            raise PrepError(f"{name}: not in the checkpoint")
        uniq, where = torch.unique(ids.cpu(), return_inverse=True)
        rows = torch.cat([self._read_rows(name, slice(i, i + 1)) for i in uniq.tolist()])
        drop_mapped_pages(self._mapped)
        return rows[where]

    def has(self, name: str) -> bool:
        return name in self._tensors or name.removesuffix(".weight") in self._linears


def load_weights(model_dir: str | pathlib.Path, assume_layout: str | None = None,
                 manifest: layouts.Manifest | None = None, max_memory: int = MAX_MEMORY) -> ModelWeights:
    """The model's weights from a Quark source folder or a converted checkpoint (whose
    ``manifest`` the caller may have loaded already), made within ``max_memory`` bytes."""
    root = pathlib.Path(model_dir)
    if manifest is not None or (root / layouts.manifest.MANIFEST_NAME).is_file():
        return _from_converted(root, assume_layout, manifest or layouts.load_manifest(root), max_memory)
    if assume_layout is not None:
        raise PrepError(f"{root}: assume_layout applies to converted checkpoints only")
    return _from_source(root, max_memory)


def _from_source(root: pathlib.Path, max_memory: int) -> ModelWeights:
    from ..config_check import check_complete

    src = SourceCheckpoint(root)
    linears: dict[str, Callable[[], torch.Tensor]] = {}
    linear_rows: dict[str, Callable[[slice], torch.Tensor]] = {}
    tensors: dict[str, Callable[[], torch.Tensor]] = {}
    rows: dict[str, Callable[[slice], torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in src.tensors.items():
        if name.endswith(".weight_scale") and info.dtype == "U8":  # an MXFP4 scale: read with its weight
            continue
        prefix = name.removesuffix(".weight")
        if info.dtype == "U8" and f"{prefix}.weight_scale" in src.tensors:
            def make(name=name, prefix=prefix, rows=None):
                w = src.read(name, rows)
                return layouts.mxfp4.dequantize(w, src.read(f"{prefix}.weight_scale", rows), k=2 * w.shape[-1])
            linears[prefix] = make
            linear_rows[prefix] = lambda r, make=make: make(rows=r)
            shapes[prefix] = (info.shape[0], 2 * info.shape[-1])
        else:
            tensors[name] = lambda name=name: src.read(name)
            rows[name] = lambda r, name=name: src.read(name, r)
            shapes[name] = tuple(info.shape)
    weights = ModelWeights(src.config, linears, tensors, f"Quark source {root}", max_memory, shapes=shapes, rows=rows,
                           linear_rows=linear_rows,
                           fp8={n for n, info in src.tensors.items() if info.dtype == "F8_E4M3"})
    # config.json against the tensors, as convert checks it (a kv_lora_rank that is not theirs: one line, not a crash)
    weights.check_config = lambda: check_complete(src)
    return weights


def _from_converted(root: pathlib.Path, assume_layout: str | None, manifest: layouts.Manifest,
                    max_memory: int) -> ModelWeights:
    ranks = [layouts.load_rank(root, r, manifest=manifest) for r in range(manifest.tp)]  # mapped, not read
    if manifest.source is None:
        raise PrepError(f"{root}: the manifest has no source tensor table; convert again")
    recorded = manifest.source.files.get("config.json")
    if recorded is not None and (root / "config.json").is_file():  # the model is built from it: the source's
        from ..identity import side_file_changed

        problem = side_file_changed(root / "config.json", recorded)
        if problem:
            raise PrepError(problem)
    config = language_config(json.loads((root / "config.json").read_text()))
    src_meta = manifest.source.tensors
    # For each source module: the (rank piece -> placement) steps that rebuild it.
    pieces: dict[str, list[Callable[[torch.Tensor], None]]] = {}

    def layout_of(g) -> layouts.Layout:
        lay = g.layout
        if assume_layout and layouts.get_layout(assume_layout).kind == lay.kind:
            return layouts.get_layout(assume_layout)
        return lay

    split: dict[str, list[Bf16Group]] = {}  # rank-exact: BF16 source tensor -> the groups holding a window
    memo: dict = {}  # the last dequantized stored output, shared by every group
    headroom = 0  # the most any one read of a stored output holds beyond its rows
    for rec in manifest.groups:
        g = group_from_record(rec, manifest.recorded_layout)
        if isinstance(g, Bf16Group):
            for name in dict.fromkeys(g.sources()):
                split.setdefault(name, []).append(g)
            continue
        lay = layout_of(g)
        _weight_pieces(g, ranks[g.rank], lay, pieces, memo)
        headroom = max(headroom, _read_headroom(g, lay))

    def assemble_bf16(name: str, rs: slice | None = None) -> torch.Tensor:
        """A split BF16 source tensor, or its rows ``rs`` (unstacked groups only), put back
        together from its ranks' windows. Coverage is counted by windows, not by a mask of the
        tensor's size (an embedding is 1.8 GiB); a replicated window is taken once."""
        meta = src_meta[name]
        planned = as_planned(meta.shape)  # a 1-D scale is held as its column [N, 1]
        rows = rs or slice(0, meta.shape[0])
        out = torch.empty((rows.stop - rows.start, *planned[1:]), dtype=TORCH_DTYPES[meta.dtype])
        placed: set[tuple[int, int, int, int]] = set()
        for g in split[name]:
            stored = ranks[g.rank][g.name]
            if g.stacked:  # an expert's tensor, whole: only its own slot is taken out of the layout
                windows = []
                for p in (p for p in g.placements if p.source == name):
                    expert = g.from_layout(stored[p.slot:p.slot + 1])[0]
                    windows.append((p.rows, p.cols, expert[p.dest_row:p.dest_row + p.out_shape[0]]))
            else:
                windows = [(local, cols, g.stored_rows(lambda r, stored=stored: stored[r], at))
                           for local, cols, at in g.window_rows(name, rows)]
            for local, cols, piece in windows:
                rect = (local.start, local.stop, cols.start, cols.stop)
                if rect not in placed:
                    out[local, cols] = piece
                    placed.add(rect)
        if not _covers(placed, out[:, 0].numel() * planned[1]):
            raise PrepError(f"{name}: no rank holds all of it; the converted checkpoint is incomplete")
        return out.reshape(-1) if len(meta.shape) == 1 else out

    def assemble(prefix: str, rs: slice | None = None) -> torch.Tensor:
        """An MXFP4 module's float32 matrix, or its rows ``rs``, from the rows of its ranks'
        stored outputs that hold them (a block of a 1 GB dense MLP never makes it whole).
        Coverage is counted by windows, as for BF16 tensors; a replicated window is taken once."""
        n, kb = src_meta[f"{prefix}.weight"].shape
        rows = rs or slice(0, n)
        out = torch.empty((rows.stop - rows.start, 2 * kb))
        placed: set[tuple[int, int, int, int]] = set()
        for place in pieces[prefix]:
            place(out, rows, placed)
        if not _covers(placed, (rows.stop - rows.start) * kb):
            raise PrepError(f"{prefix}.weight: no rank holds all of it; the converted checkpoint is incomplete")
        return out

    linears = {prefix: (lambda prefix=prefix: assemble(prefix)) for prefix in pieces}
    linear_rows = {prefix: (lambda rs, prefix=prefix: assemble(prefix, rs)) for prefix in pieces}
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix in pieces:
        n, kb = src_meta[f"{prefix}.weight"].shape
        shapes[prefix] = (n, 2 * kb)
    tensors, rows = {}, {}
    for r in ranks:
        for name, t in r.items():
            if r.records[name].role == "passthrough":
                # Copied out of the mapping, whose pages are then dropped (see drop_mapped_pages).
                tensors[name] = lambda t=t: t.clone()
                rows[name] = lambda rs, t=t: t[rs].clone()
                shapes[name] = tuple(t.shape)
    for name in split:
        tensors[name] = lambda name=name: assemble_bf16(name)
        if not any(g.stacked for g in split[name]):  # e.g. the embedding: a prompt's rows, not 1.8 GiB
            rows[name] = lambda rs, name=name: assemble_bf16(name, rs)
        shapes[name] = tuple(src_meta[name].shape)
    what = f"converted {root} ({manifest.layout}+{manifest.moe_layout}, tp {manifest.tp}, ep {manifest.ep})"
    if assume_layout:
        what += f" read as {assume_layout}"
    mapped = [b for r in ranks for b in r.buffers]
    return ModelWeights(config, linears, tensors, what, max_memory, shapes=shapes, rows=rows, mapped=mapped,
                        memo=memo, linear_rows=linear_rows, read_headroom=headroom,
                        fp8={n for n, meta in src_meta.items() if meta.dtype == "F8_E4M3"})


def _read_headroom(g: LinearGroup | MoEGroup, lay: layouts.Layout) -> int:
    """The most that reading one of ``g``'s stored MXFP4 outputs holds beyond the rows read:
    its position map derived, for a band of rows or the whole tensor (an expert at a time)."""
    shapes, outputs = g.local_shapes(), g.outputs()
    worst = 0
    for o, (_, role, _) in enumerate(outputs):
        if role == "mxfp4_weight":
            for transform, shape in ((lay.weight, shapes[o]), (lay.scale, shapes[o + 1])):
                shape = (1, *shape[1:]) if len(shape) == 3 else shape  # experts: one at a time
                worst = max(worst, read_overhead(transform, tuple(shape)))
    return worst


def _last(fn: Callable[..., torch.Tensor], memo: dict) -> Callable[..., torch.Tensor]:
    """Remember the last result: the modules of one merged tensor ([q_a ; kv_a], [gate ; up])
    are asked for one after the other, and should not dequantize it twice. ``memo`` is shared
    by every group: one result is held in all (a dense MLP's is 1 GB), not one per group."""

    def call(*args):
        key = (id(call), args)
        if key not in memo:
            memo.clear()
            memo[key] = fn(*args)
        return memo[key]

    return call


def _covers(placed: set[tuple[int, int, int, int]], total: int) -> bool:
    """Whether distinct windows ``(row0, row1, col0, col1)`` add up to ``total`` entries."""
    return sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in placed) == total


def _values(cols: slice) -> slice:
    """Packed weight bytes as value columns (two values a byte)."""
    return slice(2 * cols.start, 2 * cols.stop)


def _weight_pieces(g: LinearGroup | MoEGroup, held, lay: layouts.Layout, pieces, memo: dict) -> None:
    """One step per weight placement of ``g`` (the group's own geometry, as its build and its
    inverse use it): for the module rows asked, the placement's destination rows in the rank's
    output, read in its layout (only the bands of rows holding them for a dense output; one
    expert's bytes at a time for stacked experts), put at its window of the source module."""
    shapes, outputs = g.local_shapes(), g.outputs()

    def dequantized(o: int, expert: int) -> torch.Tensor:
        w, s = held[outputs[o][0]], held[outputs[o + 1][0]]
        return dequantize_expert(w, s, lay, expert, shapes[o], shapes[o + 1])

    def dense_rows(o: int, rows: slice) -> torch.Tensor:
        w, s = held[outputs[o][0]], held[outputs[o + 1][0]]
        return dequantize_stored_rows(w, s, lay, shapes[o], shapes[o + 1], rows)

    values = {o: _last(lambda e, o=o: dequantized(o, e), memo) for o, (_, role, _) in enumerate(outputs)
              if role == "mxfp4_weight"}
    for p in g.placements():
        if p.output in values:
            def place(out, rows, placed, p=p):
                win = p.window[0]
                r0, r1 = max(rows.start, win.start), min(rows.stop, win.stop)
                if r0 >= r1:
                    return
                dest = slice(p.dest[0].start + r0 - win.start, p.dest[0].start + r1 - win.start)
                if p.expert is None:
                    got = dense_rows(p.output, dest)[:, _values(p.dest[1])]
                else:
                    got = values[p.output](p.expert)[dest, _values(p.dest[1])]
                out[r0 - rows.start:r1 - rows.start, _values(p.window[1])] = got
                placed.add((r0, r1, p.window[1].start, p.window[1].stop))

            pieces.setdefault(p.source.removesuffix(".weight"), []).append(place)
