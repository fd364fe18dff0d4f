"""Engine profiles: what each inference engine's switches mean for a converted checkpoint.

One module per engine (``atom.py``: ROCm ATOM) holds what this repository knows of that engine:
its switches and how it reads them, which registered layout each of its dense GEMM paths and MoE
back ends reads, the activation-quant flags each GEMM path needs, the configurations it would
misread (refused with the fix), and its adapter. The rest of ``layouts`` and all of ``prep`` ask
the profile and the layout registry (:mod:`layouts.registry`) instead of naming layouts or
switches, so:

* a new layout is one registration in the registry (+ its shuffle math), plus a line in the
  profile of each engine that has a path reading it;
* a new engine is one module in this package that defines ``PROFILE``, an instance of an
  :class:`EngineProfile` subclass. It is found by its module name (``get_engine("sglang")``
  imports ``layouts.engines.sglang``); a profile defined elsewhere joins with
  :func:`register_engine`.

A profile is data (class attributes) plus one required method, :meth:`EngineProfile.config_from_env`,
and optional fix hints; ``docs/engines.md`` lists them and sketches SGLang's.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from ._sharding import (COLS, QKV, ROWS, WHOLE, Constant, Merge, OutsideRow, ShardingRules, deepseek_merges,
                        layer_index)

if TYPE_CHECKING:  # imported at the end of this file (_compat needs EngineProfile first)
    from ._compat import EngineConfig
    from ..manifest import Manifest

NEVER = None


@dataclasses.dataclass(frozen=True)
class GemmPathRule:
    """One dense MXFP4 GEMM path: the layout it reads its weights in, and from how many tokens
    the fused RMSNorm + MXFP4 quant feeding it must shuffle / pad the activation scale.

    ``min_tokens_*``: smallest token count that turns the flag on (0 = always, None = never).
    ``fuses_fp8_group_input_quant``: with FP8-block attention (1x128 activation groups), whether
    the engine fuses the input RMSNorm with the FP8 quant on this path (ATOM: only with its Triton
    GEMM, its HIP per-group FP8 quant being unimplemented); per-token FP8 is fused on every path."""

    weight_layout: str
    min_tokens_shuffle: int | None
    min_tokens_padding: int | None
    fuses_fp8_group_input_quant: bool = False


@dataclasses.dataclass(frozen=True)
class GpuArch:
    """A GPU family an engine runs on, by ``gcnArchName`` prefix."""

    prefix: str  # "gfx95": every arch name starting with it belongs to the family
    example: str  # a full arch of the family, for configurations made without a device ("gfx950")
    label: str  # how messages name the family ("gfx95x (MI355)")


Check = Callable[["Manifest", "EngineConfig"], Optional[str]]
"""One compatibility rule: why ``engine`` would misread ``manifest``'s checkpoint (one line that
names the fix, without the checkpoint's path, which the caller puts in front), or None."""


