import os

# The tests run Triton kernels (ours and aiter's) on the CPU; triton.jit reads this when a
# kernel is defined, so it must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Where stderr is not a terminal, long verbs print a progress line every 10 s: a test that checks
# stderr is one line must not see one because a loaded CI machine made a run slow. The tests of
# those lines set their own interval.
os.environ.setdefault("PREP_PROGRESS_SECONDS", "3600")

# Under pytest-xdist (scripts/test.sh runs `-n auto`) every worker is a process of its own, and
# torch would give each one thread per core: N workers x N threads on N cores, whose OpenMP threads
# spin waiting on each other. Each worker (and the prep processes it starts) gets its share of the
# cores instead; this must be set before torch is first imported, which is just below.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import dataclasses  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

import aiter_oracle  # noqa: E402


def _need(ok: bool, what: str, how: str = "run `bash scripts/setup_env.sh --tests`") -> None:
    """Skip the test in one line saying what is missing and how to get it; where the oracles must be
    there (.ci/run sets PREP_REQUIRE_ORACLES=1, CI sets CI), a missing one fails it instead, so
    that a comparison never stops running unnoticed."""
    if not ok:
        msg = f"{what} not available: {how} (comparison skipped)"
        if os.environ.get("PREP_REQUIRE_ORACLES") == "1" or os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def need_engine_sources() -> pathlib.Path:
    """The folder of ATOM's and aiter's pinned sources (harness/sources.py), or skip saying how to
    get them: users have no shared/oracles beside their clone."""
    from harness import sources

    folder = sources.find()
    if folder is None:
        _need(False, "ATOM's and aiter's pinned sources", sources.HOW_TO_GET.split(": ", 1)[1])
    return folder


@pytest.fixture(scope="session")
def aiter_shuffle():
    """aiter/ops/shuffle.py from the pinned amd-aiter wheel."""
    _need(aiter_oracle.available(), "aiter oracle files")
    return aiter_oracle.shuffle_module()


@pytest.fixture(scope="session")
def aiter_fp4_utils():
    """aiter/utility/fp4_utils.py from the pinned amd-aiter wheel."""
    _need(aiter_oracle.available(), "aiter oracle files")
    return aiter_oracle.fp4_utils_module()


@pytest.fixture(scope="session")
def aiter_triton_quant():
    """aiter's Triton MXFP4 quant kernel, interpreted on the CPU."""
    _need(aiter_oracle.triton_available(), "triton + aiter oracle files")
    return aiter_oracle.dynamic_mxfp4_quant


@pytest.fixture(scope="session")
def quark_mxfp4():
    """amd-quark's MXFP4 weight export (observer + real quantizer + pack) on the CPU."""
    import quark_oracle

    _need(quark_oracle.available(), "amd-quark")
    return quark_oracle.quark_mxfp4_in_subprocess


@pytest.fixture(scope="session")
def aiter_fused_rms_quant():
    """aiter's own `fused_rms_mxfp4_quant` (its wrapper and Triton kernel), interpreted on the CPU."""
    _need(aiter_oracle.triton_ops_available("fused_mxfp4_quant"), "triton + aiter oracle files (fused_mxfp4_quant)")
    return aiter_oracle.triton_ops_module("fused_mxfp4_quant").fused_rms_mxfp4_quant


@pytest.fixture(scope="session")
def aiter_triton_gemm():
    """aiter/ops/triton/gemm_afp4wfp4.py (its three MXFP4 GEMMs and their JSON configs), interpreted
    on the CPU; needs triton >= 3.8, whose interpreter has `tl.dot_scaled`."""
    _need(aiter_oracle.triton_gemm_available(), "triton + aiter oracle files (gemm_afp4wfp4 and its configs)")
    _need(aiter_oracle.interpreter_has_dot_scaled(), "triton >= 3.8 (tl.dot_scaled in the interpreter)")
    return aiter_oracle.triton_gemm_module()


# ------------------------------------------------------------------ engines' conversions
@pytest.fixture(scope="session")
def tiny_r1(tmp_path_factory) -> pathlib.Path:
    """The tiny R1-0528 checkpoint (prep.testing's preset), written once per worker."""
    from prep.testing import PRESETS
    from checkpoints import write_checkpoint

    return write_checkpoint(dataclasses.replace(PRESETS["tiny"], variant="r1-0528"),
                            tmp_path_factory.mktemp("tiny-r1") / "src")


