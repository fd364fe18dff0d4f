"""The manifest format's fixed points: the names of the files a converted checkpoint carries, the
format and the versions this package reads and writes, and :class:`ManifestError`."""

from __future__ import annotations

from typing import Any

from ..errors import LayoutsError


MANIFEST_NAME = "prep-manifest.json"
COMPLETE_NAME = "prep-complete.json"
FILE_NAME_KEY = "prep_file"  # in each written file's safetensors metadata: the name prep wrote it under
# The source's tensor table (every source tensor's dtype, shape and shard), from version 4 a file
# of its own that the manifest names and hashes: only verify, revert and inspect read it, and at
# R1-0528's 90,910 tensors it was 61% of the manifest's JSON and 69% of parsing it, which every
# rank load paid (docs/BENCHMARKS.md).
SOURCE_TABLE_NAME = "prep-source.json"
SOURCE_TABLE_FORMAT = "prep-source-tensors"
FORMAT = "prep-manifest"
# Bumped when a reader of the previous version would misread a checkpoint of the new one (a field
# that changes meaning, goes away or must be understood to read the bytes); readers refuse any
# version but their own. docs/manifest.md states the rule in full.
FORMAT_VERSION = 4
# A multimodal source's (source.wrapper): a reader before it would revert the language model's
# tensors under the family's names, not the source's; prep writes it for those sources only.
WRAPPED_VERSION = 5
# Versions this module reads. 1: every non-MXFP4 tensor whole in common files every rank reads.
# 2 (rank-exact): split BF16 tensors (role "bf16_shard", group kind "bf16"), replicated tensors in
# every rank's files, and role "unread" for what no rank reads (kept for revert). 3: a conversion
# for an engine other than ATOM (target.engine, which an older reader would take for ATOM's);
# 4: the source tensor table in SOURCE_TABLE_NAME, named and hashed by source.tensors_file (a
# reader before it finds no source.tensors and calls the manifest damaged). 5: source.wrapper, a
# multimodal source (WRAPPED_VERSION). prep writes 4, or 5 for a multimodal source.
READ_VERSIONS = (1, 2, 3, 4, 5)
MAX_TP = 1 << 16  # no engine runs more ranks: a larger tp is a damaged manifest
# The engine of a manifest that does not name one: manifests written before ``target.engine`` was
# recorded were all converted for ATOM's ranks (the format's history, not a default engine).
UNRECORDED_ENGINE = "atom"


class ManifestError(LayoutsError):
    """A converted checkpoint's manifest is missing, unfinished, or not one we can read."""


def _format_problem(raw: dict[str, Any], required: bool) -> str | None:
    """Why ``raw`` is not a manifest this module reads (None when it is). ``required``: the keys
    must be there (a file on disk); a manifest built in memory may leave them out."""
    fmt = raw.get("format", None if required else FORMAT)
    version = raw.get("format_version", None if required else FORMAT_VERSION)
    if fmt != FORMAT:
        return f"format {fmt!r} is not {FORMAT!r}; not a checkpoint converted by prep"
    if version not in READ_VERSIONS:  # see docs/manifest.md: another version may mean other bytes
        return (f"format_version {version} is not supported (this layouts reads "
                f"{', '.join(map(str, READ_VERSIONS))}); upgrade prep/layouts")
    return None
