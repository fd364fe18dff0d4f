"""How an engine holds a DeepSeek checkpoint's linears on each tensor-parallel rank: which source
modules it merges into one module, along which dimension it splits each, and which routed
experts a rank holds under expert parallel.

These are the engine's rules, not the checkpoint's: vLLM and SGLang build the same DeepSeek
model with their own merged names and splits. So they are data in each engine's profile
(:attr:`EngineProfile.sharding <layouts.engines.EngineProfile.sharding>`), and prep's planners,
the MXFP4 one and the BF16 one alike, read them from there: each rule is written once, by the
engine that has it.
"""

from __future__ import annotations

import dataclasses
import re

from ..families import COLS, ROWS, WHOLE, Family


@dataclasses.dataclass(frozen=True)
class Merge:
    """One engine module built from several source linears of a layer, stacked along its output
    rows in ``parts`` order (``fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``)."""

    module: str  # the engine's module, relative to the layer ("self_attn.fused_qkv_a_proj")
    parts: tuple[str, ...]  # the source modules, relative to the layer, in row order
    split: str  # how TP splits each part: ROWS (each part's rows, then stacked) or WHOLE
    after_experts: bool = False  # placed after the layer's stacked experts in a rank's files


@dataclasses.dataclass(frozen=True)
class Constant:
    """A tensor the engine's model holds in every decoder layer that no checkpoint has, with the
    value the engine initialises it to (SGLang's attention ``k_scale`` / ``v_scale``, 1.0). prep
    writes it into every rank's files where the engine's loader wants each of its model's
    tensors in the files (SGLang's ``sharded_state``)."""

    name: str  # relative to the layer in the rules ("self_attn.attn_mqa.k_scale"); whole once placed
    dtype: str  # safetensors dtype ("F32")
    value: float
    shape: tuple[int, ...] = ()

    def at_layer(self, layer: int) -> "Constant":
        """The constant of decoder layer ``layer``, under its full name."""
        return dataclasses.replace(self, name=f"model.layers.{layer}.{self.name}")

    def tensor(self):
        """Its value as a tensor of its dtype and shape."""
        from ..safetensors_file import TORCH_DTYPES  # torch only here: the rules are data
        import torch

        return torch.full(self.shape, self.value, dtype=TORCH_DTYPES[self.dtype])


QKV = "qkv"
"""A fused ``q | k | v`` projection's split (a vision tower's ``wqkv``, an engine's
``QKVParallelLinear``): each third split by rows over TP, the rank's three parts stacked."""


