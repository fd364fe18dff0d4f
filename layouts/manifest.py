"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this module, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import stat
from typing import Any, Iterable

MANIFEST_NAME = "prep-manifest.json"
COMPLETE_NAME = "prep-complete.json"
FORMAT = "prep-manifest"
FORMAT_VERSION = 1
MAX_TP = 1 << 16  # no engine runs more ranks: a larger tp is a damaged manifest


class ManifestError(ValueError):
    """A converted checkpoint's manifest is missing, unfinished, or not one we can read."""


# ------------------------------------------------------------------ files a manifest or an index names
# Shared with prep (its source index names shards the same way), kept here because this module
# is torch-free. A manifest or an index is input like any other: a name in it must not make a
# reader open a file outside the folder (``../x``, ``/etc/passwd``) nor block forever (a FIFO).

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


def read_regular(path: str | os.PathLike) -> bytes:
    """The whole of a regular file (see :func:`open_regular`)."""
    fd = open_regular(path)
    try:
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


_LAST_INDEX = re.compile(r"^(.*\.)(\d+)(\..+)$")  # the last numeric path component: experts.<i>.
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def compress_names(names: Iterable[str]) -> list[str]:
    """Runs of names that differ only in their last numeric component, by consecutive integers,
    as one ``prefix{a..b}suffix`` pattern (``experts.{0..255}.gate_proj.weight``). Exact:
    :func:`expand_names` gives back the same list. A stacked MoE tensor's 257 sources stay one
    line, which keeps a TP 8 manifest of DeepSeek-R1 in megabytes rather than hundreds."""
    out: list[str] = []
    run: list[Any] | None = None  # [prefix, start, stop, suffix]

    def flush() -> None:
        if run is not None:
            p, a, b, sfx = run
            out.append(f"{p}{a}{sfx}" if b == a + 1 else f"{p}{{{a}..{b - 1}}}{sfx}")

    for name in names:
        m = _LAST_INDEX.match(name)
        if m and run is not None and (run[0], run[3]) == (m.group(1), m.group(3)) and run[2] == int(m.group(2)) \
                and m.group(2) == str(int(m.group(2))):
            run[2] += 1
            continue
        flush()
        run = [m.group(1), int(m.group(2)), int(m.group(2)) + 1, m.group(3)] \
            if m and m.group(2) == str(int(m.group(2))) else None
        if run is None:
            out.append(name)
    flush()
    return out


def expand_names(patterns: Iterable[str]) -> list[str]:
    """The inverse of :func:`compress_names`."""
    out: list[str] = []
    for p in patterns:
        m = _RANGE.search(p)
        if m is None:
            out.append(p)
        else:
            out += [f"{p[:m.start()]}{i}{p[m.end():]}" for i in range(int(m.group(1)), int(m.group(2)) + 1)]
    return out


