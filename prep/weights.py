"""The reference engine's weights: every linear of the DeepSeek model, by its Hugging Face name,
as the logical float32 matrix it computes with, read from any checkpoint prep understands.

* a Quark source: each MXFP4 weight dequantized from its raw bytes;
* a converted checkpoint: every rank loaded through the runtime module (``layouts.load_rank``,
  manifest-checked, attributes set), each stored tensor read in its layout
  (``layouts.dequant.dequantize_stored``, the layout's own index map), its pads dropped, and
  the ranks' pieces put back where the TP/EP split took them from (the group records say
  where). Merged tensors (``[q_a ; kv_a]``, ``[gate ; up]``, stacked experts) are split back
  into their modules.

MXFP4 values are exact in float32, so every layout and TP size of one source gives the same
matrices bit for bit, and the forward computes the same logits: what the tests pin down.
``assume_layout`` reads a converted checkpoint's MXFP4 tensors as if they were in another
layout, past every check: it exists to show the checks are not vacuous (wrong layout, wrong
numbers).
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

import layouts
from layouts.dequant import dequantize_stored

from .errors import PrepError
from .groups import LinearGroup, MoEGroup, group_from_record
from .source import SourceCheckpoint

BLOCK = layouts.BLOCK_SIZE


class ModelWeights:
    """``linear(prefix)``: float32 ``[N, K]`` (MXFP4 dequantized, or BF16 upcast); ``tensor(name)``:
    any other tensor (norms, router, embeddings) as stored. ``mxfp4(prefix)`` says which is which."""

    def __init__(self, config: dict[str, Any], linears: dict[str, torch.Tensor], mxfp4: set[str],
                 tensors: dict[str, torch.Tensor], description: str):
        self.config = config
        self._linears = linears
        self._mxfp4 = mxfp4
        self._tensors = tensors
        self.description = description

    def to(self, device: str | torch.device) -> "ModelWeights":
        """Move every tensor to ``device`` once (a forward then never copies weights)."""
        self._linears = {k: v.to(device) for k, v in self._linears.items()}
        self._tensors = {k: v.to(device) for k, v in self._tensors.items()}
        return self

    def linear(self, prefix: str) -> torch.Tensor:
        w = self._linears.get(prefix)
        if w is not None:
            return w
        t = self._tensors.get(f"{prefix}.weight")
        if t is None:
            raise PrepError(f"{prefix}.weight: not in the checkpoint")
        return t.float()

    def mxfp4(self, prefix: str) -> bool:
        return prefix in self._mxfp4

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise PrepError(f"{name}: not in the checkpoint") from None

    def has(self, name: str) -> bool:
        return name in self._tensors or name.removesuffix(".weight") in self._linears


def load_weights(model_dir: str | pathlib.Path, assume_layout: str | None = None) -> ModelWeights:
    """The model's weights from a Quark source folder or a converted checkpoint."""
    root = pathlib.Path(model_dir)
    if (root / layouts.manifest.MANIFEST_NAME).is_file():
        return _from_converted(root, assume_layout)
    if assume_layout is not None:
        raise PrepError(f"{root}: assume_layout applies to converted checkpoints only")
    return _from_source(root)


def _from_source(root: pathlib.Path) -> ModelWeights:
    src = SourceCheckpoint(root)
    linears, tensors, mxfp4 = {}, {}, set()
    for name, info in src.tensors.items():
        if name.endswith(".weight_scale"):
            continue
        prefix = name.removesuffix(".weight")
        if info.dtype == "U8" and f"{prefix}.weight_scale" in src.tensors:
            w, s = src.read(name), src.read(f"{prefix}.weight_scale")
            linears[prefix] = layouts.dequantize(w, s, k=2 * w.shape[-1])
            mxfp4.add(prefix)
        else:
            tensors[name] = src.read(name)
    return ModelWeights(src.config, linears, mxfp4, tensors, f"Quark source {root}")


def _from_converted(root: pathlib.Path, assume_layout: str | None) -> ModelWeights:
    manifest = layouts.load_manifest(root)
    ranks = [layouts.load_rank(root, r, manifest=manifest) for r in range(manifest.tp)]
    import json

    config = json.loads((root / "config.json").read_text())
    src_meta = manifest.raw["source"]["tensors"]
    linears: dict[str, torch.Tensor] = {}
    mxfp4: set[str] = set()

    def full(src_prefix: str) -> torch.Tensor:
        if src_prefix not in linears:
            n, kb = src_meta[f"{src_prefix}.weight"]["shape"]
            linears[src_prefix] = torch.full((n, 2 * kb), float("nan"))  # NaN until a rank fills it
            mxfp4.add(src_prefix)
        return linears[src_prefix]

    for rec in manifest.raw["groups"]:
        g = group_from_record(rec)
        held = ranks[g.rank]
        w_name, s_name = (n for n, _, _ in g.outputs()[:2])
        layout = layouts.get_layout(g.layout)
        if assume_layout and layouts.get_layout(assume_layout).kind == layout.kind:
            layout = layouts.get_layout(assume_layout)
        if isinstance(g, LinearGroup):
            wshape, sshape = g.local_shapes()
            values = dequantize_stored(held[w_name], held[s_name], layout, wshape, sshape)
            row = 0
            for p in g.parts:
                n = p.local(g.tp)[0]
                rows, wcols, _ = p.window(g.tp, g.rank)
                full(p.src)[rows, 2 * wcols.start:2 * wcols.stop] = values[row:row + n]
                row += n
        else:
            _place_experts(g, held, layout, full)
    # Anything left NaN was never provided by a rank: the checkpoint is incomplete.
    for prefix, w in linears.items():
        if torch.isnan(w).any():
            raise PrepError(f"{prefix}.weight: no rank holds all of it; the converted checkpoint is incomplete")
    tensors = {}
    for r in ranks:
        for name, t in r.items():
            if r.records[name].role == "passthrough":
                tensors[name] = t
    what = f"converted {root} ({manifest.layout}+{manifest.moe_layout}, tp {manifest.tp}, ep {manifest.ep})"
    if assume_layout:
        what += f" read as {assume_layout}"
    return ModelWeights(config, linears, mxfp4, tensors, what)


def _place_experts(g: MoEGroup, held, layout: layouts.Layout, full) -> None:
    names = [n for n, _, _ in g.outputs()]
    w13s, s13s, w2s, s2s = g.local_shapes()
    w13 = dequantize_stored(held[names[0]], held[names[1]], layout, w13s, s13s)
    w2 = dequantize_stored(held[names[2]], held[names[3]], layout, w2s, s2s)
    rows, (dcols, _) = g._windows()
    il, ip, h = g.i_local, g.i_pad, g.hidden
    for e, src in enumerate(g.experts):
        for half, proj in enumerate(("gate_proj", "up_proj")):
            full(f"{src}.{proj}")[rows, :] = w13[e, half * ip:half * ip + il, :h]
        full(f"{src}.down_proj")[:, 2 * dcols.start:2 * dcols.stop] = w2[e, :h, :il]
