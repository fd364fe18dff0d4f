"""Model families: for every module a family's checkpoint holds, what it is, when a layer has it,
whether it is attention, and how tensor parallel splits it.

A family is a table (one :class:`Module` row per module), not code: prep's reader checks a
checkpoint against it (every tensor a module of a row, every row a config.json implies present),
and the planners and the engines' doors ask it how a module is split. What differs between
engines (the names of merged modules, the stacked experts' name, padding) stays in each engine's
profile; what the checkpoint is, is here, once. The family is resolved once, from config.json
(:func:`family_of`), and passed on as the object.

A family may wrap its language model in a multimodal checkpoint (:class:`Wrapper`: Kimi-K2.5's
``language_model.`` prefix, its config under ``text_config``, a vision tower beside it): prep reads
the language model under the family's own names and keeps the rest as the source has it.

A new family is one module of this package with its table, registered with :func:`register_family`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import pkgutil
import re
from typing import Any, Iterator, Mapping

from ..errors import LayoutsError

ROWS, COLS, WHOLE = "rows", "cols", "none"
"""A module's TP split: its output rows (column parallel; an embedding or head: vocabulary
parallel), its input columns (row parallel), or none (every rank holds it whole, or the MoE
planner stacks it)."""

# When a decoder layer holds a module (Module.when), decided from config.json's integers (and its indexer_types):
ALWAYS = "always"
Q_LORA = "q_lora"  # q_lora_rank set: q_a_proj, its norm and q_b_proj
NO_Q_LORA = "no_q_lora"  # no q LoRA (DeepSeek-V2-Lite): q_proj
MOE = "moe"  # a MoE layer (from first_k_dense_replace, on the moe_layer_freq beat): the router
EXPERTS = "experts"  # a MoE layer's routed experts, one row per expert ("{e}" in the name)
SHARED = "shared"  # a MoE layer with shared experts (n_shared_experts)
DENSE = "dense"  # a layer before first_k_dense_replace or off the beat: the dense MLP
INDEXED = "indexed"  # a layer with a sparse-attention indexer of its own: every one but those config.json's
# indexer_types marks "shared" (GLM-5.2's IndexShare: they reuse the last full layer's top-k)
_WHEN = (ALWAYS, Q_LORA, NO_Q_LORA, MOE, EXPERTS, SHARED, DENSE, INDEXED)


@dataclasses.dataclass(frozen=True)
class Module:
    """One module of a family: ``name`` relative to its decoder layer (``self_attn.q_a_proj``;
    ``{e}`` stands for a routed expert's index) or, outside the layers, the whole name
    (``model.embed_tokens``); ``kind`` says what it is (``q_b_proj``, ``routed_expert``,
    ``norm``, ``router``, ``embedding``, ``head``, ...)."""

    name: str
    kind: str
    split: str = WHOLE
    attention: bool = False
    when: str = ALWAYS
    extra: tuple[str, ...] = ()
    """Its tensors beside ``weight`` (and a quantized weight's ``weight_scale`` /
    ``weight_scale_inv``): the router's ``e_score_correction_bias``, a LayerNorm's ``bias``."""

    def __post_init__(self) -> None:
        if self.split not in (ROWS, COLS, WHOLE):
            raise ValueError(f"module {self.name}: split {self.split!r} is not rows, cols or none")
        if self.when not in _WHEN:
            raise ValueError(f"module {self.name}: when {self.when!r} is not one of {', '.join(_WHEN)}")
        if ("{e}" in self.name) != (self.when == EXPERTS):
            raise ValueError(f"module {self.name}: a routed expert's row, and only one, has {{e}} and when=experts")


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint around a family's language model: every language-model tensor is
    named ``prefix`` + the family's name for it (``language_model.model.layers.0...``), its
    config.json keys are under ``config_key`` (the quantization config may stay at the top, as in
    AMD's Quark exports, which ATOM reads there), and the tensors under ``outside`` (a vision tower,
    its projector) are no module of the family: prep copies them through as they are, for
    ``revert``, and no rank of an engine that serves text only reads them."""

    prefix: str
    config_key: str
    outside: tuple[str, ...]

    def language_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The language model's config: ``config[config_key]``, with the top level's
        ``quantization_config`` where it has none of its own."""
        inner = config.get(self.config_key)
        if not isinstance(inner, dict):
            raise LayoutsError(f"config.json: {self.config_key} is {type(inner).__name__}, not the language model's "
                               "config object; config.json is damaged: re-download it")
        if "quantization_config" in config and "quantization_config" not in inner:
            inner = {**inner, "quantization_config": config["quantization_config"]}
        return dict(inner)

    def is_outside(self, name: str) -> bool:
        return name.startswith(self.outside)

    def inner_name(self, name: str) -> str | None:
        """The family's name of source tensor ``name`` (its prefix taken off), None where it is
        outside the language model or has no prefix (a tensor no module names: refused later)."""
        return name[len(self.prefix):] if name.startswith(self.prefix) else None

    def source_name(self, name: str) -> str:
        """The source's name of a tensor prep names ``name`` (:meth:`inner_name`'s inverse)."""
        return name if self.is_outside(name) else self.prefix + name

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "config_key": self.config_key, "outside": list(self.outside)}

    @classmethod
    def from_json(cls, raw: Any) -> "Wrapper":
        """A manifest's record of it; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or type(raw.get("prefix")) is not str or not raw["prefix"] or \
                type(raw.get("config_key")) is not str or not isinstance(raw.get("outside"), list) or \
                not all(type(o) is str and o for o in raw["outside"]):
            raise ValueError(f"{raw!r} is not {{prefix, config_key, outside: [name prefixes]}}")
        return cls(raw["prefix"], raw["config_key"], tuple(raw["outside"]))


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's table (module docstring). ``before`` / ``after``: the modules outside the
    layers, in the order a checkpoint lists them; ``layer``: a decoder layer's, in order;
    ``mtp``: what an MTP layer holds beside a decoder layer's modules (its own embedding, norms,
    projection and head), wherever config.json puts that layer."""

    name: str
    label: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]  # model_types[i] is architectures[i]'s (a model type without a class of its own last)
    before: tuple[Module, ...]
    layer: tuple[Module, ...]
    after: tuple[Module, ...]
    mtp: tuple[Module, ...] = ()
    tied_head: str = "lm_head"
    """The module config.json's ``tie_word_embeddings`` leaves out (the embedding stands in)."""
    twist: str = ""
    """What sets the family apart from DeepSeek-V3, said where prep names the family."""
    dense_up_to: str = ""
    """The config.json key of the number of cached tokens a sparse attention's indexer keeps per
    query (DeepSeek-V3.2's ``index_topk``): up to that many positions it keeps every one, so
    attention is dense and the reference engine computes it exactly without the indexer; it
    refuses a longer sequence. Empty: attention is dense at any length."""
    wrapper: Wrapper | None = None
    """Where a multimodal checkpoint holds the language model (:class:`Wrapper`); None: the
    checkpoint is the language model."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for m in (*self.before, *self.layer, *self.after, *self.mtp):
            if m.name in seen:
                raise ValueError(f"family {self.name}: module {m.name} has two rows")
            seen.add(m.name)

    def language_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The language model's config.json keys (a :class:`Wrapper`'s ``config_key`` object, else
        ``config`` itself): what sizes the family's modules."""
        return self.wrapper.language_config(config) if self.wrapper else dict(config)

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Refuse (:class:`LayoutsError`, one line) a config.json whose layers' indexers prep cannot
        tell: ``indexer_types`` (transformers 5 writes it: one ``"full"`` or ``"shared"`` per decoder
        layer) malformed, or an ``index_topk_freq`` above 1 without it, where the engines read the
        shared layers differently (vLLM derives them, ATOM builds an indexer in every layer)."""
        if not any(m.when == INDEXED for m in self.layer):
            return
        types, layers = config.get("indexer_types"), config.get("num_hidden_layers")
        if types is not None:
            if not isinstance(types, list) or any(t not in ("full", "shared") for t in types) or \
                    (type(layers) is int and len(types) != layers):
                raise LayoutsError(f"config.json: indexer_types must list 'full' or 'shared' for each of the "
                                   f"num_hidden_layers={layers} decoder layers; config.json is damaged")
        elif config.get("index_topk_freq", 1) != 1:
            raise LayoutsError(f"config.json: index_topk_freq is {config['index_topk_freq']!r} without indexer_types, "
                               "so which layers share an indexer is each engine's own reading; add indexer_types "
                               "(transformers 5's config writes it)")

    # ------------------------------------------------------------------ lookups by full name
    @functools.cached_property
    def _rows(self) -> dict[str, Module]:
        rows = {m.name: m for m in (*self.before, *self.after)}
        rows.update({f"layer.{m.name}": m for m in (*self.layer, *self.mtp)})
        return rows

    def module(self, name: str) -> Module | None:
        """The row of module ``name`` (a full name, e.g. ``model.layers.3.mlp.experts.7.up_proj``),
        None where the family has none."""
        m = _IN_LAYER.match(name)
        key = f"layer.{_EXPERT.sub('.experts.{e}.', '.' + m.group(2))[1:]}" if m else name
        return self._rows.get(key)

    def row(self, name: str) -> Module:
        """:meth:`module`, refusing a module the family has no row for (nothing is split or
        replicated by default)."""
        m = self.module(name)
        if m is None:
            raise LayoutsError(f"{name}: no module of {self.label} is named so; prep does not know how an engine "
                               "holds it")
        return m

    def split_of(self, name: str) -> str:
        """How TP splits module ``name`` (:data:`ROWS`, :data:`COLS` or :data:`WHOLE`)."""
        return self.row(name).split

    def kind_of(self, name: str) -> str:
        return self.row(name).kind

    def knows_tensor(self, name: str) -> bool:
        """Whether tensor ``name`` is one a module of the family holds: its weight (with a
        quantized weight's scales) or one of the row's ``extra`` tensors."""
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight", "weight_scale", "weight_scale_inv"):
            return True
        m = self.module(module)
        return m is not None and suffix in m.extra

    @functools.cached_property
    def _mtp_names(self) -> frozenset[str]:
        return frozenset(m.name for m in self.mtp)

    def is_mtp_own(self, name: str) -> bool:
        """Whether ``name`` is one of an MTP layer's own modules (in any layer: a transformers-5
        config may count the MTP layer among the decoder layers)."""
        m = _IN_LAYER.match(name)
        return bool(m) and m.group(2) in self._mtp_names

    # ------------------------------------------------------------------ what config.json implies
    def expected(self, config: Mapping[str, Any], ints: Mapping[str, int | None],
                 mtp_present: Any = ()) -> Iterator[tuple[str, str]]:
        """(module, why) for every module whose ``.weight`` a checkpoint of this family and
        config holds, lazily and in checkpoint order (a config of 1e9 layers must fail at the
        first layer missing, not build a list first). The MTP layers follow the decoder layers;
        one may be absent as a whole (``mtp_present``: the MTP layer indices the checkpoint has
        any tensor of): transformers builds none, so an amd-quark export has none while its
        config still says ``num_nextn_predict_layers: 1``."""
        n_layers, n_mtp = ints["num_hidden_layers"], ints["num_nextn_predict_layers"]
        for m in self.before:
            yield m.name, f"every {self.label} checkpoint has it"
        # chained, not listed: a config of 1e8 layers made that list first (4 GB, 3 s) before the
        # walk stopped at the first layer missing
        for layer in itertools.chain(range(n_layers),
                                     sorted(i for i in mtp_present if n_layers <= i < n_layers + n_mtp)):
            p = f"model.layers.{layer}"
            why = f"config.json has num_hidden_layers={n_layers}" if layer < n_layers else \
                f"config.json has num_nextn_predict_layers={n_mtp}"
            for m in self.layer:
                if m.when == EXPERTS:
                    if _holds(MOE, layer, ints):
                        for e in range(ints["n_routed_experts"]):
                            yield f"{p}.{m.name.format(e=e)}", f"config.json has n_routed_experts={ints['n_routed_experts']}"
                elif m.when == INDEXED:
                    if _indexed(layer, config):
                        yield f"{p}.{m.name}", why
                elif _holds(m.when, layer, ints):
                    yield f"{p}.{m.name}", _WHY.get(m.when, lambda i: why)(ints)
        for m in self.after:
            if m.name != self.tied_head or not config.get("tie_word_embeddings"):
                yield m.name, (f"every {self.label} checkpoint has it" if m.name != self.tied_head
                               else "config.json does not tie it to the embedding")


_IN_LAYER = re.compile(r"^(model\.layers\.\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")
_WHY = {SHARED: lambda i: f"config.json has n_shared_experts={i['n_shared_experts']}",
        DENSE: lambda i: f"config.json has first_k_dense_replace={i['first_k_dense_replace']}"}


def _indexed(layer: int, config: Mapping[str, Any]) -> bool:
    """Whether decoder (or MTP) layer ``layer`` has an indexer of its own (:data:`INDEXED`); an MTP
    layer, past indexer_types, always has one."""
    types = config.get("indexer_types")
    return not types or layer >= len(types) or types[layer] == "full"


def _holds(when: str, layer: int, ints: Mapping[str, int | None]) -> bool:
    moe = (ints["n_routed_experts"] is not None and layer >= ints["first_k_dense_replace"]
           and layer % ints["moe_layer_freq"] == 0)
    return {ALWAYS: True, Q_LORA: ints["q_lora_rank"] is not None, NO_Q_LORA: ints["q_lora_rank"] is None,
            MOE: moe, EXPERTS: moe, SHARED: moe and bool(ints["n_shared_experts"]), DENSE: not moe}[when]


# ---------------------------------------------------------------------- the registry
_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to those :func:`family_of` resolves (a model type names one family)."""
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    for other in _FAMILIES.values():
        both = set(other.model_types) & set(family.model_types)
        if both:
            raise ValueError(f"families {other.name!r} and {family.name!r} both claim model_type {sorted(both)}")
    _FAMILIES[family.name] = family
    return family


