"""Time and peak memory of one reference forward (`prep run`), source against converted.

Baseline: the source checkpoint (run first, then the converted one: not alternated, each
loads its weights once). Without --src, generates the tiny default checkpoint (or, with --size large, a wider one:
hidden 2048, 64 experts, 8 layers; for the GPU). Converts it (preshuffle + ck, --tp), then for the
source and the converted checkpoint: weight load time (dequantized to float32 logical matrices,
converted ranks combined), forward time (best of --repeat) and peak memory (host RSS; on CUDA
also torch.cuda.max_memory_allocated: the process's peaks so far, so the converted row's
includes the source's), and checks the logits are identical.

Example:
    python scripts/bench.py run --device cuda --size large --tokens 256
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import shutil
import tempfile
import time

import torch

from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.reference.model import DeepseekV3, ForwardOptions
from prep.reference.weights import load_weights
from prep.testing import SynthSpec, write_checkpoint

from .common.args import add_repeat
from .common.table import Table

ATOM = get_engine("atom")  # the engine this benchmark converts for and runs as

LARGE = SynthSpec(hidden_size=2048, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                  v_head_dim=64, num_attention_heads=16, intermediate_size=4096, moe_intermediate_size=512,
                  n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=8,
                  vocab_size=8192, num_shards=8, random_bytes=True, variant="v2")


def measure(path: pathlib.Path, ids: torch.Tensor, device: str, layers, repeat: int) -> dict:
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    w = load_weights(path)
    if device != "cpu":
        w.to(device)
        torch.cuda.synchronize()
    load = time.perf_counter() - t0
    model = DeepseekV3(w, ForwardOptions(engine=ATOM, gemm_path=ATOM.default_gemm_path), layers=layers)
    times, logits = [], None
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        logits = model(ids, device)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"load_s": load, "forward_s": times[1:], "first_forward_s": times[0], "logits": logits.cpu(),
           "host_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device != "cpu":
        out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--src", type=pathlib.Path)
    ap.add_argument("--size", choices=["tiny", "large"], default="tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int)
    add_repeat(ap, 3, "timed forwards of each (after an untimed first)")


def run(args: argparse.Namespace) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="prep-bench-run-"))
    try:
        src = args.src
        if src is None:
            t0 = time.perf_counter()
            src = write_checkpoint(LARGE if args.size == "large" else SynthSpec(variant="v2"), work / "src")
            print(f"generated {args.size} checkpoint in {time.perf_counter() - t0:.1f} s")
        conv = work / "converted"
        convert(str(src), conv, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=args.tp))
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
        results = {"source": measure(src, ids, args.device, args.layers, args.repeat),
                   "converted": measure(conv, ids, args.device, args.layers, args.repeat)}
        table = Table("source", title=f"{args.tokens} tokens, device {args.device}, "
                                      f"converted = preshuffle+ck tp {args.tp}")
        for name, r in results.items():
            gpu = {"gpu_peak": f"{r['gpu_peak_mib']:.0f} MiB"} if "gpu_peak_mib" in r else {}
            table.add(name, r["load_s"], case="load weights", host_peak_rss=f"{r['host_rss_mib']:.0f} MiB", **gpu)
        for name, r in results.items():
            table.add(name, r["forward_s"], case="forward", first=f"{r['first_forward_s'] * 1e3:.1f} ms")
        table.print()
        print(f"logits identical: {torch.equal(results['source']['logits'], results['converted']['logits'])}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
