"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this module, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

MANIFEST_NAME = "prep-manifest.json"
COMPLETE_NAME = "prep-complete.json"
FORMAT = "prep-manifest"
FORMAT_VERSION = 1


class ManifestError(ValueError):
    """A converted checkpoint's manifest is missing, unfinished, or not one we can read."""


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
