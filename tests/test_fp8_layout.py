"""The ``fp8-preshuffle`` layout: aiter's ``shuffle_weight(x, (16, 16))`` of FP8 weights, a
linear's ``[N, K]`` or stacked experts' ``[E, N, K]`` one expert at a time, as ATOM's
block-scale FP8 linears and MoE hold them after loading (atom/model_ops/utils.py
``shuffle_weights``); checked against aiter's own function, inverted exactly."""

from __future__ import annotations

import pytest
import torch

import layouts as L
from layouts.registry import FP8, FP8_PRESHUFFLE


def rand8(*shape: int, seed: int) -> torch.Tensor:
    """Random byte patterns (NaN payloads included) seen as e4m3fn."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# R1's FP8 weights per rank at TP 8 (fused_qkv_a 2112 rows: 132 16-row bands) and an expert stack
@pytest.mark.parametrize("shape", [(2112, 7168), (3072, 1536), (7168, 2048), (3, 512, 7168), (3, 7168, 256)],
                         ids=["fused_qkv_a", "q_b-tp8", "o_proj-tp8", "w13-tp8", "w2-tp8"])
def test_matches_aiter_shuffle_weight_on_fp8_weights_and_expert_stacks(aiter_shuffle, shape):
    w = rand8(*shape, seed=sum(shape))
    if len(shape) == 2:
        want = aiter_shuffle.shuffle_weight(w, layout=(16, 16))
    else:  # ATOM's shuffle_weights: one expert at a time, in place
        want = w.clone()
        for i in range(shape[0]):
            want[i].copy_(aiter_shuffle.shuffle_weight(want[i], layout=(16, 16)))
    got, scale = FP8_PRESHUFFLE.apply(w, None, "t")
    assert scale is None and same(got, want)
    back, _ = FP8_PRESHUFFLE.invert(got, None, shape, None)
    assert same(back, w)


def test_a_shape_aiter_cannot_shuffle_is_refused_naming_the_tensor(aiter_shuffle):
    assert FP8_PRESHUFFLE.kind == FP8 and not FP8_PRESHUFFLE.has_scale
    with pytest.raises(L.shuffle.LayoutConstraintError, match=r"q: layout 'fp8-preshuffle' cannot apply to weight \(24, 48\): "
                                                      r"needs weight: N % 16 == 0 \(N = 24\); weight: K % 32 == 0"):
        FP8_PRESHUFFLE.apply(rand8(24, 48, seed=0), None, "q")
    with pytest.raises(AssertionError):  # aiter refuses it too
        aiter_shuffle.shuffle_weight(rand8(24, 48, seed=0), layout=(16, 16))


def test_fp8_channel_layouts_pad_as_atom_does_then_shuffle_with_aiter(aiter_shuffle):
    # ATOM's per-token FP8 linears at load (atom/model_ops/linear.py _maybe_pad_a8w8_preshuffle_output,
    # then shuffle_weights): N padded to a multiple of 128 with zero rows and scale 1.0, then aiter's
    # shuffle. R1's fused_qkv_a_proj (2112 rows -> 2176) and a TP 2 q_b of the tiny preset (192 -> 256).
    from layouts.registry import FP8_CHANNEL_PRESHUFFLE, FP8_CHANNEL_SCALE

    for n, k in ((2112, 7168), (192, 128), (256, 256)):
        w = rand8(n, k, seed=n)
        pad = -(-n // 128) * 128 - n
        want = aiter_shuffle.shuffle_weight(torch.nn.functional.pad(w.view(torch.uint8), (0, 0, 0, pad)).view(w.dtype),
                                            layout=(16, 16))
        got, _ = FP8_CHANNEL_PRESHUFFLE.apply(w, None, "w")
        assert same(got, want) and FP8_CHANNEL_PRESHUFFLE.weight.pad_mismatches(got, (n, k)) == 0
        assert same(FP8_CHANNEL_PRESHUFFLE.invert(got, None, (n, k), None)[0], w)
        for dtype in (torch.float32, torch.bfloat16):  # amd-quark 0.13 writes the scales BF16
            scale = torch.rand(n, 1).to(dtype)
            padded, _ = FP8_CHANNEL_SCALE.apply(scale, None, "s")
            assert padded.shape == (n + pad, 1) and torch.equal(padded[:n], scale) and bool((padded[n:] == 1).all())
            assert torch.equal(FP8_CHANNEL_SCALE.invert(padded, None, (n, 1), None)[0], scale)
