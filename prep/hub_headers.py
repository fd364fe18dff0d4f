"""A repo on the Hugging Face hub, seen without downloading its weights: ``prep inspect ORG/NAME``.

A real checkpoint is ~350 GiB; what ``inspect`` needs of it is its config, its index and every
shard's safetensors header (names, dtypes, shapes, offsets: ~150 KB a shard). huggingface_hub
reads a header with ranged requests (``get_safetensors_metadata``); each shard is then mirrored
as a sparse file that holds that header and a hole as long as the shard's data, so that the
checkpoint opens, is classified and planned exactly as a local folder is, with no disk used for
the data. ``inspect`` reads no tensor's bytes, and the mirror is a temporary folder removed when it
is done.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from .errors import PrepError
from .source import HUB_HINT, INDEX_NAME, SINGLE_NAME, _hub_problem

SMALL = ("config.json", "generation_config.json", "tokenizer_config.json")  # fetched whole: a few KB


def cached_snapshot(repo: str, revision: str | None) -> pathlib.Path | None:
    """The repo's complete local snapshot in the hub cache, or None when any file is missing
    (nothing is downloaded)."""
    from huggingface_hub import snapshot_download

    try:
        snap = pathlib.Path(snapshot_download(repo, revision=revision, local_files_only=True,
                                              allow_patterns=["*.safetensors", "*.json"]))
        # local_files_only answers with the snapshot folder as soon as it exists: an earlier
        # inspect leaves the config and index there, and no shard. Complete means every shard.
        index = json.loads((snap / INDEX_NAME).read_text()) if (snap / INDEX_NAME).is_file() else None
        shards = set(index["weight_map"].values()) if index else {SINGLE_NAME}
        return snap if all((snap / f).is_file() for f in shards) else None
    except Exception:  # not cached (or partly): the caller reads the headers instead
        return None


def mirror_headers(repo: str, revision: str | None, dest: pathlib.Path) -> dict[str, Any]:
    """Write into ``dest`` the repo's config and index, whole, and each shard as its header plus
    a hole of its data's length. Returns what was fetched: ``{"shards", "header_bytes", "bytes"}``
    (``bytes``: the shards' full size on the hub)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    api = HfApi()
    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # its bar over the headers would be the only one: inspect has its own
    try:
        meta = api.get_safetensors_metadata(repo, revision=revision)
        for name in (*SMALL, *((INDEX_NAME,) if meta.sharded else ())):
            try:
                path = hf_hub_download(repo, name, revision=revision)
            except Exception as e:
                if name in ("config.json", INDEX_NAME):
                    raise
                if "EntryNotFound" not in type(e).__name__:
                    raise
                continue
            (dest / name).write_bytes(pathlib.Path(path).read_bytes())
    except PrepError:
        raise
    except Exception as e:
        raise PrepError(f"{repo}: {_hub_problem(e, revision)}; {HUB_HINT}") from None
    finally:
        if not quiet:
            enable_progress_bars()
    header_bytes = total = 0
    for fname, fm in meta.files_metadata.items():
        if "/" in fname or fname.startswith("."):
            raise PrepError(f"{repo}: the hub lists a shard named {fname!r}; a checkpoint's shards are plain names")
        header: dict[str, Any] = {"__metadata__": dict(fm.metadata)} if fm.metadata else {}
        end = 0
        for tname, t in fm.tensors.items():
            start, stop = t.data_offsets
            header[tname] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [start, stop]}
            end = max(end, stop)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dest / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + end)  # the data: a hole, no disk used
        header_bytes += 8 + len(raw)
        total += 8 + len(raw) + end
    return {"shards": len(meta.files_metadata), "header_bytes": header_bytes, "bytes": total}