class EngineProfile:
    """What one engine reads and refuses. A subclass sets the class attributes below and
    implements :meth:`config_from_env`; the fix hints have neutral defaults. Everything else
    (defaults, the layout each configuration reads, the configuration that reads a checkpoint)
    is derived from the data, so the data is the only place the engine's rules are written."""

    name: str
    """The engine's name: :attr:`EngineConfig.engine <layouts.EngineConfig>`, this module's name."""
    label: str = ""
    """How messages name the engine ("ATOM"); the name when empty."""
    gemm_paths: Mapping[str, GemmPathRule]
    """Dense GEMM paths by name, the engine's default first. A path name means one GEMM in every
    engine: two engines may both name a path only with the same rule. For a checkpoint, the first
    path that reads its dense layout is the one assumed (``prep run``)."""
    moe_layouts: Mapping[tuple[str, str], str]
    """``(MoE back end, GpuArch.prefix) -> MoE layout`` that back end reads on that GPU family;
    the default back end first."""
    mtp_draft_flags: str | None = None
    """What the serve command takes to run speculative decoding with the checkpoint's MTP layer as
    the draft model, from the same folder (ATOM: ``--method mtp``); None: the door does not serve
    it. Shown, not added: whether to speculate is the user's choice."""
    bf16_moe_layout: str | None = None
    """The ``bf16-moe`` layout the engine's unquantized MoE holds stacked BF16 experts in once
    loaded (R1-0528's MTP layer), in every configuration: a checkpoint whose BF16 experts are in
    it installs them with no processing. None: no such layout is known for the engine, and a
    checkpoint that stores BF16 experts in a layout is refused."""
    gpu_archs: tuple[GpuArch, ...]
    """The GPU families the engine's layouts cover; any other arch is refused."""
    default_gpu_arch: str
    """The arch assumed when neither the caller nor the device says (one of ``gpu_archs``)."""
    expert_parallel_backends: tuple[str, ...]
    """MoE back ends that honour the expert map, so run expert parallel correctly."""
    expert_parallel_switch: str
    """What turns expert parallel on in this engine (named in fixes)."""
    checks: tuple[Check, ...]
    """:func:`check_compatibility <layouts.check_compatibility>`'s rules for this engine, in
    order; the first refusal is raised. ``layouts.engines`` exports the rules every engine shares (``SHARED_CHECKS``)."""
    families: tuple[str, ...] = ("deepseek-v3",)
    """The model families (:mod:`layouts.families`) whose checkpoints the engine's door is checked
    with, on the engine's real code; ``prep convert`` refuses another family's for this engine,
    naming the engines that serve it."""
    fp8_channel_linears: bool = False
    """Whether the engine's door is checked to serve FP8 per-channel linears (Quark's FP8
    ``per_channel`` override of attention) stored as split source bytes, the engine processing
    them at load as it does its source's; False: ``prep convert`` refuses a checkpoint holding
    them, naming the engines that are."""
    fp8_channel_refusal: str = ""
    """Why the engine's door cannot serve FP8 per-channel linears, where it is known (said when
    ``prep convert`` refuses them for this engine); empty: not checked against its load yet."""
    fp8_layout: str | None = None
    """The ``fp8`` layout the engine holds FP8 block-scaled weights in once loaded (linears and
    experts), which prep writes so that the engine need not shuffle them at load; None: the
    source's bytes, the engine processing them as it loads them."""
    fp8_channel_layouts: tuple[str, str] | None = None
    """The ``fp8`` layouts (weight, scale) the engine holds FP8 per-channel linears in once
    loaded (Quark's per-channel attention), which prep writes so that the engine need not pad and
    shuffle them at load; None: the source's bytes, the engine processing them as it loads them."""
    fp8_layout_fix: str = ""
    """What makes the engine read its ``fp8_layout`` again where its configuration reads FP8
    weights otherwise (a switch to unset), named when it refuses a checkpoint."""
    fp8_block_linears: bool = False
    """The same for FP8 linears and experts with 128x128 block scales (DeepSeek's own FP8
    release), their scales split and merged by whole blocks."""
    sharding: ShardingRules | None = None
    """How the engine holds a DeepSeek checkpoint's linears per rank (merged modules, TP splits,
    the expert map): what ``prep convert --engine NAME`` writes each rank's files by. None: prep
    cannot convert for this engine (its checkpoints may still be checked against it)."""

    # ------------------------------------------------------------------ derived from the data
    @property
    def display_name(self) -> str:
        return self.label or self.name

    @property
    def default_gemm_path(self) -> str:
        return next(iter(self.gemm_paths))

    @property
    def moe_backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(backend for backend, _ in self.moe_layouts))

    @property
    def default_moe_backend(self) -> str:
        return self.moe_backends[0]

    def arch(self, gpu_arch: str) -> GpuArch | None:
        """The family ``gpu_arch`` belongs to, or None when the engine's layouts do not cover it."""
        return next((a for a in self.gpu_archs if gpu_arch.startswith(a.prefix)), None)

    def dense_layout(self, gemm_path: str) -> str:
        """The dense layout ``gemm_path`` reads."""
        return self.gemm_paths[gemm_path].weight_layout

    def moe_layout(self, moe_backend: str, gpu_arch: str) -> str:
        """The MoE layout ``moe_backend`` reads on ``gpu_arch``."""
        family = self.arch(gpu_arch)
        return self.moe_layouts[(moe_backend, family.prefix if family else gpu_arch)]

    def gemm_path_reading(self, layout: str) -> str:
        """The engine's first GEMM path that reads dense ``layout`` (:class:`KeyError` if none)."""
        path = next((p for p, rule in self.gemm_paths.items() if rule.weight_layout == layout), None)
        if path is None:
            raise KeyError(f"no {self.name} GEMM path reads the {layout!r} layout; "
                           f"its paths read {', '.join(sorted({r.weight_layout for r in self.gemm_paths.values()}))}")
        return path

    def moe_backend_reading(self, moe_layout: str) -> tuple[str, str]:
        """``(MoE back end, full GPU arch)`` that reads ``moe_layout``, preferring the default arch
        and then the default back end (:class:`KeyError` if none)."""
        default = self.arch(self.default_gpu_arch)
        for family in sorted(self.gpu_archs, key=lambda a: a != default):
            for backend in self.moe_backends:
                if self.moe_layouts.get((backend, family.prefix)) == moe_layout:
                    return backend, self.default_gpu_arch if family == default else family.example
        raise KeyError(f"no {self.name} MoE back end reads the {moe_layout!r} layout; "
                       f"its back ends read {', '.join(sorted(set(self.moe_layouts.values())))}")

    def expert_parallel_moe_layouts(self) -> list[str]:
        """The MoE layouts the engine can run with expert parallel, on any of its GPUs."""
        return list(dict.fromkeys(layout for (backend, _), layout in self.moe_layouts.items()
                                  if backend in self.expert_parallel_backends))

    def inspect_targets(self) -> list[tuple[str, str]]:
        """Every ``(dense layout, MoE layout)`` pair some configuration of the engine reads (each
        GEMM path with each MoE back end on each GPU family), once each, the default first:
        what ``prep inspect`` checks a source against, so that no pair the engine runs is left
        out (``non-shuffle`` + ``ck`` is ATOM's non-shuffle Triton GEMM with its CK MoE)."""
        families = sorted(self.gpu_archs, key=lambda a: a != self.arch(self.default_gpu_arch))
        moe = [self.moe_layouts[(backend, family.prefix)] for family in families for backend in self.moe_backends
               if (backend, family.prefix) in self.moe_layouts]
        return list(dict.fromkeys((rule.weight_layout, m) for rule in self.gemm_paths.values() for m in moe))

    # ------------------------------------------------------------------ the engine's own code
    def config_from_env(self, env: Mapping[str, str], *, tp_size: int, rank: int, ep_size: int,
                        gpu_arch: str | None) -> "EngineConfig":
        """The configuration the engine runs with these environment switches, as the engine reads
        them; raises :class:`~layouts.CompatibilityError` for combinations the engine gets wrong."""
        raise NotImplementedError(f"engine {self.name!r} does not read its configuration from the environment")

    def dense_fix(self, layout: str, gemm_path: str) -> str | None:
        """The whole refusal for a ``layout`` checkpoint on ``gemm_path``, naming the switch that
        fixes it; None: the shared message (convert with the layout the path reads)."""
        return None

    def moe_fix(self, moe_layout: str, engine: "EngineConfig") -> str | None:
        """What to change in the engine so that it reads ``moe_layout`` (put before "or convert
        with --moe-layout ..."); None: only converting again fixes it."""
        return None

    def layout_refusal(self, layout: str, moe_layout: str) -> str | None:
        """Why no GEMM path or MoE back end of this engine reads a conversion with these layouts
        (``prep convert`` refuses it before writing: nothing could serve it), or None."""
        for flag, name, what, read in (
                ("--layout", layout, "GEMM paths", [r.weight_layout for r in self.gemm_paths.values()]),
                ("--moe-layout", moe_layout, "MoE back ends", list(self.moe_layouts.values()))):
            if name not in read:
                return (f"{flag} {name}: {self.display_name}'s {what} read {' or '.join(dict.fromkeys(read))}, not "
                        f"{name}; convert with one of them, or for another --engine")
        return None

    def target_refusal(self, tp: int, ep: int, moe_layout: str, fuse_shared_expert: bool = False) -> str | None:
        """Why no configuration of this engine could run a conversion with these TP/EP sizes, MoE
        layout and shared-expert fusion (``prep convert`` refuses it before writing), or None."""
        return None

    def source_notes(self, config: Mapping) -> list[str]:
        """What in a source's ``config.json`` this engine would read otherwise than the checkpoint
        means (one line each, naming the fix); ``prep convert --engine`` prints them."""
        return []

    def mtp_draft(self, manifest: "Manifest", config: Mapping) -> bool | None:
        """Whether the door serves the conversion's MTP layer as the engine's draft model (True:
        its ranks' files hold it and ``mtp_draft_flags`` ask for it), False where the conversion
        has one the door does not serve (kept whole in the common file), None where it has none:
        no tensor of a layer from ``config``'s ``num_hidden_layers`` on (an amd-quark export made
        with transformers 5 says ``num_nextn_predict_layers: 1`` and has no MTP tensor)."""
        layers = config.get("num_hidden_layers")
        if not isinstance(layers, int) or self.sharding is None:
            return None
        served = bool(self.mtp_draft_flags and self.sharding.holds_mtp) and not self.mtp_draft_refusal(manifest, config)
        for t in manifest.tensors:
            layer = layer_index(t.name)
            if layer is not None and layer >= layers and (t.role != "unread" or not served):
                return served
        return None

    def mtp_draft_refusal(self, manifest: "Manifest", config: Mapping) -> str | None:
        """Why the engine's own draft model cannot hold this conversion's MTP layer (its own load of
        the source fails too), or None."""
        return None

    def mtp_draft_hint(self, manifest: "Manifest", config: Mapping) -> str | None:
        """The line after the serve command on the MTP layer as a draft model (:meth:`mtp_draft`):
        what to add to serve it, or, where the door does not, to serve without speculative
        decoding (an engine that would read the draft's tensors from the same files fails deep
        inside); None where the conversion has no MTP layer."""
        served = self.mtp_draft(manifest, config)
        if served is None:
            return None
        if served:
            return f"with its MTP layer as the draft model (speculative decoding), add: {self.mtp_draft_flags}"
        why = self.mtp_draft_refusal(manifest, config)
        if why:
            return f"its MTP layer is not served as {self.display_name}'s draft model: {why}; serve it without " \
                   "speculative decoding"
        return (f"its MTP layer is not served as {self.display_name}'s draft model from this folder yet "
                "(docs/engines.md): serve it without speculative decoding")

    def serve_command(self, folder: str, tp: int, ep: int, layout: str, moe_layout: str,
                      fuse_shared_expert: bool = True, config: Mapping | None = None) -> str | None:
        """The shell command that serves a conversion (switches included) with this engine, or
        None where the engine has no door for converted folders."""
        return None

    def has_door(self) -> bool:
        """Whether prep serves conversions for this engine at all (a serve command for one of the
        layout pairs it reads), so that a missing command can say why."""
        return any(self.serve_command("x", 1, 1, d, m) for d, m in self.inspect_targets())

    def __reduce__(self):
        # A profile travels to another process (a pickled EngineConfig) by its name: there it is
        # that process's registered profile, so configurations still compare equal.
        return get_engine, (self.name,)

    def __repr__(self) -> str:
        return f"<engine profile {self.name}: GEMM paths {', '.join(self.gemm_paths)}; MoE {', '.join(self.moe_backends)}>"