def manifest_hash(raw: bytes) -> str:
    import hashlib

    return hashlib.sha256(raw).hexdigest()


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor of a converted checkpoint, as the manifest states it."""

    name: str
    rank: int | None  # None: a common (pass-through) tensor every rank reads
    file: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    role: str  # "mxfp4_weight", "e8m0_scale" or "passthrough"
    layout: str | None  # registered layout name (MXFP4 tensors)
    group: str | None  # engine module the tensor belongs to
    runtime_attrs: dict[str, Any]  # attributes the engine must set on the parameter
    xxh3_128: str

    @classmethod
    def from_json(cls, t: dict[str, Any]) -> "TensorRecord":
        """The record of one ``tensors`` entry, its types checked (:class:`ManifestError` saying
        which key is wrong): an engine sets these as attributes and reads files and shapes from
        them, so a wrong type must stop here, not as an AttributeError deep in a loader."""
        if not isinstance(t, dict):
            raise ManifestError(f"entry is {type(t).__name__}, not an object")
        try:
            name, rank, file, dtype, shape, role, digest = (t["name"], t["rank"], t["file"], t["dtype"], t["shape"],
                                                            t["role"], t["xxh3_128"])
        except KeyError as e:
            raise ManifestError(f"entry {t.get('name')!r} lacks the key {e.args[0]!r}") from None
        layout, group, attrs = t.get("layout"), t.get("group"), t.get("runtime_attrs")
        if type(name) is not str or not name.isprintable():
            raise ManifestError(f"entry name {name!r} is not a string of printable characters")
        for key, value, optional in (("file", file, False), ("dtype", dtype, False), ("role", role, False),
                                     ("xxh3_128", digest, False), ("layout", layout, True), ("group", group, True)):
            if type(value) is not str and not (optional and value is None):
                raise ManifestError(f"tensor {name}: {key} is {value!r}, not a string")
        if rank is not None and (type(rank) is not int or rank < 0):  # type(): True and 1.0 are not ranks
            raise ManifestError(f"tensor {name}: rank is {rank!r}, not a non-negative integer or null")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ManifestError(f"tensor {name}: shape is {shape!r}, not a list of non-negative integers")
        if attrs is not None and not isinstance(attrs, dict):
            raise ManifestError(f"tensor {name}: runtime_attrs is {attrs!r}, not an object")
        return cls(name, rank, file, dtype, tuple(shape), role, layout, group, dict(attrs or {}), digest)


class Manifest:
    """A converted checkpoint's manifest, checked, with the answers an engine asks for.

    ``raw`` is the parsed JSON; ``target`` holds layout, moe_layout, tp, ep and arch."""

    def __init__(self, raw: dict[str, Any], root: pathlib.Path):
        self.raw = raw
        self.root = root
        where = MANIFEST_NAME if root is None else root / MANIFEST_NAME  # built in memory: no folder
        try:
            self._check(raw)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}; the manifest is damaged or not prep's: convert again") from None
        if root is None:
            return
        # Every file it names, checked once here so that every reader (load_rank, prep verify
        # and revert) is covered: a plain name of a regular file inside the folder.
        names = dict.fromkeys(t.file for t in self.tensors)
        names.update(dict.fromkeys(raw.get("files") or {}))
        names.update(dict.fromkeys(g["file"] for g in raw.get("groups") or [] if "file" in g))
        for name in names:
            problem = member_problem(root, name)
            if problem:
                raise ManifestError(f"{root / MANIFEST_NAME}: {problem}; a converted checkpoint's files are regular "
                                    "files in its folder: refusing to read it (convert again)")

    def _check(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ManifestError("not a JSON object")
        target = raw.get("target")
        if not isinstance(target, dict):
            raise ManifestError(f"target is {target!r}, not an object")
        self.layout: str = target.get("layout")
        self.moe_layout: str = target.get("moe_layout")
        self.arch: str = target.get("arch", "")
        for key, value in (("layout", self.layout), ("moe_layout", self.moe_layout), ("arch", self.arch)):
            if type(value) is not str:
                raise ManifestError(f"target.{key} is {value!r}, not a string")
        self.tp: int = target.get("tp")
        self.ep: int = target.get("ep", 1)
        tensors = raw.get("tensors")
        if type(tensors) is not list:
            raise ManifestError(f"tensors is {type(tensors).__name__}, not a list")
        # tp drives loops over ranks (engines, prep inspect): an integer in a sane range.
        if type(self.tp) is not int or not 1 <= self.tp <= MAX_TP:
            raise ManifestError(f"target.tp is {self.tp!r}, not an integer in [1, {MAX_TP}]")
        if type(self.ep) is not int or not 1 <= self.ep <= self.tp:
            raise ManifestError(f"target.ep is {self.ep!r}, not an integer in [1, tp={self.tp}]")
        if not isinstance(raw.get("files", {}), dict):
            raise ManifestError("files is not an object")
        groups = raw.get("groups", [])
        if type(groups) is not list or not all(isinstance(g, dict) for g in groups):
            raise ManifestError("groups is not a list of objects")
        self.tensors: list[TensorRecord] = []
        for i, t in enumerate(tensors):
            try:
                rec = TensorRecord.from_json(t)
            except ManifestError as e:
                raise ManifestError(f"tensors[{i}]: {e}") from None
            if rec.rank is not None and rec.rank >= self.tp:
                raise ManifestError(f"tensors[{i}]: tensor {rec.name} is for rank {rec.rank} of tp={self.tp}")
            self.tensors.append(rec)

    def __repr__(self) -> str:
        return (f"Manifest({self.root}: {self.arch}, layout={self.layout}, moe_layout={self.moe_layout}, "
                f"tp={self.tp}, ep={self.ep}, {len(self.tensors)} tensors)")

    def rank_tensors(self, rank: int) -> list[TensorRecord]:
        """What rank ``rank`` loads: its own tensors and the common ones, in file order."""
        if not 0 <= rank < self.tp:
            raise ManifestError(f"{self.root}: rank {rank} is out of range for a checkpoint converted for tp={self.tp}")
        return [t for t in self.tensors if t.rank in (rank, None)]

    def rank_files(self, rank: int) -> list[str]:
        """The files rank ``rank`` reads, each once, in manifest order (its own files first)."""
        return list(dict.fromkeys(t.file for t in self.rank_tensors(rank)))

    def verify_hashes(self, rank: int | None = None) -> int:
        """Re-hash every tensor (of ``rank``, or all) and compare with the manifest. Needs
        ``xxhash``. Returns the number of tensors checked; raises naming the first mismatch."""
        from .safetensors_file import SafetensorsFile, SafetensorsFileError

        records = self.tensors if rank is None else self.rank_tensors(rank)
        by_file: dict[str, list[TensorRecord]] = {}
        for t in records:
            by_file.setdefault(t.file, []).append(t)
        for fname, ts in by_file.items():
            try:
                f = SafetensorsFile(self.root / fname)
            except (FileNotFoundError, SafetensorsFileError) as e:
                raise ManifestError(f"{self.root / fname}: listed in the manifest but "
                                    f"{'missing' if isinstance(e, FileNotFoundError) else 'unreadable'}; convert again") from None
            for t in ts:
                if t.name not in f.tensors:
                    raise ManifestError(f"{self.root / fname}: tensor {t.name} is missing from the file; convert again")
            hashes = f.hash_tensors([t.name for t in ts])
            for t in ts:
                if hashes[t.name] != t.xxh3_128:
                    raise ManifestError(f"{self.root / fname}: tensor {t.name} does not match its manifest hash; "
                                        "the file was modified or damaged: convert again")
        return len(records)


def load_manifest(model_dir: str | pathlib.Path, verify_hashes: bool = False) -> Manifest:
    """Parse and check ``prep-manifest.json`` of ``model_dir``: format, version, the completion
    marker, every entry's types and every file name (and, with ``verify_hashes``, every tensor's
    bytes). Raises :class:`ManifestError`, whatever is wrong with the files."""
    root = pathlib.Path(model_dir)
    manifest = Manifest(_load_raw(root), root)
    if verify_hashes:
        manifest.verify_hashes()
    return manifest


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
    import gc

    text = raw.decode("utf-8")
    paused = gc.isenabled()
    gc.disable()
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    finally:
        if paused:
            gc.enable()


def _read_json(path: pathlib.Path, missing: str, what: str) -> tuple[bytes, Any]:
    """(bytes, parsed) of ``path``; :class:`ManifestError` with ``missing`` when it is absent and
    naming the file and the fix when it is not a readable JSON object."""
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        raise ManifestError(missing) from None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable ({e.strerror or e}); {what}") from None
    try:
        obj = strict_json(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{path}: not valid UTF-8 JSON ({str(e).splitlines()[0]}); {what}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: a JSON {type(obj).__name__}, not an object; {what}")
    return raw, obj


def _load_raw(root: pathlib.Path) -> dict[str, Any]:
    mpath, cpath = root / MANIFEST_NAME, root / COMPLETE_NAME
    damaged = "the folder was modified or is not a conversion by prep: convert again"
    raw, manifest = _read_json(mpath, f"{root}: no {MANIFEST_NAME}; not a checkpoint converted by prep", damaged)
    _, marker = _read_json(cpath, f"{root}: no {COMPLETE_NAME}; the conversion did not finish: convert again (--resume)",
                           damaged)
    if marker.get("manifest_sha256") != manifest_hash(raw):
        raise ManifestError(f"{cpath}: manifest hash differs from the completion marker; the folder was modified")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{mpath}: format {manifest.get('format')!r} is not {FORMAT!r}; not a checkpoint converted by prep")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{mpath}: format_version {manifest.get('format_version')} is not supported "
                            f"(this layouts reads {FORMAT_VERSION}); upgrade prep/layouts")
    return manifest
