"""A fork server for ``check-engine sglang`` and ``check-engine vllm``: one process per engine, in
the engine's environment, that has done once what every check of that engine starts with (the
harness's :func:`install` and the engine's imports), and forks a child for each check, which runs
``python -m harness check-engine ...`` (:func:`harness.__main__.main`) from there with the
caller's environment, working folder and output files.

Why: the imports are most of such a check on a CPU (``python -X importtime``: 7.8 s of a 10.6 s
vLLM check, ~8.5 s of a 16.4 s SGLang one), and the test suite runs seven of them. Each check
still runs in a process of its own (a fork), so nothing one check does reaches another; what
they share is what a fresh process would have made the same way: the same imports, in the same
order, after the same install. The suite's engine checks use it (``tests/engine_server.py``); a
user's ``python -m harness check-engine`` runs as before.

    ENGINE_PYTHON -m harness.forkserver {sglang,vllm} SOCKET [--idle SECONDS]

Protocol, over the Unix socket ``SOCKET``: a client sends one JSON line, ``{"argv": [...], "env":
{...}, "cwd": "...", "stdout": PATH, "stderr": PATH}`` (or ``{"quit": true}``), and reads back one
line, the check's exit status, once the check has ended. The server leaves after ``--idle``
seconds without a request (default 600), or on ``quit``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import sys
import tempfile
import traceback


# The variables the warm-up's imports added to the environment (the harnesses set defaults at
# import: TRITON_INTERPRET, VLLM_ROCM_USE_AITER, ...): each child sets them where its caller did not.
IMPORT_DEFAULTS: dict[str, str] = {}


def warm(engine: str, oracles: pathlib.Path, work: pathlib.Path) -> None:
    """What a check of ``engine`` does before it reads a checkpoint: the pinned aiter tree, the
    harness's install (stand-ins, platform), and the modules its build and load import."""
    import importlib

    before = dict(os.environ)

    from harness import sources

    _, aiter_dir = sources.trees(oracles, work)
    if engine == "sglang":
        from harness import sglang

        sglang.install(aiter_dir)
        modules = ("sglang.srt.configs.device_config", "sglang.srt.configs.load_config",
                   "sglang.srt.configs.model_config", "sglang.srt.runtime_context", "sglang.srt.server_args",
                   "sglang.srt.model_loader", "sglang.srt.models.registry", "sglang.srt.models.deepseek_v2")
    elif engine == "vllm":
        from harness import vllm

        vllm.install(aiter_dir)
        modules = ("vllm.engine.arg_utils", "vllm.config", "vllm.model_executor.model_loader",
                   "vllm.v1.worker.workspace", "vllm.v1.worker.gpu.spec_decode.eagle.utils",
                   "vllm.model_executor.models.deepseek_v2")
    else:
        raise SystemExit(f"error: no fork server for {engine!r} (sglang, vllm)")
    for name in modules:
        importlib.import_module(name)
    from harness import __main__  # noqa: F401 - the children's entry point

    IMPORT_DEFAULTS.update({k: v for k, v in os.environ.items() if k not in before})


def _run(conn: socket.socket) -> None:
    """In the forked child: one request, run, answered with its exit status; the child never
    returns (whatever happens, it ends here and never goes back to the server's loop)."""
    rc = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; a check may wait on processes
        with conn.makefile("r") as f:
            req = json.loads(f.readline())
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for k, v in IMPORT_DEFAULTS.items():  # the harness's os.environ.setdefault calls, as at its import
            os.environ.setdefault(k, v)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        from harness.__main__ import main

        sys.argv = ["python -m harness", *req["argv"]]
        try:
            rc = main(req["argv"])
        except SystemExit as e:  # as the interpreter reports it: a message to stderr and 1, or the code
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            conn.sendall(f"{rc}\n".encode())
        finally:
            os._exit(0)  # no interpreter teardown: the parent's atexit hooks and objects are the parent's


def serve(engine: str, sock_path: pathlib.Path, oracles: pathlib.Path, idle: float) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"{engine}-forkserver-", dir=sock_path.parent))
    warm(engine, oracles, work)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped as they end
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staged = sock_path.with_name(sock_path.name + f".{os.getpid()}")
    srv.bind(str(staged))
    srv.listen(16)
    os.replace(staged, sock_path)  # clients see the socket only once it accepts
    ours = os.stat(sock_path).st_ino
    srv.settimeout(idle)
    try:
        while True:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                return
            conn.settimeout(None)
            peek = conn.recv(64, socket.MSG_PEEK)
            if peek.startswith(b'{"quit"'):
                conn.close()
                return
            if not peek.strip():  # a bare connection (a client asking whether it listens)
                conn.close()
                continue
            if os.fork() == 0:
                srv.close()
                _run(conn)
            conn.close()
    finally:
        srv.close()
        try:
            if os.stat(sock_path).st_ino == ours:  # not a later server's
                sock_path.unlink()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.forkserver", description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("socket", type=pathlib.Path)
    ap.add_argument("--oracles", type=pathlib.Path, required=True, help="folder with ATOM's and aiter's pinned sources")
    ap.add_argument("--idle", type=float, default=600.0, help="seconds without a request before it leaves")
    args = ap.parse_args(argv)
    serve(args.engine, args.socket, args.oracles, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
