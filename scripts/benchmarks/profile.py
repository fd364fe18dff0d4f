"""Where a prep command's seconds go, every thread included: a sampling profiler around the CLI.

No baseline: a profile, not a comparison (time a change with ``convert --baseline-tree``). Runs the ``prep`` CLI in this process with the given arguments and, every ``--interval`` seconds,
reads every thread's Python stack (``sys._current_frames``: a thread inside a C call such as
``preadv``, a torch copy or ``pwrite`` shows the Python line that made the call). It prints:

- the wall time of importing torch and of the command;
- the main thread's phases: the functions ``convert()`` called (plan, writing, manifest, ...);
- per thread role (main, the writer threads, the workers), the seconds in each of prep's own
  functions and, beside it, the call it was in (a wait on a queue or event shows as waiting).

cProfile sees one thread and adds its own cost to every Python call; this sees them all and
costs a few percent. Seconds are samples x interval, so they are estimates (+- a sample).

Example:
    python scripts/bench.py profile -- convert SRC -o OUT --tp 8
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pathlib
import re
import sys
import threading
import time

from .common.trees import REPO

OURS = (str(REPO / "prep"), str(REPO / "layouts"))
WAITS = {"wait", "get", "result", "acquire", "_wait_for_tstate_lock", "join", "synchronize"}


def _where(frame) -> tuple[str, str, str]:
    """(our innermost function, the call it is in, phase of convert()) for one thread's stack."""
    leaf = frame
    ours = None
    chain = []
    f = frame
    while f is not None:
        chain.append(f)
        if ours is None and f.f_code.co_filename.startswith(OURS):
            ours = f
        f = f.f_back
    phase = ""
    for outer, inner in zip(reversed(chain), list(reversed(chain))[1:]):
        if outer.f_code.co_name == "convert" and outer.f_code.co_filename.endswith("prep/convert.py"):
            phase = inner.f_code.co_name
            break
    name = lambda f: f"{pathlib.Path(f.f_code.co_filename).stem}.{f.f_code.co_name}"  # noqa: E731
    call = "waiting" if leaf.f_code.co_name in WAITS else name(leaf)
    return (name(ours) if ours is not None else "(outside prep)"), call, phase


class Sampler(threading.Thread):
    def __init__(self, interval: float):
        super().__init__(daemon=True, name="sampler")
        self.interval = interval
        self.stop = threading.Event()
        self.by_role: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.phases: collections.Counter = collections.Counter()
        self.busy: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def run(self) -> None:
        me = threading.get_ident()
        main = threading.main_thread().ident
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                role = "main" if ident == main else re.sub(r"[_-]?\d+$", "", names.get(ident, "?").split(" ")[0])
                ours, call, phase = _where(frame)
                self.by_role[role][(ours, call)] += 1
                self.busy[role][call != "waiting"] += 1
                if ident == main:
                    self.phases[phase or ours] += 1


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between samples")
    ap.add_argument("--top", type=int, default=12, help="lines per thread role")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the prep command and its arguments (after --)")


def run(a: argparse.Namespace) -> None:
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    t0 = time.perf_counter()
    importlib.import_module("torch")  # timed on its own: a fixed cost of every command
    t_torch = time.perf_counter() - t0
    from prep.cli import main as prep_main

    sampler = Sampler(a.interval)
    sampler.start()
    t1 = time.perf_counter()
    try:
        prep_main(args, standalone_mode=False, prog_name="prep")
    finally:
        wall = time.perf_counter() - t1
        sampler.stop.set()
        sampler.join()
    dt = a.interval
    print(f"\nimport torch {t_torch:.2f} s; prep {' '.join(args[:1])} {wall:.2f} s (samples every {dt * 1e3:.0f} ms)")
    print("\nmain thread, by phase of convert():")
    for k, n in sampler.phases.most_common(a.top):
        print(f"  {n * dt:7.2f} s  {k}")
    for role, counter in sorted(sampler.by_role.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counter.values())
        busy = sampler.busy[role][True]
        print(f"\n{role}: {total * dt:.2f} thread-s sampled, {busy * dt:.2f} s not waiting")
        for (ours, call), n in counter.most_common(a.top):
            print(f"  {n * dt:7.2f} s  {ours:40s} in {call}")