# ---------------------------------------------------------------------------- the profiles
_PROFILES: dict[str, EngineProfile] = {}
_SCANNED = {"all": False}


def _builtin_modules() -> list[str]:
    """The engine modules of this package (not the private ones)."""
    return [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]


def _load(module: str) -> None:
    mod = importlib.import_module(f"{__name__}.{module}")
    profile = getattr(mod, "PROFILE", None)
    if not isinstance(profile, EngineProfile):
        raise TypeError(f"{mod.__name__} defines no PROFILE (an EngineProfile); every engine module must")
    if profile.name not in _PROFILES:
        register_engine(profile)


def _load_all() -> None:
    if not _SCANNED["all"]:
        for module in _builtin_modules():
            _load(module)
        _SCANNED["all"] = True


def register_engine(profile: EngineProfile) -> EngineProfile:
    """Add ``profile`` to the engines :func:`get_engine` knows, after checking that it reads only
    registered layouts and that its GEMM path names mean what other engines' mean."""
    from ..registry import BF16_MOE, layout_names

    if profile.name in _PROFILES:
        raise ValueError(f"engine {profile.name!r} is already registered")
    dense, moe = layout_names("dense"), layout_names("moe")
    for path, rule in profile.gemm_paths.items():
        if rule.weight_layout not in dense:
            raise ValueError(f"engine {profile.name!r}: GEMM path {path!r} reads {rule.weight_layout!r}, which is not "
                             f"a registered dense layout ({', '.join(dense)}); register the layout first")
        for other in _PROFILES.values():
            if other.gemm_paths.get(path, rule) != rule:
                raise ValueError(f"engine {profile.name!r}: GEMM path {path!r} is {other.name}'s with another rule; "
                                 "name the path differently (a path name means one GEMM in every engine)")
    for (backend, prefix), layout in profile.moe_layouts.items():
        if layout not in moe:
            raise ValueError(f"engine {profile.name!r}: MoE back end {backend!r} on {prefix} reads {layout!r}, which is "
                             f"not a registered MoE layout ({', '.join(moe)}); register the layout first")
    bf16 = layout_names(BF16_MOE)
    if profile.bf16_moe_layout is not None and profile.bf16_moe_layout not in bf16:
        raise ValueError(f"engine {profile.name!r}: its BF16 MoE reads {profile.bf16_moe_layout!r}, which is not a "
                         f"registered {BF16_MOE} layout ({', '.join(bf16)}); register the layout first")
    if profile.arch(profile.default_gpu_arch) is None:
        raise ValueError(f"engine {profile.name!r}: default GPU arch {profile.default_gpu_arch!r} is not in its gpu_archs")
    _PROFILES[profile.name] = profile
    return profile


