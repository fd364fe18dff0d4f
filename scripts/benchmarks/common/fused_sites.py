"""What the two fused RMSNorm + quant benchmarks (fused-quant, fused-fp8-quant) time alike: the
DeepSeek call sites, their inputs, and the copy of the same bytes each is compared with."""

from __future__ import annotations

import torch

from . import cuda_timing

SITES = {
    # name: (N1, with residual, N2 of x2 or 0)
    "input_layernorm+res": (7168, True, 0),
    "q_a+kv_a_layernorm": (1536, False, 512),
}
EPS = 1e-6


def make_inputs(m: int, n1: int, res: bool, n2: int, seed: int, device: str) -> dict:
    """bf16 activations with a spread of row scales (as a real residual stream's), norm weights
    near 1: the fused call's keyword arguments."""
    g = torch.Generator(device=device).manual_seed(seed)

    def act(rows, cols):
        scale = torch.exp(torch.randn(rows, 1, device=device, generator=g) * 1.5)
        return (torch.randn(rows, cols, device=device, generator=g) * scale).to(torch.bfloat16)

    def weight(cols):
        return (1 + 0.4 * torch.randn(cols, device=device, generator=g)).to(torch.bfloat16)

    args = dict(x1=act(m, n1), x1_weight=weight(n1), x1_epsilon=EPS)
    if res:
        args["res1"] = act(m, n1)
    if n2:
        args.update(x2=act(m, n2), x2_weight=weight(n2), x2_epsilon=EPS)
    return args


def _copy_kernel():
    """A plain Triton copy of int32 words, 16-byte vectors (the bound a memory-bound kernel can
    reach: in a CUDA graph torch's ``copy_`` becomes a memcpy node, which may run on the copy
    engines rather than the SMs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    def run(src, dst, block=4096, warps=8):
        n = src.numel()
        copy_words[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=warps)
    return run


def copy_fns(nbytes: int, device: str) -> dict:
    """Copies of ``nbytes`` bytes read + written (``nbytes / 2`` each way, int32 words): torch's
    ``copy_`` and the Triton copy kernel."""
    words = max(1, nbytes // 8)
    src = torch.ones(words, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    tcopy = _copy_kernel()
    return {"copy_": lambda: dst.copy_(src), "triton": lambda: tcopy(src, dst)}


def copy_us(nbytes: int, budget_ms: float, cpu: bool = False) -> float:
    """The faster of the two copies of ``nbytes`` (CUDA-graph microseconds per call)."""
    return min(cuda_timing.time_graph_us(fn, budget_ms, cpu=cpu) for fn in copy_fns(nbytes, "cpu" if cpu else "cuda")
               .values())
