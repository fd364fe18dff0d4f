"""The reference engine's weights: every linear of the DeepSeek model, by its Hugging Face name,
as the logical float32 matrix it computes with, read from any checkpoint prep understands.

* a Quark source: each MXFP4 weight dequantized from its raw bytes;
* a converted checkpoint: every rank loaded through the runtime module (``layouts.load_rank``,
  manifest-checked, files mapped), each stored tensor read in its layout
  (``layouts.dequant``: the layout's own index map; one expert's bytes at a time for stacked
  experts), its pads dropped, and the ranks' pieces put back where the TP/EP split took them
  from (the group records say where). Merged tensors (``[q_a ; kv_a]``, ``[gate ; up]``,
  stacked experts) are split back into their modules.

Matrices are made on first use and kept while they fit a byte budget, so a forward over the
first layers of a 350 GB checkpoint touches only those layers' bytes (DeepSeek-R1 in float32
would be 2.8 TB). MXFP4 values are exact in float32, so every layout and TP size of one source
gives the same matrices bit for bit, and the forward the same logits.

``assume_layout`` reads a converted checkpoint's MXFP4 tensors as if they were in another
layout of the same kind, past every check: it exists to show that the checks are not vacuous.
"""

from __future__ import annotations

import json
import pathlib
from collections import OrderedDict
from typing import Any, Callable

import torch

import layouts
from layouts.dequant import dequantize_expert, dequantize_stored
from layouts.safetensors_file import TORCH_DTYPES

from ..bf16 import Bf16Group
from ..errors import PrepError
from ..groups import LinearGroup, MoEGroup, group_from_record
from ..source import SourceCheckpoint

CACHE_BYTES = 8 << 30  # dequantized matrices kept between uses (an R1 MoE layer is 45 GB in float32)


