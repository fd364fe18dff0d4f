"""The verbs of the reference engine: ``run`` (a checkpoint's forward on the CPU or a GPU) and
``compare`` (two checkpoints on the same tokens)."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import click

from ..errors import PrepError
from ..progress import Progress
from .app import (_FromLayouts, _checkpoint_dir, _default_engine, _emit, _fail_cleanly, _gemm_paths, _quiet_option,
                  main)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise PrepError(f"--prompt-ids {text!r}: give comma-separated integer token ids, e.g. 1,2,3") from None


_RUN_OPTIONS = [
    click.option("--prompt-ids", required=True, help="Comma-separated token ids, e.g. 0,17,42."),
    click.option("--layers", type=int, help="Run only the first N decoder layers."),
    click.option("--device", default="cpu", show_default=True, help="cpu or cuda (the fused op uses prep's Triton kernel there)."),
    click.option("--act-quant/--no-act-quant", default=True, show_default=True,
                 help="Quantize GEMM inputs to MXFP4 as the kernels do (off: weight-only emulation)."),
    click.option("--gemm-path", type=_FromLayouts(_gemm_paths),
                 help="Emulate this GEMM path's activation flags (default: the one that reads the checkpoint: of "
                      "the engine it was converted for; a source is read as ATOM, prep's default engine, reads it)."),
    click.option("--gemm", type=click.Choice(["torch", "aiter-triton"]), default="torch", show_default=True,
                 help="Who computes the dense MXFP4 GEMMs: torch (dequantize and matmul in float32) or aiter-triton "
                      "(aiter's own Triton GEMM for the checkpoint's dense layout, on its stored bytes, rank by rank; "
                      "interpreted on the CPU, needs triton >= 3.8 and aiter's files, see --aiter-dir). MoE experts "
                      "always run on torch."),
    click.option("--aiter-dir", type=click.Path(file_okay=False),
                 help="Folder of the amd-aiter wheel's files for --gemm aiter-triton (default: $PREP_AITER_DIR, else "
                      ".cache/aiter-oracle, filled by `python scripts/fetch_aiter_oracle.py`; an installed aiter "
                      "is used on a ROCm GPU)."),
    click.option("--verify/--no-verify", "verify", default=True, show_default=True,
                 help="Check the hash of every tensor of a converted checkpoint that the forward reads, before it "
                      "runs (a damaged file stops the run, naming the tensor)."),
    click.option("--max-memory", type=click.FloatRange(min=0.25), default=8.0, show_default=True, metavar="GIB",
                 help="Bound on this process's memory (resident set, GiB): dequantized matrices are kept while the "
                      "process, activations and torch included, stays under it, least recently used dropped first; a "
                      "matrix over 64 MiB in float32 is made and multiplied in row blocks, an embedding read at the "
                      "prompt's rows only; room is kept for the block being made and the position map it may derive. "
                      "On DeepSeek's real widths at TP 1 the process peaked at 0.94 GiB with --max-memory 1, 1.93 with "
                      "2, 7.49 with 8 (docs/BENCHMARKS.md). Below a floor (torch, the block being made: ~0.8 GiB "
                      "there) it cannot hold; the run prints its peak and says so. The logits do not depend on it."),
    click.option("--prefill", type=click.IntRange(min=1), metavar="K",
                 help="Decode as an engine does: the first K prompt ids as one prefill, then each other id as one "
                      "decode step (teacher-forced: the logits of every id, as without it), against the cache "
                      "--kv-cache says."),
    click.option("--kv-cache", type=click.Choice(["latent", "none"]), default="latent", show_default=True,
                 help="With --prefill or --generate: latent keeps per token and layer only the compressed KV and the "
                      "rope key (kv_lora_rank + qk_rope_head_dim values) and absorbs kv_b_proj into the query and "
                      "the output, as engines decode MLA; none computes every step again from its whole prefix."),
    click.option("--generate", type=click.IntRange(min=0), default=0, metavar="N",
                 help="After the prompt, N greedy tokens (decode steps), printed with the argmax."),
    click.option("--latent-kv", is_flag=True,
                 help="Compute the full forward's keys and values as the latent decode does (BF16 normed KV, no "
                      "MXFP4 quant, float32 keys): the two then agree to float32 precision, which checks the latent "
                      "path; without it they differ by the prefill's own rounding."),
    click.option("--mla-order", type=click.Choice(["reference", "sglang"]), default="reference", show_default=True,
                 help="How a latent decode multiplies by kv_b_proj's halves: reference (float32 W_UK/W_UV, BF16 "
                      "queries and cache) or sglang (SGLang's ROCm MXFP4 decode: the query and the attention output "
                      "quantized to MXFP4, W_UK and W_UV re-quantized to MXFP4, W_UK along its nope dim)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON summary."),
    _quiet_option,
]


def _run_options(fn: Callable) -> Callable:
    for opt in reversed(_RUN_OPTIONS):
        fn = opt(fn)
    return fn


def _with_run_bars(fn: Callable, as_json: bool, quiet: bool, *args, **kwargs) -> dict[str, Any]:
    """``fn`` (run or compare) with a bar over the bytes it hashes and one over the layers it runs."""
    check, layers = Progress.shown("check", as_json, quiet), Progress.shown("forward", as_json, quiet, unit="layer")
    try:
        return fn(*args, **kwargs, progress={"check": check, "forward": layers})
    finally:
        check.close()
        layers.close()


def _hashes_line(checked: int | None, converted: bool, short: bool = False) -> str:
    """What the run checked: ``checked`` tensors' hashes, or why none (a source, --no-verify)."""
    if not converted:
        what = "a source (no manifest hashes)"
    elif checked is None:
        what = "not checked (--no-verify)"
    else:
        what = f"{checked} tensors read match the manifest"
    return what if short else f"hashes: {what}"


