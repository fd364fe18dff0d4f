"""The transforms a layout is built from: each a byte-exact, invertible rewrite of one tensor.

A :class:`~layouts.registry.Layout` pairs one :class:`Transform` for the weight with one for its
scale. Transforms are small frozen objects; their ``params`` go into the manifest so a reader
knows exactly what was applied (:func:`~layouts.registry.recorded_layout` rebuilds them with the
parameters a manifest recorded). Each one's byte math is a permutation of ``layouts/shuffle.py``
(or a pad, a transpose, the identity); its shape rules are that module's too, reported as
:meth:`Transform.violations`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from . import shuffle as _sh
from .shuffle import S32X8_PAD, pad_to

__all__ = [
    "Shape", "Transform", "Identity", "WeightPreshuffle", "WeightPreshuffle16Bit",
    "WeightPreshuffle8Bit", "PadRowsPreshuffle8Bit", "PadRowsOnes", "ScaleShuffle",
    "ScaleShuffleStacked", "ScaleShuffleUnpadded", "ScaleTranspose", "ScaleShufflePerExpert",
]

Shape = tuple[int, ...]

@dataclasses.dataclass(frozen=True)
class Transform:
    """A byte-exact, invertible rewrite of one tensor. Subclasses fill in the four methods."""

    name = "identity"
    # Rows that forward keeps to themselves, or None. Where set, rows [a, a+m) of a [..., N, C]
    # tensor (a and m multiples of it) transform into the same rows of the output and nowhere
    # else, and forward reads a strided ``t`` (rows of unit stride) in place and writes an
    # ``out`` whose rows are contiguous: a converter transforms each rank's window of a source
    # stack straight into its rows of the output buffer, with no copy of the window first.
    row_block: ClassVar[int | None] = None

    def violations(self, shape: Shape) -> list[str]:
        """The constraints ``shape`` breaks, each as a short rule (empty when it applies)."""
        return []

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The transformed tensor; with ``out`` (of ``output_shape`` and ``t``'s dtype:
        contiguous, or with a :attr:`row_block` its rows contiguous) it is written there and
        ``out`` returned: how a converter builds straight into its output buffer. ``t``'s shape
        is not checked here: it was, once (:meth:`violations`, through :meth:`Layout.check`;
        :meth:`Layout.apply` checks, then calls this)."""
        if out is None:
            return t.contiguous()
        _sh.check_rows_out(out, t)
        return out.copy_(t)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        """Undo :meth:`forward`; ``shape`` is the tensor's shape before the transform."""
        return t.contiguous()

    def output_shape(self, shape: Shape) -> Shape:
        return tuple(shape)

    def splits_over_experts(self, rows_per_expert: int) -> bool:
        """Whether a block of stacked experts (``[e, rows_per_expert, C]``) transforms into, and
        inverts from, exactly its part of the whole stacked tensor's result: blocks laid end to
        end are the whole. True for a transform that works inside each expert's matrix."""
        return True

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        """How many bytes of the stored ``t`` that hold no source byte (the pad this transform
        writes) differ from what it writes there; ``shape`` is the source shape. 0 without a pad."""
        return 0

    @property
    def params(self) -> dict[str, Any]:
        """What the manifest records of this transform."""
        return {"name": self.name, **dataclasses.asdict(self)}


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or ``result`` copied into ``out`` (nothing to copy when it is ``out``)."""
    if out is None:
        return result
    _sh.check_out(out, result)
    if out.data_ptr() != result.data_ptr():
        out.copy_(result)
    return out


@dataclasses.dataclass(frozen=True)
class Identity(Transform):
    name = "identity"
    row_block = 1


@dataclasses.dataclass(frozen=True)
class WeightPreshuffle(Transform):
    """W16 on ``[..., N, K/2]`` (aiter ``shuffle_weight(x, (16, 16))``); leading dims are experts."""

    name = "w16"
    row_block = _sh.W16_ROWS
    # aiter's conditions, N % 16 and K % 32 bytes, as the values it counts (the rules are
    # :func:`layouts.shuffle.w16_violations`): packed MXFP4 holds two per byte (K % 64), a 16-bit
    # value takes two bytes (K % 32 values), an FP8 one one (K % 32)
    shape_text: ClassVar[str] = "[..., N, K/2]"
    values_per_column: ClassVar[int] = 2
    k_multiple: ClassVar[int] = 2 * _sh.W16_KBYTES

    def violations(self, shape: Shape) -> list[str]:
        return _sh.w16_violations(shape, self.values_per_column, self.k_multiple, self.shape_text)

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _sh._w16(t, out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return _sh.unshuffle_weight(t)


@dataclasses.dataclass(frozen=True)
class WeightPreshuffle16Bit(WeightPreshuffle):
    """aiter ``shuffle_weight(x, (16, 16))`` on 16-bit values ``[..., N, K]``: W16 of the bytes,
    N % 16 and K % 32 (values); leading dims are experts, each shuffled inside its own rows."""

    name = "w16-16bit"
    shape_text = "[..., N, K]"
    values_per_column = 1
    k_multiple = _sh.W16_K_VALUES_16BIT

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _sh._w16_16bit(t, out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return _sh.unshuffle_weight_16bit(t)


@dataclasses.dataclass(frozen=True)
class WeightPreshuffle8Bit(WeightPreshuffle):
    """aiter ``shuffle_weight(x, (16, 16))`` on one-byte values ``[..., N, K]`` (FP8): W16 of the
    bytes, N % 16 and K % 32 (aiter's condition for a one-byte dtype); leading dims are experts."""

    name = "w16-8bit"
    shape_text = "[..., N, K]"
    values_per_column = 1
    k_multiple = _sh.W16_KBYTES


@dataclasses.dataclass(frozen=True)
class PadRowsPreshuffle8Bit(WeightPreshuffle8Bit):
    """FP8 rows padded with zero rows to a multiple of ``rows``, then W16: what ATOM does to a
    per-token FP8 linear at load (``_maybe_pad_a8w8_preshuffle_output``, its GEMM's 128-row tile,
    then ``shuffle_weights``). The pad rows are the last, so any N is taken."""

    name = "pad-w16-8bit"
    rows: int = 128

    def violations(self, shape: Shape) -> list[str]:
        return [v for v in super().violations(shape) if not v.startswith("N ")]

    def output_shape(self, shape: Shape) -> Shape:
        return (*shape[:-2], pad_to(shape[-2], self.rows), shape[-1])

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        padded = torch.zeros(self.output_shape(tuple(t.shape)), dtype=torch.uint8)
        padded[..., :t.shape[-2], :] = t.view(torch.uint8)
        return _sh._w16(padded.view(t.dtype), out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return _sh.unshuffle_weight(t)[..., :shape[-2], :].contiguous()

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        return int(_sh.unshuffle_weight(t).view(torch.uint8)[..., shape[-2]:, :].count_nonzero())


@dataclasses.dataclass(frozen=True)
class PadRowsOnes(Transform):
    """A per-output-channel scale ``[N, 1]`` with rows of 1.0 to a multiple of ``rows``: what
    ATOM gives the pad rows of a per-token FP8 linear's weight (``_maybe_pad_a8w8_preshuffle_output``)."""

    name = "pad-rows-ones"
    rows: int = 128

    def violations(self, shape: Shape) -> list[str]:
        return [] if len(shape) == 2 and shape[-1] == 1 else ["a scale [N, 1]"]

    def output_shape(self, shape: Shape) -> Shape:
        return (pad_to(shape[0], self.rows), *shape[1:])

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        padded = torch.cat([t, t.new_ones((self.output_shape(tuple(t.shape))[0] - t.shape[0], *t.shape[1:]))])
        if out is None:
            return padded
        _sh.check_rows_out(out, padded)
        return out.copy_(padded)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return t[:shape[0]].contiguous()

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        return int((t[shape[0]:] != 1).sum())


@dataclasses.dataclass(frozen=True)
class ScaleShuffle(Transform):
    """S32x8 on ``[R, C]`` padded to ``[pad256(R), pad8(C)]`` (aiter ``e8m0_shuffle``).

    ``flatten_experts``: a 3-D ``[E, R, C]`` scale is first viewed as ``[E*R, C]`` (what CK's
    fused MoE reads), and the result stays 2-D.
    """

    name = "s32x8"
    pad_value: int = S32X8_PAD
    flatten_experts: bool = False

    def _rows_cols(self, shape: Shape) -> tuple[int, int]:
        rows = shape[0] * shape[1] if (self.flatten_experts and len(shape) == 3) else shape[0]
        return rows, shape[-1]

    def violations(self, shape: Shape) -> list[str]:
        want = (2, 3) if self.flatten_experts else (2,)
        return [] if len(shape) in want else [f"scale is {' or '.join(f'{n}-D' for n in want)}"]

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _into(_sh._s32x8_scale(t.reshape(self._rows_cols(t.shape)), pad_value=self.pad_value), out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return _sh.unshuffle_scale(t, *self._rows_cols(shape)).reshape(shape)

    def output_shape(self, shape: Shape) -> Shape:
        return _sh.shuffled_scale_shape(*self._rows_cols(shape))

    def splits_over_experts(self, rows_per_expert: int) -> bool:
        # Flattened over experts, rows are padded to 256 and moved inside 32-row bands of the
        # whole [E*N, K/32]: a block is exact only when each expert's rows are whole multiples
        # of 256, or the block would be padded where the whole tensor is not. Unflattened, the
        # transform takes one 2-D tensor and stacks no experts.
        return self.flatten_experts and rows_per_expert % _sh.SCALE_ROW_PAD == 0

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        rows, cols = self._rows_cols(shape)
        rp, cp = self.output_shape(shape)
        if (rp, cp) == (rows, cols):
            return 0
        full = _sh.unshuffle_scale(t, rp, cp).view(torch.uint8)  # row-major, pad kept
        return int((full[rows:] != self.pad_value).sum() + (full[:rows, cols:] != self.pad_value).sum())


@dataclasses.dataclass(frozen=True)
class _ScaleShuffleNoPad(ScaleShuffle):
    """An S32x8 variant whose constraints (its ``violations``) leave nothing to pad: its output
    has the scale's own shape, and it has no pad byte to check."""

    def output_shape(self, shape: Shape) -> Shape:
        return tuple(shape)

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class ScaleShuffleStacked(_ScaleShuffleNoPad):
    """:class:`ScaleShuffle` over the flattened ``[E*N, C]`` with the result viewed back as
    ``[E, N, C]``: the same bytes as ``ck``'s scale, held 3-D (SGLang's aiter MoE views aiter's
    ``e8m0_shuffle`` output so). The view exists only where the shuffle pads nothing, so
    ``E*N % 256 == 0`` and ``C % 8 == 0`` are its constraints."""

    name = "s32x8-stacked"
    flatten_experts: bool = True

    def violations(self, shape: Shape) -> list[str]:
        if len(shape) != 3:
            return ["scale is [E, N, K/32]"]
        e, n, c = shape
        found = [] if (e * n) % _sh.SCALE_ROW_PAD == 0 else [f"E*N % {_sh.SCALE_ROW_PAD} == 0 (E*N = {e * n})"]
        return found + ([] if c % _sh.S8_COLS == 0 else [f"K/32 % {_sh.S8_COLS} == 0 (K/32 = {c})"])

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = _sh._s32x8_scale(t.reshape(self._rows_cols(t.shape)), pad_value=self.pad_value)
        return _into(flat.view(t.shape), out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return super().inverse(t.reshape(self._rows_cols(shape)), shape)


@dataclasses.dataclass(frozen=True)
class ScaleShuffleUnpadded(_ScaleShuffleNoPad):
    """:class:`ScaleShuffle` on a ``[R, C]`` scale that needs no pad: ``R % 32 == 0`` and
    ``C % 8 == 0`` (its constraints), the bytes of ``e8m0_shuffle`` cut to the scale's own rows
    (each 32-row band is shuffled on its own, so the cut is exact). vLLM's aiter linear swizzles
    the scale so for aiter's ASM FP4 GEMM, without padding it."""

    name = "s32x8-unpadded"

    def violations(self, shape: Shape) -> list[str]:
        if len(shape) != 2:
            return ["scale is 2-D [N, K/32]"]
        r, c = shape
        return ([] if r % _sh.S32_ROWS == 0 else [f"N % {_sh.S32_ROWS} == 0 (N = {r})"]) + (
            [] if c % _sh.S8_COLS == 0 else [f"K/32 % {_sh.S8_COLS} == 0 (K/32 = {c})"])

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _into(_sh._s32x8_scale(t, pad_value=self.pad_value, pad_rows=False), out)


@dataclasses.dataclass(frozen=True)
class ScaleTranspose(Transform):
    """The scale ``[N, K/32]`` held transposed, ``[K/32, N]`` (vLLM's aiter linear keeps it so for
    the shapes it runs on ``gemm_afp4wfp4``)."""

    name = "transpose"

    def violations(self, shape: Shape) -> list[str]:
        return [] if len(shape) == 2 else ["scale is 2-D"]

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _into(t.t().contiguous(), out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return t.reshape(shape[1], shape[0]).t().contiguous()

    def output_shape(self, shape: Shape) -> Shape:
        return (shape[1], shape[0])


@dataclasses.dataclass(frozen=True)
class ScaleShufflePerExpert(Transform):
    """Per-expert S32x8 without the 256-row pad: ``[E, N, SK] -> [E, N/32, pad8(SK)*32]``
    (triton_kernels ``CDNA4MXScaleLayout``)."""

    name = "s32x8-per-expert"
    pad_value: int = S32X8_PAD

    def violations(self, shape: Shape) -> list[str]:
        return _sh.per_expert_scale_violations(shape)

    def forward(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _into(_sh._s32x8_per_expert(t, pad_value=self.pad_value), out)

    def inverse(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        return _sh.unshuffle_scale_per_expert(t, shape[-1])

    def output_shape(self, shape: Shape) -> Shape:
        e, n, sk = shape
        return (e, n // _sh.S32_ROWS, pad_to(sk, _sh.S8_COLS) * _sh.S32_ROWS)

    def pad_mismatches(self, t: torch.Tensor, shape: Shape) -> int:
        skp = pad_to(shape[-1], _sh.S8_COLS)
        if skp == shape[-1]:
            return 0
        full = _sh.unshuffle_scale_per_expert(t, skp).view(torch.uint8)  # [E, N, skp], pad kept
        return int((full[..., shape[-1]:] != self.pad_value).sum())