def family_names() -> list[str]:
    _load()
    return list(_FAMILIES)


def get_family(name: str) -> Family:
    _load()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(_FAMILIES)}") from None


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of a checkpoint's config.json: by its ``model_type`` where a family claims it,
    else by its ``architectures``; :class:`LayoutsError` naming what prep knows otherwise."""
    _load()
    model_type = config.get("model_type")
    for f in _FAMILIES.values():
        if isinstance(model_type, str) and model_type in f.model_types:
            f.check_config(f.language_config(config))
            return f
    archs = config.get("architectures")
    for a in archs if isinstance(archs, list) else []:  # a number or a list of objects: no family, not a crash
        for f in _FAMILIES.values():
            if isinstance(a, str) and a in f.architectures:
                f.check_config(f.language_config(config))
                return f
    known = ", ".join(f"{f.label} ({', '.join(f.architectures) or 'model_type ' + ', '.join(f.model_types)})"
                      for f in _FAMILIES.values())
    raise LayoutsError(f"config.json: architecture {archs} (model_type {model_type!r}) is no family prep knows: "
                       f"{known}")


def wrapper_of(config: Mapping[str, Any]) -> Wrapper | None:
    """The :class:`Wrapper` of the family config.json names, where that family has one (no
    family, or one without: None; :func:`family_of` refuses what is wrong with it later)."""
    try:
        return family_of(config).wrapper
    except LayoutsError:
        return None


def language_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's language-model keys: a multimodal checkpoint's (:meth:`Wrapper.language_config`),
    else ``config`` itself. What a converted folder's readers size the model by (the folder keeps
    the source's config.json, so that ``revert`` is exact)."""
    wrapper = wrapper_of(config)
    return wrapper.language_config(config) if wrapper else dict(config)