@main.command(name="run")
@click.argument("model_dir")
@_run_options
@click.option("--save-logits", type=click.Path(dir_okay=False), help="Write the logits of every position to this .safetensors file.")
@click.option("--assume-layout", help="Read MXFP4 tensors as this layout, skipping the compatibility check (to see "
                                      "a mismatch: the logits are garbage by design, and a warning says so).")
@_fail_cleanly
def run_cmd(model_dir, prompt_ids, layers, device, act_quant, gemm_path, gemm, aiter_dir, verify, max_memory, prefill,
            kv_cache, generate, latent_kv, mla_order, as_json, quiet, save_logits, assume_layout):
    """Run the reference DeepSeek-V3 forward on MODEL_DIR (a Quark source, as a folder or a
    Hugging Face repo id, or a converted checkpoint at any layout and TP; ranks are combined
    in-process) and print the logits' argmax.

    Converted checkpoints are loaded through the runtime module (manifest and compatibility
    checks, load_rank), and each MXFP4 weight is read in its stored layout.

    \b
    Examples:
      prep run r1-tp8 --prompt-ids 0,100,200 --save-logits logits.safetensors
      prep run ./tiny --prompt-ids 1,2,3 --layers 2 --no-act-quant
      prep run r1-tp2 --prompt-ids 1,2,3 --gemm aiter-triton
    """
    import torch

    from ..reference.run import run

    model_dir = _checkpoint_dir(model_dir)
    if save_logits and not os.path.isdir(os.path.dirname(os.path.abspath(save_logits))):
        raise PrepError(f"--save-logits {save_logits}: its folder does not exist")
    r = _with_run_bars(run, as_json, quiet, model_dir, _ids(prompt_ids), layers=layers, device=device,
                       act_quant=act_quant, gemm_path=gemm_path, source_engine=_default_engine(),
                       assume_layout=assume_layout, verify=verify,
                       gemm=gemm, aiter_dir=aiter_dir, max_memory=int(max_memory * 2**30), prefill=prefill,
                       kv_cache=kv_cache, generate=generate, latent_kv=latent_kv, mla_order=mla_order)
    if assume_layout:
        # On stderr even with --json (stdout stays one JSON object), just before the results: a
        # reader of the argmax must not mistake it for the model's output.
        click.echo(f"WARNING: --assume-layout {assume_layout}: the checkpoint's bytes were read as a layout they are "
                   "not in, past the compatibility check; these logits are GARBAGE BY DESIGN (they show what a "
                   "layout mismatch does; never serve or compare them)", err=True)
        r["warning"] = f"--assume-layout {assume_layout}: logits are garbage by design"
    logits = r.pop("logits")
    bad = (~torch.isfinite(logits)).nonzero()
    if bad.numel() and not assume_layout:  # an argmax of NaN is no answer (--assume-layout says so itself)
        raise PrepError(f"{model_dir}: the forward gave non-finite logits (NaN or inf) from position "
                        f"{int(bad[0, 0])} of {logits.shape[0]}: the weights or config.json hold values it cannot "
                        "compute with; nothing reported or written")
    if save_logits:
        from safetensors.torch import save_file

        tmp = save_logits + ".tmp"
        save_file({"logits": logits.contiguous()}, tmp, metadata={"model": str(model_dir), "prompt_ids": prompt_ids})
        os.replace(tmp, save_logits)
    r["argmax"] = logits.argmax(-1).tolist()
    _emit(r, as_json, [f"{r['weights']}: {r['layers']} layers, gemm path {r['gemm_path']}, act quant {r['act_quant']}"
                       f"{', dense GEMMs on aiter-triton' if gemm == 'aiter-triton' else ''}",
                       _hashes_line(r["hashes_checked"], r["converted"]),
                       f"load {r['load_s']:.2f} s, forward {r['forward_s']:.2f} s; argmax per position: {r['argmax']}",
                       *_decode_lines(r), *_memory_line(r)]
          + ([f"logits written to {save_logits}"] if save_logits else []))


