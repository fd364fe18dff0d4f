"""Check prep's ATOM door (``prep-atom-serve``) on ATOM's real start-up path, on the CPU: every rank
of a converted folder, started as ATOM's OpenAI server starts it, must leave ATOM's target and MTP
draft models byte for byte as ATOM's own server start-up on the source leaves them, with no "NOT
loaded" warning.

    .venv/bin/python -m harness check-engine atom --serve --source SRC --converted OUT [--oracles DIR]
        [--work DIR] [--gpu-arch gfx950|gfx942] [--no-mtp] [-- ATOM server options]

DIR is the folder holding ATOM's and aiter's pinned sources, as tarballs or git checkouts (default:
where :mod:`harness.sources` finds them: ``$PREP_ORACLES``, ``shared/oracles`` beside the
checkout, or ``.cache/engine-sources`` after ``python -m harness sources fetch``; tarballs are
unpacked under ``--work``). TP and EP come from OUT's manifest, ATOM's switches from the manifest's layouts, as
``prep convert`` printed them (``asm`` for ``preshuffle``, ``ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM=1``
for ``non-shuffle``; ``ATOM_USE_TRITON_MOE=1`` for the ``triton`` MoE layouts, ``=0`` for ``ck``),
unless the environment sets them (the seed's test plan also sets both DeepSeek fusion switches). The
server options are those of ATOM's test plan for this feature (``--kv_cache_dtype fp8
--gpu-memory-utilization 0.8 --no-enable_prefix_caching``) with the MTP draft model on
(``--method mtp --num-speculative-tokens 1``); options after ``--`` are added.

Each side (ATOM on SRC with ``python -m atom.entrypoints.openai_server``; the door on OUT) runs
as a server process of its own, and its workers as processes of their own:

* real: ATOM's argument parsing and ``api_server.main`` (tokenizer, ``EngineArgs``, ``LLMEngine``,
  ``Config``), the door's checks and its patch of ``EngineArgs``, the worker's runner class
  resolved by ``Config.runner_qualname`` from the pickled config, ``ModelRunner.__init__`` up to
  both models loaded: building them, ``load_model`` (ATOM's reader on SRC, the door's reading step
  on OUT), every ``process_weights_after_loading``, ``_report_coverage``, the drafter's build and
  ``Drafter.load_model`` with its embedding and head sharing;
* stand-ins (:mod:`harness.atom.on_cpu`): aiter's GPU kernels and collectives; the GPU and the
  NCCL group (``ModelRunner._setup_device_and_distributed``: the CPU, and the TP rank answered by
  the stand-in process group; ``ModelRunner.exit``, which releases them); ATOM's ``CoreManager``/``EngineCore`` between the server and its
  workers (they talk through aiter's shared-memory broadcast queue, a GPU-side part of aiter, and
  the workers join an NCCL group: neither exists here), replaced by starting the TP workers
  straight from the server process, each a separate process given ATOM's pickled ``Config``, as
  ``AsyncIOProc`` gives it; ``uvicorn.run`` (the server would listen: recorded, not run). Each
  worker stops at ``allocate_forward_vars``, the first step after both models are loaded.

Both start-ups run twice per rank (``torch.empty`` memory filled with 0x00 and 0xFF): bytes that
differ between ATOM's two are memory ATOM never writes (aiter's scale padding), compared nowhere;
every other byte must be equal in both of the door's.
From an MXFP4 ``kv_b_proj`` (v2), ATOM derives ``W_K``/``W_V`` with aiter's GEMM, a GPU binary:
skipped in both loads alike (``harness.atom.mla.mla_from_mxfp4(None)``).

A rank passes only when both models match, the door warned "NOT loaded" exactly as often as ATOM's
own start-up and no stand-in ran while loading.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Iterator
from unittest import mock

from harness import freeze_imports, pythonpath, stand_ins
from harness.report import Failure, RankResult

NOT_LOADED = "were NOT loaded from checkpoint"  # ATOM's loading_core._report_coverage
SERVER = "atom.entrypoints.openai_server"
TEST_PLAN = ["--kv_cache_dtype", "fp8", "--gpu-memory-utilization", "0.8", "--no-enable_prefix_caching"]
MTP = ["--method", "mtp", "--num-speculative-tokens", "1"]


def switches(target) -> dict[str, str]:
    """ATOM's switches that read the manifest ``target``'s layouts, as ``prep convert`` printed them
    (the profile's serve command: the GEMM path's switch and the MoE back end's, set explicitly)."""
    import shlex

    from layouts.engines.atom import PROFILE

    cmd = PROFILE.serve_command("x", target.tp, target.ep, target.layout, target.moe_layout)
    if cmd is None:
        raise SystemExit(f"ATOM's door serves no configuration reading layout {target.layout} with MoE layout "
                         f"{target.moe_layout}")
    words = shlex.split(cmd)
    return dict(w.split("=", 1) for w in words[:words.index("prep-atom-serve")])


# ---------------------------------------------------------------------------- a worker process
class ModelsLoaded(Exception):
    """Raised where the worker stops: both models are loaded."""

    def __init__(self, runner):
        super().__init__("models loaded")
        self.runner = runner


def worker(setup: dict) -> int:
    """One TP worker: ATOM's runner class (by ``Config.runner_qualname``) built from the pickled
    Config for ``setup['rank']``, once per fill byte, stopped once both models are loaded; writes
    their tensors and what happened to ``setup['out']``."""
    import torch

    from harness.atom import install, mla, on_cpu

    rank, out = setup["rank"], pathlib.Path(setup["out"])
    on_cpu.install(pathlib.Path(setup["atom_dir"]), pathlib.Path(setup["aiter_dir"]), setup["gpu_arch"])
    from atom.model_engine.model_runner import ModelRunner
    from atom.utils import resolve_obj_by_qualname

    config_bytes = pathlib.Path(setup["config"]).read_bytes()
    tp = pickle.loads(config_bytes).tensor_parallel_size
    on_cpu.set_tp(rank, tp)

    def device_and_group(self, rank, config):  # stand-in: the GPU is the CPU, the TP group answers set_tp
        self.device = torch.device("cpu")

    def stop(self):
        raise ModelsLoaded(self)

    params = {"created": 0}
    new_param = torch.nn.Parameter.__new__

    def counted(cls, data=None, requires_grad=True):
        params["created"] += 1
        return new_param(cls, data, requires_grad)

    # Stand-ins called inside ATOM's load_model (the target's, from the runner, and the draft's, from
    # the drafter; each module holds its own reference): there a stand-in would be skipped work.
    from atom.model_engine import model_runner
    from atom.spec_decode import drafter as drafter_module

    during_load: list[str] = []
    loads: list[int] = []  # load_model calls (the check fails unless both models went through one)

    def recorded(load_model):
        def load(*args, **kwargs):
            loads.append(1)
            start = len(on_cpu.CALLS)
            try:
                return load_model(*args, **kwargs)
            finally:
                during_load.extend(on_cpu.CALLS[start:])
        return load

    caught = install.CaughtWarnings()  # ATOM's warnings, as the install check catches them
    logging.getLogger("atom").addHandler(caught)
    result = {"rank": rank, "refused": None, "params_created": 0, "fills": []}
    with mock.patch.object(ModelRunner, "_setup_device_and_distributed", device_and_group), \
            mock.patch.object(ModelRunner, "allocate_forward_vars", stop), \
            mock.patch.object(ModelRunner, "exit", lambda self: None), \
            mock.patch.object(torch.nn.Parameter, "__new__", counted), \
            mock.patch.object(model_runner, "load_model", recorded(model_runner.load_model)), \
            mock.patch.object(drafter_module, "load_model", recorded(drafter_module.load_model)), \
            mla.mla_from_mxfp4(None):
        for fill in setup["fills"]:
            config = pickle.loads(config_bytes)  # a fresh Config per start, as each worker unpickles its own
            caught.messages.clear()
            on_cpu.CALLS.clear()
            during_load.clear()
            loads.clear()
            try:
                with on_cpu.on_cpu(fill):
                    runner_class = resolve_obj_by_qualname(config.runner_qualname)
                    runner_class(rank, config)
                raise RuntimeError("ModelRunner.__init__ returned without reaching allocate_forward_vars")
            except ModelsLoaded as done:
                runner = done.runner
            except Exception as e:  # noqa: BLE001 - a refusal (the door's one line) or ATOM failing
                result["refused"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                result["where"] = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
                result["params_created"] = params["created"]
                break
            drafter = getattr(runner, "drafter", None)
            draft = drafter.model if drafter is not None else torch.nn.Module()
            # each its own copy: the adapter's tensors are views of one file buffer under several dtypes
            state, derived = ({k: v.detach().clone() for k, v in d.items()} for d in install.held(runner.model, draft))
            flags = install.shuffled_flags(runner.model, draft)
            labels = install.swizzle_labels(runner.model, draft)
            torch.save({"state": state, "derived": derived, "flags": flags, "labels": labels},
                       out / f"rank{rank}-fill{fill}.pt")
            result["fills"].append({
                "fill": fill, "runner": type(runner).__qualname__, "runner_module": type(runner).__module__,
                "draft": drafter is not None, "draft_head_shared": _head_shared(runner),
                "not_loaded": [m[:300] for m in caught.messages if NOT_LOADED in m],
                "load_model_calls": len(loads), "stand_ins_while_loading": sorted(set(during_load))})
            del runner, drafter, draft, state, derived
        result["params_created"] = params["created"]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["refused"] is None else 1


def _head_shared(runner) -> bool | None:
    """Whether the draft's MTP head is the target's lm_head (ATOM's drafter shares it when the
    checkpoint did not fill it)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return None
    heads = [getattr(layer, "shared_head", None) for layer in drafter.model.model.layers.values()]
    return any(h is not None and getattr(h, "head", None) is runner.model.lm_head for h in heads)


# ---------------------------------------------------------------------------- the server process
START_TIMEOUT_S = 600  # one start-up of a tiny checkpoint takes ~10 s; a TP 8 one on bench-r1 a few minutes


def _fork_worker(setup: dict, env: dict[str, str]) -> int:
    """A TP worker process (:func:`worker`), forked from the server process, which has imported
    ATOM and torch already: a worker started as a new interpreter spent ~6.5 s of CPU importing
    them again (6 such processes made most of a TP 2 check's 43 s). ``env`` is the worker's own
    (ATOM reads its switches when it uses them). Returns the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(env)
        code = worker(setup)
    except BaseException:  # noqa: BLE001 - reported, then the child's exit status says it failed
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def server(setup: dict, argv: list[str]) -> int:
    """ATOM's server process: the door's main (``kind`` door) or ``python -m
    atom.entrypoints.openai_server`` (``kind`` atom) on ``argv``, with ATOM's engine-core
    processes replaced by TP worker processes (:func:`worker`) and uvicorn recorded."""
    from harness.atom import on_cpu

    out = pathlib.Path(setup["out"])
    on_cpu.install(pathlib.Path(setup["atom_dir"]), pathlib.Path(setup["aiter_dir"]), setup["gpu_arch"])
    import runpy

    import uvicorn
    from atom.model_engine import llm_engine

    freeze_imports()  # before the workers are forked: their collections skip what the imports made

    state = {"workers": [], "listening": False}

    class WorkerProcesses:
        """Stands in for ATOM's CoreManager: starts the engine's TP workers as processes of their
        own, each given the engine's pickled Config (after CoreManager's per-engine settings)."""

        def __init__(self, config):
            config.parallel_config.data_parallel_rank = config.parallel_config.data_parallel_rank_local = 0
            path = out / "config.pkl"
            path.write_bytes(pickle.dumps(config))
            pids = [_fork_worker(dict(setup, rank=rank, config=str(path)), setup.get("worker_env", {}))
                    for rank in range(config.tp_world_size)]
            codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
            state["workers"] = codes
            if any(codes):
                raise RuntimeError("Failed to start all EngineCore processes")  # as ATOM's CoreManager says

        def close(self):
            pass

    def listen(app, **kw):
        state["listening"] = True

    rc = 0
    with mock.patch.object(llm_engine, "CoreManager", WorkerProcesses), mock.patch.object(uvicorn, "run", listen):
        try:
            if setup["kind"] == "door":
                from layouts.engines.atom.serve import main

                rc = main(argv)
            else:
                sys.argv = [SERVER, *argv]
                runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
        except Exception as e:  # noqa: BLE001
            print(f"server: {type(e).__name__}: {e}", file=sys.stderr)
            rc = 1
    (out / "server.json").write_text(json.dumps(dict(state, rc=rc)))
    return rc


# ---------------------------------------------------------------------------- the check
# How start() runs a server process: ``run(module, args, env, timeout) -> (exit status or None if it
# was killed past the timeout, stdout, stderr)`` of ``python -m module args``. None: a new
# interpreter; the test suite puts in a fork of its server (tests/engine_server.py), which has made
# the third-party imports already (harness/forkserver.py).
LAUNCH: dict = {"run": None}


def _new_interpreter(module: str, args: list[str], env: dict[str, str], timeout: float):
    # A session of its own: a start-up that hangs (a forked worker, say) is ended with its workers.
    p = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        return None, stdout, stderr
    return p.returncode, stdout, stderr


def start(kind: str, model: pathlib.Path, argv: list[str], env: dict[str, str], fills: list[int],
          out: pathlib.Path, trees: tuple[pathlib.Path, pathlib.Path], gpu_arch: str = "gfx950",
          worker_env: dict[str, str] | None = None) -> dict:
    """One server start-up (``kind`` "atom" or "door") in a fresh ``out``; returns its record
    (server.json and each rank's). ``worker_env`` is added to the workers' environment only (to
    show what a worker's own check does with what it reads)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    setup = {"kind": kind, "out": str(out), "fills": fills, "atom_dir": str(trees[0]), "aiter_dir": str(trees[1]),
             "gpu_arch": gpu_arch, "worker_env": worker_env or {}}
    t0 = time.monotonic()
    path = pythonpath(os.environ.get("PYTHONPATH"))
    args, run_env = [json.dumps(setup), "--model", str(model), *argv], {**os.environ, **env, "PYTHONPATH": path}
    returncode, stdout, stderr = (LAUNCH["run"] or _new_interpreter)("harness.atom.serve", args, run_env,
                                                                    START_TIMEOUT_S)
    if returncode is None:  # killed, as a process ended by SIGKILL reports it
        returncode = -signal.SIGKILL
        stderr += f"\nthe start-up did not end within {START_TIMEOUT_S} s: killed with its workers"
    (out / "server.log").write_text(stdout + stderr)
    record = json.loads((out / "server.json").read_text()) if (out / "server.json").is_file() else {"rc": returncode}
    record["returncode"], record["seconds"], record["stderr"] = returncode, time.monotonic() - t0, stderr
    record["ranks"] = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    return record


def server_argv(converted: pathlib.Path, mtp: bool = True, extra: list[str] = ()) -> list[str]:
    """ATOM's server options for the check (``--model`` aside): TP/EP from the manifest; the MTP
    draft where the checkpoint's config.json has an MTP layer (Kimi-K2's has none)."""
    from layouts import load_manifest
    from layouts.engines.atom.adapter import mtp_layers

    target = load_manifest(converted).target
    mtp = mtp and len(mtp_layers(pathlib.Path(converted))) > 0
    return ["--tensor-parallel-size", str(target.tp), *(["--enable-expert-parallel"] if target.ep > 1 else []),
            *TEST_PLAN, *(MTP if mtp else []), *extra]


def check(source: pathlib.Path, converted: pathlib.Path, trees: tuple[pathlib.Path, pathlib.Path], work: pathlib.Path,
          gpu_arch: str = "gfx950", mtp: bool = True, extra: list[str] = (), env: dict[str, str] | None = None,
          reuse_reference: bool = False, door_name: str = "door-on-converted") -> dict:
    """Both start-ups and the comparison: ``{"ok", "ranks", "failures", "reference", "door"}``,
    ``ranks`` each rank's :class:`RankResult`, ``failures`` what failed beside them (one line each).
    ``env``: ATOM's switches (default: those reading the manifest's layout, where the environment
    does not set them); ``reuse_reference``: compare with the records of an earlier check in
    ``work`` (same source and options) instead of starting ATOM on the source again; ``trees``:
    ATOM's and aiter's source trees (``harness.sources.trees``)."""
    import torch

    from harness.compare import compare
    from layouts import load_manifest

    target = load_manifest(converted).target
    argv = server_argv(converted, mtp, extra)
    if env is None:
        env = {k: v for k, v in switches(target).items() if k not in os.environ}
    ref_dir, door_dir = work / "atom-on-source", work / door_name
    if reuse_reference and (ref_dir / "server.json").is_file():
        ref = json.loads((ref_dir / "server.json").read_text())
        ref.update(returncode=0, seconds=0.0, stderr="",
                   ranks=[json.loads(f.read_text()) for f in sorted(ref_dir.glob("rank*.json"))])
    else:
        ref = start("atom", source, argv, env, [0x00, 0xFF], ref_dir, trees, gpu_arch)
    door = start("door", converted, argv, env, [0x00, 0xFF], door_dir, trees, gpu_arch)
    result = {"ok": False, "ranks": [], "failures": [], "reference": ref, "door": door}
    if ref.get("rc") or ref["returncode"]:
        result["failures"].append(f"ATOM's own start-up on {source} failed: {_tail(ref)}")
        return result
    if door.get("rc") or door["returncode"]:
        refused = [r["refused"] for r in door["ranks"] if r["refused"]]
        why = refused[0] if refused else _tail(door)
        result["failures"].append(f"the door's start-up on {converted} failed: {why}")
        return result
    for rank in range(target.tp):
        refs = [torch.load(ref_dir / f"rank{rank}-fill{f}.pt") for f in (0x00, 0xFF)]
        own, other_fill = ({**r["state"], **r["derived"]} for r in refs)
        got = torch.load(door_dir / f"rank{rank}-fill0.pt")
        compared = compare(own, {**got["state"], **got["derived"]}, other_fill)
        bad = compared.problems
        # The door's start-up ran with torch.empty memory filled both ways too: a byte it leaves unwritten
        # where ATOM writes one shows as a difference in one of the two.
        got_ff = torch.load(door_dir / f"rank{rank}-fill255.pt")
        bad += [f"{b} (torch.empty filled with 0xFF)"
                for b in compare(own, {**got_ff["state"], **got_ff["derived"]}, other_fill).problems]
        bad += [f"{k}: is_shuffled {v} in ATOM's load, {got['flags'].get(k)} through the door"
                for k, v in refs[0]["flags"].items() if v != got["flags"].get(k)]
        bad += [f"{k}: swizzle label {refs[0]['labels'].get(k)!r} in ATOM's load, {got['labels'].get(k)!r} through "
                "the door" for k in refs[0]["labels"].keys() | got["labels"].keys()
                if refs[0]["labels"].get(k, "absent") != got["labels"].get(k, "absent")]
        fill = next(r for r in door["ranks"] if r["rank"] == rank)["fills"][0]
        ref_fill = next(r for r in ref["ranks"] if r["rank"] == rank)["fills"][0]
        if fill["draft_head_shared"] != ref_fill["draft_head_shared"]:
            bad.append(f"draft head shared with lm_head: {fill['draft_head_shared']} through the door, "
                       f"{ref_fill['draft_head_shared']} in ATOM's load")
        if fill["runner"] != "ConvertedModelRunner":
            bad.append(f"the worker ran {fill['runner_module']}.{fill['runner']}, not the door's runner")
        bad += [f"stand-in called while loading: {c}" for c in stand_ins.skipped(fill["stand_ins_while_loading"])]
        if fill["load_model_calls"] != 1 + fill["draft"]:
            bad.append(f"ATOM's load_model ran {fill['load_model_calls']} times, not once per model")
        # ATOM's own load warns too where the source lacks a parameter its drafter then shares (an MTP
        # layer without shared_head.head): the door must warn exactly as often, and never otherwise.
        warned, ref_warned = len(fill["not_loaded"]), len(ref_fill["not_loaded"])
        notes = [f"draft head {'shared with the target' if fill['draft_head_shared'] else 'its own'}" if fill["draft"]
                 else "no MTP draft model"]
        notes += [f"NOT-loaded warnings: {warned} (ATOM's own: {ref_warned})"] if warned or ref_warned else []
        notes += [f"warning: {m[:200]}" for m in fill["not_loaded"][:3]]
        note = stand_ins.computed_note(fill["stand_ins_while_loading"])  # torch math ATOM's start-up ran
        notes += [note] if note else []
        result["ranks"].append(RankResult(
            engine="atom", rank=rank, tp=target.tp, tensors=len(refs[0]["state"]),
            draft=sum(k.startswith("draft:") for k in refs[0]["state"]) if fill["draft"] else None,
            derived=len(refs[0]["derived"]), bytes_equal=compared.equal, unwritten=compared.unwritten,
            warned="no" if not warned and not ref_warned else "same" if warned == ref_warned else "yes",
            problems=bad, notes=notes))
    if not door.get("listening"):
        result["failures"].append("the door's start-up did not reach the server's uvicorn.run")
    result["ok"] = not result["failures"] and all(r.ok for r in result["ranks"])
    return result


def _tail(record: dict) -> str:
    lines = [ln for ln in record.get("stderr", "").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {record.get('returncode')}"


def run(source: pathlib.Path, converted: pathlib.Path, trees: tuple[pathlib.Path, pathlib.Path], work: pathlib.Path,
        gpu_arch: str = "gfx950", mtp: bool = True, extra: list[str] = ()) -> Iterator[str | RankResult]:
    """``check-engine atom --serve``: :func:`check`, yielding each rank's result, then what failed
    beside them and the time each side took."""
    result = check(source, converted, trees, work, gpu_arch, mtp, extra)
    yield from result["ranks"]
    yield from (Failure(f) for f in result["failures"])
    yield f"ATOM on the source: {result['reference']['seconds']:.1f} s; the door: {result['door']['seconds']:.1f} s"


if __name__ == "__main__":  # the server process start() runs: python -m harness.atom.serve SETUP ATOM-OPTIONS
    sys.exit(server(json.loads(sys.argv[1]), sys.argv[2:]))
