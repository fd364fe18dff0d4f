#!/usr/bin/env python3
"""The sha256 of every file of a fixed matrix of conversions, for "this change moved no byte".

    python scripts/conversion_matrix.py WORKDIR [--out hashes.json]

Generates both variants of the tiny checkpoint into WORKDIR (deterministic: the same bytes on
every run), converts each into every combination of dense layout x MoE layout x TP 1/2/4, plus
EP 2, and prints one line per conversion: its name, the sha256 of its manifest and a sha256 over
all its files. Run it before and after a refactor in the same WORKDIR (the manifest records the
source's path) and diff the two outputs; ``--out`` also writes every file's sha256 as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def matrix():
    """(variant, engine, dense layout, MoE layout, tp, ep): ATOM's layouts on both MXFP4 variants,
    each engine's own conversion, the FP8 variants, and Kimi-K2's shape (384 experts, 64 heads)."""
    for variant in ("r1-0528", "v2"):
        for layout in ("preshuffle", "non-shuffle"):
            for moe in ("ck", "triton"):
                for tp in (1, 2, 4):
                    yield variant, "atom", layout, moe, tp, 1
            yield variant, "atom", layout, "ck", 2, 2
        yield variant, "sglang", "non-shuffle", "ck-3d", 2, 1
        yield variant, "vllm", "non-shuffle-t", "ck-3d", 2, 2
    yield "mtp-moefp4", "atom", "preshuffle", "ck", 2, 1
    yield "mtp-moefp4", "vllm", "non-shuffle-t", "ck-3d", 2, 2
    yield "fp8-block", "atom", "preshuffle", "ck", 1, 1
    yield "kimi-k2", "atom", "preshuffle", "ck", 2, 1
    yield "kimi-k2", "vllm", "non-shuffle-t", "ck-3d", 2, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, help="write {conversion: {file: sha256}} here")
    args = ap.parse_args()

    from prep.convert import convert
    from layouts.engines import get_engine
    from prep.deepseek import target_for

    def target(engine, layout, moe, tp, ep):
        return target_for(get_engine(engine), layout=layout, moe_layout=moe, tp=tp, ep=ep)
    from prep.testing import PRESETS, SynthSpec, write_checkpoint

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    srcs = {}
    for v in ("r1-0528", "v2", "mtp-moefp4", "fp8-block", "kimi-k2"):
        srcs[v] = work / f"src-{v}"
        if not (srcs[v] / "config.json").is_file():
            write_checkpoint(PRESETS[v] if v in PRESETS else SynthSpec(variant=v), srcs[v])
    table = {}
    for variant, engine, layout, moe, tp, ep in matrix():
        name = f"{variant}-{engine}-{layout}-{moe}-tp{tp}-ep{ep}"
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        convert(str(srcs[variant]), out, target(engine, layout, moe, tp, ep))
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
        table[name] = files
        whole = hashlib.sha256("".join(f"{k} {v}\n" for k, v in files.items()).encode()).hexdigest()
        print(f"{name:42s} manifest {files['prep-manifest.json'][:16]}  all files {whole[:16]}", flush=True)
        shutil.rmtree(out)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
