"""The layout registry: each engine-side layout is a name, its constraints, a forward and an inverse.

A :class:`Layout` pairs one :class:`~layouts.transforms.Transform` for the packed weight with
one for its E8M0 scale (a ``bf16-moe`` layout, for stacked BF16 experts, has a weight only: its
scale transform is the identity and takes no tensor), plus the runtime attributes an engine must
set on the loaded tensors so that its kernels read them right (``is_shuffled``, the MoE scale
swizzle label). The transforms are in ``layouts/transforms.py``; this module says which pairs
exist, under which names. Transforms are small frozen objects; their ``params`` go into the
manifest so a reader knows exactly what was applied, and :func:`recorded_layout` rebuilds a
layout as a manifest recorded it (an older checkpoint's pad byte included).

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
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .errors import LayoutsError
from .mxfp4 import E8M0_ONE
from .shuffle import LayoutConstraintError
from .transforms import (
    Identity,
    PadRowsOnes,
    PadRowsPreshuffle8Bit,
    ScaleShuffle,
    ScaleShufflePerExpert,
    ScaleShuffleStacked,
    ScaleShuffleUnpadded,
    ScaleTranspose,
    Shape,
    Transform,
    WeightPreshuffle,
    WeightPreshuffle8Bit,
    WeightPreshuffle16Bit,
)

__all__ = [
    "BF16_MOE", "FP8", "LEGACY_S32X8_PAD", "Layout", "register_layout", "get_layout",
    "recorded_layout", "layout_names", "source_order_layout", "NON_SHUFFLE", "NON_SHUFFLE_T",
    "PRESHUFFLE", "PRESHUFFLE_UNPADDED", "MOE_CK", "MOE_CK_3D", "MOE_TRITON", "MOE_TRITON_GFX942",
    "MOE_BF16", "FP8_PRESHUFFLE", "FP8_CHANNEL_PRESHUFFLE", "FP8_CHANNEL_SCALE",
]

if TYPE_CHECKING:
    from .manifest.records import LayoutRecord  # for its type only: no manifest module is imported here

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
    ``LayoutRecord.of`` the layout of the prep that wrote it): the registered layout of that name with the
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
