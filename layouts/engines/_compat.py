"""Does a converted checkpoint fit the engine about to load it? The engine's configuration
(:class:`EngineConfig`: which engine, its GEMM path, MoE back end, TP/EP size, rank, GPU arch,
the two DeepSeek quant-fusion switches), read from the engine's environment switches or given, is
checked against the manifest; a mismatch is refused with one line naming it and the fix, never
loaded into silent garbage.

This module is the engine-neutral half: the configuration, the rules every engine shares (TP, rank,
EP, "the dense / MoE layout the engine reads is the checkpoint's"), and :func:`check_compatibility`,
which runs the engine profile's rules in the profile's order. What an engine's switches mean,
which layout each of its paths reads, its own refusals and the fixes they name: its profile in
``layouts/engines/`` (ATOM's switches, with the sources: ``layouts/engines/atom/``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from ..errors import LayoutsError
from ..manifest import Manifest
from ..registry import BF16_MOE, FP8
from . import EngineProfile, get_engine


class CompatibilityError(LayoutsError):
    """The checkpoint and the engine's configuration disagree; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine will run: which kernels read the weights, and where this process sits.

    ``gemm_path``, ``moe_backend`` and ``gpu_arch`` left None are the engine's defaults (its
    profile's first GEMM path and MoE back end, its default arch), filled in on construction.
    ``profile`` is always given: there is no default engine (the engine's door, or prep's CLI,
    chooses it)."""

    gemm_path: str | None = None  # one of the engine profile's gemm_paths
    moe_backend: str | None = None  # one of the engine profile's MoE back ends
    tp_size: int = 1
    rank: int = 0
    ep_size: int = 1  # 1, or tp_size with expert parallel on
    gpu_arch: str | None = None  # e.g. gfx942 (MI300) or gfx950 (MI355): MoE scale layouts differ by arch
    input_norm_quant_fusion: bool = True
    qknorm_quant_fusion: bool = True
    # The engine: its profile (layouts/engines/<engine>) says what the rest means
    profile: EngineProfile = dataclasses.field(kw_only=True)
    # The fp8 layout it reads FP8 block-scaled weights in ("" : its profile's; None: the source's
    # bytes, which it processes at load: ATOM with ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE=0)
    fp8_layout: str | None = ""

    def __post_init__(self) -> None:
        profile = self.profile
        fill = {"gemm_path": profile.default_gemm_path, "moe_backend": profile.default_moe_backend,
                "gpu_arch": profile.default_gpu_arch}
        if self.fp8_layout == "":
            object.__setattr__(self, "fp8_layout", profile.fp8_layout)
        for field, default in fill.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)  # frozen: set once, here
        if self.gemm_path not in profile.gemm_paths:
            raise CompatibilityError(f"unknown GEMM path {self.gemm_path!r}; known: {', '.join(profile.gemm_paths)}")
        if self.moe_backend not in profile.moe_backends:
            raise CompatibilityError(f"unknown MoE backend {self.moe_backend!r}; known: {', '.join(profile.moe_backends)}")
        if profile.arch(self.gpu_arch) is None:
            covered = " and ".join(a.label for a in profile.gpu_archs)
            raise CompatibilityError(f"GPU arch {self.gpu_arch!r}: prep's {profile.display_name} profile covers "
                                     f"{covered} only; on this GPU {profile.display_name} holds the checkpoint in "
                                     f"layouts prep does not write (docs/engines.md, \"{profile.display_name}\")")

    @property
    def engine(self) -> str:
        """The engine's name (what a manifest's ``target.engine`` records)."""
        return self.profile.name

    @classmethod
    def from_env(cls, profile: EngineProfile, tp_size: int = 1, rank: int = 0, ep_size: int = 1,
                 gpu_arch: str | None = None, env: Mapping[str, str] | None = None) -> "EngineConfig":
        """``profile``'s engine's switches as the engine reads them, refusing the combinations it
        gets wrong.

        ``gpu_arch`` defaults to the current device's (``gcnArchName`` on ROCm), else the
        engine's default; ``env`` to ``os.environ``."""
        return profile.config_from_env(os.environ if env is None else env, tp_size=tp_size, rank=rank,
                                       ep_size=ep_size, gpu_arch=gpu_arch)

    @classmethod
    def reading(cls, manifest: Manifest, gemm_path: str | None = None,
                profile: EngineProfile | None = None) -> "EngineConfig":
        """Rank 0's configuration of ``profile``'s engine (None: the one the checkpoint was
        converted for, as its manifest names it) that reads ``manifest``'s checkpoint: the first
        GEMM path that reads its dense layout (or ``gemm_path``), the MoE back end and arch that
        read its MoE layout (the default arch first), its TP and EP sizes."""
        try:
            profile = profile or get_engine(manifest.target.engine)
            path = gemm_path or profile.gemm_path_reading(manifest.layout)
            backend, arch = profile.moe_backend_reading(manifest.moe_layout)
        except KeyError as e:
            raise CompatibilityError(f"{manifest.root}: {e.args[0]}") from None
        return cls(path, backend, manifest.tp, 0, manifest.ep, arch, profile=profile)

    def expected_dense_layout(self) -> str:
        """The dense layout this configuration's GEMM path reads."""
        return self.profile.dense_layout(self.gemm_path)

    def expected_moe_layout(self) -> str:
        """The MoE layout this configuration's MoE back end reads on its GPU."""
        return self.profile.moe_layout(self.moe_backend, self.gpu_arch)

    def expected_fp8_layout(self) -> str | None:
        """The ``fp8`` layout this configuration holds FP8 block-scaled weights in after loading."""
        return self.fp8_layout

    def expected_fp8_layouts(self) -> frozenset[str]:
        """Every ``fp8`` layout this configuration reads: the block-scaled weights' and the
        per-channel linears' (weight and scale)."""
        return frozenset(n for n in (self.fp8_layout, *(self.profile.fp8_channel_layouts or ())) if n)

    def expected_bf16_moe_layout(self) -> str | None:
        """The layout the engine's unquantized MoE holds BF16 experts in (None: none known)."""
        return self.profile.bf16_moe_layout


