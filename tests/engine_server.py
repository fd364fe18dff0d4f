"""The suite's client of :mod:`harness.forkserver`: ``check-engine sglang`` / ``vllm``, ATOM's
start-ups and install checks run as forks of one server per kind, shared by the test processes of a
run (pytest-xdist's workers), which has made each process's start (for an engine, the harness's
install and the engine's imports; for prep's environment, the third-party imports) once.

The first run of a kind starts its server (under a lock, so two workers start one) in the
run's shared temporary folder; the run's last act (:func:`stop_all`, from conftest's
``pytest_sessionfinish`` in the controlling process) tells every server to leave, and a server
left behind by a killed run leaves by itself after :data:`IDLE_S` idle seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time

IDLE_S = 300
START_S = 300  # the slowest start seen (an SGLang server on a loaded 2-core machine) is ~20 s


def shared_dir(basetemp: pathlib.Path, worker: bool, make: bool = True) -> pathlib.Path:
    """The folder of this run's servers: beside the workers' own temporary folders (their
    parent), where every process of the run finds it. A Unix socket's path has ~100 bytes: a
    deeper ``--basetemp`` gets a short folder named after it."""
    root = basetemp.parent if worker else basetemp
    folder = root / "engine-servers"
    if len(str(folder / "sglang.sock.0000000")) > 100:
        folder = pathlib.Path(tempfile.gettempdir()) / f"prep-es-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"
    if make:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_check(kind: str, python: pathlib.Path, argv: list[str], env: dict[str, str], cwd: pathlib.Path,
              folder: pathlib.Path, oracles: pathlib.Path | None = None, module: str = "harness",
              timeout: float | None = None, path: pathlib.Path | None = None) -> tuple[int | None, str, str]:
    """``python -m MODULE ARGV`` (or ``python PATH ARGV``) through the fork server of ``kind``
    (``sglang``, ``vllm``: a ``check-engine``; ``python``: any module or script, in prep's
    environment): (exit status, stdout, stderr), as a ``subprocess.run`` of it would give them.
    Past ``timeout`` seconds the run is killed with everything it started, and its exit status is
    None."""
    fd, out = tempfile.mkstemp(dir=folder, suffix=".out")
    os.close(fd)
    err = out.removesuffix(".out") + ".err"
    try:
        for attempt in range(2):
            sock = _server(kind, python, env, folder, oracles)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.connect(str(sock))
                    req = dict(argv=argv, module=module, env=env, cwd=str(cwd), stdout=out, stderr=err)
                    if path is not None:
                        req["path"] = str(path)
                    c.sendall(json.dumps(req).encode() + b"\n")
                    with c.makefile("r") as f:
                        pid = f.readline().strip()
                        if not pid:
                            raise ConnectionResetError("no child answered")
                        c.settimeout(timeout)
                        try:
                            answer = f.readline().strip()
                        except (socket.timeout, TimeoutError):
                            with contextlib.suppress(ProcessLookupError, ValueError):
                                os.killpg(int(pid), signal.SIGKILL)
                            answer = None
                        except BaseException:  # interrupted (Ctrl-C, a test's timeout): the run ends too
                            with contextlib.suppress(ProcessLookupError, ValueError):
                                os.killpg(int(pid), signal.SIGKILL)
                            raise
            except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, FileNotFoundError):
                # a server that has just left (or was leaving as this connected)
                with _lock(folder, kind):
                    if sock.exists() and not _accepts(sock):
                        sock.unlink()
                continue
            text = pathlib.Path(out).read_text(errors="replace"), pathlib.Path(err).read_text(errors="replace")
            if answer is None:
                return None, *text
            if not answer:
                return 1, text[0], text[1] + f"\n(the {kind} fork server's child ended without an exit status)"
            return int(answer), *text
        raise RuntimeError(f"the {kind} fork server in {folder} did not take the run twice")
    finally:
        for p in (out, err):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def stop_all(folder: pathlib.Path) -> None:
    """Tell every server in ``folder`` to leave (the checks they are running finish)."""
    for path in folder.glob("*.sock"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(path))
            c.sendall(b'{"quit": true}\n')


@contextlib.contextmanager
def _lock(folder: pathlib.Path, engine: str):
    with open(folder / f"{engine}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _accepts(path: pathlib.Path) -> bool:
    """Whether a server listens at ``path`` (a bare connection: the server takes it for nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        try:
            c.connect(str(path))
        except OSError:
            return False
        c.sendall(b"\n")
    return True


def _server(kind: str, python: pathlib.Path, env: dict[str, str], folder: pathlib.Path,
            oracles: pathlib.Path | None) -> pathlib.Path:
    path = folder / f"{kind}.sock"
    if path.exists():
        return path
    with _lock(folder, kind):
        if path.exists():  # another worker started it while this one waited
            return path
        log = folder / f"{kind}-server.log"
        cmd = [str(python), "-m", "harness.forkserver", kind, str(path), "--idle", str(IDLE_S)]
        cmd += ["--oracles", str(oracles)] if oracles is not None else []
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        deadline = time.monotonic() + START_S
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the {kind} fork server did not start ({log}):\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
    return path
