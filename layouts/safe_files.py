"""Reading the files a checkpoint's folder holds, when they are input like any other: a name in
a manifest or an index must not make a reader open a file outside the folder (``../x``,
``/etc/passwd``) or block forever (a FIFO); a JSON file is read whole only under a size bound,
strictly (UTF-8, no key twice). Shared by the manifest, the safetensors reader and prep; torch-free,
and it imports nothing of theirs, so none of them imports another to reach it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import stat
from typing import Any, Iterator

__all__ = [
    "open_regular", "MAX_JSON_BYTES", "MIN_BYTES_PER_CONTAINER", "MAX_CONTAINERS",
    "FileTooLargeError", "read_regular", "plain_name_problem", "opened_outside", "member_problem",
    "DuplicateKeyError", "strict_json", "gc_paused",
]

_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def open_regular(path: str | os.PathLike) -> int:
    """``os.open(path, O_RDONLY)`` that refuses anything but a regular file (OSError saying what
    it is; FileNotFoundError as open raises it). O_NONBLOCK makes opening a FIFO return at once
    instead of waiting for a writer forever; the type is then read from the descriptor opened,
    not from the path, which could be swapped in between. Blocking mode is restored (it means
    nothing for a regular file, but a reader should not depend on that)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"not a regular file but {_FILE_KINDS.get(stat.S_IFMT(mode), 'a special file')}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# The most a JSON file prep reads whole may hold: DeepSeek-R1's manifest at TP 8 is 20 MB (its
# 90,910 source tensors are 12 MB of it), its index 8 MB; this is 4.8x the manifest. Past it a file
# is not what it claims to be. What one just under it costs an engine's rank load, measured
# (scripts/bench.py manifest-bound, 2-core VM): 3.5 s and 1.36 GiB peak at 96 MiB, against 14.4 s
# and 3.16 GiB at the 256 MiB this was before (7.0 GB with a costlier hostile shape).
MAX_JSON_BYTES = 96 << 20
MIN_BYTES_PER_CONTAINER = 16  # strict_json: see there
MAX_CONTAINERS = 2_000_000


class FileTooLargeError(ValueError):
    """A file larger than what its reader takes whole."""


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The whole of a regular file (see :func:`open_regular`); :class:`FileTooLargeError` before
    reading anything when it holds more than ``limit`` bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise FileTooLargeError(f"{size} bytes, more than the {limit} such a file can be")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def plain_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside a folder (None when it is): a manifest's and
    an index's files are siblings of it, never paths."""
    if not isinstance(name, str):
        return f"file name {name!r} is not a string"
    if name in ("", ".", "..") or "/" in name or "\\" in name or not name.isprintable():  # NUL, newlines
        return f"file name {name!r} is not a plain file name inside the folder"
    return None


def _container(root: pathlib.Path) -> str:
    """The real folder a member's symlink may point into: the folder itself, or for a Hugging
    Face cache snapshot (``.../models--org--name/snapshots/<rev>/``, whose files are symlinks
    into ``../../blobs/``) the repo's cache folder."""
    real = pathlib.Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return str(real.parent.parent)
    return str(real)


def opened_outside(fd: int, root: str | os.PathLike) -> str | None:
    """Where the file open at ``fd`` lies when that is outside folder ``root`` (its container:
    the repo's cache folder for a Hugging Face snapshot), else None. :func:`member_problem`
    checks a name before it is opened; a symlink put in its place between that check and the
    open is followed by the open, so what was opened is checked again, by the descriptor
    (``/proc/self/fd/N``; None where the system has no such view)."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    box = _container(pathlib.Path(root))
    if not real.startswith("/") or os.path.commonpath([real, box]) == box:
        return None
    return real


def member_problem(root: str | os.PathLike, name: Any) -> str | None:
    """Why file ``name`` that a manifest or an index of folder ``root`` names may not be read
    (None when it may, or when it does not exist: the reader says "missing" with its own fix).
    It must be a plain name (no ``/``, ``\\``, NUL, ``.``, ``..``), a regular file, and a symlink
    must stay inside the folder (inside the repo's cache folder for a Hugging Face snapshot)."""
    problem = plain_name_problem(name)
    if problem:
        return problem
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{name}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        real, box = os.path.realpath(path), _container(pathlib.Path(root))
        if os.path.commonpath([real, box]) != box:
            return f"{name} is a symlink to {real}, outside {box}"
        try:
            st = os.stat(path)
        except OSError:
            return None  # a dangling link: missing
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file but {_FILE_KINDS.get(stat.S_IFMT(st.st_mode), 'a special file')}"
    return None


class DuplicateKeyError(ValueError):
    """A JSON object names ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(f"key {key!r} given twice")
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """``object_pairs_hook``: a dict, refusing a key given twice (plain ``json.loads`` keeps the
    last silently: a safetensors header could hide a tensor behind another of the same name, an
    index list a tensor in two shards)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        raise DuplicateKeyError(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


def strict_json(raw: bytes) -> Any:
    """JSON of a safetensors header, an index or a manifest, read strictly: UTF-8 only
    (``json.loads`` of bytes would also take UTF-16 and UTF-32), no key twice
    (:class:`DuplicateKeyError`), nesting too deep for the parser a ValueError like any other
    malformed text. Raises ValueError.

    The hook costs time, so the cyclic garbage collector is paused while the objects are built
    (~100k small ones for a header of 61k tensors): its generation-0 passes over them were the
    larger cost all along. Opening a safetensors file of 61,373 tensors (``SafetensorsFile``,
    7.6 MB header; median of 15 per process, two processes each, 2-core machine under load):
    before the hostile-input checks 630-730 ms (min 500-580); with the hook and the checks but
    no pause 790-860 ms; with the hook, the checks and the pause 300-330 ms (min 240-265).
    The pause is process-wide but only ever ends where it began: a thread that found the
    collector paused leaves it to the one that paused it, and a caller's own ``gc.disable()``
    is kept."""
    # Each object or array costs ~60-200 bytes parsed whatever its text: a file of empty ones
    # ("[{},{},...]", 3 bytes each) within the size bound took 2.6 GiB to parse. What prep and
    # safetensors write has one container per 27 bytes or more (a safetensors header entry; a
    # manifest ~60), so fewer than 16 bytes per container is refused before parsing.
    # And at most MAX_CONTAINERS (R1's TP 8 manifest, 20 MB, holds ~330k), so that no file within
    # the bounds costs more than ~0.5 GiB parsed.
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > min(MAX_CONTAINERS, max(1024, len(raw) // MIN_BYTES_PER_CONTAINER)):
        raise ValueError(f"{containers} objects and arrays in {len(raw)} bytes (at most {MAX_CONTAINERS}, and "
                         f"{MIN_BYTES_PER_CONTAINER} bytes each or more): not JSON that prep or safetensors writes")
    text = raw.decode("utf-8")
    with gc_paused():
        try:
            return json.loads(text, object_pairs_hook=_unique_keys)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while many small objects are built (a header's
    entries, a manifest's records): its generation-0 passes over them cost more than the
    building. Only ever resumed where it was paused: a thread that found it paused leaves it
    to the one that paused it, and a caller's own ``gc.disable()`` is kept."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()
