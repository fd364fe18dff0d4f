"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this module, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.
"""

from __future__ import annotations

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


def load_manifest(model_dir: str | pathlib.Path) -> dict[str, Any]:
    """Parse and check ``prep-manifest.json``: format, version, and the completion marker."""
    root = pathlib.Path(model_dir)
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
