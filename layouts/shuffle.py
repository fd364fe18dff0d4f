"""The two byte-layout primitives AMD's MXFP4 kernels read, with their exact inverses.

**W16** (aiter ``shuffle_weight(x, layout=(16, 16))``) on packed weights ``[..., N, Kb]``,
Kb = K/2 bytes. Needs N % 16 == 0 and Kb % 32 == 0; shape unchanged. Byte (n, kb) lands at
``((((n//16)*(Kb/32) + kb//32)*2 + (kb%32)//16)*16 + n%16)*16 + kb%16``: every 16-row block
stays inside its own 16 rows, moved in 16-byte runs.

**S32x8** (aiter ``e8m0_shuffle``) on E8M0 scales ``[R, C]``: pad to ``[pad256(R), pad8(C)]``,
then with r = 32s + 16a + l and c = 8g + 4d + e, element (r, c) lands at
``s*32*Cp + g*256 + e*64 + l*4 + d*2 + a``. aiter leaves the pad uninitialised; we write
``pad_value`` so the output is deterministic and hashable: :data:`S32X8_PAD` (0x00, scale
2^-127) by default, the only byte that keeps a GEMM right when a kernel multiplies the K-pad
columns by data past K (docs/consumer-kernels.md has the kernels' evidence).

**S32x8 per expert** (triton_kernels ``CDNA4MXScaleLayout``, label ``CDNA4_SCALE``) on
``[E, N, SK]``: the same permutation inside each expert with no 256-row pad (N % 32 == 0, SK
padded to a multiple of 8), stored ``[E, N/32, SKp*32]``.

**W16 on 16-bit weights** (aiter ``shuffle_weight(x, layout=(16, 16))`` on BF16/F16 ``[..., N, K]``,
what ATOM applies to the BF16 experts of its unquantized MoE): aiter moves runs of 16 bytes, 8
values here, so it is W16 on the tensor's bytes ``[..., N, 2K]``; element (n, k) lands at
``(((n//16)*(K/8) + k//8)*16 + n%16)*8 + k%8``. aiter's K block is 32 values whatever the dtype,
so it needs N % 16 == 0 and K % 32 == 0 (64 bytes a row, where packed MXFP4 needs 32).

Every MXFP4 function takes uint8 or the matching torch fp4/e8m0 view dtype and returns the same
dtype; the 16-bit one takes and returns a 2-byte dtype.
"""

from __future__ import annotations

import functools

import torch

from .errors import LayoutsError
from .mxfp4 import as_uint8
from .sizes import pad_to  # noqa: F401  (imported from here by the layouts and prep)

__all__ = [
    "W16_ROWS", "W16_KBYTES", "W16_K_VALUES_16BIT", "S32_ROWS", "S8_COLS", "SCALE_ROW_PAD",
    "S32X8_PAD", "LayoutConstraintError", "w16_violations", "per_expert_scale_violations",
    "check_rows_out", "preshuffle_weight", "check_out", "unshuffle_weight", "w16_16bit_violations",
    "preshuffle_weight_16bit", "unshuffle_weight_16bit", "shuffled_scale_shape", "preshuffle_scale",
    "unshuffle_scale", "preshuffle_scale_per_expert", "unshuffle_scale_per_expert",
]

W16_ROWS = 16
W16_KBYTES = 32
W16_K_VALUES_16BIT = 32  # aiter's BK = 2 * layout[1] values: 64 bytes of a 16-bit row
S32_ROWS = 32
S8_COLS = 8
SCALE_ROW_PAD = 256
# What a stored S32x8 weight scale holds where no logical scale lands (layout version 2 on; the
# layouts of version 1 wrote E8M0_ONE, 0x7F). Not the activation scale's pad, which the fused
# quant writes as aiter's kernel does (0x7F).
S32X8_PAD = 0x00


class LayoutConstraintError(LayoutsError):
    """A tensor's shape does not meet a layout's constraint."""


# Each permutation's constraints are written once, here, as the rules a shape breaks: the public
# functions below refuse a tensor with them, and the registry's layouts report them
# (``Transform.violations``), so that a converter checks each tensor once, when it plans it, and
# then transforms it with the unchecked functions (``_w16`` ...) that these wrap.
def w16_violations(shape: tuple[int, ...], values_per_column: int = 2, k_multiple: int = 2 * W16_KBYTES,
                   shape_text: str = "[..., N, K/2]") -> list[str]:
    """The W16 constraints ``shape`` breaks: aiter's, N % 16 rows and K % 32 bytes a row, counted
    in the values a column holds (packed MXFP4 two, ``k_multiple`` 64; a 16-bit value takes two
    bytes, and aiter's K block is 32 values whatever the dtype, so 16-bit weights need K % 32)."""
    if len(shape) < 2:
        return [f"a {shape_text} tensor"]
    n, k = shape[-2], shape[-1] * values_per_column
    return ([f"N % {W16_ROWS} == 0 (N = {n})"] if n % W16_ROWS else []) + (
        [f"K % {k_multiple} == 0 (K = {k})"] if k % k_multiple else [])


