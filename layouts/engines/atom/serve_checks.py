"""What ``prep-atom-serve`` (:mod:`layouts.engines.atom.serve`) checks before ATOM starts, and
each worker again before it allocates anything: the converted folder as a complete ``--model``,
the ATOM options and environment the door was not checked with, and the manifest against each
rank's configuration. Each refusal is one line (:class:`ServeError`)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

from .._compat import EngineConfig, check_compatibility
from ...errors import LayoutsError
from ...manifest import MANIFEST_NAME, Manifest, load_manifest
from . import PROFILE
from ...loader import side_file_problem

PROG = "prep-atom-serve"


class ServeError(LayoutsError):
    """A refusal of the door: one line, naming what to do."""


# ---------------------------------------------------------------------------- the folder
def converted_root(model: str | os.PathLike | None) -> pathlib.Path | None:
    """``model`` as a folder prep converted (it holds a manifest), or None."""
    if not model:
        return None
    root = pathlib.Path(model)
    return root if (root / MANIFEST_NAME).is_file() else None


# What ATOM's server reads from --model besides weights: AutoConfig (config.json and its
# quantization_config), GenerationConfig, AutoTokenizer (tokenizer files, the chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def check_folder(root: pathlib.Path) -> Manifest:
    """The converted folder as a complete ``--model``: a sealed rank-exact conversion, and every
    side file the source had, here as the source had it (:func:`layouts.loader.side_file_problem`)."""
    manifest = load_manifest(root)  # format, completion marker, every file named
    if not manifest.target.rank_exact:
        raise ServeError(f"{root}: converted with --common-bf16 (manifest format 1: BF16 tensors whole, for an "
                         f"engine that slices them itself); {PROG} serves rank-exact conversions: convert again "
                         "without --common-bf16")
    problem = side_file_problem(manifest, "ATOM's server", "--model")
    if problem:
        raise ServeError(problem)
    if not (root / "config.json").is_file():
        raise ServeError(f"{root}: no config.json; ATOM builds its models from it: copy the source's there")
    if not any((root / t).is_file() for t in TOKENIZER_FILES):
        raise ServeError(f"{root}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); ATOM's server loads it from --model: "
                         "copy the source's tokenizer files there")
    return manifest


# ---------------------------------------------------------------------------- ATOM's options
# EngineArgs fields that change which weights a rank holds, or how they are processed, in ways the
# door has not been checked against: (field, the value that is checked, why).
UNCHECKED_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("pipeline_parallel_size", 1, "pipeline parallel (each stage holds some layers)"),
    ("data_parallel_size", 1, "data parallel"),
    ("enable_dp_attention", False, "DP attention (ATOM then runs TP 1 per DP rank)"),
    ("prefill_context_parallel_size", 1, "prefill context parallel (more workers than TP ranks)"),
    ("decode_context_parallel_size", 1, "decode context parallel"),
    ("enable_rapidserve", False, "RapidServe (its own model runners)"),
    ("load_dummy", None, "dummy weights (nothing is loaded: use ATOM's own server)"),
    ("online_quant_config", None, "online quantization (ATOM quantizes BF16 weights at load)"),
    ("eplb_enable", False, "expert load balancing (moves experts between ranks)"),
    ("fake_eplb", False, "fake EPLB"),
    ("moe_backend", "standard", "a MoE back end other than ATOM's standard one"),
    ("all2all_backend", None, "an all-to-all MoE dispatch back end"),
    ("moe_all2all_backend", None, "an all-to-all MoE dispatch back end"),  # later ATOM's name for it
    ("hf_overrides", None, "config overrides (ATOM would build other models than the folder's config.json says)"),
)


def check_options(args: Any) -> None:
    """Refuse ATOM options the door was not checked with (``args``: ATOM's ``EngineArgs``)."""
    for field, checked, what in UNCHECKED_OPTIONS:
        value = getattr(args, field, checked)
        if field == "moe_backend" and isinstance(value, str):
            value = value.strip().lower()  # as ATOM's Config reads it
        if value != checked:
            raise ServeError(f"{field} = {getattr(args, field)!r}: {what} is not checked with converted checkpoints; "
                             f"serve with --{field.replace('_', '-')} left at its default ({checked!r})")
    method = getattr(args, "method", None)
    if method not in (None, "mtp") and not getattr(args, "draft_model", None):
        raise ServeError(f"--method {method} without --draft-model: its draft model would be read from the converted "
                         "folder, which holds the MTP layer only for ATOM's MTP draft model; serve with --method mtp, "
                         "or give the draft its own checkpoint with --draft-model")


ENV_REPLICATE_VOCAB_EMBED = "ATOM_REPLICATE_VOCAB_EMBED"


def check_vocab_embed(manifest: Manifest, env: Mapping[str, str]) -> None:
    """GLM-5's embedding is whole on every rank of an ATOM conversion (ATOM's default,
    use_replicated_vocab_embed); with ``ATOM_REPLICATE_VOCAB_EMBED=0`` ATOM splits it by vocabulary."""
    if manifest.arch == "glm_moe_dsa" and env.get(ENV_REPLICATE_VOCAB_EMBED, "1") != "1":
        raise ServeError(f"{ENV_REPLICATE_VOCAB_EMBED}={env[ENV_REPLICATE_VOCAB_EMBED]}: ATOM then splits GLM-5's "
                         "embedding by vocabulary over the ranks, but this folder holds it whole on every rank, as "
                         f"ATOM's default does; unset {ENV_REPLICATE_VOCAB_EMBED}")


def check_draft(args: Any, manifest: Manifest) -> None:
    """``--method mtp`` needs the MTP layer in the folder (ATOM's draft model loads it from there)."""
    if getattr(args, "method", None) != "mtp":
        return
    from .adapter import layer_index, mtp_layers

    layers = mtp_layers(manifest.root)
    if not any(layer_index(t.name) in layers for t in manifest.tensors):
        raise ServeError(f"--method mtp: {manifest.root} holds no MTP layer (config.json: num_nextn_predict_layers "
                         f"{len(layers)}); serve it without --method mtp")


def engine_config(manifest: Manifest, env: Mapping[str, str], *, tp: int, rank: int, expert_parallel: bool,
                  gpu_arch: str | None) -> EngineConfig:
    """The configuration one worker runs (ATOM: ``--enable-expert-parallel`` sets ep_size =
    tp_size), checked against the manifest; a mismatch raises the profile's one-line fix."""
    engine = PROFILE.config_from_env(env, tp_size=tp, rank=rank, ep_size=tp if expert_parallel else 1,
                                     gpu_arch=gpu_arch)
    check_compatibility(manifest, engine)
    return engine


def atom_gpu_arch() -> str | None:
    """The GPU arch as ATOM asks it (aiter's ``get_gfx``), or None where aiter cannot say."""
    try:
        from aiter.jit.utils.chip_info import get_gfx

        arch = get_gfx()
        return arch if isinstance(arch, str) else None
    except Exception:  # noqa: BLE001 - no aiter, no GPU: the profile's default arch stands
        return None
