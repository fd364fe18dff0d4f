"""Which files of a folder prep wrote: those its sealed manifest lists (a conversion) or its
revert marker lists (a reverted checkpoint), and of the side files only those still holding the
bytes prep copied. What ``--force`` may replace and nothing else (:mod:`prep.outdir`)."""

from __future__ import annotations

import json
import os
import pathlib
import stat

from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME, SOURCE_TABLE_NAME
from layouts.safe_files import MAX_JSON_BYTES, FileTooLargeError, read_regular

from .errors import PrepError

REVERT_MARKER = "prep-revert.json"  # written last into a reverted checkpoint: the files prep wrote there
PROBE_PREFIX = ".prep-write-check-"  # the file --force makes and removes in OUT to see that it can delete there


def side_files() -> tuple[str, ...]:
    from .source import SIDE_FILES

    return SIDE_FILES


def read_own(folder: pathlib.Path, name: str) -> bytes:
    """A file prep writes into its outputs (manifest, completion or revert marker): a regular file,
    not a link, read whole under the JSON size bound; anything else is refused (a FIFO would block
    forever, a link to /dev/zero never end, a link out of the folder is not this output's)."""
    path = folder / name
    try:
        st = os.lstat(path)
    except OSError as e:
        raise PrepError(f"{path}: unreadable ({e.strerror}); remove the folder yourself or choose another -o") from None
    if not stat.S_ISREG(st.st_mode):
        raise PrepError(f"{path}: not a regular file (prep writes {name} as one), so the folder is not an output of "
                        "prep as it wrote it; remove it yourself or choose another -o")
    try:
        return read_regular(path, MAX_JSON_BYTES)
    except (OSError, FileTooLargeError) as e:
        raise PrepError(f"{path}: unreadable ({e}); remove the folder yourself or choose another -o") from None


def _sealed_manifest(folder: pathlib.Path) -> tuple[str, bytes] | None:
    """(sha256, bytes) of ``folder``'s manifest when its completion marker seals those bytes, else
    None; each file read once."""
    from layouts.manifest import manifest_hash

    if not os.path.lexists(folder / COMPLETE_NAME):
        return None
    try:
        sha = json.loads(read_own(folder, COMPLETE_NAME)).get("manifest_sha256")
    except (ValueError, AttributeError):
        return None
    raw = read_own(folder, MANIFEST_NAME)
    return (sha, raw) if sha == manifest_hash(raw) else None


def sealed_run(folder: pathlib.Path) -> str | None:
    """The run key in ``folder``'s completion marker (what the conversion was made from and
    how, see ``prep.convert.run_key``) when that marker seals the manifest there, else None."""
    try:
        if not os.path.lexists(folder / COMPLETE_NAME) or _sealed_manifest(folder) is None:
            return None
        run = json.loads(read_own(folder, COMPLETE_NAME)).get("run")
    except (PrepError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _size(path: pathlib.Path) -> int | None:
    try:
        return os.lstat(path).st_size
    except OSError:
        return None


def _unchanged(path: pathlib.Path, recorded: dict) -> bool:
    """Whether the side file at ``path`` still holds what prep wrote there: the size and the
    xxh3-128 that ``recorded`` gives (either may be absent: a manifest of an older prep records
    sizes only). A missing or irregular file is not prep's to delete."""
    from layouts.safetensors_file import file_xxh3

    if "size" in recorded and _size(path) != recorded["size"]:
        return False
    if "xxh3_128" not in recorded:
        return _size(path) is not None
    try:
        return file_xxh3(path) == recorded["xxh3_128"]
    except OSError:
        return False


def prep_files_in(folder: pathlib.Path) -> set[str] | None:
    """The names prep wrote into ``folder``, from its manifest or revert marker; None when the
    folder holds neither (it is not an output of prep)."""
    manifest, marker = folder / MANIFEST_NAME, folder / REVERT_MARKER
    if manifest.is_file() or (folder / COMPLETE_NAME).is_file():
        # Only a manifest its completion marker seals says what prep wrote (prep swaps in complete
        # outputs only), and of its names only what prep writes: its safetensors files, and the side
        # files the source had (copied only then), never a name a manifest merely lists.
        sealed = _sealed_manifest(folder)
        if sealed is None:
            raise PrepError(f"{folder}: holds a prep manifest or completion marker ({COMPLETE_NAME}), but the marker "
                            "does not seal that manifest, so prep cannot tell which files are its own; remove the folder "
                            "yourself or choose another -o")
        try:
            raw = json.loads(sealed[1])
            names = {n for n in raw["files"] if isinstance(n, str) and n.endswith(".safetensors")}
            had = raw["source"]["files"]
            # copied only where the source had them, and still the bytes the source's had (its size, and its
            # hash where the manifest records one): one edited in OUT since (a tuned generation_config.json,
            # "temperature": 0.6 -> 0.7 at the same size) is the user's work now
            side = {n for n in side_files() if n in had and _unchanged(folder / n, had[n])}
            # the source tensor table (format 4), under prep's one name for it only
            table = {SOURCE_TABLE_NAME} if "tensors_file" in raw["source"] else set()
        except (OSError, ValueError, KeyError, TypeError):
            raise PrepError(f"{folder}: holds a prep manifest that cannot be read, so prep cannot tell which files "
                            "are its own; remove the folder yourself or choose another -o") from None
        return names | side | table | {MANIFEST_NAME, COMPLETE_NAME}
    if marker.is_file():
        try:
            raw = json.loads(read_own(folder, REVERT_MARKER))
            listed, hashes = raw["files"], raw.get("side_files")
            # what revert writes: the source's shards, its index and the side files; no other name counts,
            # and a side file only while it holds what revert wrote (the marker's hash; a marker of an older
            # prep records none: its size cannot be told from the user's either, so it counts as before)
            names = {n for n in listed if isinstance(n, str) and (
                n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                or (n in side_files() and (hashes is None or _unchanged(folder / n, {"xxh3_128": hashes.get(n)}))))}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise PrepError(f"{marker}: unreadable, so prep cannot tell which files are its own; remove the folder "
                            "yourself or choose another -o") from None
        return names | {REVERT_MARKER}
    return None


def output_id(folder: pathlib.Path) -> str | None:
    """What identifies a finished output of prep in ``folder``: the sha256 of its manifest (as
    its completion marker states it, and checked), or the id in its revert marker; None when
    the folder holds no finished output."""
    try:
        if os.path.lexists(folder / COMPLETE_NAME):
            sealed = _sealed_manifest(folder)
            return sealed[0] if sealed is not None else None
        if os.path.lexists(folder / REVERT_MARKER):
            return json.loads(read_own(folder, REVERT_MARKER)).get("id")
    except (ValueError, AttributeError):
        pass
    return None


def foreign_entry(folder: pathlib.Path) -> str | None:
    """The first entry of a non-empty ``folder`` that prep did not write (None: all are prep's)."""
    own = prep_files_in(folder)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith(PROBE_PREFIX) and entry.is_file(follow_symlinks=False):
            continue  # a write check of an earlier prep, killed between making and removing it
        if own is None or entry.name not in own or not entry.is_file(follow_symlinks=False):
            return entry.name
    return None