def _decode_lines(r: dict) -> list[str]:
    """What a --prefill / --generate run decoded, and the cache it held."""
    if "kv_cache" not in r:
        return []
    steps, made = len(r["argmax"]) - r["prefill"], len(r["generated"])
    cache = (f"a latent cache of {r['kv_cache_bytes_per_token']} bytes per token (per-head keys and values would be "
             f"{r['per_head_kv_bytes_per_token']})" if r["kv_cache"] == "latent" else "no cache (each step recomputed)")
    return [f"decode: prefill of {r['prefill']}, then {steps} steps" + (f" and {made} generated" if made else "")
            + f", with {cache}"] + \
        ([f"generated: {r['generated']}"] if r["generated"] else [])


def _memory_line(r: dict) -> list[str]:
    """The process's peak memory against --max-memory; over it, what the floor is made of."""
    if r.get("peak_rss") is None:
        return []
    peak, bound = r["peak_rss"] / 2**30, r["max_memory"] / 2**30
    if peak <= bound:
        return [f"peak memory {peak:.2f} GiB (--max-memory {bound:g})"]
    return [f"peak memory {peak:.2f} GiB: over --max-memory {bound:g}, below what this checkpoint needs at least "
            "(torch, the prompt's activations, the block of rows being made and its position map); "
            f"give --max-memory {math.ceil(peak * 4) / 4:g} or more"]


@main.command()
@click.argument("a")
@click.argument("b")
@_run_options
@click.option("--tolerance", type=float, default=0.0, show_default=True, help="Largest |logit difference| that passes.")
@click.option("--rtol", type=float, default=0.0, show_default=True,
              help="Also pass differences up to RTOL times A's largest |logit| (torch vs aiter-triton: 0.00390625, "
                   "one BF16 rounding step; docs/consumer-kernels.md derives it).")
