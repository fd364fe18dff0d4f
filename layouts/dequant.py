"""Read MXFP4 weights (and activation scales) in the layout they are stored in.

A reference GEMM needs the logical ``[N, K]`` values of a weight that sits in memory as W16
tiles, S32x8 scale bands, flattened expert scales, and so on. Rather than a second, hand-written
inverse per layout, the index map is derived from the layout's own forward transform: running
the transform on the byte planes of ``arange(numel)`` tells, for every stored byte, which
logical byte it holds (pad bytes hold none). One gather through that cached map then reads the
stored tensor straight into logical order. A layout whose forward is wrong, or a tensor read
with another layout's map, therefore gives visibly different numbers, never the right ones by
accident of sharing code with the inverse.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .mxfp4 import BLOCK_SIZE, dequantize
from .registry import Layout
from .sizes import ceil_div
from .transforms import ScaleShuffle, Shape, Transform

__all__ = [
    "FP8_BLOCK", "fp8_block_scales", "POSITIONS_CACHE_BYTES", "stored_positions",
    "MAP_DERIVE_BYTES_PER_BYTE", "MAP_DERIVE_FIXED", "clear_position_maps", "read_overhead",
    "BAND_BYTES", "read_logical", "dequantize_stored", "dequantize_stored_rows",
    "dequantize_activation", "stored_expert", "dequantize_expert",
]

FP8_BLOCK = 128  # DeepSeek's FP8 release: one F32 scale per 128x128 block of a weight


def fp8_block_scales(scale_inv: torch.Tensor, rows: slice, k: int) -> torch.Tensor:
    """The per-element float32 scales of rows ``rows`` of an ``[N, k]`` FP8 weight whose 128x128
    blocks each have one (``weight_scale_inv [ceil(N/128), ceil(k/128)]``; the last blocks may be
    partial, and ``rows`` may start inside a block)."""
    b = FP8_BLOCK
    s = scale_inv.float()[rows.start // b:-(-rows.stop // b)].repeat_interleave(b, 0).repeat_interleave(b, 1)
    first = rows.start - rows.start // b * b
    return s[first:first + rows.stop - rows.start, :k]


_POSITIONS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
POSITIONS_CACHE_BYTES = 512 << 20  # int64 maps are 8 bytes per stored byte: keep only recent ones
_positions_held = 0  # bytes in _POSITIONS


def stored_positions(transform: Transform, shape: Shape, device: torch.device | str = "cpu") -> torch.Tensor:
    """For each byte of a logical ``shape`` tensor (row-major), its flat position in the
    transform's output. int64 ``[numel]`` on ``device``; recent maps are cached (512 MiB)."""
    key = (transform, tuple(shape), str(device))
    hit = _POSITIONS.get(key)
    if hit is not None:
        _POSITIONS.move_to_end(key)
        return hit
    global _positions_held
    where = _positions(transform, tuple(shape)).to(device)
    size = where.numel() * 8
    if size <= POSITIONS_CACHE_BYTES:
        while _POSITIONS and _positions_held + size > POSITIONS_CACHE_BYTES:
            _positions_held -= _POSITIONS.popitem(last=False)[1].numel() * 8
        _POSITIONS[key] = where
        _positions_held += size
    return where


def _positions(transform: Transform, shape: Shape) -> torch.Tensor:
    n = math.prod(shape)
    if n >= (1 << 31) - 1:
        raise ValueError(f"tensor of {n} bytes is too large for a position map; dequantize it in expert blocks")
    # One byte plane of arange(1, n + 1) at a time, accumulated in int32 (n < 2^31): every array
    # but the result is 4 bytes a byte or less. Holding the four planes and int64 sums, as this
    # once did, took 48-61 bytes a byte at its peak (400 MB for a dense MLP's 8 MB scale).
    stored = None
    for i in range(4):
        plane = torch.arange(1, n + 1, dtype=torch.int32).bitwise_right_shift_(8 * i).bitwise_and_(0xFF)
        moved = transform.forward(plane.to(torch.uint8).view(shape)).reshape(-1)
        del plane
        if stored is None:
            stored = moved.to(torch.int32)
        else:
            stored.add_(moved.to(torch.int32).bitwise_left_shift_(8 * i))
        del moved
    # Invert it a chunk of stored bytes at a time (no int64 array of all positions but the
    # result). Every logical byte must land in exactly one stored position (anything else is
    # not a layout): n landings on n distinct bytes is that, checked with a bool per byte.
    where = torch.empty(n, dtype=torch.int64)
    seen = torch.zeros(n, dtype=torch.bool)
    landed = 0
    for c0 in range(0, stored.numel(), _CHUNK):
        chunk = stored[c0:c0 + _CHUNK]
        valid = (chunk >= 1) & (chunk <= n)  # 0 and out-of-range values mark pad bytes
        index = chunk[valid].long().sub_(1)
        where[index] = torch.arange(c0, c0 + chunk.numel())[valid]
        seen[index] = True
        landed += index.numel()
    if landed != n or not bool(seen.all()):
        raise ValueError(f"{transform.name} on {shape} is not a permutation plus padding")
    return where


