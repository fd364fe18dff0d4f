"""W16 and S32x8: byte-identical to aiter's own functions, equal to the offset formulas of the
facts page, and exactly invertible."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from layouts.shuffle import pad_to

FP4 = torch.float4_e2m1fn_x2
E8M0 = torch.float8_e8m0fnu


def rand_u8(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def data_mask(rows, cols, pad_rows=True):
    """True where an S32x8 buffer holds real data (not pad), computed by shuffling a marker."""
    marker = torch.ones(rows, cols, dtype=torch.uint8)
    return L.shuffle.preshuffle_scale(marker, pad_value=0, pad_rows=pad_rows) == 1


# DeepSeek-V3 per-rank shapes: (N, K/2) of packed weights.
DEEPSEEK_WEIGHTS = {
    "expert down_proj, TP1": (7168, 1024),
    "kv_a_proj_with_mqa": (576, 3584),
    "fused_qkv_a_proj": (2112, 3584),
    "q_b_proj": (24576, 768),
    "dense gate_up, TP8": (4608, 3584),
    "o_proj, TP8": (7168, 1024),
}
# (rows, cols) of their scales, plus the flattened 257-expert CK MoE scale at TP8.
DEEPSEEK_SCALES = {
    "expert down_proj, TP1": (7168, 64),
    "kv_a_proj_with_mqa": (576, 224),
    "q_b_proj": (24576, 48),
    "257 experts w2 flattened, TP8": (257 * 7168, 8),
    "257 experts w13 flattened, TP16 padded": (257 * 512, 224),
}


# ------------------------------------------------------------------------- against aiter
@pytest.mark.parametrize("name", list(DEEPSEEK_WEIGHTS))
def test_preshuffle_weight_matches_aiter_on_deepseek_shapes(aiter_shuffle, name):
    w = rand_u8(*DEEPSEEK_WEIGHTS[name], seed=1)
    assert torch.equal(L.shuffle.preshuffle_weight(w), aiter_shuffle.shuffle_weight(w, layout=(16, 16)))


def test_preshuffle_weight_matches_aiter_on_257_stacked_experts(aiter_shuffle):
    w = rand_u8(257, 7168, 128, seed=2)  # w2 of V3 at TP8: [E, H, I_rank/2]
    assert torch.equal(L.shuffle.preshuffle_weight(w), aiter_shuffle.shuffle_weight(w, layout=(16, 16)))


@settings(max_examples=40, deadline=None)
@given(e=st.integers(1, 3), n16=st.integers(1, 12), kb32=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_preshuffle_weight_matches_aiter_on_random_shapes(aiter_shuffle, e, n16, kb32, seed):
    w = rand_u8(e, 16 * n16, 32 * kb32, seed=seed)
    assert torch.equal(L.shuffle.preshuffle_weight(w), aiter_shuffle.shuffle_weight(w, layout=(16, 16)))


@pytest.mark.parametrize("name", list(DEEPSEEK_SCALES))
def test_preshuffle_scale_matches_aiter_on_deepseek_shapes(aiter_fp4_utils, name):
    rows, cols = DEEPSEEK_SCALES[name]
    s = rand_u8(rows, cols, seed=3)
    ours = L.shuffle.preshuffle_scale(s)
    theirs = aiter_fp4_utils.e8m0_shuffle(s)
    assert ours.shape == theirs.shape
    mask = data_mask(rows, cols)
    assert torch.equal(ours[mask], theirs[mask])
    assert (ours[~mask] == 0x00).all()  # aiter leaves the pad uninitialised; ours is S32X8_PAD


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 600), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_preshuffle_scale_matches_aiter_on_random_shapes(aiter_fp4_utils, rows, cols, seed):
    s = rand_u8(rows, cols, seed=seed)
    ours, theirs = L.shuffle.preshuffle_scale(s), aiter_fp4_utils.e8m0_shuffle(s)
    mask = data_mask(rows, cols)
    assert ours.shape == theirs.shape and torch.equal(ours[mask], theirs[mask])


# ------------------------------------------------------------ against the facts-page formulas
def test_preshuffle_weight_follows_the_documented_offset_formula():
    n, kb = 48, 96
    w = torch.arange(n * kb, dtype=torch.int64).view(n, kb)
    src = w.view(-1)
    out = torch.empty(n * kb, dtype=torch.int64)
    for r in range(n):
        for c in range(kb):
            off = ((((r // 16) * (kb // 32) + c // 32) * 2 + (c % 32) // 16) * 16 + r % 16) * 16 + c % 16
            out[off] = src[r * kb + c]
    # The same permutation on bytes: encode positions in two byte planes.
    lo, hi = (w % 256).to(torch.uint8), (w // 256).to(torch.uint8)
    got = L.shuffle.preshuffle_weight(lo).long() + 256 * L.shuffle.preshuffle_weight(hi).long()
    assert torch.equal(got.view(-1), out)


def test_preshuffle_scale_follows_the_documented_offset_formula():
    rows, cols = 70, 13
    rp, cp = pad_to(rows, 256), pad_to(cols, 8)
    s = rand_u8(rows, cols, seed=4)
    got = L.shuffle.preshuffle_scale(s).view(-1)
    for r in range(rows):
        for c in range(cols):
            sb, a, l = r // 32, (r % 32) // 16, r % 16
            g, d, e = c // 8, (c % 8) // 4, c % 4
            assert got[sb * 32 * cp + g * 256 + e * 64 + l * 4 + d * 2 + a] == s[r, c]
    assert got.numel() == rp * cp


def test_per_expert_scale_is_s32x8_inside_each_expert_without_row_pad():
    s = rand_u8(3, 64, 12, seed=5)
    got = L.shuffle.preshuffle_scale_per_expert(s)
    assert got.shape == (3, 2, 16 * 32)
    for e in range(3):
        want = L.shuffle.preshuffle_scale(s[e], pad_rows=False)  # [64, 16]
        assert torch.equal(got[e].reshape(-1), want.reshape(-1))


# ------------------------------------------------------------------------------ round trips
@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), n16=st.integers(1, 10), kb32=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_unshuffle_weight_inverts_preshuffle_exactly(lead, n16, kb32, seed):
    w = rand_u8(*lead, 16 * n16, 32 * kb32, seed=seed)
    shuffled = L.shuffle.preshuffle_weight(w)
    assert shuffled.shape == w.shape
    assert torch.equal(L.shuffle.unshuffle_weight(shuffled), w)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 700), cols=st.integers(1, 50), pad_rows=st.booleans(), seed=st.integers(0, 2**16))
def test_unshuffle_scale_inverts_preshuffle_exactly(rows, cols, pad_rows, seed):
    s = rand_u8(rows, cols, seed=seed)
    assert torch.equal(L.shuffle.unshuffle_scale(L.shuffle.preshuffle_scale(s, pad_rows=pad_rows), rows, cols), s)


@settings(max_examples=40, deadline=None)
@given(e=st.integers(1, 4), n32=st.integers(1, 6), sk=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_unshuffle_scale_per_expert_inverts_exactly(e, n32, sk, seed):
    s = rand_u8(e, 32 * n32, sk, seed=seed)
    assert torch.equal(L.shuffle.unshuffle_scale_per_expert(L.shuffle.preshuffle_scale_per_expert(s), sk), s)


def test_shuffle_output_does_not_depend_on_uninitialised_memory():
    s = rand_u8(300, 13, seed=6)
    runs = []
    for junk in (0x7F, 0xAB):  # neither is the pad byte, 0x00
        torch.full((1 << 20,), junk, dtype=torch.uint8).sum()  # dirty the allocator's free memory
        runs.append(L.shuffle.preshuffle_scale(s))
    assert torch.equal(runs[0], runs[1])
    assert (runs[0][~data_mask(300, 13)] == 0x00).all()


def test_torch_fp4_and_e8m0_views_round_trip_with_their_dtype():
    w = rand_u8(32, 64, seed=7).view(FP4)
    s = rand_u8(32, 4, seed=8).view(E8M0)
    sw, ss = L.shuffle.preshuffle_weight(w), L.shuffle.preshuffle_scale(s)
    assert sw.dtype == FP4 and ss.dtype == E8M0
    assert torch.equal(sw.view(torch.uint8), L.shuffle.preshuffle_weight(w.view(torch.uint8)))
    assert torch.equal(L.shuffle.unshuffle_weight(sw).view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(L.shuffle.unshuffle_scale(ss, 32, 4).view(torch.uint8), s.view(torch.uint8))
    pe = L.shuffle.preshuffle_scale_per_expert(rand_u8(2, 32, 4, seed=9).view(E8M0))
    assert pe.dtype == E8M0


def test_preshuffle_weight_accepts_an_unaligned_slice():
    base = rand_u8(16 * 64 + 3, seed=10)
    w = base[3:].view(16, 64)  # storage offset 3: not viewable as int64 directly
    assert torch.equal(L.shuffle.unshuffle_weight(L.shuffle.preshuffle_weight(w)), w)


@settings(max_examples=30, deadline=None)
@given(e=st.integers(1, 3), n16=st.integers(1, 6), kb32=st.integers(1, 4), tp=st.sampled_from([1, 2, 4]),
       shift=st.sampled_from([0, 8, 3]), seed=st.integers(0, 2**16))
def test_w16_of_a_strided_window_written_into_a_band_of_rows_equals_aiter_on_the_copied_window(
        aiter_shuffle, e, n16, kb32, tp, shift, seed):
    # What a converter does with a rank's window of a source stack (prep/siblings.py): the window
    # (a column cut, its storage offset 0, 8 or 3 bytes off 16) is shuffled straight into a band of
    # rows of a larger output, whose rows around the band stay untouched.
    n, kb = 16 * n16, 32 * kb32
    stack = rand_u8(e * n * kb * tp + shift, seed=seed)[shift:].view(e, n, kb * tp)
    window = stack[:, :, kb * (tp - 1):]
    out = torch.full((e, n + 32, kb), 0xA5, dtype=torch.uint8)
    L.shuffle.preshuffle_weight(window, out=out[:, 16:16 + n])
    assert torch.equal(out[:, 16:16 + n], aiter_shuffle.shuffle_weight(window.contiguous(), layout=(16, 16)))
    assert bool((out[:, :16] == 0xA5).all()) and bool((out[:, 16 + n:] == 0xA5).all())
    with pytest.raises(ValueError, match="rows are contiguous"):  # an out whose rows are not contiguous
        L.shuffle.preshuffle_weight(window, out=torch.empty((e, kb, n), dtype=torch.uint8).transpose(1, 2))


@pytest.mark.parametrize("shape, rule", [((24, 64), "N % 16"), ((32, 48), "K % 64"), ((64,), "[..., N, K/2]")])
def test_preshuffle_weight_names_the_broken_constraint(shape, rule):
    with pytest.raises(L.shuffle.LayoutConstraintError, match=rule.replace("[", r"\[").replace(".", r"\.")):
        L.shuffle.preshuffle_weight(torch.zeros(shape, dtype=torch.uint8))


def test_per_expert_scale_needs_rows_in_blocks_of_32():
    with pytest.raises(L.shuffle.LayoutConstraintError, match="N % 32"):
        L.shuffle.preshuffle_scale_per_expert(torch.zeros(2, 48, 8, dtype=torch.uint8))


def test_weight_shuffle_copies_nan_bit_patterns_unchanged():
    # The W16 copy moves 16-byte runs as complex128; signalling/quiet NaN and denormal patterns
    # must come through bit for bit.
    patterns = [b"\xff" * 8, b"\x01\x00\x00\x00\x00\x00\xf0\x7f", b"\x00\x00\x00\x00\x00\x00\xf8\xff",
                b"\x01" + b"\x00" * 7, b"\x00" * 7 + b"\x80"]
    row = torch.frombuffer(bytearray(b"".join(patterns) * 4 + b"\x7f" * 96), dtype=torch.uint8)
    w = torch.stack([row.roll(i) for i in range(32)])  # [32, 256]
    assert torch.equal(L.shuffle.unshuffle_weight(L.shuffle.preshuffle_weight(w)), w)
    assert torch.equal(L.shuffle.preshuffle_weight(w), L.shuffle.preshuffle_weight(w.clone().view(torch.int8)).view(torch.uint8))
