"""Load one rank of a converted checkpoint as its engine will hold it.

Only the rank's own files and the common (pass-through) files are read, each once, mapped (or
read from start to end in large blocks) as one buffer per file; every tensor is a view into it, so
thousands of stacked-expert tensors cost a handful of reads rather than a read and allocation
each (ATOM's load of R1's 90k source tensors is dominated by that per-tensor dispatch). On a
GPU the buffer is copied over in one transfer per file. Each tensor is checked against the
manifest (dtype, shape, optionally its hash) and carries the runtime attributes the manifest
states (``is_shuffled``, ``scale_swizzle``, ``hidden_pad``, ...), as Python attributes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
from typing import TYPE_CHECKING, Iterator

import torch

from .engines._compat import EngineConfig, check_compatibility
from .device_load import read_to_device
from .manifest import COMPLETE_NAME, FILE_NAME_KEY, MANIFEST_NAME, Manifest, ManifestError, TensorRecord, load_manifest
from .safe_files import opened_outside, read_regular
from .errors import LayoutsError
from .safetensors_file import TORCH_DTYPES, SafetensorsFile, SafetensorsFileError, file_xxh3, map_all, tensor_hash

__all__ = [
    "RankTensors", "load_rank", "OpenRank", "open_rank", "iter_rank_files", "PinnedFolder",
    "open_pinned", "pinned_folder", "STAGE_BYTES", "to_device", "side_file_difference",
    "side_file_problem",
]

if TYPE_CHECKING:  # activation imports the engine profiles, whose adapters import this module
    from .activation import ActivationQuantPlan


class RankTensors(dict):
    """``name -> tensor`` for one rank, in file order, with the manifest's record of each."""

    def __init__(self, manifest: Manifest, rank: int):
        super().__init__()
        self.manifest = manifest
        self.rank = rank
        self.records: dict[str, TensorRecord] = {}
        self.buffers: list[torch.Tensor] = []  # one per file; every tensor is a view into one



def load_rank(model_dir: str | pathlib.Path, rank: int, device: str | torch.device = "cpu", *,
              engine: EngineConfig | None = None, verify_hashes: bool = False,
              manifest: Manifest | None = None, mmap: bool = True, direct: bool = False) -> RankTensors:
    """This rank's tensors from a converted checkpoint, on ``device``, with runtime attributes set.

    With ``engine``, the checkpoint is first checked against it (:func:`check_compatibility`):
    a checkpoint the engine would misread is refused before a byte is loaded. With
    ``verify_hashes`` every tensor's xxh3-128 is checked against the manifest (needs xxhash).
    On the CPU, ``mmap`` (default) maps each file copy-on-write instead of reading it into new
    memory: the tensors are then backed by the page cache (no copy, nothing anonymous);
    ``mmap=False`` reads each file with large sequential ``pread`` calls into one buffer (for
    filesystems where mapping is slow, e.g. some network mounts); with ``direct`` too, with
    ``O_DIRECT``: from the disk past the page cache, at the disk's speed cold (buffered where the
    filesystem refuses it). To a CUDA device each file is read by a few threads straight into
    pinned staging blocks, each copied over while the next are read (:mod:`layouts.device_load`;
    ``direct`` reads past the page cache there too); with ``verify_hashes`` it is read on the
    host, checked, then copied.
    Raises :class:`ManifestError` naming the file and tensor when the files disagree with it.
    """
    with pinned_folder(model_dir) as folder:
        manifest = folder.manifest(manifest)
        if engine is not None:
            if engine.rank != rank:
                raise ValueError(f"load_rank(rank={rank}) with an engine config for rank {engine.rank}")
            check_compatibility(manifest, engine)
        out = RankTensors(manifest, rank)
        for part in folder.files(manifest, rank, device, names=None, verify_hashes=verify_hashes, mmap=mmap,
                                 direct=direct):
            out.update(part)
            out.records.update(part.records)
            out.buffers += part.buffers
    return out


