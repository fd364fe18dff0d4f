"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this package, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.

The schema lives here once, as typed records (:class:`Manifest`, :class:`Target`,
:class:`FileRecord`, :class:`GroupRecord`, :class:`TensorRecord`, ...), each with ``from_json``
and ``to_json``; ``FORMAT`` and ``FORMAT_VERSION`` say which format this package reads and
writes. The format, field by field, and its versioning rule: docs/manifest.md.
"""

# One module a job, imported bottom up (none imports this package, so no import circle):
# format (file names, versions, ManifestError), names (expert runs compressed), values (a JSON
# value's type), records and groups (the typed records), hashing (manifest sha256, tensor xxh3),
# reading (a folder's JSON, the completion marker), source (the source section and tensor
# table), check (the records against each other), manifest (Manifest, load_manifest).
from .format import (COMPLETE_NAME, FILE_NAME_KEY, FORMAT, FORMAT_VERSION, MANIFEST_NAME, MAX_TP, READ_VERSIONS,
                     SOURCE_TABLE_FORMAT, SOURCE_TABLE_NAME, WRAPPED_VERSION, ManifestError)
from .groups import STACK_PROJECTIONS, STACK_TENSORS, GroupRecord, PartRecord, Placement, StackRecord, WindowRecord
from .hashing import manifest_hash
from .manifest import Manifest, load_manifest
from .names import compress_names, expand_names
from .reading import Completion
from .records import FileRecord, LayoutRecord, Target, TensorRecord, Tool
from .source import Source, SourceFile, SourceTableRef, SourceTensor, SourceTensors, source_table_json

__all__ = [
    "MANIFEST_NAME", "COMPLETE_NAME", "FILE_NAME_KEY", "SOURCE_TABLE_NAME", "SOURCE_TABLE_FORMAT", "FORMAT",
    "FORMAT_VERSION", "READ_VERSIONS", "WRAPPED_VERSION", "MAX_TP", "ManifestError",
    "compress_names", "expand_names", "manifest_hash",
    "Target", "Tool", "LayoutRecord", "FileRecord", "TensorRecord",
    "PartRecord", "Placement", "STACK_PROJECTIONS", "STACK_TENSORS", "WindowRecord", "StackRecord", "GroupRecord",
    "SourceFile", "SourceTensor", "SourceTableRef", "source_table_json", "SourceTensors", "Source",
    "Completion", "Manifest", "load_manifest",
]