def per_expert_scale_violations(shape: tuple[int, ...]) -> list[str]:
    """The per-expert S32x8 constraints ``shape`` breaks: ``[E, N, SK]`` with N % 32 (no row pad)."""
    if len(shape) != 3:
        return ["a [E, N, K/32] scale"]
    return [] if shape[1] % S32_ROWS == 0 else [f"N % {S32_ROWS} == 0 (N = {shape[1]})"]


def _refuse(what: str, shape: tuple[int, ...], broken: list[str]) -> None:
    if broken:
        raise LayoutConstraintError(f"{what} needs {'; '.join(broken)}, got shape {tuple(shape)}")


def _check_w16(shape: torch.Size) -> None:
    _refuse("W16", shape, w16_violations(tuple(shape)))


_RUN_TYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _run_type(*ts: torch.Tensor) -> torch.dtype:
    """The widest bit-copy type every tensor's storage offset and strides allow."""
    return next(dt for dt in _RUN_TYPES
                if all(t.storage_offset() % dt.itemsize == 0 and all(st % dt.itemsize == 0 for st in t.stride()[:-1])
                       for t in ts))


def _run_source(w: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
    """``w``'s bytes with rows of unit stride (``contiguous``: wholly). Not cloned where its offset
    allows only narrow runs: measured on [8, 2048, 3584] 3 bytes off, byte runs took 34 ms and
    a clone then 16-byte runs 49 ms."""
    u = as_uint8(w)
    return u.contiguous() if contiguous or u.stride(-1) != 1 else u


def _run_views(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Each uint8 ``[..., R, C]`` (C % 16 == 0, rows of unit stride) as ``[..., R, C/16, w]``: its
    16-byte runs, each ``w`` elements of the widest bit-copy type all of them allow. W16 moves
    16-byte runs that are contiguous on both sides; copied as single 16-byte elements
    (complex128, w = 1: a pure bit copy, no arithmetic touches the values) they go at about
    memcpy speed, against ~0.3x as bytes. A view of a file's bytes may be 8-byte aligned only
    (int64, w = 2: a quarter of the speed, measured in docs/BENCHMARKS.md; why prep's writer
    starts every file's data on a 4 KiB boundary)."""
    dt = _run_type(*ts)
    return [t.view(dt).unflatten(-1, (t.shape[-1] // 16, 16 // dt.itemsize)) for t in ts]


def check_rows_out(out: torch.Tensor, like: torch.Tensor) -> None:
    """Refuse an ``out`` that cannot take ``like``'s bytes in place: same shape and dtype, each
    matrix's rows one after the other (a window of whole rows of a larger stack is fine)."""
    rows_apart = out.dim() >= 2 and out.shape[-2] > 1 and out.stride(-2) != out.shape[-1]
    if out.shape != like.shape or out.dtype != like.dtype or (out.dim() and out.stride(-1) != 1) or rows_apart:
        raise ValueError(f"out must be a {like.dtype} tensor of shape {tuple(like.shape)} whose rows are contiguous, "
                         f"got {out.dtype} {tuple(out.shape)} with strides {tuple(out.stride())}")


def preshuffle_weight(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """W16 preshuffle of packed MXFP4 weights ``[..., N, K/2]`` (experts may lead). Exact inverse:
    :func:`unshuffle_weight`. With ``out`` (``w``'s shape and dtype, rows contiguous: e.g. a
    window of whole rows of a stacked output) the result is written there and ``out`` returned.

    ``w`` may be a strided view (a column window of a stacked source, its rows of unit stride):
    it is read in place, so a converter transforms a rank's window of a source stack straight
    into its output buffer, with no copy of the window first. Each 16-row block stays in its
    own rows, so a window of rows transforms into the same rows of the output."""
    _check_w16(w.shape)
    return _w16(w, out)


def _w16(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`preshuffle_weight` of a ``w`` whose shape was checked (:func:`w16_violations`)."""
    u = _run_source(w)
    if out is None:
        out = torch.empty(w.shape, dtype=w.dtype)
    else:
        check_rows_out(out, w)
    n, kb = u.shape[-2], u.shape[-1]
    src, dst = _run_views(u, as_uint8(out))
    # (n//16, n%16, kb//16) -> (n//16, kb//16, n%16): a transpose of 16-byte runs per 16-row block.
    src = src.unflatten(-3, (n // 16, 16)).transpose(-3, -2)
    # A view, never a copy (view() refuses what check_rows_out let through by mistake).
    dst.view(*dst.shape[:-3], n // 16, kb // 16, 16, dst.shape[-1]).copy_(src)
    return out


def check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    """Refuse an ``out`` that cannot take ``like``'s bytes as they are (shape, dtype, contiguity)."""
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")


def unshuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`preshuffle_weight`: row-major ``[..., N, K/2]`` bytes back."""
    _check_w16(w.shape)
    u = _run_source(w, contiguous=True)
    n, kb = u.shape[-2], u.shape[-1]
    out = torch.empty(u.shape, dtype=torch.uint8)
    src, dst = _run_views(u, out)
    src = src.view(*src.shape[:-3], n // 16, kb // 16, 16, src.shape[-1]).transpose(-3, -2)
    dst.unflatten(-3, (n // 16, 16)).copy_(src)
    return out.view(w.dtype)


def w16_16bit_violations(shape: tuple[int, ...]) -> list[str]:
    """The W16 constraints a 16-bit ``[..., N, K]`` tensor's ``shape`` breaks."""
    return w16_violations(shape, 1, W16_K_VALUES_16BIT, "[..., N, K]")


def _check_w16_16bit(w: torch.Tensor) -> None:
    if w.element_size() != 2 or w.dtype.is_complex:
        raise LayoutConstraintError(f"16-bit W16 takes a 2-byte dtype (bfloat16, float16), got {w.dtype}")
    _refuse("16-bit W16", w.shape, w16_16bit_violations(tuple(w.shape)))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes share memory (a transpose cannot run in place)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def preshuffle_weight_16bit(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """aiter ``shuffle_weight(w, layout=(16, 16))`` of 16-bit weights ``[..., N, K]`` (BF16 stacked
    experts: leading dims are experts; each expert's rows stay its own). Exact inverse:
    :func:`unshuffle_weight_16bit`. ``w`` and ``out`` as for :func:`preshuffle_weight`; ``out``
    may be ``w``."""
    _check_w16_16bit(w)
    return _w16_16bit(w, out)


def _w16_16bit(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`preshuffle_weight_16bit` of a ``w`` whose shape was checked (:func:`w16_16bit_violations`)."""
    if out is not None:
        check_rows_out(out, w)
        if _overlaps(out, w):
            w = w.clone()
        _w16(_bytes_of(w), out.view(torch.uint8))
        return out
    return _w16(_bytes_of(w)).view(w.dtype)


def _bytes_of(w: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bytes ``[..., N, 2K]``, a view where its rows have unit stride."""
    return (w if w.stride(-1) == 1 else w.contiguous()).view(torch.uint8)


def unshuffle_weight_16bit(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`preshuffle_weight_16bit`: row-major ``[..., N, K]`` values back."""
    _check_w16_16bit(w)
    return unshuffle_weight(w.contiguous().view(torch.uint8)).view(w.dtype)


def shuffled_scale_shape(rows: int, cols: int, pad_rows: bool = True) -> tuple[int, int]:
    """Shape of the S32x8 buffer for a ``[rows, cols]`` scale (rows padded to 256 or to 32)."""
    return pad_to(rows, SCALE_ROW_PAD if pad_rows else S32_ROWS), pad_to(cols, S8_COLS)


def _padded(u: torch.Tensor, rows: int, cols: int, pad_value: int) -> torch.Tensor:
    if u.shape[-2:] == (rows, cols):
        return u.contiguous()
    out = torch.full((*u.shape[:-2], rows, cols), pad_value, dtype=torch.uint8, device=u.device)
    out[..., : u.shape[-2], : u.shape[-1]] = u
    return out


@functools.lru_cache(maxsize=64)
def _s32x8_band_index(cp: int, inverse: bool) -> torch.Tensor:
    """Source offset of each output byte inside one 32-row band of ``cp`` columns.

    S32x8 never moves a byte out of its 32-row band, and every band is permuted alike, so the
    whole shuffle is one ``gather`` along the band with this index (2-10x faster than a byte
    permute-copy, whose innermost output axis strides across 16 rows).
    """
    pos = torch.arange(32 * cp, dtype=torch.int64)
    if not inverse:  # (a, l, g, d, e) -> (g, e, l, d, a)
        return pos.view(2, 16, cp // 8, 2, 4).permute(2, 4, 1, 3, 0).reshape(-1)
    # (g, e, l, d, a) -> (a, l, g, d, e)
    return pos.view(cp // 8, 4, 16, 2, 2).permute(4, 2, 0, 3, 1).reshape(-1)


def _s32x8(u: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Apply S32x8 (or its inverse) to a contiguous uint8 buffer whose rows are a multiple of 32."""
    cp = u.shape[-1]
    bands = u.reshape(-1, 32 * cp)
    index = _s32x8_band_index(cp, inverse).to(u.device).expand(bands.shape[0], -1)
    return torch.gather(bands, 1, index).view(u.shape)


def preshuffle_scale(s: torch.Tensor, pad_value: int = S32X8_PAD, pad_rows: bool = True) -> torch.Tensor:
    """S32x8 shuffle of E8M0 scales ``[R, C]`` into ``[pad256(R), pad8(C)]`` (aiter ``e8m0_shuffle``).

    The pad is filled with ``pad_value``. ``pad_rows=False`` pads rows to 32 only (what a
    per-expert or kernel-internal view needs). Exact inverse: :func:`unshuffle_scale`.
    """
    _refuse("S32x8", s.shape, [] if s.dim() == 2 else ["a 2-D [rows, cols] scale"])
    return _s32x8_scale(s, pad_value, pad_rows)


def _s32x8_scale(s: torch.Tensor, pad_value: int = S32X8_PAD, pad_rows: bool = True) -> torch.Tensor:
    """:func:`preshuffle_scale` of a 2-D ``s``."""
    rp, cp = shuffled_scale_shape(*s.shape, pad_rows=pad_rows)
    u = _padded(as_uint8(s), rp, cp, pad_value)
    return _s32x8(u, inverse=False).view(s.dtype)


def unshuffle_scale(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`preshuffle_scale`: the row-major ``[rows, cols]`` scale, pad dropped."""
    if s.dim() != 2 or s.shape[0] % S32_ROWS or s.shape[1] % S8_COLS:
        raise LayoutConstraintError(
            f"an S32x8 buffer is [32*i, 8*j], got shape {tuple(s.shape)}"
        )
    if rows > s.shape[0] or cols > s.shape[1]:
        raise LayoutConstraintError(f"[{rows}, {cols}] does not fit in S32x8 buffer {tuple(s.shape)}")
    u = _s32x8(as_uint8(s).contiguous(), inverse=True)
    return u[:rows, :cols].contiguous().view(s.dtype)


def preshuffle_scale_per_expert(s: torch.Tensor, pad_value: int = S32X8_PAD) -> torch.Tensor:
    """Per-expert S32x8 of ``[E, N, SK]`` scales into ``[E, N/32, pad8(SK)*32]`` (``CDNA4_SCALE``).

    Needs N % 32 == 0; SK is padded to a multiple of 8 with ``pad_value``. Exact inverse:
    :func:`unshuffle_scale_per_expert`.
    """
    _refuse("per-expert S32x8", s.shape, per_expert_scale_violations(tuple(s.shape)))
    return _s32x8_per_expert(s, pad_value)


def _s32x8_per_expert(s: torch.Tensor, pad_value: int = S32X8_PAD) -> torch.Tensor:
    """:func:`preshuffle_scale_per_expert` of an ``s`` whose shape was checked
    (:func:`per_expert_scale_violations`)."""
    e, n, sk = s.shape
    skp = pad_to(sk, S8_COLS)
    u = _padded(as_uint8(s), n, skp, pad_value)
    return _s32x8(u, inverse=False).view(e, n // 32, skp * 32).view(s.dtype)


def unshuffle_scale_per_expert(s: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`preshuffle_scale_per_expert`: ``[E, N, cols]`` scales back."""
    if s.dim() != 3 or s.shape[2] % (S32_ROWS * S8_COLS):
        raise LayoutConstraintError(f"a CDNA4_SCALE buffer is [E, N/32, 256*j], got shape {tuple(s.shape)}")
    e, n32, width = s.shape
    skp = width // S32_ROWS
    if cols > skp:
        raise LayoutConstraintError(f"{cols} scale columns do not fit in CDNA4_SCALE buffer {tuple(s.shape)}")
    u = _s32x8(as_uint8(s).contiguous().view(e, n32 * 32, skp), inverse=True)
    return u[..., :cols].contiguous().view(s.dtype)