def get_engine(name: str) -> EngineProfile:
    """The profile of engine ``name`` (its module here is imported on first use); the error
    lists the engines known."""
    if name not in _PROFILES and name in _builtin_modules():
        _load(name)
    try:
        return _PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(engine_names())}") from None


def engine_names() -> list[str]:
    """Every engine with a profile: this package's modules (in name order, however they were
    imported) and then those registered from outside, in registration order."""
    _load_all()
    builtin = _builtin_modules()
    return [n for n in builtin if n in _PROFILES] + [n for n in _PROFILES if n not in builtin]


def current_gpu_arch() -> str | None:
    """The first GPU's arch (``gcnArchName`` without its feature suffix) on ROCm, else None."""
    try:
        import torch

        if torch.cuda.is_available() and getattr(torch.version, "hip", None):
            return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    except Exception:  # noqa: BLE001 - no device, no arch: the caller falls back
        return None
    return None


__all__ = [
    "COLS", "NEVER", "QKV", "ROWS", "WHOLE", "Check", "Constant", "EngineProfile",
    "GemmPathRule", "GpuArch", "Merge", "OutsideRow", "ShardingRules", "deepseek_merges",
    "current_gpu_arch", "engine_names", "get_engine", "register_engine",
    "SHARED_CHECKS", "CompatibilityError", "EngineConfig", "check_compatibility", "bf16_moe_layout_matches",
    "dense_layout_matches", "engine_matches", "ep_matches", "fp8_layout_matches", "moe_layout_matches",
    "rank_in_range", "tp_matches",
]


# What every engine shares (the configuration, the shared checks a profile lists, the check that
# runs them), for profiles written outside this package. Imported last: ``_compat`` imports
# ``EngineProfile`` and ``get_engine`` from here, which exist by now.
from ._compat import (SHARED_CHECKS, CompatibilityError, EngineConfig, bf16_moe_layout_matches,  # noqa: E402
                      check_compatibility, dense_layout_matches, engine_matches, ep_matches, fp8_layout_matches,
                      moe_layout_matches, rank_in_range, tp_matches)