@dataclasses.dataclass
class OpenRank:
    """One rank of a converted checkpoint, checked once against its engine: the manifest, the
    engine's configuration, the rank's tensors (attributes set) and the activation-quant plan
    of its GEMM path (:func:`open_rank`)."""

    manifest: Manifest
    engine: EngineConfig
    tensors: RankTensors
    plan: "ActivationQuantPlan"

    @property
    def rank(self) -> int:
        return self.engine.rank


def open_rank(model_dir: str | pathlib.Path, engine: EngineConfig, device: str | torch.device = "cpu", *,
              verify_hashes: bool = False, mmap: bool = True, direct: bool = False,
              backend: str = "auto") -> OpenRank:
    """``engine.rank``'s part of a converted checkpoint, for ``engine``: the manifest read and
    the compatibility check made once (a :class:`CompatibilityError` naming the fix before a
    byte is loaded), then the rank's files loaded (:func:`load_rank`) and the activation plan
    made (:class:`ActivationQuantPlan`), neither checking again. ``backend``: the fused quant's."""
    from .activation import ActivationQuantPlan  # at call time: see the import above
    with pinned_folder(model_dir) as folder:
        manifest = folder.manifest(None)
        check_compatibility(manifest, engine)
        tensors = RankTensors(manifest, engine.rank)
        for part in folder.files(manifest, engine.rank, device, names=None, verify_hashes=verify_hashes, mmap=mmap,
                                 direct=direct):
            tensors.update(part)
            tensors.records.update(part.records)
            tensors.buffers += part.buffers
    return OpenRank(manifest, engine, tensors, ActivationQuantPlan.for_engine(engine, backend))


def iter_rank_files(model_dir: str | pathlib.Path, rank: int, device: str | torch.device = "cpu", *,
                    manifest: Manifest | None = None, names: set[str] | None = None, verify_hashes: bool = False,
                    mmap: bool = True, direct: bool = False) -> Iterator[RankTensors]:
    """:func:`load_rank` one file at a time: a :class:`RankTensors` per file of the rank (only the
    files holding one of ``names``, and only those tensors, when given), each file's buffer its
    own. A caller that copies the tensors elsewhere and drops each part holds one file at a time
    (an engine filling parameters it allocated itself: ``layouts.engines.atom.adapter``)."""
    with pinned_folder(model_dir) as folder:
        yield from folder.files(folder.manifest(manifest), rank, device, names=names, verify_hashes=verify_hashes,
                                mmap=mmap, direct=direct)


