"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this module, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, Iterable

MANIFEST_NAME = "prep-manifest.json"
COMPLETE_NAME = "prep-complete.json"
FORMAT = "prep-manifest"
FORMAT_VERSION = 1


class ManifestError(ValueError):
    """A converted checkpoint's manifest is missing, unfinished, or not one we can read."""


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
        return cls(t["name"], t["rank"], t["file"], t["dtype"], tuple(t["shape"]), t["role"], t.get("layout"),
                   t.get("group"), dict(t.get("runtime_attrs") or {}), t["xxh3_128"])


class Manifest:
    """A converted checkpoint's manifest, checked, with the answers an engine asks for.

    ``raw`` is the parsed JSON; ``target`` holds layout, moe_layout, tp, ep and arch."""

    def __init__(self, raw: dict[str, Any], root: pathlib.Path):
        self.raw = raw
        self.root = root
        target = raw["target"]
        self.layout: str = target["layout"]
        self.moe_layout: str = target["moe_layout"]
        self.tp: int = int(target["tp"])
        self.ep: int = int(target.get("ep", 1))
        self.arch: str = target.get("arch", "")
        self.tensors: list[TensorRecord] = [TensorRecord.from_json(t) for t in raw["tensors"]]

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
    """Parse and check ``prep-manifest.json`` of ``model_dir``: format, version and the completion
    marker (and, with ``verify_hashes``, every tensor's bytes). Raises :class:`ManifestError`."""
    root = pathlib.Path(model_dir)
    raw = _load_raw(root)
    try:
        manifest = Manifest(raw, root)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{root / MANIFEST_NAME}: malformed manifest ({e!r}); convert again") from None
    if verify_hashes:
        manifest.verify_hashes()
    return manifest


def _load_raw(root: pathlib.Path) -> dict[str, Any]:
    mpath, cpath = root / MANIFEST_NAME, root / COMPLETE_NAME
    if not mpath.is_file():
        raise ManifestError(f"{root}: no {MANIFEST_NAME}; not a checkpoint converted by prep")
    raw = mpath.read_bytes()
    if not cpath.is_file():
        raise ManifestError(f"{root}: no {COMPLETE_NAME}; the conversion did not finish: convert again (--resume)")
    marker = json.loads(cpath.read_text())
    if marker.get("manifest_sha256") != manifest_hash(raw):
        raise ManifestError(f"{cpath}: manifest hash differs from the completion marker; the folder was modified")
    manifest = json.loads(raw)
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{mpath}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{mpath}: format_version {manifest.get('format_version')} is not supported "
                            f"(this layouts reads {FORMAT_VERSION}); upgrade prep/layouts")
    return manifest
