"""MLA decoded with a latent KV cache: the two halves of ``kv_b_proj`` that engines absorb.

DeepSeek's attention caches, per token and layer, the compressed KV (``kv_lora_rank`` values,
after ``kv_a_layernorm``) and the rotary key (``qk_rope_head_dim`` values), not each head's keys
and values. ``kv_b_proj`` (``[heads * (qk_nope + v), kv_lora_rank]``, head by head: the head's
``qk_nope`` key rows, then its ``v`` value rows) is then split per head into

- ``W_UK [heads, qk_nope, kv_lora_rank]``: absorbed into the query, ``q_latent = q_nope @ W_UK``,
  so that scores are ``q_latent . c_kv + q_rope . k_rope`` against the cache itself;
- ``W_UV [heads, v, kv_lora_rank]``: applied after attention, ``out = (probs @ c_kv) @ W_UV.T``.

Engines derive both from the loaded ``kv_b_proj`` (ATOM keeps ``W_K = W_UK`` transposed and
``W_V = W_UV`` after ``process_weights_after_loading``). When ``kv_b_proj`` is MXFP4 and laid out
for a kernel, that read is where a layout mistake computes silent garbage: here the stored bytes
are read through the layout's own index map (:mod:`layouts.dequant`), a block of heads at a
time, and nothing but this tensor is dequantized.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .dequant import FP8_BLOCK, dequantize_stored_rows, fp8_block_scales
from .errors import LayoutsError
from .registry import Layout, get_layout
from .sizes import ceil_div

__all__ = [
    "BLOCK", "MlaShape", "absorbed_kv_b", "absorbed_kv_b_of_rank",
]

BLOCK = 32  # values per E8M0 scale


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """The sizes of one rank's MLA: ``heads`` held by the rank (all of them over TP)."""

    heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tp: int = 1) -> "MlaShape":
        """A rank's sizes from a DeepSeek ``config.json`` at tensor parallel size ``tp`` (heads
        are split over the ranks, as ``kv_b_proj``'s rows are)."""
        heads = int(config["num_attention_heads"])
        if heads % tp:
            raise LayoutsError(f"num_attention_heads {heads} does not split over tp {tp}")
        return cls(heads // tp, int(config["qk_nope_head_dim"]), int(config["v_head_dim"]),
                   int(config["kv_lora_rank"]), int(config.get("qk_rope_head_dim", 0)))

    @property
    def rows(self) -> int:
        """Rows of ``kv_b_proj`` (this rank's)."""
        return self.heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def cache_values_per_token(self) -> int:
        """Values a latent cache holds per token and layer (shared by every head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def absorbed_kv_b(weight: torch.Tensor, shape: MlaShape, *, scale: torch.Tensor | None = None,
                  layout: Layout | str | None = None, heads_per_block: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK, W_UV)`` float32, ``[heads, qk_nope, kv_lora]`` and ``[heads, v, kv_lora]``, of one
    rank's ``kv_b_proj``.

    MXFP4: ``weight`` and ``scale`` as stored (any registered ``layout``, e.g. preshuffled:
    W16 tiles and S32x8 scale bands), read ``heads_per_block`` heads at a time through the
    layout's index map. Otherwise ``weight`` is the ``[rows, kv_lora]`` matrix itself (BF16) and
    ``scale``/``layout`` are None."""
    nope, v, lora = shape.qk_nope_head_dim, shape.v_head_dim, shape.kv_lora_rank
    per_head = nope + v
    if scale is None:
        if layout is not None:
            raise LayoutsError("kv_b_proj: a layout was given without the weight's scale")
        if tuple(weight.shape) != (shape.rows, lora):
            raise LayoutsError(f"kv_b_proj: weight {tuple(weight.shape)}, the config says {(shape.rows, lora)}")
        w = weight.float().view(shape.heads, per_head, lora)
        return w[:, :nope].contiguous(), w[:, nope:].contiguous()
    lay = get_layout(layout) if isinstance(layout, str) else layout
    if lay is None:
        raise LayoutsError("kv_b_proj: an MXFP4 weight needs the layout it is stored in")
    wshape, sshape = (shape.rows, lora // 2), (shape.rows, ceil_div(lora, BLOCK))
    lay.check(wshape, sshape, "kv_b_proj")
    w_uk = torch.empty(shape.heads, nope, lora, dtype=torch.float32)
    w_uv = torch.empty(shape.heads, v, lora, dtype=torch.float32)
    for h0 in range(0, shape.heads, heads_per_block):
        h1 = min(shape.heads, h0 + heads_per_block)
        block = dequantize_stored_rows(weight, scale, lay, wshape, sshape, slice(h0 * per_head, h1 * per_head))
        block = block.view(h1 - h0, per_head, lora)
        w_uk[h0:h1] = block[:, :nope]
        w_uv[h0:h1] = block[:, nope:]
    return w_uk, w_uv


def absorbed_kv_b_of_rank(rank: Mapping[str, torch.Tensor], records: Mapping[str, Any], layer: int,
                          shape: MlaShape, heads_per_block: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`absorbed_kv_b` of layer ``layer`` of a loaded rank (``load_rank``'s result and its
    ``records``): the weight, its scale and the layout the manifest records for it."""
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    if name not in rank:
        raise LayoutsError(f"{name}: not in this rank's tensors")
    rec = records.get(name)
    if rank[name].dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return absorbed_kv_b(_fp8_matrix(rank, records, name, (shape.rows, shape.kv_lora_rank)), shape)
    if rec is None or rec.role != "mxfp4_weight":
        return absorbed_kv_b(rank[name], shape)
    return absorbed_kv_b(rank[name], shape, scale=rank[f"{name}_scale"], layout=rec.layout,
                         heads_per_block=heads_per_block)


def _fp8_matrix(rank: Mapping[str, torch.Tensor], records: Mapping[str, Any], name: str,
                shape: tuple[int, int]) -> torch.Tensor:
    """An FP8 linear's ``[N, K]`` weight as float32 (each code times its scale, the product exact
    in float32) from a loaded rank: the weight and its ``weight_scale`` read back through the
    layouts the manifest records (a padded and shuffled per-channel weight, a padded scale), the
    scale one per row (Quark's per-channel ``[N]`` or ``[N, 1]``) or per 128x128 block (DeepSeek's
    own FP8, ``[ceil(N/128), ceil(K/128)]``)."""
    def logical(key: str, rows_cols: tuple[int, ...]) -> torch.Tensor:
        t, rec = rank[key], records.get(key)
        layout = get_layout(rec.layout) if rec is not None and rec.layout else None
        return t if layout is None else layout.weight.inverse(t, rows_cols)

    n, k = shape
    scale_name = next((f"{name}_scale{x}" for x in ("", "_inv") if f"{name}_scale{x}" in rank), None)
    if scale_name is None:
        raise LayoutsError(f"{name}: an FP8 weight without its weight_scale in this rank's tensors")
    w = logical(name, shape)
    scale = rank[scale_name]
    if scale.shape[0] >= n and scale.numel() == scale.shape[0]:  # one per row (the rows past n: padding)
        s = logical(scale_name, (n, *scale.shape[1:])).reshape(n, 1).float()
    elif tuple(scale.shape) == (ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)):
        s = fp8_block_scales(scale, slice(0, n), k)
    else:
        raise LayoutsError(f"{scale_name}: {list(scale.shape)} is neither one scale per row of {name} [{n}, {k}] "
                           "nor one per 128x128 block")
    if tuple(w.shape) != (n, k):
        raise LayoutsError(f"{name}: weight {list(w.shape)}, the config says {[n, k]}")
    return w.float() * s