class PinnedFolder:
    """A converted folder as it was opened: every file is read through the folder's open
    descriptor (``/proc/self/fd/N/NAME``), so all of them come from that folder even if another is
    renamed into its place meanwhile (``prep convert --force`` swaps whole folders in). A swap is
    then an error (:meth:`check`), never a mix of two checkpoints' files or one checkpoint's bytes
    under the other's manifest. Where ``/proc`` cannot do it, files are read by path and the
    folder's identity is compared after the load instead."""

    def __init__(self, path: str | pathlib.Path, fd: int, via: pathlib.Path):
        self.path, self.fd, self.via = pathlib.Path(path), fd, via

    def manifest(self, given: Manifest | None = None) -> Manifest:
        """The manifest read through the pinned folder, or ``given`` (read earlier by path) once the
        pinned folder's completion marker shows it is that folder's."""
        if given is None:
            try:
                m = load_manifest(self.via)
            except ManifestError as e:
                raise ManifestError(self.shown(str(e))) from None
            m.read_from(self.path)  # what callers and messages name; the load's reads go through ``via``
            return m
        try:
            sealed = json.loads(read_regular(self.via / COMPLETE_NAME, 1 << 20)).get("manifest_sha256")
        except (OSError, ValueError, AttributeError):
            sealed = None
        if given.sha256 is not None and sealed != given.sha256:
            raise ManifestError(f"{self.path}: its completion marker no longer seals the manifest read before (the "
                                "folder was converted again meanwhile); load it again")
        return given

    def files(self, manifest: Manifest, rank: int, device: str | torch.device, *, names: set[str] | None,
              verify_hashes: bool, mmap: bool, direct: bool = False) -> Iterator["RankTensors"]:
        """Rank ``rank``'s tensors of ``manifest`` (this folder's: :meth:`manifest`), a file at a time."""
        by_file: dict[str, list[TensorRecord]] = {}
        for r in manifest.rank_tensors(rank):
            if names is None or r.name in names:
                by_file.setdefault(r.file, []).append(r)
        device = torch.device(device)
        for fname, recs in by_file.items():
            part = RankTensors(manifest, rank)
            try:
                _load_file(manifest, fname, recs, device, part, verify_hashes, mmap, self.via, direct)
            except ManifestError as e:
                self.check()  # a folder swapped or removed meanwhile is the cause to name
                raise ManifestError(self.shown(str(e))) from None
            yield part
        self.check()

    def check(self) -> None:
        """Refuse a folder that is no longer at its path (replaced or removed since it was opened)."""
        try:
            now = os.stat(self.path)
        except OSError:
            now = None
        then = os.fstat(self.fd)
        if now is None or (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
            raise ManifestError(f"{self.path}: replaced or removed while it was being loaded (a prep convert --force "
                                "into it?); what was read is discarded: load it again")

    def shown(self, message: str) -> str:
        """``message`` naming the folder by its path, not the descriptor it is read through."""
        return message.replace(str(self.via), str(self.path)) if self.via != self.path else message

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def open_pinned(path: str | pathlib.Path) -> PinnedFolder:
    """Converted folder ``path`` opened for reading (:class:`PinnedFolder`); the caller closes it
    (:meth:`PinnedFolder.close`), or uses :func:`pinned_folder`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such folder") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot be opened as a folder ({e.strerror})") from None
    via = pathlib.Path(f"/proc/self/fd/{fd}")
    return PinnedFolder(path, fd, via if via.is_dir() else pathlib.Path(path))


@contextlib.contextmanager
def pinned_folder(path: str | pathlib.Path) -> Iterator[PinnedFolder]:
    """Open converted folder ``path`` for one load (:class:`PinnedFolder`)."""
    folder = open_pinned(path)
    try:
        yield folder
    finally:
        folder.close()


def _load_file(manifest: Manifest, fname: str, recs: list[TensorRecord], device: torch.device, out: RankTensors,
               verify_hashes: bool, mmap: bool, via: pathlib.Path, direct: bool = False) -> None:
    """File ``fname``'s tensors ``recs`` into ``out``, checked against the manifest; read through
    ``via`` (the pinned folder), named by its path in messages."""
    path = manifest.root / fname
    # To a GPU the file is read straight into pinned staging blocks and copied over as it is read
    # (device_load); with hashes to check, it is read on the host first and checked there.
    staged = device.type == "cuda" and not verify_hashes
    try:
        f = SafetensorsFile(via / fname)
        outside = opened_outside(f.fd, via)  # the pinned folder, wherever it is now
        if outside is not None:  # replaced by a link out of the folder after the folder's check
            raise ManifestError(f"{path}: opened as {outside}, outside the folder (a symlink put in its place); "
                                "replace it with the file prep wrote, or convert again")
        named = f.metadata.get(FILE_NAME_KEY)
        if named is not None and named != fname:  # files of a prep before 2026-12-06 name none
            raise ManifestError(f"{path}: holds the tensors prep wrote as {str(named)[:200]!r}: the folder's files were "
                                "renamed or swapped; convert again")
        if staged:
            buf, views = read_to_device(f, device, direct=direct)
        else:
            buf, views = map_all(f) if mmap else f.read_direct() if direct else f.read_all()
    except FileNotFoundError:
        raise ManifestError(f"{path}: listed in the manifest but missing; convert again") from None
    except SafetensorsFileError as e:
        raise ManifestError(f"{e}; convert again") from None
    except (OSError, RuntimeError) as e:  # mapping or reading failed (mmap raises OSError, torch RuntimeError)
        raise ManifestError(f"{path}: could not be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "check the file and convert again") from None
    for r in recs:
        t = views.get(r.name)
        if t is None:
            raise ManifestError(f"{path}: tensor {r.name} (rank {r.rank}) is missing from the file; convert again")
        if t.dtype != TORCH_DTYPES[r.dtype] or tuple(t.shape) != r.shape:
            raise ManifestError(f"{path}: tensor {r.name} is {t.dtype} {list(t.shape)} but the manifest says "
                                f"{r.dtype} {list(r.shape)}; convert again")
        if verify_hashes and tensor_hash(t) != r.xxh3_128:
            raise ManifestError(f"{path}: tensor {r.name} does not match its manifest hash; convert again")
    if device.type != "cpu" and not staged:  # one transfer per file, then the same views on the device
        buf = to_device(buf, device)
        views = f.views(buf)
    out.buffers.append(buf)
    for r in recs:
        t = views[r.name]
        for k, v in r.runtime_attrs.items():
            # An attribute torch.Tensor has (``view``, ``data``, ``__class__``) would be replaced on
            # this tensor, or the assignment would fail deep in here: only new names are set.
            if not k.isidentifier() or k.startswith("_") or hasattr(torch.Tensor, k):
                raise ManifestError(f"{manifest.root / MANIFEST_NAME}: tensor {r.name} has runtime attribute "
                                    f"{k!r}, which is not a name an engine reads; convert again")
            setattr(t, k, v)
        t.prep_layout, t.prep_role = r.layout, r.role
        out[r.name] = t
        out.records[r.name] = r


STAGE_BYTES = 64 << 20


def to_device(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a (mapped) host byte buffer to ``device`` through two pinned staging blocks: the
    host copies block i+1 into one while the DMA engine moves block i from the other. A plain
    ``.to(device)`` of pageable (mapped) memory ran at 3.7 GB/s on an H200 host."""
    n = buf.numel()
    if device.type != "cuda" or n <= STAGE_BYTES:
        return buf.to(device)
    out = torch.empty(n, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    stages = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    for i, start in enumerate(range(0, n, STAGE_BYTES)):
        k, m = i % 2, min(STAGE_BYTES, n - start)
        if done[k] is not None:
            done[k].synchronize()  # the DMA from this stage block has finished
        stages[k][:m].copy_(buf[start:start + m])
        out[start:start + m].copy_(stages[k][:m], non_blocking=True)
        done[k] = torch.cuda.Event()
        done[k].record(stream)
    stream.synchronize()
    return out


def side_file_difference(path: pathlib.Path, size: int, xxh3_128: str | None) -> tuple[str, int] | None:
    """How the side file at ``path`` differs from the source's (its ``size`` and, where recorded
    and xxhash is installed, its ``xxh3_128``): ``("missing", 0)``, ``("size", the file's size)``,
    ``("bytes", size)`` (same size, another hash), or None where it is the source's. The one check
    behind prep's verify, revert and run and the engines' doors; each words it for its reader."""
    if not path.is_file():
        return "missing", 0
    have = path.stat().st_size
    if have != size:
        return "size", have
    if xxh3_128 is not None:
        try:
            if file_xxh3(path) != xxh3_128:
                return "bytes", have
        except LayoutsError:  # xxhash not installed (the runtime's ``hashes`` extra): the size held
            pass
    return None


def side_file_problem(manifest: Manifest, engine: str, given_as: str = "the folder") -> str | None:
    """Why ``manifest``'s folder would not give ``engine`` the source's side files (config.json with
    its quantization_config, tokenizer files, generation config, chat template), which it reads from
    the folder with the weights (:func:`side_file_difference` of each). One line naming the file and
    the fix (``given_as``: how the engine was given the folder, e.g. ``--model``); None where every
    one is the source's."""
    for name, f in sorted((manifest.source.files if manifest.source else {}).items()):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            continue  # weights: replaced by the rank files
        path = manifest.root / name
        diff = side_file_difference(path, f.size, f.xxh3_128)
        if diff is None:
            continue
        kind, have = diff
        if kind == "missing":
            return (f"{path}: missing; the source had it ({f.size} bytes) and {engine} reads it from {given_as}: "
                    "copy it from the source or convert again")
        if kind == "size":
            return f"{path}: {have} bytes, the source's had {f.size}; copy it from the source or convert again"
        return (f"{path}: its bytes differ from the source's (same size, another hash); {engine} would build from "
                "or tokenize with the edited file: copy it from the source or convert again")
    return None