def _load() -> None:
    """Import every module of this package (each registers its families), once: a new family is
    a module here and nothing else, as a new engine is a module of ``layouts.engines``."""
    if not _SCANNED:
        for m in pkgutil.iter_modules(__path__):
            if not m.name.startswith("_"):
                importlib.import_module(f"{__name__}.{m.name}")
        _SCANNED.append(True)


_SCANNED: list[bool] = []


def architecture_of(config: Mapping[str, Any]) -> str | None:
    """The architecture a conversion's manifest records for config.json (``target.arch``): the
    model type of the first class in ``architectures`` a family pairs with one (``Family``:
    ``architectures[i]`` is the class of ``model_types[i]``), else its ``model_type`` where a
    family pairs that with a class; None otherwise."""
    _load()
    pairs = {a: t for f in _FAMILIES.values() for a, t in zip(f.architectures, f.model_types)}
    archs = config.get("architectures")
    for a in archs if isinstance(archs, list) else []:  # a number or a list of objects: none, not a crash
        if isinstance(a, str) and a in pairs:
            return pairs[a]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) and model_type in pairs.values() else None


__all__ = ["ALWAYS", "COLS", "DENSE", "EXPERTS", "Family", "INDEXED", "MOE", "Module", "NO_Q_LORA", "Q_LORA", "ROWS", "SHARED",
           "WHOLE", "Wrapper", "architecture_of", "family_names", "family_of", "get_family", "language_config", "register_family", "wrapper_of"]
