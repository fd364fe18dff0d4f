"""A fork server for the test suite's engine processes: one process per kind, which has done once
what every process of that kind starts with, and forks a child for each request, which runs from
there with the caller's arguments, environment, working folder and output files. Kinds:

* ``sglang``, ``vllm`` (in the engine's environment): ``python -m harness check-engine ENGINE``
  after the harness's install (stand-ins, platform) and the engine's imports;
* ``python`` (prep's own environment): ``python -m MODULE`` (ATOM's start-ups, ``harness.atom.serve``;
  ATOM's install checks, ``harness``) after the third-party imports alone (torch, triton,
  transformers, ...): ATOM reads its switches as its modules are imported, and each start-up
  sets its own, so ATOM and the harness are imported by the child, as in a new interpreter.

Why: the imports are most of such a process on a CPU (``python -X importtime``: 7.8 s of a 10.6 s
vLLM check, ~8.5 s of a 16.4 s SGLang one, ~2.8 s of third-party imports in each of ATOM's ~7 s
start-ups), and the suite starts dozens of them. Each request still runs in a process of its own
(a fork, in a session of its own), so nothing one does reaches another; what they share is what a
fresh process would have made the same way: the same imports, in the same order, under the same
environment. The suite's client is ``tests/engine_server.py``; by hand, ``python -m harness
check-engine`` and the rest run as before, one interpreter each.

    PYTHON -m harness.forkserver {sglang,vllm,python} SOCKET [--oracles DIR] [--idle SECONDS]

Protocol, over the Unix socket ``SOCKET``: a client sends one JSON line, ``{"argv": [...],
"module": "harness" (or "path": a script, ``python`` only), "env": {...}, "cwd": "...", "stdout":
PATH, "stderr": PATH}`` (or
``{"quit": true}``) and reads back two lines: the child's pid (its session's id, to end it with
everything it started), then, once it has ended, its exit status. The server leaves after
``--idle`` seconds without a request (default 600), or on ``quit``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import runpy
import signal
import socket
import sys
import tempfile
import traceback

KINDS = ("sglang", "vllm", "python")
# What prep's environment imports before any of ATOM's or prep's own code: none of it reads ATOM's
# switches (`python -X importtime` of an ATOM start-up: torch 1.7 s, transformers 0.36, sympy 0.31,
# regex, numpy, huggingface_hub, ...). Not triton: its kernels are interpreted or compiled as
# TRITON_INTERPRET says when each is defined, and the processes run under either.
THIRD_PARTY = ("torch", "numpy", "sympy", "transformers", "transformers.configuration_utils", "huggingface_hub",
               "safetensors", "safetensors.torch", "regex", "jinja2", "yaml", "click", "uvicorn")

# The variables the warm-up's imports added to the environment (the harnesses set defaults at
# import: TRITON_INTERPRET, VLLM_ROCM_USE_AITER, ...): each child sets them where its caller did not.
IMPORT_DEFAULTS: dict[str, str] = {}


def warm(kind: str, oracles: pathlib.Path | None, work: pathlib.Path) -> None:
    """What every process of ``kind`` does first: for an engine, the pinned aiter tree, the
    harness's install (stand-ins, platform) and the modules a check's build and load import; for
    ``python``, the third-party imports."""
    before = dict(os.environ)
    if kind == "python":
        modules = THIRD_PARTY
    else:
        from harness import sources

        if oracles is None:
            raise SystemExit(f"error: the {kind} fork server needs --oracles")
        _, aiter_dir = sources.trees(oracles, work)
        if kind == "sglang":
            from harness import sglang

            sglang.install(aiter_dir)
            modules = ("sglang.srt.configs.device_config", "sglang.srt.configs.load_config",
                       "sglang.srt.configs.model_config", "sglang.srt.runtime_context", "sglang.srt.server_args",
                       "sglang.srt.model_loader", "sglang.srt.models.registry", "sglang.srt.models.deepseek_v2")
        else:
            from harness import vllm

            vllm.install(aiter_dir)
            modules = ("vllm.engine.arg_utils", "vllm.config", "vllm.model_executor.model_loader",
                       "vllm.v1.worker.workspace", "vllm.v1.worker.gpu.spec_decode.eagle.utils",
                       "vllm.model_executor.models.deepseek_v2")
        # what the children's `python -m harness` imports (not harness.__main__ itself: each child
        # runs it as __main__, and runpy warns of one it finds imported)
        modules += ("harness.quark_export", "harness.report", "harness.sources")
    for name in modules:
        importlib.import_module(name)
    IMPORT_DEFAULTS.update({k: v for k, v in os.environ.items() if k not in before})


def _run(conn: socket.socket, kind: str) -> None:
    """In the forked child: one request, run, answered with its exit status; the child never
    returns (whatever happens, it ends here and never goes back to the server's loop)."""
    rc, me = 1, os.getpid()
    try:
        os.setsid()  # a session of its own: the caller can end it with every process it starts
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; a child may wait on processes
        conn.sendall(f"{os.getpid()}\n".encode())
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
        module, path = req.get("module", "harness"), req.get("path")
        if kind != "python" and (path or module != "harness"):
            raise SystemExit(f"error: the {kind} fork server runs `python -m harness` only, not {path or module}")
        # sys.path[0] as a new interpreter sets it: the script's folder, or for -m the working folder
        sys.path[0] = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
        sys.argv = [path, *req["argv"]] if path else [f"python -m {module}", *req["argv"]]
        try:
            if path:
                runpy.run_path(path, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:  # as the interpreter reports it: a message to stderr and 1, or the code
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        if os.getpid() != me:  # a process the run forked, ending here: it answers nothing
            os._exit(rc if isinstance(rc, int) else 1)
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            conn.sendall(f"{rc}\n".encode())
        finally:
            os._exit(0)  # no interpreter teardown: the parent's atexit hooks and objects are the parent's


def serve(kind: str, sock_path: pathlib.Path, oracles: pathlib.Path | None, idle: float) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"{kind}-forkserver-", dir=sock_path.parent))
    warm(kind, oracles, work)
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
            conn.settimeout(30)  # a client that connects and says nothing does not hold the server
            try:
                peek = conn.recv(64, socket.MSG_PEEK)
            except OSError:
                conn.close()
                continue
            conn.settimeout(None)
            if peek.startswith(b'{"quit"'):
                conn.close()
                return
            if not peek.strip():  # a bare connection (a client asking whether it listens)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                srv.close()
                _run(conn, kind)
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
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("socket", type=pathlib.Path)
    ap.add_argument("--oracles", type=pathlib.Path, help="folder with ATOM's and aiter's pinned sources (engines)")
    ap.add_argument("--idle", type=float, default=600.0, help="seconds without a request before it leaves")
    args = ap.parse_args(argv)
    serve(args.kind, args.socket, args.oracles, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
