"""Hashes: the sha256 a manifest and its source table are vouched for by, and every tensor's
xxh3-128 checked against its file (threads over files)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import pathlib
import threading
from typing import Callable

from ..safetensors_file import SafetensorsFile, SafetensorsFileError
from .format import ManifestError
from .records import TensorRecord


def manifest_hash(raw: bytes) -> str:
    """The sha256 (hex) of a manifest's or source table's bytes: what the completion marker and
    the manifest vouch for them by."""
    return hashlib.sha256(raw).hexdigest()


def _rank_label(rank: int | None) -> str:
    """Whose tensor it is, for a message."""
    return "common" if rank is None else f"rank {rank}"


def check_tensor_files(root: pathlib.Path, records: list[TensorRecord],
                       progress: Callable[[int], None] | None = None, workers: int = 1) -> None:
    """The files of ``records`` (in folder ``root``) checked against them: what
    :meth:`Manifest.verify_hashes <layouts.manifest.Manifest.verify_hashes>` does once it has
    chosen the records (its docstring says what is checked, in what order, and what is raised).
    ``progress`` gets each file's tensor bytes once it is hashed, in file order."""
    by_file: dict[str, list[TensorRecord]] = {}
    for t in records:
        by_file.setdefault(t.file, []).append(t)
    stop = threading.Event()

    def check_file(fname: str, ts: list[TensorRecord]) -> int:
        path = root / fname
        try:
            f = SafetensorsFile(path)
        except (FileNotFoundError, SafetensorsFileError) as e:
            raise ManifestError(f"{path}: listed in the manifest but "
                                f"{'missing' if isinstance(e, FileNotFoundError) else 'unreadable'}; convert again") from None
        for t in ts:
            info = f.tensors.get(t.name)
            if info is None:
                raise ManifestError(f"{path}: tensor {t.name} is missing from the file; convert again")
            if info.dtype != t.dtype or tuple(info.shape) != t.shape:
                raise ManifestError(f"{path}: tensor {t.name} ({_rank_label(t.rank)}) is {info.dtype} "
                                    f"{list(info.shape)} but the manifest says {t.dtype} {list(t.shape)}; "
                                    "convert again")
        hashes = f.hash_tensors([t.name for t in ts], stop)
        for t in ts:
            if stop.is_set():
                return 0  # another file's error (or Ctrl-C) ended the check
            if hashes[t.name] != t.xxh3_128:
                raise ManifestError(f"{path}: tensor {t.name} does not match its manifest hash "
                                    f"({_rank_label(t.rank)}: its content hash differs); the file was modified "
                                    "or damaged: convert again")
        return sum(f.tensors[t.name].nbytes for t in ts)

    if workers <= 1 or len(by_file) <= 1:
        for fname, ts in by_file.items():
            n = check_file(fname, ts)
            if progress:
                progress(n)
        return

    with cf.ThreadPoolExecutor(min(workers, len(by_file)), thread_name_prefix="prep-hash") as pool:
        futures = [pool.submit(check_file, fname, ts) for fname, ts in by_file.items()]
        try:
            for fut in futures:  # in file order: the first damaged file is the one named
                n = fut.result()
                if progress:
                    progress(n)
        finally:  # an error or Ctrl-C: queued files never start, running ones stop at their next block
            stop.set()
            for fut in futures:
                fut.cancel()
