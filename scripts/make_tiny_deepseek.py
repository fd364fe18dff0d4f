#!/usr/bin/env python
"""Write a synthetic DeepSeek-V3 checkpoint in AMD Quark MXFP4 format (no network needed).

Why: tests and benchmarks of `prep` need a faithful Quark checkpoint (names, shards, config,
MTP quirks) without downloading ~350 GiB. See prep/testing/ for what is written. Peak memory
is about twice the largest shard: 4.1 GB for --preset real-dims, 1.3 GB for bench.

    .venv/bin/python scripts/make_tiny_deepseek.py OUT [--preset tiny|bench|r1-0528-fp8|...] [--variant r1-0528|v2|mtp-moefp4|fp8-block]
        [--shards N] [--layers N] [--experts N] [--hidden N] [--seed N] [--random-bytes]

DeepSeek's own FP8 release (``--variant fp8-block``) converts at TP 2 from ``--preset r1-0528-fp8``
(R1's head dims): the default tiny's ``q_b_proj`` leaves a rank part of a 128x128 block, which
prep refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

try:
    from prep import testing as synth
except ImportError:  # run from a checkout without an installed `prep`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from prep import testing as synth


def spec_from_args(args: argparse.Namespace) -> synth.SynthSpec:
    """The preset's spec with the command-line overrides applied (routing knobs kept valid)."""
    base = synth.PRESETS[args.preset]
    changes: dict[str, object] = {}
    for field, value in (("variant", args.variant), ("num_shards", args.shards), ("num_hidden_layers", args.layers),
                         ("hidden_size", args.hidden), ("seed", args.seed)):
        if value is not None:
            changes[field] = value
    if args.layers is not None:
        changes["first_k_dense_replace"] = min(base.first_k_dense_replace, args.layers)
    if args.experts is not None:
        e = args.experts
        # Keep DeepSeek's group routing consistent: n_group must divide E, top-k must fit.
        n_group = max(g for g in range(1, min(base.n_group, e) + 1) if e % g == 0)
        topk_group = min(base.topk_group, n_group)
        changes.update(n_routed_experts=e, n_group=n_group, topk_group=topk_group,
                       num_experts_per_tok=min(base.num_experts_per_tok, topk_group * (e // n_group)))
    if args.random_bytes:
        changes["random_bytes"] = True
    return dataclasses.replace(base, **changes)


class _Bar:
    """A tqdm bar over the bytes generated, on stderr (called with done, total)."""

    bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:  # the total is known at the first call
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(quiet: bool) -> "_Bar | None":
    return None if quiet or not sys.stderr.isatty() else _Bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument("--preset", choices=sorted(synth.PRESETS), default="tiny")
    parser.add_argument("--variant", choices=synth.VARIANTS)
    parser.add_argument("--shards", type=int, help="number of safetensors shards")
    parser.add_argument("--layers", type=int, help="num_hidden_layers (the MTP layer comes on top)")
    parser.add_argument("--experts", type=int, help="routed experts per MoE layer")
    parser.add_argument("--hidden", type=int, help="hidden_size")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--random-bytes", action="store_true", help="random codes/scales instead of quantizing (fast)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar (it shows only on a terminal)")
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
        start = time.perf_counter()
        bar = _progress_bar(args.quiet)
        try:
            out = synth.write_checkpoint(spec, args.out, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    except ValueError as exc:
        parser.error(str(exc))
    elapsed = time.perf_counter() - start
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total, tensors = index["metadata"]["total_size"], len(index["weight_map"])
    files = len(list(out.iterdir()))
    print(f"{out}: {tensors} tensors, {total} bytes ({total / 2**30:.3f} GiB), {files} files "
          f"({spec.num_shards} shards), variant {spec.variant}, {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