def read_tensors(folder: pathlib.Path, files=None) -> dict:
    """Every tensor of ``folder``'s safetensors ``files`` (default: all of them), by name."""
    from safetensors import safe_open

    out = {}
    for f in files if files is not None else sorted(p.name for p in pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(pathlib.Path(folder) / f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def assert_verifies_and_reverts(out: pathlib.Path, src: pathlib.Path, back: pathlib.Path) -> None:
    """``prep verify --source`` passes on the conversion ``out`` of ``src``, and ``prep revert`` into
    ``back`` gives every source tensor back, byte for byte."""
    import torch
    from click.testing import CliRunner

    from prep.cli import main

    r = CliRunner().invoke(main, ["verify", str(out), "--source", str(src)])
    assert r.exit_code == 0 and "byte-identical" in r.output, r.output
    r = CliRunner().invoke(main, ["revert", str(out), "-o", str(back)])
    assert r.exit_code == 0, r.output
    got, want = read_tensors(back), read_tensors(src)
    assert got.keys() == want.keys() and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                             for k in want)


_ENGINE_SERVERS: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _engine_servers(tmp_path_factory):
    """Where this run's engine fork servers live (tests/engine_server.py), made at the first check."""
    _ENGINE_SERVERS["basetemp"] = tmp_path_factory.getbasetemp


@pytest.hookimpl(tryfirst=True)  # before pytest removes the temporary folder the servers live in
def pytest_sessionfinish(session):
    # The controlling process (not an xdist worker) ends last: every engine server leaves with it.
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)  # None: no temporary folder was made, nor any server
    if os.environ.get("PYTEST_XDIST_WORKER") or basetemp is None:
        return
    import engine_server

    folder = engine_server.shared_dir(basetemp, worker=False, make=False)
    if folder.is_dir():
        engine_server.stop_all(folder)


def _servers_folder() -> pathlib.Path:
    import engine_server

    return engine_server.shared_dir(_ENGINE_SERVERS["basetemp"](), worker=bool(os.environ.get("PYTEST_XDIST_WORKER")))


def forked_python(module: str | None, args: list[str], env: dict[str, str], timeout: float | None = None,
                  cwd: pathlib.Path | None = None, path: pathlib.Path | None = None) -> tuple[int | None, str, str]:
    """``python -m MODULE ARGS`` (or, with ``path``, ``python PATH ARGS``) in prep's environment,
    forked from the run's server of it (tests/engine_server.py: torch and the other third-party
    modules imported once a run): (exit status, or None where it ran past ``timeout`` and was
    killed; stdout; stderr)."""
    import sys

    import engine_server
    from harness import REPO, pythonpath

    env = dict(env)
    env["PYTHONPATH"] = pythonpath(env.get("PYTHONPATH"))
    return engine_server.run_check("python", pathlib.Path(sys.executable), args, env, cwd or REPO, _servers_folder(),
                                   module=module or "harness", timeout=timeout, path=path)


def engine_check_rows(engine: str, src: pathlib.Path, out: pathlib.Path, work: pathlib.Path,
                      *more: str) -> tuple[list[dict[str, str]], str]:
    """``python -m harness check-engine ENGINE`` (and ``more`` options) on ``src`` and its
    conversion ``out`` (which must pass: exit 0): its per-rank rows, by column, and what it printed.
    Run as a fork of the engine's server (tests/engine_server.py: the engine imported once a run)."""
    from harness import report

    rc, stdout, stderr = engine_check(engine, src, out, work, *more)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    return report.rows(stdout), stdout


def engine_check(engine: str, src: pathlib.Path, out: pathlib.Path, work: pathlib.Path, *more: str,
                 forked: bool = True) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m harness check-engine ENGINE`` (and ``more``) on
    ``src`` and ``out``, in the engine's Python: forked from its server (tests/engine_server.py), or,
    with ``forked=False``, as a process of its own."""
    import subprocess

    import engine_server
    from harness import REPO, pythonpath

    python = REPO / f".venv-{engine}" / "bin" / "python"
    _need(python.is_file(), f"{engine} in .venv-{engine}", f"run `bash scripts/setup_env.sh --engine {engine}`")
    oracles = need_engine_sources()
    argv = ["check-engine", engine, "--source", str(src), "--converted", str(out), "--work", str(work),
            "--oracles", str(oracles), *more]
    # the engine's own process sets TRITON_INTERPRET; its Python finds the harness as `python -m harness` does
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = pythonpath(os.environ.get("PYTHONPATH"))
    if not forked:
        r = subprocess.run([str(python), "-m", "harness", *argv], capture_output=True, text=True, env=env, cwd=REPO)
        return r.returncode, r.stdout, r.stderr
    return engine_server.run_check(engine, python, argv, env, REPO, _servers_folder(), oracles)