_CHUNK = 1 << 20  # stored bytes inverted at a time


# What reading through a map not yet cached holds at its peak beyond the output: per logical
# byte (the map kept, 8, and the arrays that derive it) and the chunk's fixed part. Measured in
# fresh processes for W16 and S32x8 maps of 3.7-8.3 MB: 19-33 bytes a byte, chunk included (the
# derivation before this one: 48-61); pinned by a test. A caller with a budget reserves it.
MAP_DERIVE_BYTES_PER_BYTE = 40
MAP_DERIVE_FIXED = 32 << 20


def clear_position_maps() -> None:
    """Forget every cached position map (they count in the process's memory; a caller under a
    budget drops them when nothing else is left to drop)."""
    global _positions_held
    _POSITIONS.clear()
    _positions_held = 0


def read_overhead(transform: Transform, shape: Shape) -> int:
    """Bytes beyond its output that reading a logical ``shape`` tensor stored by ``transform``
    may hold at once (one band, or the whole tensor where it cannot be banded): deriving the
    position map, which is then kept (8 bytes a byte) while the cache has room."""
    band = _band_rows(transform, tuple(shape))
    numel = band * shape[-1] if band is not None else math.prod(shape)
    return MAP_DERIVE_BYTES_PER_BYTE * numel + MAP_DERIVE_FIXED


BAND_BYTES = 4 << 20  # a larger tensor is gathered a band of rows at a time, where its transform allows


