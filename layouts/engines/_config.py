"""What SGLang and vLLM read from a DeepSeek checkpoint's config.json otherwise than the checkpoint
means, and the override their serve commands pass for it (SGLang ``--json-model-override-args``,
vLLM ``--hf-overrides``: both replace the named attributes). config.json itself stays the
source's, so that ``revert`` is exact.

Two cases, each found on a real export:

* Quark ``exclude`` entries written as shell wildcards (:mod:`._quark`);
* DeepSeek-V3's own keys that a config saved by transformers 5 no longer carries
  (``topk_method``, ``scoring_func``, ``moe_layer_freq``: an amd-quark 0.13 export made with
  transformers 5.24 has none of them; DeepSeek's and AMD's published configs have all three).
  Without them vLLM 0.34.0 builds no router bias (its load of the checkpoint fails on
  ``e_score_correction_bias``) and SGLang 0.5.23 stops on ``moe_layer_freq``. Every DeepSeek-V3
  model (V3, R1, R1-0528) has the same three values, so for ``model_type`` "deepseek_v3" the
  override states them.
"""

from __future__ import annotations

import json
from typing import Mapping

from ._quark import excludes_as_regex, wildcard_note

# DeepSeek-V3's routing keys as its own config states them (noaux_tc top-k over sigmoid scores with
# the correction bias, a MoE layer on every layer past first_k_dense_replace).
DEEPSEEK_V3_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def missing_keys(config: Mapping) -> dict:
    """The DeepSeek-V3 keys ``config`` lacks, with V3's values (module docstring); {} for other models."""
    if not isinstance(config, Mapping) or config.get("model_type") != "deepseek_v3":
        return {}
    return {k: v for k, v in DEEPSEEK_V3_KEYS.items() if k not in config}


def override(config: Mapping) -> dict | None:
    """The config override an engine's serve command passes for ``config``: the wildcard excludes
    as ``re:`` patterns and the missing DeepSeek-V3 keys; None when it needs none."""
    out = {**(excludes_as_regex(config) or {}), **missing_keys(config)}
    return out or None


def notes(config: Mapping, engine: str, flag: str | None, door: str | None = None) -> list[str]:
    """The lines ``prep convert`` prints for what the override fixes; ``flag`` None: an engine
    whose serve command takes no config override; ``door``: the door that sets the missing keys
    on the engine's config itself (ATOM's, in each worker)."""
    lines = wildcard_note(config, engine, flag) if flag else []
    missing = missing_keys(config)
    if missing:
        keys = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in missing.items())
        fix = (f"the serve command prep prints for a conversion passes V3's values ({flag})" if flag else
               f"{door} sets V3's values ({keys}) on {engine}'s config in each worker" if door else
               f"add them to the source's config.json ({keys}) and convert again: its door takes no config override")
        lines.append(f"config.json lacks DeepSeek-V3's {', '.join(missing)} (a config saved by transformers 5 drops "
                     f"them), without which {engine} builds another router and fails on the checkpoint: {fix}")
    return lines
