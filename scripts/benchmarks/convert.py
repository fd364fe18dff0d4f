"""Conversion time against `cp -r` of the same files, and the converter's peak memory.

Baselines, each a child process in the same rounds as `prep convert SRC`: `cp -r SRC`, `cp -r
SRC; sync` (prep fsyncs every file; cp does not) and a user-space copy (pread + write + fsync per
file, in Python: the least any converter that touches the bytes does). The rounds alternate and
their order rotates (the disk here is noisy, and deleting GBs on it slows whatever writes next);
each round's times print as it ends, then the table: medians, and the median of the per-round
ratios. Source in the page cache for all, or dropped before each command with --cold (root).
--baseline-tree times another checkout's convert in the same rounds (before/after a change);
--also-workers and --also-env time convert with other settings. Then the converter's peak RSS,
over its fixed overhead (python + torch + prep imported). Without --src, generates the multi-GB
"bench" preset first (make_tiny_deepseek.py; --preset bench-large for 9 GiB, more than this
machine's dirty-page limit). Target: convert >= 0.7x cp at --tp 1.

Example:
    python scripts/bench.py convert --src SRC --tp 2 --repeat 5 --rest 2 --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from prep.convert import CHUNK_BYTES
from prep.safetensors_writer import nbytes

from .common.args import add_repeat
from .common.page_cache import drop_all
from .common.table import Table
from .common.timing import alternate
from .common.trees import REPO, prep_in, scratch_root

# Run as a child: the user-space copy, timed like the other commands (a process of its own).
USER_COPY = f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); " \
            "from benchmarks.convert import user_copy; user_copy(*sys.argv[1:])"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--src", type=pathlib.Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layout", default="preshuffle")
    ap.add_argument("--moe-layout", default="ck")
    ap.add_argument("--workers", type=int, help="convert's --workers (default: convert's own choice)")
    ap.add_argument("--also-workers", type=int, nargs="*", default=[],
                    help="also time convert with each of these --workers in the same rounds (a sweep)")
    ap.add_argument("--also-env", nargs="*", default=[], metavar="VAR=VALUE",
                    help="also time convert with this environment setting in the same rounds (e.g. PREP_WRITE_DEPTH=4)")
    add_repeat(ap, 4, "interleaved rounds of cp, cp+sync, user copy, convert")
    ap.add_argument("--preset", default="bench", help="make_tiny_deepseek.py preset to generate without --src")
    ap.add_argument("--keep", action="store_true", help="keep the generated source and outputs")
    ap.add_argument("--rest", type=float, default=2.0,
                    help="seconds of rest after each clean-up and sync (the disk's discard of the GBs just deleted "
                         "slowed whatever wrote next: cp+sync of 4.9 GiB took 2.3 to 8.1 s without it)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before each command (root): the source read from the disk, as a "
                         "350 GiB one always is")
    ap.add_argument("--baseline-tree", type=pathlib.Path,
                    help="also time the convert of another checkout of prep (e.g. `git worktree add /tmp/base <rev>`), "
                         "in the same rounds: the before/after of a change, on the same disk at the same time")


def user_copy(src: str, dst: str) -> None:
    """What any converter that transforms bytes must at least do: read each file into user
    memory and write it out (32 MiB blocks), fsync each file. `cp` copies inside the kernel
    (copy_file_range) and does not fsync, so this is the baseline a converter can approach."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True)
    buf = memoryview(bytearray(32 << 20))
    for f in sorted(src.iterdir()):
        fi = os.open(f, os.O_RDONLY)
        with open(dst / f.name, "wb") as fo:
            off = 0
            while (n := os.preadv(fi, [buf], off)) > 0:
                fo.write(buf[:n])
                off += n
            fo.flush()
            os.fsync(fo.fileno())
        os.close(fi)


def fixed_cost() -> tuple[int, float]:
    """Peak RSS and wall seconds of a process that only imports what `prep convert` imports: the
    fixed overhead every convert pays (the second of two starts, so the files are cached). It
    leaves without the interpreter's shutdown, as the `prep` command does (prep.cli.run)."""
    code = ("import os, resource, sys, prep.cli, prep.convert, layouts, torch; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024); sys.stdout.flush(); os._exit(0)")
    for _ in range(2):
        t0 = time.perf_counter()
        rss = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(REPO))).stdout)
        dt = time.perf_counter() - t0
    return rss, dt


