"""Synthetic DeepSeek-V3 checkpoints in AMD Quark MXFP4 format, generated offline.

Why: the real amd/DeepSeek-R1-0528-MXFP4 is ~350 GiB behind a network we do not have, yet the
converter must be tested on the exact things that make it hard: HF tensor names, per-expert
routed experts, the Quark ``quantization_config`` with its ``exclude`` list, the MTP layer and
its BF16 ``eh_proj`` quirk, a sharded ``model.safetensors.index.json``, and files copied through
(tokenizer, generation config). This module writes such a checkpoint with small dims ("tiny", for
tests) or multi-GB dims ("bench", for throughput), deterministically (same spec -> same bytes;
every tensor draws from its own generator seeded by ``(seed, name)``), one shard at a time so
memory stays bounded by one shard.

What a Quark MXFP4 DeepSeek checkpoint holds (names, dtypes, the exclude list, the MTP layer's
BF16 ``eh_proj``) is the format prep converts; ``docs/manifest.md`` and ``docs/layouts.md`` say
what it becomes.
"""

from __future__ import annotations

# One module a job: spec (what a checkpoint is, the presets), config (its config.json), tensors
# (its tensors and their bytes), write (the files), fixtures (what tests do to them).
from .config import build_config, exclude_patterns, is_excluded, layer_quant_config
from .fixtures import as_format_3, drop_tensors, edit_at_same_size, run_measured
from .spec import PRESETS, VARIANTS, SynthSpec
from .tensors import Param, plan_groups, tensor_specs
from .write import write_checkpoint

__all__ = [
    "PRESETS", "VARIANTS", "Param", "SynthSpec", "as_format_3", "build_config", "drop_tensors", "edit_at_same_size",
    "exclude_patterns", "is_excluded", "layer_quant_config", "plan_groups", "run_measured", "tensor_specs",
    "write_checkpoint",
]
