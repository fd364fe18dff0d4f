#!/usr/bin/env python3
"""Conversion throughput against `cp -r` of the same files, and peak memory, in one run.

    python scripts/bench_convert.py [--src DIR] [--tp 1] [--layout preshuffle] [--workers N]

Without --src, generates the multi-GB "bench" preset (scripts/make_tiny_deepseek.py --preset
bench; --preset bench-large for 9 GiB, more than this machine's dirty-page limit) into a
temporary folder first. Runs `cp -r SRC`, `cp -r SRC; sync` and `prep convert SRC`
as child processes (source in the page cache for all, or dropped before each with --cold), with a user-space copy (pread + write +
fsync per file, in Python: the least any converter that touches the bytes does), in --repeat
interleaved rounds because the disk here is noisy, and prints each round's ratios, the medians,
and the converter's peak RSS over its fixed overhead. Target: convert >= 0.7x cp at --tp 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prep.convert import CHUNK_BYTES  # noqa: E402
from prep.safetensors_writer import nbytes  # noqa: E402


def du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and the child's peak RSS in bytes (one child per call: ru_maxrss of RUSAGE_CHILDREN
    is the max over children, so the caller compares it before/after)."""
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    dt = time.perf_counter() - t0
    return dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _fixed_cost() -> tuple[int, float]:
    """Peak RSS and wall seconds of a process that only imports what `prep convert` imports: the
    fixed overhead every convert pays (the second of two starts, so the files are cached). It
    leaves without the interpreter's shutdown, as the `prep` command does (prep.cli.run)."""
    code = ("import os, resource, sys, prep.cli, prep.convert, layouts, torch; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024); sys.stdout.flush(); os._exit(0)")
    for _ in range(2):
        t0 = time.perf_counter()
        rss = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        dt = time.perf_counter() - t0
    return rss, dt


def _prep_in(tree: pathlib.Path) -> list[str]:
    """The command that runs the prep CLI of checkout ``tree``, whatever the working folder and
    whichever prep is installed (``python -m prep.cli`` with PYTHONPATH=tree ran the prep of the
    working folder: ``-m`` puts it first on sys.path, so a baseline tree measured itself)."""
    # What the `prep` command runs: prep.cli.run where the tree has it (it leaves without the
    # interpreter's shutdown), else click's main.
    start = "import prep.cli as c; (getattr(c, 'run', None) or c.main)()"
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); sys.argv[0] = 'prep'; {start}"
    where = subprocess.run([sys.executable, "-c", code.replace(start, "import prep; print(prep.__file__)")],
                           check=True, capture_output=True, text=True, cwd="/").stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"{tree}: its prep is not what runs (got {where})")
    return [sys.executable, "-c", code]