def read_logical(stored: torch.Tensor, transform: Transform, shape: Shape) -> torch.Tensor:
    """The logical ``shape`` bytes of ``stored`` (the transform's output), by one gather, or
    one per band of rows: a position map is 8 bytes per byte and takes several such arrays to
    derive, so a dense MLP's 132 MB merged weight would need ~8 GB at once. Banded only where
    the transform pads nothing and works inside blocks of that many rows (as it does inside
    each stacked expert), so each band's map is the whole map's part for that band."""
    flat = _flat_bytes(stored)
    rows = _band_rows(transform, tuple(shape))
    if rows is None:
        return flat[stored_positions(transform, tuple(shape), flat.device)].view(shape)
    return _gather_bands(flat, transform, rows, shape[-1], 0, flat.numel() // shape[-1]).view(shape)


def _flat_bytes(stored: torch.Tensor) -> torch.Tensor:
    flat = stored.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _gather_bands(flat: torch.Tensor, transform: Transform, rows: int, cols: int, r0: int, r1: int) -> torch.Tensor:
    """Logical rows ``[r0, r1)`` (whole bands; rows of every leading index in turn) of stored
    bytes ``flat``, gathered a band of ``rows`` rows at a time through one band's position map."""
    where = stored_positions(transform, (rows, cols), flat.device)
    out = torch.empty((r1 - r0) * cols, dtype=torch.uint8, device=flat.device)
    for r in range(r0, r1, rows):
        torch.take(flat[r * cols:(r + rows) * cols], where, out=out[(r - r0) * cols:(r - r0 + rows) * cols])
    return out


def _band_rows(transform: Transform, shape: Shape) -> int | None:
    """Rows per band (a multiple of 256 dividing the matrix rows, about BAND_BYTES), or None
    when the tensor is small or its transform cannot be read a band at a time."""
    if len(shape) < 2 or math.prod(shape) <= BAND_BYTES or tuple(transform.output_shape(shape)) != tuple(shape):
        return None
    n, c = shape[-2], shape[-1]
    for rows in range(max(256, BAND_BYTES // c // 256 * 256), 0, -256):
        if n % rows == 0 and transform.splits_over_experts(rows) and not transform.violations((rows, c)):
            return rows
    return None


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor, layout: Layout, weight_shape: Shape,
                      scale_shape: Shape) -> torch.Tensor:
    """float32 logical values ``[..., N, K]`` of an MXFP4 weight stored in ``layout``.

    ``weight_shape`` / ``scale_shape`` are the logical (source-order) byte shapes,
    ``[..., N, K/2]`` and ``[..., N, ceil(K/32)]``."""
    w = read_logical(weight, layout.weight, tuple(weight_shape))
    s = read_logical(scale, layout.scale, tuple(scale_shape))
    return dequantize(w, s, k=2 * weight_shape[-1])


def dequantize_stored_rows(weight: torch.Tensor, scale: torch.Tensor, layout: Layout, weight_shape: Shape,
                           scale_shape: Shape, rows: slice) -> torch.Tensor:
    """float32 logical rows ``rows`` of a 2-D MXFP4 weight stored in ``layout`` (shapes as for
    :func:`dequantize_stored`), reading only the bands of rows that hold them where the
    transforms allow, so a block of a module's rows never needs its whole matrix."""
    w = _read_logical_rows(weight, layout.weight, tuple(weight_shape), rows)
    s = _read_logical_rows(scale, layout.scale, tuple(scale_shape), rows)
    return dequantize(w, s, k=2 * weight_shape[-1])


def _read_logical_rows(stored: torch.Tensor, transform: Transform, shape: Shape, rows: slice) -> torch.Tensor:
    """Logical rows ``rows`` of a 2-D ``shape``: the bands that cover them (each band's map is
    the whole map's part, see :func:`read_logical`), else the whole tensor read and cut."""
    band = _band_rows(transform, shape)
    if band is None:
        return read_logical(stored, transform, shape)[rows]
    b0, b1 = rows.start // band * band, ceil_div(rows.stop, band) * band
    out = _gather_bands(_flat_bytes(stored), transform, band, shape[-1], b0, b1)
    return out.view(b1 - b0, shape[-1])[rows.start - b0:rows.stop - b0]


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, shuffle: bool, padded: bool) -> torch.Tensor:
    """float32 ``[M, K]`` of an activation quantized by the fused op with these flags: the scale
    is ``[M, ceil(K/32)]``, or padded to ``[pad256(M), pad8(..)]`` and then S32x8-shuffled."""
    m, k = q.shape[0], 2 * q.shape[1]
    cols = ceil_div(k, BLOCK_SIZE)
    if shuffle:
        s = read_logical(scale, ScaleShuffle(), (m, cols))
    else:
        s = scale.view(torch.uint8)[:m, :cols] if padded else scale.view(torch.uint8)
    return dequantize(q.view(torch.uint8), s, k=k)


def stored_expert(stored: torch.Tensor, e: int, experts: int) -> torch.Tensor:
    """Expert ``e``'s bytes of a stacked MoE tensor as stored. Every MoE layout stores the experts
    one after another, each in the same number of bytes (W16 tiles and S32x8 bands stay inside
    an expert, whose rows are a multiple of 256), so that is a plain slice."""
    flat = stored.reshape(-1)
    if flat.numel() % experts:
        raise ValueError(f"stored tensor of {flat.numel()} bytes does not split into {experts} experts")
    per = flat.numel() // experts
    return flat[e * per:(e + 1) * per]


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor, layout: Layout, e: int, weight_shape: Shape,
                      scale_shape: Shape) -> torch.Tensor:
    """float32 logical ``[N, K]`` of expert ``e`` of a stacked MoE weight stored in ``layout``,
    reading only that expert's bytes. ``weight_shape`` / ``scale_shape``: the whole stacked
    logical shapes ``[E, N, K/2]`` / ``[E, N, K/32]``."""
    experts = weight_shape[0]
    w1, s1 = (1, *weight_shape[1:]), (1, *scale_shape[1:])
    w = stored_expert(weight, e, experts)
    s = stored_expert(scale, e, experts)
    return dequantize_stored(w, s, layout, w1, s1)[0]