@dataclasses.dataclass(frozen=True)
class OutsideRow:
    """How the engine holds tensors of a multimodal checkpoint outside its language model (a
    vision tower, its projector), where its loader needs them in each rank's files: source names
    matching ``pattern`` (a full match) are held as ``re.sub(pattern, held, name)``, split by
    ``split`` (:data:`WHOLE`: every rank the whole tensor; :data:`COLS`: row parallel, by input
    columns; :data:`QKV`)."""

    pattern: str
    held: str = r"\g<0>"
    split: str = WHOLE

    def held_name(self, name: str) -> str | None:
        """The engine's name of source tensor ``name``, None where the row does not take it."""
        return re.sub(self.pattern, self.held, name) if re.fullmatch(self.pattern, name) else None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """An engine's per-rank holding of a DeepSeek checkpoint (module docstring)."""

    merges: tuple[Merge, ...]
    """The engine's merged modules, in the order a rank's files hold them within a layer."""
    splits: tuple[tuple[str, str, str], ...] = ()
    """The engine's own departures from its model families' TP splits (a family's table says how
    every module is split, :mod:`layouts.families`): ``(family, pattern, split)``, for modules of
    that family's checkpoints; the first pattern found in a module's full name (``re.search``)
    wins. ATOM holds GLM-5's embedding whole on every rank; otherwise ATOM, SGLang and vLLM hold
    the modules as the family's table says."""
    experts: str = "mlp.experts"
    """The stacked experts' module, relative to the layer."""
    fuse_shared_expert: bool = True
    """Whether the engine stacks the shared expert after the routed ones (slot ``n_routed``) by
    default (ATOM and SGLang do; vLLM only with a switch)."""
    moe_pad_to: tuple[int, int] = (256, 256)
    """The stacked experts' intermediate and hidden dimensions padded to multiples of these, as
    the engine allocates them (ATOM: 256 and 256; vLLM's aiter MoE pads the intermediate to 128)."""

    bf16_moe_inter_align: tuple[int, int, int] | None = None
    """``(limit, small, large)``: the engine's unquantized MoE pads a rank's BF16 experts'
    intermediate to a multiple of ``small`` up to ``limit``, of ``large`` above it (vLLM's aiter
    MoE: (192, 64, 128)); prep writes no such padding, so a rank that would need it is refused.
    None: no padding."""

    holds_mtp: bool = True
    """Whether the engine's model holds the MTP layers (``num_nextn_predict_layers``) with the
    decoder layers: ATOM loads them into its draft model from the same files. False: no rank's
    files hold them; they stay whole, as the source has them, in the common file (kept for
    ``revert``), because the engine's loader refuses tensors its model does not have."""
    mtp_replaced: tuple[str, ...] = ("embed_tokens.weight",)
    """Tensors of an MTP layer (relative to the layer) that the engine's draft model replaces by
    the target model's own after loading (ATOM: the MTP embedding; vLLM: the embedding and
    ``shared_head.head``): no rank reads them, so they stay whole in the common file, kept for
    ``revert``, instead of a split copy in every rank's files."""
    loads_outside: bool = False
    """Whether the engine's model holds a multimodal checkpoint's tensors outside its language
    model (Kimi-K2.5's vision tower and projector, :class:`~layouts.families.Wrapper`) and its
    door hands them to the engine's own loader, which splits them as it holds them: prep keeps
    them whole in the common file, read by every rank (role ``passthrough``). False: the engine
    serves the text only and no rank reads them (role ``unread``, kept for ``revert``)."""
    constants: tuple[Constant, ...] = ()
    """Tensors of every decoder layer the engine's model holds that no checkpoint has."""
    outside: tuple[OutsideRow, ...] = ()
    """How each rank holds a multimodal checkpoint's tensors outside its language model, in its
    own files (SGLang, whose loader wants every parameter there); the first row that takes a
    tensor says. Empty: :attr:`loads_outside` says."""
    wrapped: bool = False
    """Whether a rank's files name a multimodal checkpoint's language-model tensors with the
    wrapper's prefix (``language_model.model.layers.0...``): the engine's loader reads the files by
    its model's parameter names, which hold the language model under that prefix (SGLang's
    ``sharded_state``). False: the family's names (the door resolves the inner model)."""
    fp8_block_scale: str = "weight_scale_inv"
    """What the engine's module calls the 128x128 block scales of an FP8 linear (DeepSeek's FP8
    release names them ``weight_scale_inv``; ATOM's loader renames them ``weight_scale``, its
    stacked experts' ``w13_weight_scale``): a rank's files hold them under that name."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple((f, re.compile(p), s) for f, p, s in self.splits))

    def split_of(self, module: str, family: Family) -> str:
        """How the engine splits ``module`` of a ``family`` checkpoint over TP (a full name, e.g.
        ``model.layers.3.self_attn.o_proj``): the family's split unless the engine departs from it."""
        for name, pattern, split in self._compiled:  # type: ignore[attr-defined]
            if name == family.name and pattern.search(module):
                return split
        return family.split_of(module)

    @staticmethod
    def expert_block(n_routed: int, ep: int, rank: int) -> tuple[int, int]:
        """The routed experts ``[start, stop)`` rank ``rank`` of ``ep`` holds: contiguous blocks
        of ``n_routed // ep``, the remainder to the last rank (every engine with expert
        parallel for DeepSeek does this; a profile with another map overrides it)."""
        per = n_routed // ep
        return rank * per, n_routed if rank == ep - 1 else (rank + 1) * per


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder (or MTP) layer a DeepSeek tensor name is in (``model.layers.61.mlp...`` -> 61),
    None outside the layers (embedding, final norm, head)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def deepseek_merges(fused_qkv_a: str) -> tuple[Merge, ...]:
    """DeepSeek's merged modules as every engine profiled here builds them, the merged q_a + kv_a
    under the engine's own name (``fused_qkv_a`` relative to the layer): [q_a; kv_a] replicated,
    [gate; up] of the dense MLP and of a shared expert held apart from the routed ones, by rows."""
    return (
        Merge(fused_qkv_a, ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), WHOLE),
        Merge("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), ROWS),
        Merge("mlp.shared_experts.gate_up_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), ROWS,
              after_experts=True),
    )