@click.option("--gemm-a", type=click.Choice(["torch", "aiter-triton"]), help="--gemm for A only.")
@click.option("--gemm-b", type=click.Choice(["torch", "aiter-triton"]), help="--gemm for B only.")
@click.option("--prefill-b", type=click.IntRange(min=1), metavar="K",
              help="--prefill for B only: A's full forward against B decoded with --kv-cache (e.g. the same checkpoint "
                   "twice, to see what decoding against a latent cache changes).")
@_fail_cleanly
def compare(a, b, prompt_ids, layers, device, act_quant, gemm_path, gemm, aiter_dir, verify, max_memory, prefill,
            kv_cache, generate, latent_kv, mla_order, as_json, quiet, tolerance, rtol, gemm_a, gemm_b, prefill_b):
    """Run checkpoints A and B on the same tokens and compare their logits (exit 1 above --tolerance).

    A converted checkpoint computes the same model as its source bit for bit: the layouts only
    move bytes. Use this before putting a conversion behind a server. A and B are folders; a
    source may also be a Hugging Face repo id, as for convert. A and B run one after the other,
    each within --max-memory.

    To compare aiter's own GEMMs with prep's on one checkpoint, give it twice with
    --gemm-b aiter-triton (or two checkpoints, each with its --gemm-a / --gemm-b).

    \b
    Examples:
      prep compare amd/DeepSeek-R1-0528-MXFP4 r1-tp8 --prompt-ids 0,100,200 --layers 4
      prep compare r1-tp2 r1-tp2 --gemm-b aiter-triton --prompt-ids 1,2,3 --rtol 0.00390625
    """
    from ..reference.run import compare as run

    a, b = _checkpoint_dir(a), _checkpoint_dir(b)
    r = _with_run_bars(run, as_json, quiet, a, b, _ids(prompt_ids), layers=layers, device=device, act_quant=act_quant,
                       gemm_path=gemm_path, source_engine=_default_engine(), verify=verify, gemm=gemm, gemm_a=gemm_a,
                       gemm_b=gemm_b, aiter_dir=aiter_dir,
                       max_memory=int(max_memory * 2**30), prefill=prefill, kv_cache=kv_cache, generate=generate,
                       latent_kv=latent_kv, mla_order=mla_order, prefill_b=prefill_b)
    bad = [k.upper() for k, ok in r["finite"].items() if not ok]
    allowed = tolerance + rtol * r["max_abs_logit"]
    failure = None
    if bad:
        failure = f"logits of {' and '.join(bad)} are not finite (NaN or inf): that checkpoint computes garbage"
    elif r["max_abs_diff"] > allowed:
        failure = (f"logits differ by {r['max_abs_diff']:.6g} > --tolerance {tolerance}"
                   + (f" + --rtol {rtol} x max |logit| {r['max_abs_logit']:.6g}" if rtol else ""))
    if failure and as_json:  # one JSON object, the measurements in it
        raise PrepError(failure, result=r)
    _emit(r, as_json, [f"A: {r['a']}" + (f" (gemm {r['gemm_a']})" if r["gemm_a"] != r["gemm_b"] else ""),
                       f"B: {r['b']}" + (f" (gemm {r['gemm_b']})" if r["gemm_a"] != r["gemm_b"] else ""),
                       f"hashes: A {_hashes_line(r['hashes_checked']['a'], r['converted']['a'], short=True)}, "
                       f"B {_hashes_line(r['hashes_checked']['b'], r['converted']['b'], short=True)}",
                       f"max |logit difference| {r['max_abs_diff']:.6g} (max |logit| {r['max_abs_logit']:.4g}) "
                       f"over {r['tokens']} positions"
                       f"{' (identical bit for bit)' if r['identical'] else ''}; argmax agrees on "
                       f"{100 * r['argmax_agree']:.1f}%", *_memory_line(r)])
    if failure:
        raise PrepError(failure)
