"""config.json values the reference forward computes with, checked by range before it runs: a NaN
or negative ``rms_norm_eps``, ``rope_theta`` 0, more experts per token than experts and the like
made ``prep run`` exit 0 with an argmax of non-finite logits (issue 25, item 5). Each refusal is
one line naming the key; the integer counts are bounded by the tensors the checkpoint holds, as
``prep convert`` bounds them (``prep.config_check.check_config_ints``)."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from ..config_check import check_config_ints, source_family
from ..errors import PrepError


def _positive_float(cfg: dict[str, Any], key: str, where: pathlib.Path, default: float | None,
                    at_least: float = 0.0, strictly: bool = True, within: str = "") -> float | None:
    v = cfg.get(key, default)
    key = within + key
    if v is None:
        return None
    ok = type(v) in (int, float) and math.isfinite(v) and (v > at_least if strictly else v >= at_least)
    if not ok:
        bound = f"> {at_least:g}" if strictly else f">= {at_least:g}"
        raise PrepError(f"{where}: {key} is {v!r}, not a finite number {bound}; config.json is damaged or not this "
                        "checkpoint's")
    return float(v)


def rope_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """Where config.json keeps its RoPE: (the object holding ``rope_theta``, the scaling object or
    None, its name). DeepSeek's transformers-4 configs have ``rope_theta`` and ``rope_scaling`` at
    the top; transformers 5 (GLM-5's config) writes one ``rope_parameters`` object with both, whose
    ``rope_type`` "default" means no scaling."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" not in cfg:
        return rp, (rp if rp.get("type", rp.get("rope_type")) not in (None, "default") else None), "rope_parameters"
    return cfg, cfg.get("rope_scaling"), "rope_scaling"


def check_model_config(cfg: dict[str, Any], root: pathlib.Path, tensors: int, positions: int = 0) -> None:
    """Refuse (one line, naming the key) a config.json the DeepSeek forward cannot compute with,
    or ``positions`` (the prompt and what is generated) it cannot compute exactly for this family."""
    where = root / "config.json"
    family = source_family(cfg)
    if family.dense_up_to:
        keep = cfg.get(family.dense_up_to)
        if type(keep) is not int or keep < 1:
            raise PrepError(f"{where}: {family.dense_up_to} is {keep!r}, not a positive integer; {family.label} "
                            "needs it (re-download config.json)")
        if positions > keep:  # past it the indexer chooses, which the reference engine does not compute
            raise PrepError(f"{where}: {family.label}'s indexer keeps {keep} cached tokens per query "
                            f"({family.dense_up_to}); up to that many positions attention is dense and prep's reference "
                            f"engine computes it, but this prompt and generation take {positions}: give at most {keep}")
    ints = check_config_ints(cfg, root, tensors)
    for key in ("hidden_size", "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "kv_lora_rank", "vocab_size"):
        if ints[key] is None:
            raise PrepError(f"{where}: no {key}; the DeepSeek forward needs it (re-download config.json)")
    if ints["qk_rope_head_dim"] % 2:
        raise PrepError(f"{where}: qk_rope_head_dim is {ints['qk_rope_head_dim']}, odd; rotary embedding pairs need "
                        "an even size")
    experts = ints["n_routed_experts"]
    if experts:
        k, groups, top_groups = ints["num_experts_per_tok"], ints["n_group"] or 1, ints["topk_group"] or 1
        if k is None or k > experts:
            raise PrepError(f"{where}: num_experts_per_tok is {k!r}, not an integer in [1, n_routed_experts = "
                            f"{experts}]")
        if experts % groups or top_groups > groups or k > top_groups * (experts // groups):
            raise PrepError(f"{where}: n_group {groups}, topk_group {top_groups} and num_experts_per_tok {k} cannot "
                            f"route {experts} experts (n_group must divide them, topk_group <= n_group, and the groups "
                            "kept must hold num_experts_per_tok experts)")
        if (experts // groups) < 2:
            raise PrepError(f"{where}: n_group {groups} leaves fewer than 2 experts per group; DeepSeek's group score "
                            "sums each group's top 2")
    _positive_float(cfg, "rms_norm_eps", where, 1e-6)
    holder, rs, name = rope_config(cfg)
    _positive_float(holder, "rope_theta", where, 10000.0, at_least=1.0, within="" if holder is cfg else f"{name}.")
    _positive_float(cfg, "routed_scaling_factor", where, 1.0)
    if cfg.get("rope_interleave", True) is not True:  # GLM-5 states it; DeepSeek's checkpoints are interleaved
        raise PrepError(f"{where}: rope_interleave is {cfg['rope_interleave']!r}; prep's reference engine computes "
                        "the interleaved RoPE of DeepSeek's and GLM-5's checkpoints only")
    if rs is not None and not isinstance(rs, dict):
        raise PrepError(f"{where}: {name} is {rs!r}, not an object or null")
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        _positive_float(rs, "factor", where, None, at_least=1.0, strictly=False, within=f"{name}.")
        if rs.get("factor") is None:
            raise PrepError(f"{where}: {name} (yarn) has no factor")
        orig = rs.get("original_max_position_embeddings")
        if type(orig) is not int or orig < 1:
            raise PrepError(f"{where}: {name}.original_max_position_embeddings is {orig!r}, not a positive "
                            "integer")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            _positive_float(rs, key, where, None, strictly=False, within=f"{name}.")
    elif rs and rs.get("type", rs.get("rope_type")) not in (None, "default"):
        raise PrepError(f"{where}: {name} has rope_type {rs.get('type', rs.get('rope_type'))!r}; prep's reference "
                        "engine computes default and yarn RoPE only")
