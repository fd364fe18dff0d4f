"""A converted folder's JSON files read as untrusted input, and the completion marker: its record,
and the manifest's bytes checked against it before they are parsed."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from ..safe_files import MAX_JSON_BYTES, FileTooLargeError, member_problem, read_regular, strict_json
from .format import COMPLETE_NAME, MANIFEST_NAME, ManifestError, _format_problem
from .hashing import manifest_hash


@dataclasses.dataclass(frozen=True)
class Completion:
    """The completion marker ``prep-complete.json``, written after every other file: a folder
    without it, or whose manifest's sha256 differs, is not a finished conversion."""

    manifest_sha256: str  # sha256 of prep-manifest.json's bytes
    tool: str  # "prep <version>"
    # What the output was made from and how (a hash of options, plan and source identities): a
    # ``--resume`` finding a finished output with its own key has nothing to do.
    run: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"manifest_sha256": self.manifest_sha256, "tool": self.tool,
                **({"run": self.run} if self.run is not None else {})}


def _read_json(path: pathlib.Path, missing: str, what: str) -> tuple[bytes, Any]:
    """(bytes, parsed) of ``path``; :class:`ManifestError` with ``missing`` when it is absent and
    naming the file and the fix when it is not a readable JSON object."""
    try:
        raw = read_regular(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise ManifestError(missing) from None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable ({e.strerror or e}); {what}") from None
    except FileTooLargeError as e:
        raise ManifestError(f"{path}: {e}; {what}") from None
    try:
        obj = strict_json(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{path}: not valid UTF-8 JSON ({str(e).splitlines()[0]}); {what}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: a JSON {type(obj).__name__}, not an object; {what}")
    return raw, obj


def _load_raw(root: pathlib.Path) -> tuple[dict[str, Any], str]:
    """(parsed manifest, its sha256) of folder ``root``, once the completion marker vouches for
    its bytes and its format and version are ours."""
    mpath, cpath = root / MANIFEST_NAME, root / COMPLETE_NAME
    damaged = "the folder was modified or is not a conversion by prep: convert again"
    for name in (MANIFEST_NAME, COMPLETE_NAME):  # prep writes both as regular files inside the folder
        problem = member_problem(root, name)
        if problem:
            raise ManifestError(f"{root}: {problem}; {damaged}")
    raw, manifest = _read_json(mpath, f"{root}: no {MANIFEST_NAME}; not a checkpoint converted by prep", damaged)
    _, marker = _read_json(cpath, f"{root}: no {COMPLETE_NAME}; the conversion did not finish: convert again (--resume)",
                           damaged)
    digest = manifest_hash(raw)
    if marker.get("manifest_sha256") != digest:
        raise ManifestError(f"{cpath}: manifest hash differs from the completion marker; the folder was modified")
    problem = _format_problem(manifest, required=True)
    if problem:
        raise ManifestError(f"{mpath}: {problem}")
    return manifest, digest
