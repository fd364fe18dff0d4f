"""Peak memory (RSS) of every prep command, each run as a process of its own, on one generated
checkpoint: this tree against a baseline tree (another git revision), in the same run.

Baseline: ``--baseline REV`` (default main; '' for none), each command run with it first, then
with this tree. WORK holds the generated source (``WORK/src``, reused when present: generating 13 GiB takes
minutes), its conversion (``WORK/out``) and each revert's output (deleted after it is measured).
The baseline is the revision's files unpacked with ``git archive`` into ``WORK/baseline``; both
trees run with the same interpreter, their own folder first on ``PYTHONPATH``.

Peak RSS is the kernel's high-water mark of the process (``ru_maxrss`` from ``wait4``): anonymous
memory and the file pages it has mapped and touched, as a user's ``top`` or an OOM killer sees
it. ``convert`` runs with this tree only (its memory is not what changed). The table goes to
stdout, one JSON object per run to ``WORK/bench_memory.jsonl``.

Example:
    python scripts/bench.py memory /tmp/mem --source-layers 2 --tp 8 --baseline HEAD~1 --only verify,revert
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from prep import testing as synth

from .common.table import GiB, Table
from .common.trees import REPO, unpack


def measure(cmd: list[str], tree: pathlib.Path) -> dict:
    """Run ``cmd`` with ``tree`` first on the path; its peak RSS (bytes), wall time, exit code."""
    t0 = time.perf_counter()
    rc, peak, out = synth.run_measured(cmd, {"PYTHONPATH": str(tree)}, cwd=str(tree))  # -m: cwd comes first
    return {"peak_rss": peak, "wall_s": time.perf_counter() - t0, "rc": rc, "tail": out.strip().splitlines()[-1:]}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("--preset", default="real-dims")
    ap.add_argument("--source-layers", type=int, help="the generator's --layers (real-dims has 1; 2 is 18.8 GiB)")
    ap.add_argument("--tp", type=int, default=1, help="convert's --tp")
    ap.add_argument("--src-dir", type=pathlib.Path, help="the source's folder (default WORK/src): e.g. in RAM "
                    "(/dev/shm) when the disk cannot hold the source, its conversion and a revert at once")
    ap.add_argument("--revert-dir", type=pathlib.Path, help="revert's output (default WORK/reverted), as --src-dir")
    ap.add_argument("--baseline", default="main", help="git revision to compare against ('' for none)")
    ap.add_argument("--layers", type=int, default=1, help="compare's --layers")
    ap.add_argument("--prompt-ids", default="0,1,2,3")
    ap.add_argument("--max-memory", type=float, nargs="+",
                    help="compare's --max-memory in GiB, one run per value, for both trees (default: their own)")
    ap.add_argument("--only", help="comma-separated commands to run (convert,verify,revert,compare)")
    ap.add_argument("--keep", action="store_true", help="keep WORK/src and WORK/out afterwards")


def run(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    src, out = (args.src_dir or work / "src").resolve(), work / "out"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        layers = ["--layers", str(args.source_layers)] if args.source_layers else []
        subprocess.run([py, str(REPO / "scripts/make_tiny_deepseek.py"), str(src), "--preset", args.preset, *layers, "-q"],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
    trees = [("this", REPO)]
    if args.baseline:
        trees.insert(0, (f"baseline {args.baseline}", unpack(args.baseline, work / "baseline")))
    only = set(args.only.split(",")) if args.only else {"convert", "verify", "revert", "compare"}
    prep = [py, "-m", "prep"]
    rows = []

    def record(command: str, tree_name: str, result: dict) -> None:
        rows.append((command, tree_name, result))
        with open(work / "bench_memory.jsonl", "a") as f:
            f.write(json.dumps({"command": command, "tree": tree_name, "checkpoint_bytes": size, **result}) + "\n")
        print(f"  {command} ({tree_name}): peak RSS {result['peak_rss'] / GiB:.2f} GiB, {result['wall_s']:.1f} s, "
              f"rc {result['rc']}", flush=True)

    print(f"checkpoint {src}: {size / GiB:.2f} GiB, largest shard {largest / GiB:.2f} GiB")
    if "convert" in only or not (out / "prep-complete.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        record("convert", "this", measure([*prep, "convert", str(src), "-o", str(out), "--tp", str(args.tp), "-q"], REPO))
    for name, tree in trees:
        if "verify" in only:
            record("verify --source", name, measure([*prep, "verify", str(out), "--source", str(src), "-q"], tree))
        if "revert" in only:
            dest = (args.revert_dir or work / "reverted").resolve()
            shutil.rmtree(dest, ignore_errors=True)
            record("revert", name, measure([*prep, "revert", str(out), "-o", str(dest), "-q"], tree))
            shutil.rmtree(dest, ignore_errors=True)
        if "compare" in only:
            for budget in args.max_memory or [None]:
                cmd = [*prep, "compare", str(src), str(out), "--prompt-ids", args.prompt_ids,
                       "--layers", str(args.layers), "-q"]
                label = f"compare --layers {args.layers}"
                if budget:
                    cmd += ["--max-memory", f"{budget}"]
                    label += f" --max-memory {budget:g}"
                record(label, name, measure(cmd, tree))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    table = Table(trees[0][0], what="memory", title="peak RSS of each command, a process of its own")
    for command, tree_name, r in rows:
        table.add(tree_name, r["peak_rss"], case=command, wall=f"{r['wall_s']:.1f} s", rc=r["rc"])
    table.print()
    return 1 if any(r["rc"] for _, _, r in rows) else 0