# ---------------------------------------------------------------------------- shared rules
# Each returns why the engine would misread the checkpoint (one line, naming the fix), or None.
# A profile lists them, with its own, in its ``checks``.
def engine_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    """Each engine holds a rank's modules its own way (merged names, splits, expert map): a
    checkpoint converted for another engine has the wrong tensors in each rank's files."""
    if manifest.target.engine != engine.engine:
        return (f"converted for {manifest.target.engine}, whose ranks hold other modules than {engine.engine}'s; "
                f"convert again with --engine {engine.engine}")
    return None


def tp_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    if manifest.tp != engine.tp_size:
        return (f"converted for tp={manifest.tp} but the engine runs tp={engine.tp_size}; per-rank tensors "
                f"([gate;up], [q_a;kv_a], padded experts) differ between TP sizes: convert again with --tp {engine.tp_size}")
    return None


def rank_in_range(manifest: Manifest, engine: EngineConfig) -> str | None:
    if not 0 <= engine.rank < engine.tp_size:
        return f"rank {engine.rank} is out of range for tp={engine.tp_size}"
    return None


def ep_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    if manifest.ep != engine.ep_size:
        fix = f"convert again with --ep {engine.ep_size}" if engine.ep_size > 1 else "convert again with --ep 1"
        return (f"converted with ep={manifest.ep} but the engine runs ep={engine.ep_size} "
                f"({'expert parallel on' if engine.ep_size > 1 else 'expert parallel off'}); the experts each rank "
                f"holds differ: {fix}, or {'disable' if manifest.ep == 1 else 'enable'} "
                f"{engine.profile.expert_parallel_switch}")
    return None


def _none_of(manifest: Manifest, kind: str) -> bool:
    """Whether the checkpoint's groups hold no group of ``kind`` ("linear": MXFP4 linears, "moe":
    MXFP4 experts), so that nothing is in the layout the target names for them (DeepSeek's FP8
    release has neither, and any GEMM path or MoE back end reads its FP8 bytes)."""
    return bool(manifest.groups) and kind not in manifest.group_kinds


def dense_layout_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    want = engine.expected_dense_layout()
    if manifest.layout != want and not _none_of(manifest, "linear"):
        return engine.profile.dense_fix(manifest.layout, engine.gemm_path) or (
            f"checkpoint layout {manifest.layout!r} but the {engine.gemm_path} GEMM reads {want!r}: "
            f"convert with --layout {want}")
    return None


def moe_layout_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    want = engine.expected_moe_layout()
    if manifest.moe_layout != want and not _none_of(manifest, "moe"):
        fix = engine.profile.moe_fix(manifest.moe_layout, engine)
        return (f"MoE experts are in the {manifest.moe_layout!r} layout but the engine's {engine.moe_backend} MoE "
                f"on {engine.gpu_arch} reads {want!r}; it would compute garbage: "
                f"{f'{fix} or convert' if fix else 'convert'} with --moe-layout {want}")
    return None


def bf16_moe_layout_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    # A BF16 expert group names its layout, and the manifest's ``layouts`` records every layout
    # used; BF16 experts stored without one are unshuffled, which the engine's own load-time
    # processing still handles (so the adapter must let it run), and are not checked here.
    want = engine.expected_bf16_moe_layout()
    for name, record in manifest.layouts.items():
        if record.kind == BF16_MOE and name != want:
            reads = f"reads {want!r}" if want else "has no layout for them"
            return (f"BF16 MoE experts are in the {name!r} layout but the {engine.engine} engine's unquantized MoE "
                    f"{reads}; it would compute garbage: convert for {engine.engine} again")
    return None


def fp8_layout_matches(manifest: Manifest, engine: EngineConfig) -> str | None:
    # Like the BF16 experts': FP8 weights stored in a layout name it (the manifest's ``layouts``); stored
    # as the source holds them they are processed by the engine at load and not checked here.
    want, known = engine.expected_fp8_layout(), engine.expected_fp8_layouts()
    for name, record in manifest.layouts.items():
        if record.kind == FP8 and name not in known:
            block = name == engine.profile.fp8_layout  # the block layout, which a switch turns off
            reads = "reads them as the source holds them (it shuffles them at load)" if block and not want else \
                f"reads {sorted(known)}"
            fix = engine.profile.fp8_layout_fix if block else ""
            return (f"FP8 weights are in the {name!r} layout but the {engine.engine} engine as configured {reads}; "
                    f"it would compute garbage: {fix or f'convert for {engine.engine} again'}")
    return None


SHARED_CHECKS = (engine_matches, tp_matches, rank_in_range, ep_matches, dense_layout_matches, moe_layout_matches,
                 bf16_moe_layout_matches, fp8_layout_matches)
"""The rules every engine has, in the order a profile without rules of its own runs them."""


def check_compatibility(manifest: Manifest, engine: EngineConfig) -> None:
    """Raise :class:`CompatibilityError` naming the first mismatch (in the engine profile's
    order of checks) and its fix; else return."""
    for check in engine.profile.checks:
        why = check(manifest, engine)
        if why:
            raise CompatibilityError(f"{manifest.root}: {why}")
