"""A source checked against its config.json before anything is planned: the family config.json
names, its counts and sizes as JSON integers in a range the checkpoint can fill, every tensor the
config implies present, every tensor one a module of the family holds, and the first layers' shapes
as config.json states them. Each refusal is one line naming the key or tensor and what to do."""

from __future__ import annotations

import pathlib
from typing import Any, Mapping

from layouts.errors import LayoutsError
from layouts.families import Family, family_of

from .errors import PrepError
from .source import SourceCheckpoint


def source_family(config: Mapping[str, Any]) -> Family:
    """The model family of a source's config.json (:func:`layouts.families.family_of`), refused
    in one line naming what prep knows."""
    try:
        return family_of(config)
    except LayoutsError as e:
        raise PrepError(str(e)) from None


# config.json values that size loops and lists, read as what they must be: JSON integers (a
# string, a float such as 1e9 or a bool is refused naming the key), in a range the checkpoint can
# fill. Counts of layers and experts are bounded by the tensors present (each layer and each
# expert holds several), so a config of 1e9 layers fails here, not as a MemoryError or a loop
# over a billion layers; sizes by 2**24 (DeepSeek's largest, the vocabulary, is 129,280).
_COUNTS = {  # key: (default when absent, lowest, may be null)
    "num_hidden_layers": (None, 1, False), "num_nextn_predict_layers": (0, 0, True), "first_k_dense_replace": (0, 0, False),
    "moe_layer_freq": (1, 1, False), "n_routed_experts": (None, 1, True), "n_shared_experts": (None, 0, True),
}
_SIZES = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
          "num_experts_per_tok", "n_group", "topk_group")
MAX_SIZE = 1 << 24


def config_ints(src: SourceCheckpoint, bounded: bool = True) -> dict[str, int | None]:
    """The integer values of config.json that prep reads, checked (:class:`PrepError` naming the
    key): counts in [lowest, number of tensors present] (``bounded=False``: no upper bound, for
    :func:`check_complete`'s walk, which stops at the first tensor missing anyway), sizes in
    [1, 2**24] or null/absent."""
    return check_config_ints(src.config, src.root, len(src.tensors) if bounded else None)


def check_config_ints(cfg: dict[str, Any], root: pathlib.Path, tensors: int | None) -> dict[str, int | None]:
    """:func:`config_ints` of a config.json in folder ``root`` whose checkpoint holds ``tensors``
    tensors (None: counts unbounded)."""
    bounded = tensors is not None
    limit = tensors if bounded else float("inf")
    out: dict[str, int | None] = {}
    for key, (default, lo, nullable) in _COUNTS.items():
        if key not in cfg and default is None and not nullable:
            raise PrepError(f"{root / 'config.json'}: no {key}; not a DeepSeek config (re-download config.json)")
        v = cfg.get(key, default)
        if v is None and nullable:
            out[key] = 0 if key == "num_nextn_predict_layers" else None
            continue
        if type(v) is not int or not lo <= v <= max(lo, limit):
            raise PrepError(f"{root / 'config.json'}: {key} is {v!r}, not an integer in [{lo}, "
                            f"{max(lo, limit) if bounded else 'inf'}]"
                            + (f" (the checkpoint holds {limit} tensors)" if bounded else "")
                            + "; config.json is damaged or not this checkpoint's")
        out[key] = v
    layers = out["num_hidden_layers"] + out["num_nextn_predict_layers"]
    if layers > limit:
        raise PrepError(f"{root / 'config.json'}: num_hidden_layers + num_nextn_predict_layers = {layers}, more "
                        f"layers than the checkpoint's {limit} tensors; config.json is damaged or not this checkpoint's")
    for key in _SIZES:
        v = cfg.get(key)
        if v is not None and (type(v) is not int or not 1 <= v <= MAX_SIZE):
            raise PrepError(f"{root / 'config.json'}: {key} is {v!r}, not an integer in [1, {MAX_SIZE}]; "
                            "config.json is damaged or not this checkpoint's")
        out[key] = v
    return out


def check_complete(src: SourceCheckpoint, family: Family | None = None) -> dict[str, int | None]:
    """Refuse a checkpoint that lacks a tensor its config.json implies, naming the first one
    missing (a weight counts in any dtype: MXFP4 or not). Returns the checked config values.
    The walk stops at the first name missing, so it is bounded by the tensors present whatever
    the config says; the counts are bounded by them too once it passed."""
    family = family or source_family(src.file_config)
    ints = config_ints(src, bounded=False)
    tensors = src.tensors
    layers = {name.split(".", 3)[2] for name in tensors if name.startswith("model.layers.")}
    mtp_present = {int(i) for i in layers if i.isdigit() and int(i) >= ints["num_hidden_layers"]}
    known: set[str] = set()  # every module the config implies, each found: what _check_known holds the tensors to
    for module, why in family.expected(src.config, ints, mtp_present):
        if f"{module}.weight" not in tensors:
            raise PrepError(f"{src.root}: tensor {module}.weight is missing ({why}); the checkpoint is incomplete "
                            "or config.json is not its own: re-download it")
        known.add(module)
    ints = config_ints(src)
    _check_sizes(src, ints)  # first: a config.json that is not the checkpoint's says so, not "unknown module"
    _check_known(src, known, family)
    return ints




