"""A compact DeepSeek-V3 forward (the reference engine): MLA attention with q/kv LoRA and RoPE,
MoE with grouped top-k routing and the shared expert, dense MLP layers, final norm, lm_head.

It follows transformers' ``DeepseekV3ForCausalLM`` (interleaved RoPE, sigmoid router with the
correction bias, ``routed_scaling_factor``) and computes every MXFP4 GEMM the way AMD's kernels
do: the activation is quantized to MXFP4 first (at DeepSeek's two fused call sites by the
runtime module's :class:`layouts.ActivationQuantPlan`, whose flags decide how the scale is laid
out; elsewhere by aiter's dynamic quant recipe), then multiplied, in float32, with the weight
dequantized from its stored layout. With ``act_quant=False`` activations stay BF16
(weight-only emulation, the mode to compare with transformers). Given ``dense_gemm``
(:class:`prep.reference.dense_gemm.AiterDenseGemms`, ``prep run --gemm aiter-triton``), the dense MXFP4
GEMMs it handles run on aiter's own kernels instead, on the quantized activation and the stored
bytes; MoE experts stay on the dequantize-and-matmul path.

Arithmetic is float32 with BF16 between modules, on one device, deterministically: the same
weights give the same logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import layouts
from layouts.dequant import FP8_BLOCK, dequantize_activation

from .config import rope_config
from .weights import ModelWeights

BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    act_quant: bool = True  # quantize activations of MXFP4 GEMMs (as the kernels do)
    # With act_quant: the engine (its profile) and its GEMM path whose activation-quant flags the
    # fused call sites use, as ``prep.reference.run`` chooses them for the checkpoint
    engine: layouts.EngineProfile | None = None
    gemm_path: str | None = None
    backend: str = "auto"  # fused op back end ("torch" on CPU, "triton" on other GPUs)
    # The full forward's keys and values computed as a latent-cache decode uses them: from the
    # BF16 normed KV, not quantized to MXFP4, kept float32. The two forwards then differ only in
    # the order of their sums (float32 precision), which is how the latent path is checked; off
    # (the default), they are what a prefill kernel computes: MXFP4 activation, BF16 keys.
    latent_kv: bool = False
    # How the latent decode multiplies by W_UK / W_UV: "reference" (float32 weights, BF16 queries
    # and cache) or "sglang" (SGLang's ROCm MXFP4 decode: the query's nope part and the attention
    # output quantized to MXFP4 on the fly, W_UK and W_UV dequantized and quantized again to MXFP4
    # along their last dims: the nope dim for W_UK, kv_lora for W_UV; docs/engines.md).
    mla_order: str = "reference"

    def __post_init__(self) -> None:
        if self.act_quant and (self.engine is None or self.gemm_path is None):
            raise ValueError("act_quant emulates a GEMM path's activation quant: give the engine and its gemm_path, "
                             "or act_quant=False")


def rope_tables(cfg: dict[str, Any], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """cos, sin ``[T, rope_dim]`` and the softmax scale's mscale factor (YaRN when configured)."""
    holder, rs, _ = rope_config(cfg)
    dim, base = cfg["qk_rope_head_dim"], float(holder.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    mscale = 1.0
    rs = rs or {}
    if rs.get("type", rs.get("rope_type")) == "yarn":
        factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn_factor = get_mscale(factor, rs.get("mscale", 1)) / get_mscale(factor, rs.get("mscale_all_dim", 0))
        mscale = get_mscale(factor, rs.get("mscale_all_dim", 0))
    else:
        attn_factor = 1.0
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attn_factor, emb.sin() * attn_factor, mscale


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_interleave``: de-interleave pairs, then rotate_half."""
    *lead, d = x.shape
    x = x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + half * sin


def _mxfp4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` quantized to MXFP4 along its last dim (aiter's dynamic quant) and back."""
    q, scale = layouts.mxfp4.quantize(x.float().contiguous(), layouts.mxfp4.AITER_TRITON)
    return layouts.mxfp4.dequantize(q, scale, k=x.shape[-1])


class LatentCache:
    """What MLA decode keeps per token and layer, as engines do (a latent cache): the compressed
    KV after ``kv_a_layernorm`` (``kv_lora_rank`` values) and the rotated rope key
    (``qk_rope_head_dim`` values), BF16, shared by every head. ``length``: tokens held."""

    def __init__(self) -> None:
        self.c_kv: dict[int, torch.Tensor] = {}
        self.k_rope: dict[int, torch.Tensor] = {}
        self.length = 0

    def append(self, layer: int, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's tokens of ``layer``; returns the layer's whole cache (the step's tokens last)."""
        if layer in self.c_kv:
            c_kv, k_rope = torch.cat([self.c_kv[layer], c_kv]), torch.cat([self.k_rope[layer], k_rope])
        self.c_kv[layer], self.k_rope[layer] = c_kv, k_rope
        return c_kv, k_rope

    @staticmethod
    def bytes_per_token(cfg: dict[str, Any], layers: int) -> int:
        """BF16 bytes a latent cache holds per token, over ``layers`` layers."""
        return 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * layers


class DeepseekV3:
    """``logits = DeepseekV3(weights)(token_ids)``; ``layers`` runs only the first N decoder layers.
    With a :class:`LatentCache`, ``model(ids, cache=cache)`` runs ``ids`` as the tokens after those
    the cache holds (a prefill, or one decode step) and adds them to it: attention then reads the
    cache with ``kv_b_proj`` absorbed, as engines decode."""

    def __init__(self, weights: ModelWeights, options: ForwardOptions, layers: int | None = None,
                 dense_gemm: Any = None):
        self.w = weights
        self.dense_gemm = dense_gemm  # handles(prefix), (prefix, q, scale, flags) -> float32 [T, N]
        self.cfg = weights.config
        self.opt = options
        self.num_layers = self.cfg["num_hidden_layers"] if layers is None else min(layers, self.cfg["num_hidden_layers"])
        self.plan = layouts.ActivationQuantPlan(options.gemm_path, profile=options.engine, backend=options.backend) \
            if options.act_quant else None
        self.eps = float(self.cfg.get("rms_norm_eps", 1e-6))
        self._cache: LatentCache | None = None

    # -------------------------------------------------------------- GEMMs
    def _gemm(self, xf: torch.Tensor, prefix: str) -> torch.Tensor:
        """float32 ``xf @ W.T``, rounded to BF16."""
        return self.w.matmul(xf, prefix).to(BF16)

    @staticmethod
    def _dequantized(quantized, flags) -> torch.Tensor:
        """float32 values of a fused-op output ``(q, scale)``, its scale read in the flags' layout."""
        return dequantize_activation(*quantized, flags.shuffle, flags.scale_shuffle_padding)

    def _on_stored(self, prefix: str) -> bool:
        return self.dense_gemm is not None and self.dense_gemm.handles(prefix)

    def _mxfp4_gemm(self, quantized, flags, prefix: str) -> torch.Tensor:
        """BF16 ``x @ W.T`` of a fused-op output ``(q, scale)`` whose scale is laid out by ``flags``."""
        if self._on_stored(prefix):
            return self.dense_gemm(prefix, *quantized, flags).to(BF16)
        return self._gemm(self._dequantized(quantized, flags), prefix)

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """``x @ W.T`` for a BF16 input: MXFP4 weights quantize the input first (aiter's dynamic
        quant, raw scale layout), FP8 per-channel weights per token (as ATOM's per_Token linears),
        FP8 block-scaled weights per token and 128 columns (ATOM's per_1x128), BF16 weights
        multiply it as is."""
        if (self.w.fp8(prefix) or self.w.fp8_block(prefix)) and self.opt.act_quant:
            from layouts.fused_fp8_quant import fp8_quant

            # per token for a per-channel weight, per token and block of columns for a block-scaled one
            q, s = fp8_quant(x, group_size=None if self.w.fp8(prefix) else FP8_BLOCK)  # s: [M, groups]
            return self._gemm((q.float().reshape(*s.shape, -1) * s.unsqueeze(-1)).reshape(x.shape), prefix)
        if self.w.mxfp4(prefix) and self.opt.act_quant:
            q, s = layouts.mxfp4.quantize(x.float(), layouts.mxfp4.AITER_TRITON)
            if self._on_stored(prefix):  # the kernel reads the scale laid out as its path quantizes it
                from .dense_gemm import lay_out_scale

                flags = self.plan.flags(x.shape[0])
                return self.dense_gemm(prefix, q, lay_out_scale(s, flags), flags).to(BF16)
            return self._gemm(layouts.mxfp4.dequantize(q, s, k=x.shape[-1]), prefix)
        return self._gemm(x.float(), prefix)

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return layouts.activation.rms_norm(x, self.w.tensor(name).to(x.device), self.eps)

    # -------------------------------------------------------------- blocks
    def attention(self, i: int, x_q: torch.Tensor | None, x_bf16: torch.Tensor, cos, sin, mscale) -> torch.Tensor:
        """MLA. ``x_q``: the fused input-norm quant output and its flags (or None); ``x_bf16``: the normed input."""
        c, p = self.cfg, f"model.layers.{i}.self_attn"
        nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        t = x_bf16.shape[0]

        def qkv_a(name: str) -> torch.Tensor:
            if x_q is not None and self.w.mxfp4(f"{p}.{name}"):
                return self._mxfp4_gemm(*x_q, f"{p}.{name}")
            return self.linear(x_bf16, f"{p}.{name}")

        kv_a = qkv_a("kv_a_proj_with_mqa")
        k_pass, k_rot = kv_a[:, :c["kv_lora_rank"]], kv_a[:, c["kv_lora_rank"]:]
        if c.get("q_lora_rank"):
            q_c = qkv_a("q_a_proj")
            qw, kvw = self.w.tensor(f"{p}.q_a_layernorm.weight"), self.w.tensor(f"{p}.kv_a_layernorm.weight")
            if self.opt.act_quant and self.w.mxfp4(f"{p}.q_b_proj"):
                (qq, qs), kv_n = self.plan.q_a_layernorm(q_c, qw.to(q_c.device), self.eps, k_pass.contiguous(),
                                                         kvw.to(q_c.device), self.eps)
                q = self._mxfp4_gemm((qq, qs), self.plan.flags(t), f"{p}.q_b_proj")
            else:
                kv_n = self.rms(k_pass, f"{p}.kv_a_layernorm.weight")
                q = self.linear(self.rms(q_c, f"{p}.q_a_layernorm.weight"), f"{p}.q_b_proj")
        else:
            kv_n = self.rms(k_pass, f"{p}.kv_a_layernorm.weight")
            q = self.linear(x_bf16, f"{p}.q_proj")
        q = q.view(t, nh, nope + rope)
        if self._cache is not None:
            return self._latent_attention(i, q, kv_n, k_rot, cos, sin, mscale)
        if not self.opt.latent_kv:
            kv = self.linear(kv_n, f"{p}.kv_b_proj").view(t, nh, nope + vd)
        else:
            kv = self.w.matmul(kv_n.float(), f"{p}.kv_b_proj").view(t, nh, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_rot = _rotate_interleaved(q[..., nope:].float(), cos[:, None], sin[:, None])
        k_rot = _rotate_interleaved(k_rot.float()[:, None, :], cos[:, None], sin[:, None]).expand(t, nh, rope)
        qf = torch.cat([q[..., :nope].float(), q_rot], dim=-1).to(BF16).float()
        kf = torch.cat([k_nope.float(), k_rot], dim=-1)
        kf = kf.to(BF16).float() if not self.opt.latent_kv else torch.cat([kf[..., :nope], kf[..., nope:].to(BF16).float()], -1)
        scale = (nope + rope) ** -0.5 * mscale * mscale
        scores = torch.einsum("thd,shd->hts", qf, kf) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(BF16).float()
        out = torch.einsum("hts,shd->thd", probs, v.float()).reshape(t, nh * vd).to(BF16)
        return self.linear(out, f"{p}.o_proj")

    def _latent_attention(self, i: int, q: torch.Tensor, kv_n: torch.Tensor, k_rot: torch.Tensor, cos, sin,
                          mscale: float) -> torch.Tensor:
        """MLA against the latent cache: the step's normed compressed KV and rotated rope key are
        appended, ``q_nope`` is carried into the latent space by ``W_UK`` and scored against the
        cached compressed KV (plus ``q_rope . k_rope``), and the attention-weighted compressed KV
        is carried out by ``W_UV``. Mathematically the full forward's attention; the engines'
        rounding: the cache and the queries BF16, no MXFP4 quant of the cached KV (their batched
        GEMMs take BF16 activations against the weights)."""
        c, p = self.cfg, f"model.layers.{i}.self_attn"
        nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        t = q.shape[0]
        w_uk, w_uv = self.absorbed_kv_b(i)
        k_new = _rotate_interleaved(k_rot.float()[:, None, :], cos[:, None], sin[:, None])[:, 0].to(BF16)
        c_kv, k_rope = self._cache.append(i, kv_n.to(BF16), k_new)
        s_len = c_kv.shape[0]
        q_nope = q[..., :nope].float()
        q_rot = _rotate_interleaved(q[..., nope:].float(), cos[:, None], sin[:, None]).to(BF16).float()
        sglang = self.opt.mla_order == "sglang"
        if sglang:  # MXFP4 x MXFP4 batched GEMMs, each operand quantized along its reduced dim
            q_nope = _mxfp4_roundtrip(q_nope)
            w_uk, w_uv = self._sglang_absorbed(i)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk.to(q.device))
        if sglang:
            q_lat = q_lat.to(BF16).float()  # the batched GEMM's BF16 output
        scores = torch.einsum("thl,sl->hts", q_lat, c_kv.float()) + torch.einsum("thr,sr->hts", q_rot, k_rope.float())
        scores = scores * ((nope + rope) ** -0.5 * mscale * mscale)
        # Query j of this step sits at position s_len - t + j: it sees every cached token up to it.
        causal = torch.ones(t, s_len, dtype=torch.bool, device=scores.device).triu(s_len - t + 1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(BF16).float()
        o_lat = torch.einsum("hts,sl->thl", probs, c_kv.float())
        if sglang:
            o_lat = _mxfp4_roundtrip(o_lat.to(BF16).float())
        out = torch.einsum("thl,hvl->thv", o_lat, w_uv.to(q.device)).reshape(t, nh * vd).to(BF16)
        return self.linear(out, f"{p}.o_proj")

    def _sglang_absorbed(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK and W_UV as SGLang keeps them for its MXFP4 decode (``quark_post_load_weights``):
        the BF16 dequantized ``kv_b_proj`` cut per head, W_UK quantized to MXFP4 in blocks along
        its nope dim (not the checkpoint's kv_lora blocks: a lossy regrouping), W_UV along kv_lora."""
        w_uk, w_uv = self.absorbed_kv_b(i)
        w_uk = _mxfp4_roundtrip(w_uk.to(BF16).float().transpose(1, 2)).transpose(1, 2)
        return w_uk, _mxfp4_roundtrip(w_uv.to(BF16).float())

    def absorbed_kv_b(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``W_UK [heads, qk_nope, kv_lora]`` and ``W_UV [heads, v, kv_lora]`` of layer
        ``i``: its ``kv_b_proj`` matrix (MXFP4 dequantized from its stored layout, or BF16) cut
        per head, the rows of each head being its key rows, then its value rows."""
        c = self.cfg
        nope, vd = c["qk_nope_head_dim"], c["v_head_dim"]
        w = self.w.linear(f"model.layers.{i}.self_attn.kv_b_proj").view(c["num_attention_heads"], nope + vd, -1)
        return w[:, :nope], w[:, nope:]

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate, up = self.linear(x, f"{prefix}.gate_proj"), self.linear(x, f"{prefix}.up_proj")
        h = (torch.nn.functional.silu(gate.float()) * up.float()).to(BF16)
        return self.linear(h, f"{prefix}.down_proj")

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, f"model.layers.{i}.mlp"
        e, k = c["n_routed_experts"], c["num_experts_per_tok"]
        ng, tg = c.get("n_group", 1), c.get("topk_group", 1)
        logits = x.float() @ self.w.tensor(f"{p}.gate.weight").to(x.device).float().T
        scores = logits.sigmoid()
        bias_name = f"{p}.gate.e_score_correction_bias"
        choice = scores + (self.w.tensor(bias_name).to(x.device).float() if self.w.has(bias_name) else 0.0)
        group = choice.view(-1, ng, e // ng).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(tg, dim=-1, sorted=False)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, ng, e // ng).reshape(-1, e).bool()
        idx = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1, sorted=False)[1]
        self.last_routing = idx  # (inspection and tests: which experts each token went to)
        weights = scores.gather(1, idx)
        if c.get("norm_topk_prob", True):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * float(c.get("routed_scaling_factor", 1.0))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in idx.unique().tolist():
            tok, slot = (idx == expert).nonzero(as_tuple=True)
            y = self.mlp(x[tok], f"{p}.experts.{expert}")
            out.index_add_(0, tok, y.float() * weights[tok, slot, None])
        if c.get("n_shared_experts"):
            out += self.mlp(x, f"{p}.shared_experts").float()
        return out.to(BF16)

    # -------------------------------------------------------------- model
    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, device: str | torch.device = "cpu",
                 cache: LatentCache | None = None) -> torch.Tensor:
        """float32 logits ``[T, vocab]`` for one sequence of token ids (with ``cache``: the ids
        that follow the tokens it holds, which it then holds too)."""
        ids = ids.to(device)
        start = cache.length if cache is not None else 0
        h = self.w.embedding("model.embed_tokens.weight", ids).to(device).to(BF16)
        rope = rope_tables(self.cfg, torch.arange(start, start + ids.numel(), device=device))
        residual = None
        self._cache = cache
        try:
            for i in range(self.num_layers):
                h, residual = self.decoder_layer(i, h, residual, rope)
        finally:
            self._cache = None
        if cache is not None:
            cache.length += ids.numel()
        final = (h.float() + residual.float()).to(BF16)
        x = self.rms(final, "model.norm.weight")
        return self.w.matmul(x.float(), "lm_head")

    def decoder_layer(self, i: int, h: torch.Tensor, residual: torch.Tensor | None, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer, vLLM style: returns (block output, residual); the layer's output
        hidden state is their sum. ``residual=None``: ``h`` is the layer's whole input."""
        cos, sin, mscale = rope
        p = f"model.layers.{i}"
        norm_w = self.w.tensor(f"{p}.input_layernorm.weight").to(h.device)
        fused = self.opt.act_quant and self.w.mxfp4(f"{p}.self_attn.kv_a_proj_with_mqa")
        if fused:  # input_layernorm (+ residual add) fused with the MXFP4 quant
            quantized, residual = self.plan.input_layernorm(h, norm_w, self.eps, residual)
            x_q = (quantized, self.plan.flags(h.shape[0]))  # for q_a and kv_a
        else:
            residual = h if residual is None else (h.float() + residual.float()).to(BF16)
            x_q = None
        x = layouts.activation.rms_norm(residual, norm_w, self.eps)
        h = self.attention(i, x_q, x, cos.to(h.device), sin.to(h.device), mscale)
        residual = (h.float() + residual.float()).to(BF16)
        x = self.rms(residual, f"{p}.post_attention_layernorm.weight")
        if i < self.cfg.get("first_k_dense_replace", 0):
            return self.mlp(x, f"{p}.mlp"), residual
        return self.moe(i, x), residual