class ModelWeights:
    """``linear(prefix)``: float32 ``[N, K]`` (MXFP4 dequantized, or BF16 upcast); ``tensor(name)``:
    any other tensor (norms, router, embeddings) as stored. ``mxfp4(prefix)`` says which is which."""

    def __init__(self, config: dict[str, Any], linears: dict[str, Callable[[], torch.Tensor]],
                 tensors: dict[str, Callable[[], torch.Tensor]], description: str, cache_bytes: int = CACHE_BYTES):
        self.config = config
        self._linears = linears  # MXFP4 module prefix -> makes its float32 matrix
        self._tensors = tensors  # tensor name -> reads it
        self.description = description
        self.device: torch.device | None = None
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_bytes, self._held = cache_bytes, 0

    def to(self, device: str | torch.device) -> "ModelWeights":
        """Hand out every tensor on ``device`` from now on."""
        self.device = torch.device(device)
        self._cache.clear()
        self._held = 0
        return self

    def _get(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = self._cache.get(key)
        if t is not None:
            self._cache.move_to_end(key)
            return t
        t = make()
        if self.device is not None:
            t = t.to(self.device)
        n = t.numel() * t.element_size()
        if n <= self._cache_bytes:
            while self._held + n > self._cache_bytes and self._cache:
                old = self._cache.popitem(last=False)[1]
                self._held -= old.numel() * old.element_size()
            self._cache[key] = t
            self._held += n
        return t

    def linear(self, prefix: str) -> torch.Tensor:
        make = self._linears.get(prefix)
        if make is not None:
            return self._get(prefix, make)
        return self._get(f"{prefix}.weight:float32", lambda: self.tensor(f"{prefix}.weight").float())

    def mxfp4(self, prefix: str) -> bool:
        return prefix in self._linears

    def tensor(self, name: str) -> torch.Tensor:
        read = self._tensors.get(name)
        if read is None:
            raise PrepError(f"{name}: not in the checkpoint")
        return self._get(name, read)

    def has(self, name: str) -> bool:
        return name in self._tensors or name.removesuffix(".weight") in self._linears


def load_weights(model_dir: str | pathlib.Path, assume_layout: str | None = None,
                 manifest: layouts.Manifest | None = None) -> ModelWeights:
    """The model's weights from a Quark source folder or a converted checkpoint (whose
    ``manifest`` the caller may have loaded already)."""
    root = pathlib.Path(model_dir)
    if manifest is not None or (root / layouts.manifest.MANIFEST_NAME).is_file():
        return _from_converted(root, assume_layout, manifest or layouts.load_manifest(root))
    if assume_layout is not None:
        raise PrepError(f"{root}: assume_layout applies to converted checkpoints only")
    return _from_source(root)


def _from_source(root: pathlib.Path) -> ModelWeights:
    src = SourceCheckpoint(root)
    linears: dict[str, Callable[[], torch.Tensor]] = {}
    tensors: dict[str, Callable[[], torch.Tensor]] = {}
    for name, info in src.tensors.items():
        if name.endswith(".weight_scale"):
            continue
        prefix = name.removesuffix(".weight")
        if info.dtype == "U8" and f"{prefix}.weight_scale" in src.tensors:
            def make(name=name, prefix=prefix):
                w = src.read(name)
                return layouts.dequantize(w, src.read(f"{prefix}.weight_scale"), k=2 * w.shape[-1])
            linears[prefix] = make
        else:
            tensors[name] = lambda name=name: src.read(name)
    return ModelWeights(src.config, linears, tensors, f"Quark source {root}")


def _from_converted(root: pathlib.Path, assume_layout: str | None, manifest: layouts.Manifest) -> ModelWeights:
    ranks = [layouts.load_rank(root, r, manifest=manifest) for r in range(manifest.tp)]  # mapped, not read
    config = json.loads((root / "config.json").read_text())
    if manifest.source is None:
        raise PrepError(f"{root}: the manifest has no source tensor table; convert again")
    src_meta = manifest.source.tensors
    # For each source module: the (rank piece -> placement) steps that rebuild it.
    pieces: dict[str, list[Callable[[torch.Tensor], None]]] = {}

    def layout_of(g) -> layouts.Layout:
        lay = layouts.get_layout(g.layout)
        if assume_layout and layouts.get_layout(assume_layout).kind == lay.kind:
            return layouts.get_layout(assume_layout)
        return lay

    split: dict[str, list[Bf16Group]] = {}  # rank-exact: BF16 source tensor -> the groups holding a window
    for rec in manifest.groups:
        g = group_from_record(rec.to_json())  # prep's groups read the record's JSON
        if isinstance(g, Bf16Group):
            for name in dict.fromkeys(g.sources()):
                split.setdefault(name, []).append(g)
            continue
        _weight_pieces(g, ranks[g.rank], layout_of(g), pieces)

    def assemble_bf16(name: str) -> torch.Tensor:
        """A split BF16 source tensor put back together from its ranks' windows."""
        meta = src_meta[name]
        full = torch.empty(meta.shape, dtype=TORCH_DTYPES[meta.dtype])
        covered = torch.zeros(meta.shape, dtype=torch.bool)
        for g in split[name]:
            for source, (rows, cols), piece in g.invert([ranks[g.rank][g.name]]):
                if source == name:
                    full[rows, cols] = piece
                    covered[rows, cols] = True
        if not covered.all():
            raise PrepError(f"{name}: no rank holds all of it; the converted checkpoint is incomplete")
        return full

    def assemble(prefix: str) -> torch.Tensor:
        n, kb = src_meta[f"{prefix}.weight"].shape
        full = torch.empty((n, 2 * kb))
        covered = torch.zeros((n, 2 * kb), dtype=torch.bool)  # which values some rank provided
        for place in pieces[prefix]:
            place(full, covered)
        if not covered.all():
            raise PrepError(f"{prefix}.weight: no rank holds all of it; the converted checkpoint is incomplete")
        return full

    linears = {prefix: (lambda prefix=prefix: assemble(prefix)) for prefix in pieces}
    tensors = {}
    for r in ranks:
        for name, t in r.items():
            if r.records[name].role == "passthrough":
                tensors[name] = lambda t=t: t
    for name in split:
        tensors[name] = lambda name=name: assemble_bf16(name)
    what = f"converted {root} ({manifest.layout}+{manifest.moe_layout}, tp {manifest.tp}, ep {manifest.ep})"
    if assume_layout:
        what += f" read as {assume_layout}"
    return ModelWeights(config, linears, tensors, what)


def _last(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Remember the last result: the modules of one merged tensor ([q_a ; kv_a], [gate ; up])
    are asked for one after the other, and should not dequantize it twice."""
    memo: dict[tuple, torch.Tensor] = {}

    def call(*args):
        if args not in memo:
            memo.clear()
            memo[args] = fn(*args)
        return memo[args]

    return call


def _put(full: torch.Tensor, covered: torch.Tensor, where: tuple[slice, slice], values: torch.Tensor) -> None:
    full[where] = values
    covered[where] = True


def _values(cols: slice) -> slice:
    """Packed weight bytes as value columns (two values a byte)."""
    return slice(2 * cols.start, 2 * cols.stop)


def _weight_pieces(g: LinearGroup | MoEGroup, held, lay: layouts.Layout, pieces) -> None:
    """One step per weight placement of ``g`` (the group's own geometry, as its build and its
    inverse use it): the placement's destination in the rank's output, read in its layout
    (one expert's bytes at a time for stacked experts), put at its window of the source module."""
    shapes, outputs = g.local_shapes(), g.outputs()

    def dequantized(o: int, expert: int | None) -> torch.Tensor:
        w, s = held[outputs[o][0]], held[outputs[o + 1][0]]
        if expert is None:
            return dequantize_stored(w, s, lay, shapes[o], shapes[o + 1])
        return dequantize_expert(w, s, lay, expert, shapes[o], shapes[o + 1])

    values = {o: _last(lambda e, o=o: dequantized(o, e)) for o, (_, role, _) in enumerate(outputs)
              if role == "mxfp4_weight"}
    for p in g.placements():
        if p.output in values:
            def place(full, covered, p=p):
                got = values[p.output](p.expert)[p.dest[0], _values(p.dest[1])]
                _put(full, covered, (p.window[0], _values(p.window[1])), got)

            pieces.setdefault(p.source.removesuffix(".weight"), []).append(place)
