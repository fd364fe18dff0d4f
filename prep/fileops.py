"""The file operations prep's writes into a user's folder are made of, each one whole or not at
all: a regular file copied a MiB at a time, JSON written under a temporary name and renamed, a
rename made durable, two folders swapped in one rename, the free space left; and the fault
suite's kill points, which stop a real run at each step of a write. What is written where, and
when, is :mod:`prep.outdir`'s."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pathlib
import shutil
import signal
from typing import Any

from layouts.safe_files import open_regular


def copy_regular(src: pathlib.Path, dst: pathlib.Path, limit: int | None = None) -> int:
    """Copy regular file ``src`` to ``dst`` a MiB at a time (never whole in memory), through the
    descriptor that was checked to be a regular file (a FIFO would block forever); its size.
    ``limit``: copy at most that many bytes and one more (enough for the caller to see it grew)."""
    with os.fdopen(open_regular(src), "rb") as fin, open(dst, "wb") as fout:
        if limit is None:
            shutil.copyfileobj(fin, fout, 1 << 20)
        else:
            left = limit + 1
            while left > 0 and (block := fin.read(min(left, 1 << 20))):
                fout.write(block)
                left -= len(block)
        return fout.tell()


def kill_point(name: str) -> None:
    """Test hook: ``PREP_TEST_KILL_AT=<name>`` makes this process kill -9 itself here (and
    ``PREP_TEST_INTERRUPT_AT=<name>`` raises KeyboardInterrupt), so the fault suite can stop a
    real run at every step of a write (tests/test_output_safety.py)."""
    if os.environ.get("PREP_TEST_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("PREP_TEST_INTERRUPT_AT") == name:  # what Ctrl-C does there
        raise KeyboardInterrupt


def write_json(path: pathlib.Path, obj: Any) -> None:
    """Write ``obj`` as JSON under a temporary name, fsync, and rename: never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None  # named: a full disk says which file


def fsync_dir(path: pathlib.Path) -> None:
    """Make a rename in ``path`` durable (not only atomic)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: pathlib.Path) -> int:
    """Bytes an unprivileged writer may still put on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class _Renamer:
    """``renameat2(RENAME_EXCHANGE)`` through libc where it exists (Linux >= 3.15, glibc >= 2.28)."""

    RENAME_EXCHANGE = 2
    AT_FDCWD = -100

    def __init__(self) -> None:
        try:
            self._fn = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            self._fn = None

    def exchange(self, a: pathlib.Path, b: pathlib.Path) -> bool:
        """Swap ``a`` and ``b`` atomically; False where the system or filesystem cannot."""
        if self._fn is None:
            return False
        rc = self._fn(self.AT_FDCWD, os.fsencode(a), self.AT_FDCWD, os.fsencode(b), self.RENAME_EXCHANGE)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return False
        raise OSError(err, os.strerror(err), str(a))


renamer = _Renamer()
