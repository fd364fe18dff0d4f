"""One rank's load in vLLM or SGLang on the CPU (their real model and loader code, the harnesses'
stand-ins for the GPU): the engine's own loader on the Quark source against its load of prep's
conversion through the door, each in a fresh process, alternated, in the same run.

Baseline: the engine's own loader on the Quark source. Per load: the seconds of ``get_model_loader(...).load_model`` with the model built inside it (the
same model both ways), the process's peak RSS, and the bytes of the files it reads (the source's
shards the engine opens, or the rank's own files). The files are in the page cache (one untimed
load of each first). On the CPU the shuffles run in torch, not on a GPU: the times say what work
is skipped, not what a server waits on an MI355. Runs in the engine's venv (.venv-vllm,
.venv-sglang: scripts/setup_env.sh) through the CPU harnesses (harness/vllm.py, harness/sglang.py)
and the pinned sources (harness/sources.py).

Example:
    python3 scripts/bench.py engine-load --engine vllm --source SRC --converted OUT --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess

from .common.args import add_repeat
from .common.table import GiB, Table
from .common.timing import Timed, alternate
from .common.trees import REPO

ENGINE_PYTHON = {"sglang": REPO / ".venv-sglang" / "bin" / "python", "vllm": REPO / ".venv-vllm" / "bin" / "python"}

# Run in the engine's venv: load one rank one way, print {"seconds", "max_rss_kib"}.
CHILD = r"""
import json, pathlib, resource, sys, time
sys.path[:0] = [sys.argv[1]]
engine, folder, fmt, tp, rank, ep, work, aiter = sys.argv[2:10]
tp, rank, ep = int(tp), int(rank), int(ep)
from layouts.engines import _config
override = _config.override(json.loads((pathlib.Path(folder) / "config.json").read_text()))
if engine == "vllm":
    from harness import vllm as h
    h.WORK["dir"] = pathlib.Path(work); h.install(aiter)
    import layouts.engines.vllm.door as door
    door.register()
    kw = {"hf_overrides": override} if override else {}
    t0 = time.perf_counter()
    h.build_and_load(folder, tp, rank, ep, fmt, **kw)
else:
    from harness import sglang as h
    h.install(aiter)
    import layouts
    kw = {"json_model_override_args": json.dumps(override)} if override else {}
    if fmt == "sharded_state":
        t = layouts.load_manifest(folder).target
        kw["model_loader_extra_config"] = json.dumps({"pattern": f"model-tp{t.tp}-rank{{rank}}-{{part}}.safetensors"})
        kw["enforce_shared_experts_fusion" if t.fuse_shared_expert else "disable_shared_experts_fusion"] = True
    else:
        t = layouts.load_manifest(sys.argv[10]).target
        kw["enforce_shared_experts_fusion" if t.fuse_shared_expert else "disable_shared_experts_fusion"] = True
    t0 = time.perf_counter()
    h.build_and_load(folder, tp, rank, fmt, ep=ep, **kw)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0,
                              "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def load(engine: str, folder: pathlib.Path, fmt: str, tp: int, rank: int, ep: int, work: pathlib.Path,
         aiter: pathlib.Path, converted: pathlib.Path) -> Timed:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([str(ENGINE_PYTHON[engine]), "-c", CHILD, str(REPO), engine, str(folder), fmt, str(tp),
                        str(rank), str(ep), str(work), str(aiter), str(converted)], capture_output=True, text=True,
                       env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"{engine} {fmt} load of {folder} failed:\n{r.stderr[-3000:]}")
    got = json.loads(line[len("RESULT "):])
    return Timed(got["seconds"], {"max_rss": got["max_rss_kib"] * 1024})


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engine", required=True, choices=sorted(ENGINE_PYTHON))
    ap.add_argument("--source", required=True, type=pathlib.Path)
    ap.add_argument("--converted", required=True, type=pathlib.Path)
    ap.add_argument("--rank", type=int, default=0)
    add_repeat(ap, 3)
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/bench-engine-load"))


def run(args: argparse.Namespace) -> None:
    from harness import sources as engine_sources  # the engines' pinned sources
    import layouts

    m = layouts.load_manifest(args.converted)
    tp, ep = m.target.tp, m.target.ep
    _, aiter = engine_sources.trees(engine_sources.require(), args.work)
    door = {"vllm": "prep", "sglang": "sharded_state"}[args.engine]
    ways = {"own loader, Quark source": (args.source, "auto"), "door, prep's conversion": (args.converted, door)}
    files = {"own loader, Quark source": sum(f.stat().st_size for f in args.source.glob("*.safetensors")),
             "door, prep's conversion": sum((args.converted / f).stat().st_size for f in m.rank_files(args.rank))}
    # The first round is untimed: the page cache and the harnesses' work folders.
    runs = alternate({way: (lambda f=folder, fmt=fmt: load(args.engine, f, fmt, tp, args.rank, ep, args.work, aiter,
                                                          args.converted))
                      for way, (folder, fmt) in ways.items()}, args.repeat, warmup=1)
    table = Table("own loader, Quark source", stat="median",
                  title=f"{args.engine}, rank {args.rank} of TP {tp} / EP {ep}; {args.repeat} runs each, alternated")
    for way in ways:
        rss = statistics.median(i["max_rss"] for i in runs.info[way])
        table.add(way, runs.seconds[way], peak_rss=f"{rss / GiB:.2f} GiB", files=f"{files[way] / GiB:.2f} GiB")
    table.print()
