"""Real `prep` processes for the fault suite, started in milliseconds instead of seconds.

Each run is a process of its own (it can be killed with SIGKILL, its exit status is real, its
files and locks are its own), forked from a "zygote" that has already imported torch and prep:
a fresh interpreter spends ~3 s importing torch on the CI machine, which made the kill-at-every-
step suite too slow to keep. The zygote imports only; it runs no torch op before forking (a
child forked after torch ops could hang in torch's OpenMP pool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_ZYGOTE = r"""
import json, os, sys
import torch, click  # noqa: F401  (the expensive imports, done once)
import prep.cli, prep.convert, prep.revert, prep.verify, prep.outdir  # noqa: F401
out = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            try:
                prep.cli.main(job["args"], prog_name="prep")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # what the interpreter would do: the traceback, exit status 1
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    out.write(json.dumps({"returncode": code}) + "\n")
    out.flush()
"""


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={k: v for k, v in os.environ.items() if not k.startswith("PREP_")})

    def run(self, args: list[str], env: dict[str, str], cwd: str | None = None,
            stderr_to: str | None = None) -> subprocess.CompletedProcess:
        """``stderr_to``: a path the run's stderr opens instead of a file (e.g. a pseudo-terminal's
        /dev/pts/N, read by the caller); the result's stderr is then empty."""
        with tempfile.TemporaryDirectory() as d:
            o, e = os.path.join(d, "out"), stderr_to or os.path.join(d, "err")
            job = {"args": args, "env": env, "cwd": cwd or os.getcwd(), "stdout": o, "stderr": e}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the prep zygote died")
            code = json.loads(line)["returncode"]
            with open(o) as fo:
                out = fo.read()
            if stderr_to:
                return subprocess.CompletedProcess(["prep", *args], code, out, "")
            with open(e) as fe:
                return subprocess.CompletedProcess(["prep", *args], code, out, fe.read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
