"""Writing a synthetic checkpoint: its shards (cut on whole layers, one shard in memory at a
time), the index, ``config.json`` and small tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from .config import build_config
from .spec import SynthSpec
from .tensors import _materialize, plan_groups

def _shard_cuts(sizes: list[int], group_ends: list[int], n: int) -> list[int]:
    """Cut indices ``[0, c1, ..., len(sizes)]`` splitting items into n non-empty shards of roughly
    equal bytes. Cuts fall on group ends when there are enough of them; else anywhere."""
    if n > len(sizes):
        raise ValueError(f"cannot write {n} shards of only {len(sizes)} modules")
    inner = [c for c in group_ends if 0 < c < len(sizes)]
    allowed = inner if len(inner) >= n - 1 else list(range(1, len(sizes)))
    cum = [0]
    for size in sizes:
        cum.append(cum[-1] + size)
    cuts, j = [0], -1
    for k in range(1, n):
        target = cum[-1] * k / n
        # Leave enough allowed cuts after this one for the shards still to come.
        choices = range(j + 1, len(allowed) - (n - 1 - k))
        j = min(choices, key=lambda i: abs(cum[allowed[i]] - target))
        cuts.append(allowed[j])
    return cuts + [len(sizes)]


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _tokenizer_files() -> dict[str, object]:
    """Tiny tokenizer files: only their bytes matter (copy-through), but they look like V3's."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    special = [bos, eos]
    vocab = {tok: i for i, tok in enumerate(special + [chr(c) for c in range(33, 127)])}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": True, "special": True} for i, t in enumerate(special)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                            "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }
    tok_config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizerFast", "unk_token": None,
    }
    gen_config = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                  "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tok_config, "generation_config.json": gen_config}


def write_checkpoint(spec: SynthSpec, out_dir: str | Path,
                     progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the checkpoint of ``spec`` into ``out_dir`` (created; must be absent or empty).

    Writes ``config.json``, the shards ``model-0000i-of-0000N.safetensors``,
    ``model.safetensors.index.json``, ``generation_config.json``, ``tokenizer_config.json`` and
    ``tokenizer.json``. Tensors are generated shard by shard, each in blocks of rows, so peak
    memory is about twice the largest shard (safetensors serializes a shard in memory): 4.1 GB
    for the real-dims preset, whose largest shard (the embedding's) is 1.85 GB; 1.3 GB for bench.
    ``progress(done, total)`` is called with bytes generated after each tensor. Returns
    ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to write a checkpoint into {out}: it exists and is not an empty directory")
    groups = plan_groups(spec)
    params = [p for group in groups for p in group]
    ends, count = [], 0
    for group in groups:
        count += len(group)
        ends.append(count)
    cuts = _shard_cuts([p.nbytes() for p in params], ends, spec.num_shards)
    out.mkdir(parents=True, exist_ok=True)

    weight_map: dict[str, str] = {}
    total, planned, made = 0, sum(p.nbytes() for p in params), 0
    for i in range(spec.num_shards):
        fname = f"model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for p in params[cuts[i]:cuts[i + 1]]:
            tensors.update(_materialize(spec, p))
            made += p.nbytes()
            if progress:
                progress(made, planned)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out / "config.json", build_config(spec))
    for name, obj in _tokenizer_files().items():
        _write_json(out / name, obj)
    return out