def _check_known(src: SourceCheckpoint, known: set[str], family: Family) -> None:
    """Refuse a tensor of a module the family's modeling code does not build for this config
    (``known``: :meth:`Family.expected`'s modules; a DeepSeek-V3.2 indexer, a vision tower, a stray
    export): no engine profile says how a rank holds it, and copying it whole to every rank (what
    prep did) let ``prep run`` compute without it and engines fail or ignore it. Named in one line,
    before anything is written."""
    outside = family.wrapper.is_outside if family.wrapper else lambda name: False
    shown = src.source_name  # as the source names it (language_model.model... in a multimodal one)
    for name in src.tensors:
        if outside(name):
            continue  # a vision tower's: copied as it is
        module, _, suffix = name.rpartition(".")
        if not family.knows_tensor(name):
            raise PrepError(f"{shown(name)}: a tensor {suffix!r} of {module} is not one prep knows (a module holds its "
                            "weight, and an MXFP4 or FP8 one its weight_scale; the router its e_score_correction_bias); "
                            "prep does not copy an unknown tensor to every rank: re-export the checkpoint without it")
        # an MTP layer's own modules: wherever config.json puts that layer (a transformers-5 config
        # may count it among the decoder layers); an engine that does not build them there says so
        if module not in known and not family.is_mtp_own(module):
            raise PrepError(f"{shown(name)}: no module of {family.label} as config.json builds it (architecture "
                            f"{src.file_config.get('architectures')}) is named {shown(module)}; prep does not know how "
                            "an engine holds it and does not copy an unknown tensor to every rank")


def _check_sizes(src: SourceCheckpoint, ints: dict[str, int | None]) -> None:
    """config.json's sizes against the tensors of the first layers that hold them: the copy of
    config.json goes out with the conversion, and an engine builds its models from it (a
    hidden_size or n_routed_experts that is not the checkpoint's fails there, after allocating)."""
    t = src.tensors

    def logical(module: str) -> tuple[int, int] | None:  # (out, in) of a linear, MXFP4 unpacked
        info = t.get(f"{module}.weight")
        if info is None or len(info.shape) != 2:
            return None
        packed = f"{module}.weight_scale" in t and info.dtype == "U8"
        return info.shape[0], info.shape[1] * (2 if packed else 1)

    c = ints
    checks: list[tuple[str, tuple[int, int] | None, tuple[Any, Any]]] = []
    embed = t.get("model.embed_tokens.weight")
    if embed is not None and len(embed.shape) == 2:
        checks.append(("model.embed_tokens", tuple(embed.shape), (c["vocab_size"], c["hidden_size"])))
    a = "model.layers.0.self_attn"
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    if None not in (heads, nope, rope, v):
        if c["q_lora_rank"] is not None:
            checks += [(f"{a}.q_a_proj", logical(f"{a}.q_a_proj"), (c["q_lora_rank"], c["hidden_size"])),
                       (f"{a}.q_b_proj", logical(f"{a}.q_b_proj"), (heads * (nope + rope), c["q_lora_rank"]))]
        if c["kv_lora_rank"] is not None:
            checks += [(f"{a}.kv_a_proj_with_mqa", logical(f"{a}.kv_a_proj_with_mqa"),
                        (c["kv_lora_rank"] + rope, c["hidden_size"])),
                       (f"{a}.kv_b_proj", logical(f"{a}.kv_b_proj"), (heads * (nope + v), c["kv_lora_rank"]))]
        checks.append((f"{a}.o_proj", logical(f"{a}.o_proj"), (c["hidden_size"], heads * v)))
    if c["first_k_dense_replace"]:
        checks.append(("model.layers.0.mlp.gate_proj", logical("model.layers.0.mlp.gate_proj"),
                       (c["intermediate_size"], c["hidden_size"])))
    moe = f"model.layers.{c['first_k_dense_replace']}.mlp.experts"
    if c["n_routed_experts"] and f"{moe}.0.gate_proj.weight" in t:
        checks.append((f"{moe}.0.gate_proj", logical(f"{moe}.0.gate_proj"), (c["moe_intermediate_size"], c["hidden_size"])))
        present = sum(1 for i in range(c["n_routed_experts"] + 1) if f"{moe}.{i}.gate_proj.weight" in t)
        if present != c["n_routed_experts"]:
            raise PrepError(f"{src.root / 'config.json'}: n_routed_experts is {c['n_routed_experts']} but "
                            f"{moe} holds {present if present <= c['n_routed_experts'] else 'more'}; config.json is "
                            "not this checkpoint's: re-download it")
    for module, have, want in checks:
        if have is not None and None not in want and tuple(have) != tuple(want):
            raise PrepError(f"{src.root / 'config.json'}: its sizes make {module} {list(want)}, but the checkpoint's "
                            f"is {list(have)}; config.json is not this checkpoint's: re-download it")
