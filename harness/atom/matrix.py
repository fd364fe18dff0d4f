"""``check-atom-matrix``: the ATOM install check (:mod:`harness.atom.install`) over a matrix of
configurations (checkpoint variant, ATOM's dense GEMM path, TP, EP), each written with
``prep.testing`` (tiny, or ``--preset``) and converted with prep here.

ATOM's derivation of ``W_K``/``W_V`` from an MXFP4 ``kv_b_proj`` (v2) runs where aiter's Triton
kernel takes ``kv_lora_rank`` as K (:func:`harness.atom.mla.mla_gemm_runs`: the tiny v2's 128
only on the non-shuffle path, hence ``v2-wide``); elsewhere that one step is skipped in both
loads alike.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Iterator

from harness.atom import mla, on_cpu
from harness.atom.install import Case, check_rank
from harness.report import RankResult
from layouts.engines.atom import ASM, PROFILE, TRITON_NON_SHUFFLE, TRITON_PRESHUFFLE
from layouts.errors import LayoutsError
from prep.errors import PrepError
from prep.testing import PRESETS, SynthSpec, write_checkpoint

# The checkpoints: prep.testing's tiny one of each variant (or another preset's: --preset), and
# with the tiny one R1-0528 "wide": 16 heads (o_proj [256, 512], wider than tall as R1's [7168,
# 16384]) and moe_intermediate 320 (ATOM and prep pad the experts' intermediate to 512 at TP 1).
WIDE = SynthSpec(variant="r1-0528", num_attention_heads=16, moe_intermediate_size=320)
# v2 "wide": kv_lora_rank 256, which aiter's preshuffle GEMM takes as K (the tiny one's 128 it
# cannot), so that ATOM's MXFP4 W_K/W_V derivation runs on the asm path too (mla_from_mxfp4).
V2_WIDE = SynthSpec(variant="v2", q_lora_rank=256, kv_lora_rank=256, v_head_dim=64)
VARIANTS = ("r1-0528", "v2")
NAME_WIDTH = 34  # the engine column holds the configuration's name


def default_cases() -> list[Case]:
    """Both variants on the default (asm) and non-shuffle paths at TP 1-8, R1-0528 on the
    triton-preshuffle path (ATOM cannot load MXFP4 attention there: the profile refuses it),
    expert parallel, the wide R1-0528, and the v2 whose kv_lora_rank the preshuffle GEMM takes."""
    cases = [Case(v, p, tp) for v in VARIANTS for p in (ASM, TRITON_NON_SHUFFLE) for tp in (1, 2, 4, 8)]
    cases += [Case("r1-0528", TRITON_PRESHUFFLE, tp) for tp in (1, 2, 4, 8)]
    cases += [Case(v, ASM, 2, 2) for v in VARIANTS] + [Case("r1-0528", TRITON_NON_SHUFFLE, 4, 4)]
    cases += [Case("r1-0528", ASM, 8, 8), Case("v2", TRITON_NON_SHUFFLE, 8, 8)]
    cases += [Case("v2-wide", ASM, tp) for tp in (1, 2)] + [Case("v2-wide", ASM, 2, 2),
                                                             Case("v2-wide", TRITON_NON_SHUFFLE, 2)]
    return cases + [Case("r1-wide", p, tp) for p in (ASM, TRITON_NON_SHUFFLE) for tp in (1, 2)] + \
        [Case("r1-wide", ASM, 2, 2)]


def source_specs(preset: str, layers: int | None) -> dict[str, SynthSpec]:
    """The checkpoints to check: each variant at the preset's dims (``layers`` decoder layers),
    and the wide R1-0528 and v2 with the tiny preset."""
    base = PRESETS[preset]
    if layers:
        base = dataclasses.replace(base, num_hidden_layers=layers,
                                   first_k_dense_replace=min(base.first_k_dense_replace, layers))
    specs = {v: dataclasses.replace(base, variant=v) for v in VARIANTS}
    return specs | ({"r1-wide": WIDE, "v2-wide": V2_WIDE} if base == PRESETS["tiny"] else {})


def write_sources(work: pathlib.Path, specs: dict[str, SynthSpec]) -> dict[str, pathlib.Path]:
    """The checkpoints, written once per work folder."""
    sources = {v: work / f"src-{v}" for v in specs}
    for v, path in sources.items():
        if not (path / "config.json").is_file():
            write_checkpoint(specs[v], path)
    return sources


def converted(case: Case, sources: dict[str, pathlib.Path], work: pathlib.Path) -> pathlib.Path | str:
    """The case's conversion (made once), or prep's one-line refusal."""
    from prep.convert import convert
    from prep.deepseek import target_for

    out = work / case.name.replace(" ", "-")
    if not (out / "config.json").is_file():
        try:
            convert(str(sources[case.variant]), out, target_for(PROFILE, layout=case.layout, tp=case.tp, ep=case.ep))
        except (PrepError, LayoutsError) as e:  # a layout the tiny dims cannot take at this TP
            return str(e).splitlines()[0]
    return out


def run(trees: tuple[pathlib.Path, pathlib.Path], work: pathlib.Path, only: list[str] | None = None,
        preset: str = "tiny", layers: int | None = None, aiter_triton_dir: str | None = None,
        gpu_arch: str = "gfx950") -> Iterator[str | RankResult]:
    """Every configuration whose name contains one of ``only`` (default all), every rank; yields
    what to say, then each rank's result."""
    specs = source_specs(preset, layers)
    data = work / f"{preset}-{layers or 'all'}"
    sources = write_sources(data, specs)
    kernels = mla.mla_kernels(aiter_triton_dir)
    # Convert first: prep runs before ATOM's stand-ins exist (harness.atom.on_cpu).
    cases = [(c, converted(c, sources, data)) for c in default_cases()
             if c.variant in specs and (not only or any(t in c.name for t in only))]
    on_cpu.install(*trees, gpu_arch)
    logging.getLogger("atom").setLevel(logging.WARNING)  # its warnings are what we look for
    if kernels is not None:
        for path in sorted({c.path for c, _ in cases}):
            yield f"kv_b_proj GEMM of ATOM's MXFP4 W_K/W_V derivation on the {path} path: {mla.MLA_GEMM[path]}"
    for case, out in cases:
        if isinstance(out, str):
            yield f"{case.name} refused by prep: {out}"
            continue
        for rank in range(case.tp):
            derive = kernels if mla.mla_gemm_runs(case.path, specs[case.variant].kv_lora_rank) else None
            yield check_rank(case, sources[case.variant], out, rank, derive)
