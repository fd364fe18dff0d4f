"""``check-triton-moe``: run aiter's own Triton MoE GEMMs (the kernels of ATOM's Triton MoE, ``ATOM_USE_TRITON_MOE=1``)
on a converted folder's stacked experts, interpreted on the CPU, and compare what they compute
with the source experts' product: the consumer check of the ``triton`` / ``triton-gfx942`` MoE
layouts, as ``tests/test_consumer_kernels.py`` is of the dense ones.

    .venv/bin/python -m harness check-triton-moe --source SRC --converted OUT [--oracles DIR]
        [--work DIR] [--layer N] [--ranks R,...] [--tokens M]

For every rank of OUT (or ``--ranks``), one MoE layer (the first, or ``--layer``): the rank's ``w13`` / ``w2``
bytes and scales read as ATOM holds them after loading (transposed views; the scale swizzle label
the layout states, ``CDNA4_SCALE`` or none), aiter's ``routing`` on random logits, then
``moe_gemm_a16w4`` (BF16 activations) and ``moe_gemm_a4w4`` (MXFP4 activations from aiter's own
``mxfp4_quant``: DeepSeek's Quark checkpoints quantize them, ATOM's ``MoEActivationQuant.FP4``),
gate/up with the tokens gathered, down with the routing weights applied and the tokens scattered
back. The reference is aiter's own ``moe_gemm_torch`` on the source experts dequantized
(``layouts.mxfp4.dequantize``), cut to the rank's part of the intermediate and padded as the engine
pads it, on the same (quantized) activations. A run also reads the same bytes as raw (no swizzle
label) and must then be far off, so that the check can fail.

Stand-ins: none for the kernels (aiter's Triton source from the pinned tree, ``TRITON_INTERPRET=1``);
aiter's arch probe answers gfx950. Note: ATOM at ffdf3bb5 calls ``moe_gemm_a4w4`` with the eight
positional arguments of ``moe_gemm_a16w4`` (two static-scale slots that ``moe_gemm_a4w4`` at the
pinned aiter e4048607 does not have), which raises TypeError; called here by keyword.

Prints one line per rank; exit status 0 only when every GEMM is within ``TOLERANCE`` of the
reference (relative to its largest value) and every raw read is not.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

TOLERANCE = 0.02  # BF16 outputs (8 significant bits) against an F32 reference: ~0.004-0.008 seen
PACKAGES = ("aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.utils", "aiter.ops.triton.utils._triton")


def load_aiter_moe(aiter_dir: pathlib.Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """aiter's ``routing``, ``moe_op_gemm_a16w4`` and ``moe_op_gemm_a4w4`` from the pinned tree,
    without aiter's package init (which loads its compiled extensions): the packages on the way
    are plain modules over their folders, and the arch probe (which asks the GPU driver) answers
    gfx950, its functions otherwise aiter's own."""
    for name in PACKAGES:
        m = types.ModuleType(name)
        m.__path__ = [str(aiter_dir / name.replace(".", "/"))]
        sys.modules[name] = m
    probe = types.ModuleType("aiter.ops.triton.utils._triton.arch_info")
    src = (aiter_dir / "aiter/ops/triton/utils/_triton/arch_info.py").read_text()
    start, end = src.index("try:"), src.index("def get_arch")
    exec(compile(src[:start] + '_CACHED_ARCH = "gfx950"\n\n\n' + src[end:], str(aiter_dir / "arch_info.py"), "exec"),
         probe.__dict__)
    sys.modules[probe.__name__] = probe
    return tuple(importlib.import_module(f"aiter.ops.triton.moe.{m}")  # type: ignore[return-value]
                 for m in ("moe_routing.routing", "moe_op_gemm_a16w4", "moe_op_gemm_a4w4"))


def source_experts(src, mlp: str, slots: list[str], rank: int, tp: int, inter_pad: int, hidden_pad: int):
    """The source experts of ``slots`` (``experts.E`` / ``shared_experts``) dequantized as the
    kernels take them: ``w13 [E, H_pad, 2 I_pad]`` (gate then up, each cut to the rank's part and
    padded with zeros) and ``w2 [E, I_pad, H_pad]``."""
    import torch

    import layouts

    def deq(name: str):
        w, s = src.read(f"{name}.weight"), src.read(f"{name}.weight_scale")
        return layouts.mxfp4.dequantize(w, s, k=2 * w.shape[-1])

    w13, w2 = [], []
    for slot in slots:
        gate, up, down = (deq(f"{mlp}.{slot}.{p}_proj") for p in ("gate", "up", "down"))
        inter, hidden = gate.shape
        part = inter // tp
        rows = slice(rank * part, (rank + 1) * part)
        a = torch.zeros(2 * inter_pad, hidden_pad)
        a[:part, :hidden], a[inter_pad:inter_pad + part, :hidden] = gate[rows], up[rows]
        b = torch.zeros(hidden_pad, inter_pad)
        b[:hidden, :part] = down[:, rows]
        w13.append(a.t())
        w2.append(b.t())
    return torch.stack(w13), torch.stack(w2)