def user_copy(src: pathlib.Path, dst: pathlib.Path) -> None:
    """What any converter that transforms bytes must at least do: read each file into user
    memory and write it out (32 MiB blocks), fsync each file. `cp` copies inside the kernel
    (copy_file_range) and does not fsync, so this is the baseline a converter can approach."""
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


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--user-copy":
        user_copy(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=pathlib.Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layout", default="preshuffle")
    ap.add_argument("--moe-layout", default="ck")
    ap.add_argument("--workers", type=int, help="convert's --workers (default: convert's own choice)")
    ap.add_argument("--also-workers", type=int, nargs="*", default=[],
                    help="also time convert with each of these --workers in the same rounds (a sweep)")
    ap.add_argument("--also-env", nargs="*", default=[], metavar="VAR=VALUE",
                    help="also time convert with this environment setting in the same rounds (e.g. PREP_WRITE_DEPTH=4)")
    ap.add_argument("--repeat", type=int, default=4, help="interleaved rounds of cp, cp+sync, user copy, convert")
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
    args = ap.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="prep-bench-", dir=REPO / "out" if (REPO / "out").is_dir() else None))
    try:
        src = args.src
        if src is None:
            src = work / "source"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_deepseek.py"), str(src), "--preset", args.preset],
                           check=True, stdout=subprocess.DEVNULL)
            print(f"generated bench preset in {time.perf_counter() - t0:.1f} s")
        size = du(src)
        if not args.cold:  # warm cache
            subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], check=True, stdout=subprocess.DEVNULL)
        prep = _prep_in(REPO)
        base_rss, start_s = _fixed_cost()
        # Measured on a GPU host whose image sets PYTHONDONTWRITEBYTECODE (torch installed without
        # its __pycache__): every start compiled torch's sources, 3.5-3.7 s instead of 1.6 s.
        print(f"start-up of convert (python + torch + prep imported): {start_s:.2f} s"
              + ("; PYTHONDONTWRITEBYTECODE is set: modules without a cached .pyc are compiled at every "
                 "start (unset it for numbers a normal install gives)" if sys.flags.dont_write_bytecode else ""),
              flush=True)
        rounds = []
        peak = 0
        out = work / "converted"
        cmds = {
            "cp": ["cp", "-r", str(src), str(work / "copy")],
            # prep fsyncs each file before renaming it into place; cp does not: time cp + sync too.
            "cp+sync": ["sh", "-c", f"cp -r '{src}' '{work / 'copy2'}' && sync"],
            "user": [sys.executable, __file__, "--user-copy", str(src), str(work / "copy3")],
            "convert": prep + ["convert", str(src), "-o", str(out), "--tp", str(args.tp), "--layout", args.layout,
                               "--moe-layout", args.moe_layout,
                               *(["--workers", str(args.workers)] if args.workers else [])],
        }
        envs = {}
        if args.baseline_tree:
            base = _prep_in(args.baseline_tree.resolve())
            cv = cmds["convert"][len(prep):]  # convert SRC -o OUT ...
            cmds["base"] = base + cv[:3] + [str(work / "converted-base")] + cv[4:]
        for w in args.also_workers:
            cv = cmds["convert"]
            rest = cv[cv.index("-o") + 2:]
            rest = rest[:rest.index("--workers")] if "--workers" in rest else rest
            cmds[f"workers {w}"] = cv[:cv.index("-o") + 1] + [str(work / f"converted-w{w}")] + rest + ["--workers", str(w)]
        for setting in args.also_env:
            var, _, value = setting.partition("=")
            cv = cmds["convert"]
            cmds[setting] = cv[:cv.index("-o") + 1] + [str(work / f"converted-{var}-{value}")] + cv[cv.index("-o") + 2:]
            envs[setting] = dict(os.environ, **{var: value})
        extra = {}
        order = list(cmds)
        for r in range(args.repeat):
            # Interleaved rounds (this machine's disk is noisy: compare within a round), and the
            # order rotates, so that no command always runs first after the clean-up: deleting
            # GBs on this disk (ext4, online discard) slows whatever writes next.
            t = {}
            for name in order[r % len(order):] + order[:r % len(order)]:
                for d in ("copy", "copy2", "copy3", "converted", "converted-base",
                          *(f"converted-w{w}" for w in args.also_workers),
                          *(f"converted-{e.replace('=', '-')}" for e in args.also_env)):
                    shutil.rmtree(work / d, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                if args.cold:
                    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
                time.sleep(args.rest)
                before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
                t[name], rss = timed(cmds[name], envs.get(name))
                if name == "convert":
                    peak = max(peak, rss if rss > before else 0)
                    manifest = json.loads((out / "prep-manifest.json").read_text())
            rounds.append((t["cp"], t["cp+sync"], t["convert"], t["user"], t.get("base", 0.0)))
            for w in args.also_workers:
                extra.setdefault(f"--workers {w}", []).append((t[f"workers {w}"], t["cp+sync"]))
            for e in args.also_env:
                extra.setdefault(e, []).append((t[e], t["cp+sync"]))
            t_cp, t_cps, t_cv, t_py, t_base = rounds[-1]
            print(f"round {r + 1}: cp {t_cp:6.2f} s, cp+sync {t_cps:6.2f} s, user-space copy+fsync {t_py:6.2f} s, "
                  f"convert {t_cv:6.2f} s -> {t_cp / t_cv:4.2f}x cp, {t_cps / t_cv:4.2f}x cp+sync, "
                  f"{t_py / t_cv:4.2f}x user-space copy"
                  + (f"; baseline tree {t_base:6.2f} s -> {t_base / t_cv:4.2f}x baseline" if args.baseline_tree else "")
                  + "".join(f"; {k} {t[k]:6.2f} s -> {t_cps / t[k]:4.2f}x cp+sync"
                            for k in [*(f"workers {w}" for w in args.also_workers), *args.also_env]),
                  flush=True)
        largest = max((t for t in manifest["tensors"]), key=lambda t: _nbytes(t))
        table = manifest["source"].get("tensors_file")  # format 4: the table is prep-source.json, counted here
        source_tensors = table["count"] if table else len(manifest["source"]["tensors"])
        med = lambda xs: statistics.median(xs)  # noqa: E731
        t_cp, t_cps, t_cv, t_py, t_base = (med([r[i] for r in rounds]) for i in range(5))
        print(f"source: {size / 2**30:.2f} GiB, {source_tensors} tensors in "
              f"{len(manifest['source']['files'])} files -> {len(manifest['tensors'])} tensors in {len(manifest['files'])} files")
        print(f"median of {args.repeat} rounds (tp {args.tp}, {args.layout}+{args.moe_layout}, "
              f"workers {args.workers or 'default'}):")
        print(f"cp -r       : {t_cp:7.2f} s  {size / t_cp / 1e9:6.2f} GB/s  (baseline)")
        print(f"cp -r; sync : {t_cps:7.2f} s  {size / t_cps / 1e9:6.2f} GB/s  (baseline with durability)")
        print(f"user copy   : {t_py:7.2f} s  {size / t_py / 1e9:6.2f} GB/s  (pread + write + fsync per file, in Python)")
        print(f"prep convert: {t_cv:7.2f} s  {size / t_cv / 1e9:6.2f} GB/s  "
              f"ratios per round, median: {med([r[0] / r[2] for r in rounds]):4.2f}x cp, "
              f"{med([r[1] / r[2] for r in rounds]):4.2f}x cp+sync, {med([r[3] / r[2] for r in rounds]):4.2f}x user copy")
        if args.baseline_tree:
            print(f"baseline    : {t_base:7.2f} s  ({args.baseline_tree}); ratio per round, median: "
                  f"{med([r[4] / r[2] for r in rounds]):4.2f}x baseline")
        for k, xs in extra.items():
            print(f"{k:12s}: {med([x[0] for x in xs]):7.2f} s  ratio per round, median: "
                  f"{med([x[1] / x[0] for x in xs]):4.2f}x cp+sync")
        print(f"peak RSS of convert: {peak / 2**20:.0f} MiB = fixed overhead {base_rss / 2**20:.0f} MiB (python + torch + "
              f"prep imported) + {(peak - base_rss) / 2**20:.0f} MiB of blocks in flight (blocks of "
              f"{CHUNK_BYTES >> 20} MiB; largest output tensor {largest['name']}, {_nbytes(largest) / 2**20:.0f} MiB)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


def _nbytes(t: dict) -> int:
    return nbytes(t["dtype"], t["shape"])


if __name__ == "__main__":
    main()
