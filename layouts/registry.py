"""The layout registry: each engine-side layout is a name, its constraints, a forward and an inverse.

A :class:`Layout` pairs one :class:`Transform` for the packed weight with one for its E8M0
scale (a ``bf16-moe`` layout, for stacked BF16 experts, has a weight only: its scale transform
is the identity and takes no tensor), plus the runtime attributes an engine must set on the
loaded tensors so that its kernels read them right (``is_shuffled``, the MoE scale swizzle
label). Transforms are small frozen objects; their ``params`` go into the manifest so a reader
knows exactly what was applied, and :func:`recorded_layout` rebuilds a layout as a manifest
recorded it (an older checkpoint's pad byte included).

A layout's ``version`` goes up when the bytes it writes change. preshuffle, ck and triton are at
version 2: their S32x8 scales pad with 0x00 (:data:`~layouts.shuffle.S32X8_PAD`); version 1
padded with 0x7F (:data:`LEGACY_S32X8_PAD`). The inverse is the same for both.

Registered layouts (``docs/layouts.md`` draws their bytes and says which engine path reads which):

=============== ======== =============================== =============================================
name            kind     weight                          weight_scale
=============== ======== =============================== =============================================
non-shuffle     dense    raw ``[N, K/2]``                raw ``[N, K/32]``
non-shuffle-t   dense    raw ``[N, K/2]``                transposed ``[K/32, N]``
preshuffle      dense    W16                             S32x8 ``[pad256(N), pad8(K/32)]``
ck              moe      W16 per expert ``[E, N, K/2]``  S32x8 of ``[E*N, K/32]``, stored 2-D
ck-3d           moe      W16 per expert ``[E, N, K/2]``  the same bytes held ``[E, N, K/32]`` (no pad)
triton          moe      raw ``[E, N, K/2]``             per-expert S32x8 ``[E, N/32, pad8(K/32)*32]``
triton-gfx942   moe      raw                             raw ``[E, N, K/32]``
bf16-preshuffle bf16-moe W16 of 16-bit values per expert none (BF16 experts ``[E, N, K]``)
fp8-preshuffle  fp8      W16 of FP8 bytes (per expert)   none: its own tensor, as the source holds it
fp8-channel-    fp8      rows padded to 128 with 0, W16  none: its own tensor (fp8-channel-scale)
 preshuffle
fp8-channel-    fp8      a per-channel scale ``[N, 1]``, rows padded to 128 with 1.0
 scale
=============== ======== =============================== =============================================
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from . import shuffle as _sh
from .errors import LayoutsError
from .mxfp4 import E8M0_ONE
from .shuffle import S32X8_PAD, LayoutConstraintError, pad_to

if TYPE_CHECKING:
    from .manifest.records import LayoutRecord  # for its type only: no manifest module is imported here

Shape = tuple[int, ...]

BF16_MOE = "bf16-moe"
"""The kind of a layout of stacked BF16 experts ``[E, N, K]`` (an unquantized MoE): a weight
transform and no scale."""

FP8 = "fp8"
"""The kind of a layout of FP8 (F8_E4M3) weights, a linear's ``[N, K]`` or stacked experts'
``[E, N, K]``: a weight transform and no scale (an FP8 weight's scales are a tensor of their own,
kept as the source holds them)."""

LEGACY_S32X8_PAD = E8M0_ONE
"""The S32x8 pad byte of layout version 1 (0x7F, scale 1.0), and what a recorded S32x8 transform
without a ``pad_value`` means."""


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way an engine's kernels read an MXFP4 linear's weight and scale, or (kind
    :data:`BF16_MOE`) stacked BF16 experts, which have no scale: pass ``None`` for it."""

    name: str
    version: int
    kind: str  # "dense" (2-D linears), "moe" (stacked experts, [E, N, K/2]), BF16_MOE ([E, N, K] BF16) or FP8
    weight: Transform
    scale: Transform
    runtime_attrs: Mapping[str, Any]
    description: str

    @property
    def has_scale(self) -> bool:
        """Whether the weight comes with an E8M0 scale (MXFP4); a BF16 layout's does not."""
        return self.kind not in (BF16_MOE, FP8)

    def violations(self, weight_shape: Shape, scale_shape: Shape | None) -> list[str]:
        """Every constraint the pair of shapes breaks, weight first (``scale_shape`` None: no scale)."""
        dims = {"dense": (2,), FP8: (2, 3)}.get(self.kind, (3,))  # FP8: a linear or stacked experts
        found = [f"weight is {' or '.join(map(str, dims))}-D"] if len(weight_shape) not in dims else []
        found += [f"weight: {v}" for v in self.weight.violations(tuple(weight_shape))]
        if self.has_scale and scale_shape is None:
            found.append("a weight_scale")
        elif not self.has_scale and scale_shape is not None:
            found.append("no scale (its scales are a tensor of their own)" if self.kind == FP8 else "no scale (BF16 weights)")
        elif scale_shape is not None:
            found += [f"scale: {v}" for v in self.scale.violations(tuple(scale_shape))]
        return found

    def check(self, weight_shape: Shape, scale_shape: Shape | None, tensor: str = "<tensor>") -> None:
        """Raise :class:`LayoutConstraintError` naming ``tensor`` and the broken constraints."""
        broken = self.violations(weight_shape, scale_shape)
        if broken:
            scale = "" if scale_shape is None else f" / scale {tuple(scale_shape)}"
            raise LayoutConstraintError(
                f"{tensor}: layout '{self.name}' cannot apply to weight {tuple(weight_shape)}{scale}: "
                f"needs {'; '.join(broken)}"
            )

    def apply(self, weight: torch.Tensor, scale: torch.Tensor | None, tensor: str = "<tensor>",
              weight_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward: source-order ``(weight, scale)`` into this layout's bytes (the weight into
        ``weight_out`` when given; see :meth:`Transform.forward`); the scale is None for a BF16
        layout. Their shapes are checked first (:meth:`check`); :meth:`forward` is this for shapes
        checked already."""
        self.check(weight.shape, None if scale is None else scale.shape, tensor)
        return self.forward(weight, scale, weight_out)

    def forward(self, weight: torch.Tensor, scale: torch.Tensor | None,
                weight_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`apply` without the check, for a caller that checked these shapes once already
        (a converter, when it planned the tensor: ``prep.groups``)."""
        return self.weight.forward(weight, weight_out), None if scale is None else self.scale.forward(scale)

    def invert(
        self, weight: torch.Tensor, scale: torch.Tensor | None, weight_shape: Shape, scale_shape: Shape | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inverse: this layout's bytes back to source order, given the source shapes."""
        back = None if scale is None else self.scale.inverse(scale, tuple(scale_shape))
        return self.weight.inverse(weight, tuple(weight_shape)), back

    def scale_pad_mismatches(self, scale: torch.Tensor, scale_shape: Shape) -> int:
        """How many pad bytes of the stored ``scale`` (source shape ``scale_shape``) are not this
        layout's pad byte (0 for a layout that pads nothing)."""
        return self.scale.pad_mismatches(scale, tuple(scale_shape))

    def output_shapes(self, weight_shape: Shape, scale_shape: Shape | None) -> tuple[Shape, Shape | None]:
        scale = None if scale_shape is None else self.scale.output_shape(tuple(scale_shape))
        return self.weight.output_shape(tuple(weight_shape)), scale

    def experts_transform_independently(self, rows_per_expert: int) -> bool:
        """Whether a block of stacked experts with ``rows_per_expert`` rows each transforms (and
        inverts) as that block of the whole stacked tensor would: what lets a converter build,
        and a reader invert, a MoE layer a block of experts at a time. A dense layout stacks no
        experts."""
        return (self.kind != "dense" and self.weight.splits_over_experts(rows_per_expert)
                and self.scale.splits_over_experts(rows_per_expert))

    def describe(self) -> dict[str, Any]:
        """The manifest's record of this layout."""
        return {
            "name": self.name,
            "version": self.version,
            "kind": self.kind,
            "weight_transform": self.weight.params,
            "scale_transform": self.scale.params,
            "runtime_attrs": dict(self.runtime_attrs),
        }


_REGISTRY: dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    if layout.name in _REGISTRY:
        raise ValueError(f"layout '{layout.name}' is already registered")
    _REGISTRY[layout.name] = layout
    return layout


def get_layout(name: str) -> Layout:
    """The registered layout called ``name``; the error lists the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown layout '{name}'; known: {', '.join(sorted(_REGISTRY))}") from None


def recorded_layout(record: "LayoutRecord") -> Layout:
    """The layout a manifest recorded (its ``layouts`` entry, :class:`~layouts.manifest.LayoutRecord`:
    ``Layout.describe()`` of the prep that wrote it): the registered layout of that name with the
    record's version and transform parameters, so that an older checkpoint is checked against
    the bytes it was written with (version 1's S32x8 pad byte is 0x7F; a recorded S32x8 transform
    without ``pad_value`` is :data:`LEGACY_S32X8_PAD`). The byte order must be the registry's: a record naming other
    transforms, or a version newer than the registry's, is refused."""
    try:
        layout = get_layout(record.name)
    except KeyError as e:
        raise LayoutsError(f"the manifest records {e.args[0]}: upgrade prep/layouts") from None
    version = record.version
    if not isinstance(version, int) or not 1 <= version <= layout.version:
        raise LayoutsError(f"layout '{layout.name}' version {version!r}: this layouts knows versions 1 to "
                           f"{layout.version}; upgrade prep/layouts")
    parts = []
    for key, have in (("weight_transform", layout.weight), ("scale_transform", layout.scale)):
        params = dict(getattr(record, key) or {})
        if params.pop("name", None) != have.name:
            raise LayoutsError(f"layout '{layout.name}': the manifest's {key} is not '{have.name}'; "
                               "the checkpoint was written by another prep: convert again")
        if "pad_value" in {f.name for f in dataclasses.fields(have)}:
            params.setdefault("pad_value", LEGACY_S32X8_PAD)
        fields = {f.name for f in dataclasses.fields(have)}
        if set(params) - fields:
            raise LayoutsError(f"layout '{layout.name}': unknown {key} parameters {sorted(set(params) - fields)}; "
                               "upgrade prep/layouts")
        for k, v in params.items():  # as the registry types them: a manifest is input like any other
            if type(v) is not type(getattr(have, k)) or (k == "pad_value" and not 0 <= v <= 0xFF):
                raise LayoutsError(f"layout '{layout.name}': {key} {k} is {v!r}, not a value prep writes; "
                                   "the manifest is damaged: convert again")
        parts.append(dataclasses.replace(have, **params))
    return dataclasses.replace(layout, version=version, weight=parts[0], scale=parts[1])


def layout_names(kind: str | None = None) -> list[str]:
    """The registered layout names, sorted; only those of ``kind`` ("dense", "moe" or
    :data:`BF16_MOE`) when given."""
    return sorted(n for n, l in _REGISTRY.items() if kind is None or l.kind == kind)


def source_order_layout(kind: str) -> Layout:
    """The registered layout of ``kind`` whose weight and scale transforms are both the identity:
    the byte order of an unconverted (Quark) checkpoint, what an engine path reading a source reads."""
    found = [l for l in _REGISTRY.values()
             if l.kind == kind and l.weight.name == Identity.name and l.scale.name == Identity.name]
    if len(found) != 1:
        raise KeyError(f"{len(found)} {kind} layouts keep the source's byte order ({', '.join(l.name for l in found)}); "
                       "exactly one must")
    return found[0]


NON_SHUFFLE = register_layout(Layout(
    "non-shuffle", 1, "dense", Identity(), Identity(), {"is_shuffled": False},
    "row-major bytes for the non-shuffle Triton GEMM (ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM=1)",
))
NON_SHUFFLE_T = register_layout(Layout(
    "non-shuffle-t", 1, "dense", Identity(), ScaleTranspose(), {"is_shuffled": False},
    "raw weight, scale transposed [K/32, N]: vLLM's aiter linear on gemm_afp4wfp4 (shapes aiter has no tuned "
    "preshuffle GEMM for)",
))
PRESHUFFLE = register_layout(Layout(
    "preshuffle", 2, "dense", WeightPreshuffle(), ScaleShuffle(), {"is_shuffled": True},
    "W16 weight + padded S32x8 scale for aiter gemm_a4w4 (ASM/CK) and the Triton preshuffle GEMM",
))
PRESHUFFLE_UNPADDED = register_layout(Layout(
    "preshuffle-unpadded", 1, "dense", WeightPreshuffle(), ScaleShuffleUnpadded(), {},
    "W16 weight + S32x8 scale without pad (N % 32, K/32 % 8): vLLM's aiter linear on the ASM FP4 GEMM (the "
    "shapes aiter has tuned it for)",
))
MOE_CK = register_layout(Layout(
    "ck", 2, "moe", WeightPreshuffle(), ScaleShuffle(flatten_experts=True), {"is_shuffled": True},
    "CK fused_moe: W16 per expert, S32x8 over the flattened [E*N, K/32] scale, stored 2-D",
))
MOE_CK_3D = register_layout(Layout(
    "ck-3d", 1, "moe", WeightPreshuffle(), ScaleShuffleStacked(), {"is_shuffled": True},
    "CK fused_moe bytes with the scale held 3-D [E, N, K/32] (SGLang's aiter MoE on gfx950)",
))
MOE_TRITON = register_layout(Layout(
    "triton", 2, "moe", Identity(), ScaleShufflePerExpert(), {"is_shuffled": False, "scale_swizzle": "CDNA4_SCALE"},
    "triton_kernels MoE on gfx950 (ATOM_USE_TRITON_MOE=1): raw weight, CDNA4_SCALE scale",
))
MOE_TRITON_GFX942 = register_layout(Layout(
    "triton-gfx942", 1, "moe", Identity(), Identity(), {"is_shuffled": False, "scale_swizzle": None},
    "triton_kernels MoE on gfx942: raw weight and scale",
))
MOE_BF16 = register_layout(Layout(
    "bf16-preshuffle", 1, BF16_MOE, WeightPreshuffle16Bit(), Identity(), {"is_shuffled": True},
    "aiter shuffle_weight (16, 16) per expert on BF16 w13/w2, as ATOM's unquantized FusedMoE holds them",
))
FP8_PRESHUFFLE = register_layout(Layout(
    "fp8-preshuffle", 1, FP8, WeightPreshuffle8Bit(), Identity(), {"is_shuffled": True},
    "aiter shuffle_weight (16, 16) of FP8 weights, a linear's or each expert's, as ATOM's block-scale FP8 linears "
    "and MoE hold them after loading; their scales as the source holds them",
))
FP8_CHANNEL_PRESHUFFLE = register_layout(Layout(
    "fp8-channel-preshuffle", 1, FP8, PadRowsPreshuffle8Bit(), Identity(), {"is_shuffled": True},
    "FP8 per-channel weights with zero rows to a multiple of 128, then aiter's shuffle_weight (16, 16): ATOM's "
    "per-token FP8 linears once loaded (their scales in fp8-channel-scale)",
))
FP8_CHANNEL_SCALE = register_layout(Layout(
    "fp8-channel-scale", 1, FP8, PadRowsOnes(), Identity(), {},
    "the per-channel scale [N, 1] of an fp8-channel-preshuffle weight, its pad rows 1.0, as ATOM holds it",
))