def check_rank(mods, src, manifest, rank: int, layer: int | None, tokens: int, seed: int) -> tuple[bool, str]:
    import torch

    import layouts

    routing, a16, a4 = mods
    groups = [g for g in manifest.groups if g.kind == "moe" and g.rank == rank]
    if not groups:
        return False, f"rank {rank}/{manifest.tp}: no MXFP4 experts"
    group = groups[0] if layer is None else next(g for g in groups if g.name.startswith(f"model.layers.{layer}."))
    lay = layouts.get_layout(group.layout)
    label = lay.runtime_attrs.get("scale_swizzle")
    held = layouts.load_rank(manifest.root, rank, manifest=manifest)
    w13, w2 = (held[f"{group.name}.{p}_weight"] for p in ("w13", "w2"))
    s13, s2 = (held[f"{group.name}.{p}_weight_scale"] for p in ("w13", "w2"))
    # as ATOM's Triton MoE holds them (moe.py _process_weight_layout_after_loading): transposed views
    w13_t, w2_t, s13_t, s2_t = w13.transpose(-2, -1), w2.transpose(-2, -1), s13.transpose(-1, -2), s2.transpose(-1, -2)
    mlp = group.name[:-len(".experts")]
    slots = [e[len(mlp) + 1:] for e in group.experts]
    ref13, ref2 = source_experts(src, mlp, slots, rank, manifest.tp, w13.shape[1] // 2, w2.shape[1])
    gen = torch.Generator().manual_seed(seed)
    hidden = w13.shape[-1] * 2
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(torch.bfloat16)
    logits = torch.randn(tokens, len(slots), generator=gen)
    rd, gather, scatter = routing.routing(logits, 2, sm_first=False)

    def rel(got, want) -> float:
        return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()

    results, ok = [], True
    for act in ("a16w4", "a4w4"):
        def gemm(inp, w, s, lab, **kw):
            if act == "a16w4":
                return a16.moe_gemm_a16w4(inp, w, None, s, routing_data=rd, swizzle_mx_scale=lab, **kw), inp
            q, qs = a4.mxfp4_quant(inp)  # aiter's own activation quant; the reference takes its values
            deq = layouts.mxfp4.dequantize(q.view(torch.uint8), qs.view(torch.uint8)[:, :inp.shape[1] // 32], k=inp.shape[1])
            return a4.moe_gemm_a4w4(q, w, qs, s, routing_data=rd, swizzle_mx_scale=lab, **kw), deq.to(torch.bfloat16)

        mid, x_in = gemm(x, w13_t, s13_t, label, gather_indx=gather)
        want13 = a16.moe_gemm_torch(x_in, ref13, None, rd, gather_indx=gather)
        inter = mid.shape[1] // 2
        act_out = (torch.nn.functional.silu(mid[:, :inter].float()) * mid[:, inter:].float()).to(torch.bfloat16)
        out, a_in = gemm(act_out, w2_t, s2_t, label, scatter_indx=scatter, gammas=rd.gate_scal)
        want2 = a16.moe_gemm_torch(a_in, ref2, None, rd, scatter_indx=scatter, gammas=rd.gate_scal)
        e13, e2 = rel(mid, want13), rel(out, want2)
        ok &= e13 <= TOLERANCE and e2 <= TOLERANCE
        results.append(f"{act} w13 {e13:.4f} w2 {e2:.4f}")
    # the same bytes read as raw (no swizzle label; or, for a raw layout, as swizzled): must be off
    wrong = None if label else "CDNA4_SCALE"
    raw, _ = a16.moe_gemm_a16w4(x, w13_t, None, s13_t, routing_data=rd, swizzle_mx_scale=wrong, gather_indx=gather), None
    off = rel(raw, a16.moe_gemm_torch(x, ref13, None, rd, gather_indx=gather))
    control = not off <= TOLERANCE  # NaN counts as off
    ok &= control
    line = (f"rank {rank}/{manifest.tp}: {group.name} ({lay.name}, scale label {label}), {len(slots)} experts, "
            f"relative error {'; '.join(results)}; read with label {wrong}: {off:.3g} "
            f"({'off, as it must be' if control else 'NOT off: the check cannot tell'}): {'ok' if ok else 'FAIL'}")
    return ok, line


def check(source: pathlib.Path, converted: pathlib.Path, aiter_dir: pathlib.Path, layer: int | None = None,
          tokens: int = 16, seed: int = 0, ranks: list[int] | None = None) -> tuple[bool, list[str]]:
    import layouts
    from prep.source import SourceCheckpoint

    mods = load_aiter_moe(aiter_dir)
    manifest = layouts.load_manifest(converted)
    src = SourceCheckpoint(source)
    lines, ok = [], True
    for rank in range(manifest.tp) if ranks is None else ranks:
        good, line = check_rank(mods, src, manifest, rank, layer, tokens, seed + rank)
        ok &= good
        lines.append(line)
    return ok, lines