def run_child(cmd: list[str], env: dict[str, str] | None) -> int:
    """Run ``cmd`` to its end; its own peak RSS in bytes (``wait4``'s usage of that child alone)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_maxrss * 1024


def run(args: argparse.Namespace) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="prep-bench-", dir=scratch_root()))
    try:
        measure(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


def measure(args: argparse.Namespace, work: pathlib.Path) -> None:
    src = args.src
    if src is None:
        src = work / "source"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_deepseek.py"), str(src), "--preset",
                        args.preset], check=True, stdout=subprocess.DEVNULL)
        print(f"generated bench preset in {time.perf_counter() - t0:.1f} s")
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    if not args.cold:  # warm cache
        subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], check=True, stdout=subprocess.DEVNULL)
    prep = prep_in(REPO)
    base_rss, start_s = fixed_cost()
    # Measured on a GPU host whose image sets PYTHONDONTWRITEBYTECODE (torch installed without
    # its __pycache__): every start compiled torch's sources, 3.5-3.7 s instead of 1.6 s.
    print(f"start-up of convert (python + torch + prep imported): {start_s:.2f} s"
          + ("; PYTHONDONTWRITEBYTECODE is set: modules without a cached .pyc are compiled at every "
             "start (unset it for numbers a normal install gives)" if sys.flags.dont_write_bytecode else ""),
          flush=True)
    out = work / "converted"
    flags = ["--tp", str(args.tp), "--layout", args.layout, "--moe-layout", args.moe_layout]
    workers = ["--workers", str(args.workers)] if args.workers else []
    # name: (command, its output folder, environment)
    cmds = {
        "cp -r": (["cp", "-r", str(src), str(work / "copy")], work / "copy", None),
        "cp -r; sync": (["sh", "-c", f"cp -r '{src}' '{work / 'copy2'}' && sync"], work / "copy2", None),
        "user copy": ([sys.executable, "-c", USER_COPY, str(src), str(work / "copy3")], work / "copy3", None),
        "prep convert": ([*prep, "convert", str(src), "-o", str(out), *flags, *workers], out, None),
    }
    if args.baseline_tree:
        dest = work / "converted-base"
        cmds["baseline tree"] = ([*prep_in(args.baseline_tree.resolve()), "convert", str(src), "-o", str(dest),
                                  *flags, *workers], dest, None)
    for w in args.also_workers:
        dest = work / f"converted-w{w}"
        cmds[f"--workers {w}"] = ([*prep, "convert", str(src), "-o", str(dest), *flags, "--workers", str(w)], dest, None)
    for setting in args.also_env:
        var, _, value = setting.partition("=")
        dest = work / f"converted-{var}-{value}"
        cmds[setting] = ([*prep, "convert", str(src), "-o", str(dest), *flags, *workers], dest,
                         dict(os.environ, **{var: value}))
    peak, manifest = 0, {}

    def clean(_name: str) -> None:
        for _, dest, _ in cmds.values():
            shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        if args.cold and not drop_all():
            raise SystemExit("--cold drops the page cache: run as root")
        time.sleep(args.rest)

    def command(name: str):
        def call() -> None:
            nonlocal peak, manifest
            rss = run_child(cmds[name][0], cmds[name][2])
            if name == "prep convert":  # read now: the next command's clean-up deletes it
                peak = max(peak, rss)
                manifest = json.loads((out / "prep-manifest.json").read_text())
        return call

    def say_round(i: int, t: dict[str, float]) -> None:
        print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items())
              + f" -> convert {t['cp -r'] / t['prep convert']:.2f}x cp", flush=True)

    runs = alternate({name: command(name) for name in cmds}, args.repeat, rotate=True, before=clean,
                     on_round=say_round)
    table = manifest["source"].get("tensors_file")  # format 4: the table is prep-source.json, counted here
    source_tensors = table["count"] if table else len(manifest["source"]["tensors"])
    print(f"source: {size / 2**30:.2f} GiB, {source_tensors} tensors in {len(manifest['source']['files'])} files -> "
          f"{len(manifest['tensors'])} tensors in {len(manifest['files'])} files")
    result = Table("cp -r", also_against=("cp -r; sync", "user copy",
                                          *(("baseline tree",) if args.baseline_tree else ())),
                   stat="median", title=f"{args.repeat} rounds (tp {args.tp}, {args.layout}+{args.moe_layout}, "
                                        f"workers {args.workers or 'default'})")
    for name, seconds in runs.seconds.items():
        result.add(name, seconds, nbytes=size)
    result.print()
    largest = max(manifest["tensors"], key=lambda t: nbytes(t["dtype"], t["shape"]))
    print(f"peak RSS of convert: {peak / 2**20:.0f} MiB = fixed overhead {base_rss / 2**20:.0f} MiB (python + torch + "
          f"prep imported) + {(peak - base_rss) / 2**20:.0f} MiB of blocks in flight (blocks of "
          f"{CHUNK_BYTES >> 20} MiB; largest output tensor {largest['name']}, "
          f"{nbytes(largest['dtype'], largest['shape']) / 2**20:.0f} MiB)")
