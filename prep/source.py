"""Reading a source checkpoint: resolve it (local folder or Hugging Face repo id), check that it
is a Quark MXFP4 checkpoint whose shards are all present and whole, and read tensors lazily.

A multimodal checkpoint (a family with a :class:`~layouts.families.Wrapper`, Kimi-K2.5) is read as
its language model: ``config`` is the language model's config, and ``tensors`` names each of its
tensors as the family does (``language_model.`` taken off); the tensors outside it (a vision
tower) keep their names.

Tensors are read with ``pread`` into fresh buffers, a block of rows at a time: no shard is
loaded whole, and nothing is memory-mapped (mapped pages that were read would stay resident).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from layouts.errors import LayoutsError
from layouts.families import Wrapper, wrapper_of
from layouts.manifest import MANIFEST_NAME, SourceFile
from layouts.safe_files import (MAX_JSON_BYTES, DuplicateKeyError, FileTooLargeError, member_problem, read_regular,
                                strict_json)
from layouts.safetensors_file import FileAccessError, SafetensorsFile, SafetensorsFileError, TensorInfo, file_xxh3

from .errors import PrepError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied next to the converted weights, where the source has them: what an engine's server
# reads from its --model besides weights (config, generation settings, tokenizer, chat template:
# transformers keeps it in tokenizer_config.json or, since 4.43, in chat_template.jinja / .json).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
              "configuration_deepseek.py", "modeling_deepseek.py")


def _show(name: str) -> str:
    """A name read from input, for a one-line message: as is when printable, else its repr."""
    return name if name.isprintable() else repr(name)


class ShardFile(SafetensorsFile):
    """A safetensors file of a checkpoint (layouts' pread reader): a truncated download or a
    changed file is named with what to do, and a missing tensor is a PrepError."""

    def __init__(self, path: pathlib.Path):
        try:
            super().__init__(path)
        except FileAccessError:
            raise  # says its own fix: permissions, not a download
        except SafetensorsFileError as e:
            raise SafetensorsFileError(f"{e}: re-download it") from None  # same type, with the fix

    def get(self, name: str) -> torch.Tensor:
        try:
            return super().get(name)
        except KeyError:
            raise PrepError(f"{self.path}: no tensor {name}") from None


def looks_like_repo_id(src: str) -> bool:
    """Whether ``src`` (not an existing path) has a hub repo id's shape, ``org/name``."""
    return src.count("/") == 1 and not src.startswith((".", "/"))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for no network, as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(src: str, revision: str | None = None) -> tuple[pathlib.Path, dict[str, Any]]:
    """A local folder, or a Hugging Face repo id fetched through huggingface_hub's cache
    (honours HF_HUB_OFFLINE; downloads only safetensors, JSON and tokenizer files)."""
    path = pathlib.Path(src).expanduser()
    if path.is_dir():
        return path.resolve(), {"kind": "directory", "path": str(path.resolve())}
    if path.exists():
        raise PrepError(f"{src}: not a directory; give a checkpoint folder or a Hugging Face repo id")
    if not looks_like_repo_id(src):
        raise PrepError(f"{src}: no such directory (and not a Hugging Face repo id like org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a dependency of prep
        raise PrepError(f"{src}: huggingface_hub is needed to resolve repo ids ({e})") from None
    try:
        local = snapshot_download(src, revision=revision,
                                  allow_patterns=["*.safetensors", "*.json", "tokenizer.*", "*.jinja", "*.py"])
    except Exception as e:  # hub errors come in many classes: say which case it is, and the way out
        raise PrepError(f"{src}: {_hub_problem(e, revision)}; {HUB_HINT}") from None
    return pathlib.Path(local), {"kind": "hf", "repo_id": src, "revision": revision or "main",
                                 "snapshot": pathlib.Path(local).name}


HUB_HINT = ("to work without the hub, give the checkpoint's local folder instead (e.g. made by `hf "
            "download ORG/NAME --local-dir DIR` where there is network), or put it in the hub cache ($HF_HUB_CACHE) and "
            "set HF_HUB_OFFLINE=1")


def _hub_problem(e: Exception, revision: str | None) -> str:
    """What went wrong resolving a repo id, in words (huggingface_hub's classes, by name: the
    classes moved between its versions)."""
    name = type(e).__name__
    first = (str(e).splitlines() or [name])[0]
    if "RepositoryNotFound" in name:
        return "no such repo on the hub (or a private one: log in with `hf auth login`)"
    if "GatedRepo" in name:
        return "a gated repo: accept its terms on huggingface.co and log in with `hf auth login`"
    if "RevisionNotFound" in name:
        return f"the repo has no revision {revision!r}"
    if hub_offline():
        return "not in the local hub cache, and HF_HUB_OFFLINE is set"
    if "LocalEntryNotFound" in name or isinstance(e, OSError) or any(k in name for k in ("Connect", "Timeout",
                                                                                       "Network")):
        return "the hub could not be reached and the repo is not in the local hub cache"
    return f"could not be resolved through huggingface_hub ({first})"


class SourceCheckpoint:
    """An opened Quark MXFP4 checkpoint: its config, tensor table and lazy readers (of a
    multimodal one, its language model's: module docstring)."""

    def __init__(self, root: pathlib.Path, origin: dict[str, Any] | None = None):
        self.root = root
        self.origin = origin or {"kind": "directory", "path": str(root)}
        self.file_config = self._read_config()  # config.json as it is
        self.wrapper: Wrapper | None = wrapper_of(self.file_config)
        try:
            self.config = self.wrapper.language_config(self.file_config) if self.wrapper else self.file_config
        except LayoutsError as e:
            raise PrepError(f"{self.root / 'config.json'}: {str(e).removeprefix('config.json: ')}") from None
        self.quant_config = self.config.get("quantization_config") or {}
        self._check_quantization()
        self.files = self._shard_files()
        self._shards = {fname: ShardFile(self.root / fname) for fname in self.files}
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards.values():
            self.tensors.update(shard.tensors)
        self._check_shards_agree()
        if self.wrapper:
            self.tensors = self._language_names(self.tensors)
        self.side_files()  # refused now, before a conversion writes anything, not when they are copied

    @classmethod
    def open(cls, src: str, revision: str | None = None) -> "SourceCheckpoint":
        root, origin = resolve(src, revision)
        return cls(root, origin)

    # ------------------------------------------------------------------ validation
    def member(self, fname: str, what: str = "") -> pathlib.Path:
        """``root / fname``, refused unless ``fname`` (named by an index, or a side file) is a plain
        name of a regular file inside the folder; a symlink may point into the folder, or for a
        Hugging Face snapshot into the repo's cache (its blobs). A missing file is the caller's
        to report."""
        problem = member_problem(self.root, fname)
        if problem:
            raise PrepError(f"{self.root}: {what + ': ' if what else ''}{problem}; a checkpoint's files are regular "
                            "files in its folder: refusing to read it")
        return self.root / fname

    def _json(self, fname: str, what: str = "") -> Any:
        p = self.member(fname, what)
        try:
            return strict_json(read_regular(p, MAX_JSON_BYTES))
        except FileNotFoundError:
            raise
        except FileTooLargeError as e:
            raise PrepError(f"{p}: {e}; not the file it is named after: re-download it") from None
        except DuplicateKeyError as e:
            raise PrepError(f"{p}: names {e.key!r} twice; the file is damaged: re-download it") from None
        except PermissionError as e:
            raise PrepError(f"{p}: cannot be read ({e.strerror}); check its permissions") from None
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise PrepError(f"{p}: not valid UTF-8 JSON ({str(e).splitlines()[0]}); re-download it") from None

    def _read_config(self) -> dict[str, Any]:
        try:
            cfg = self._json("config.json")
        except FileNotFoundError:
            raise PrepError(f"{self.root}: no config.json; is this a Hugging Face checkpoint folder?") from None
        if not isinstance(cfg, dict):
            raise PrepError(f"{self.root / 'config.json'}: a JSON {type(cfg).__name__}, not an object; "
                            "is this a Hugging Face checkpoint folder?")
        return cfg

    def _check_quantization(self) -> None:
        """Refuse a checkpoint prep does not convert: AMD Quark MXFP4 (its FP8 overrides included)
        and DeepSeek's own FP8 release are converted."""
        qc = self.quant_config
        if not isinstance(qc, dict):
            qc = {}  # refused just below, as not Quark
        if qc.get("quant_method") == "fp8" and "weight_block_size" in qc:  # DeepSeek's own FP8 release
            block = qc.get("weight_block_size")
            if block != [128, 128] or qc.get("activation_scheme", "dynamic") != "dynamic":
                raise PrepError(
                    f"{self.root}: an FP8 checkpoint with weight_block_size {block!r} and activation_scheme "
                    f"{qc.get('activation_scheme')!r}; prep converts DeepSeek's FP8 release (weight_block_size "
                    "[128, 128], dynamic activations) and AMD Quark MXFP4 checkpoints")
            return
        if qc.get("quant_method") != "quark":
            raise PrepError(
                f"{self.root}: not a Quark checkpoint (config.json quantization_config.quant_method is "
                f"{qc.get('quant_method')!r}, expected 'quark'); prep converts AMD Quark MXFP4 checkpoints")
        glob = qc.get("global_quant_config") or {}
        weight = (glob.get("weight") if isinstance(glob, dict) else None) or {}
        if not isinstance(weight, dict):
            weight = {}
        if weight.get("dtype") != "fp4" or weight.get("group_size") != 32 or weight.get("scale_format") != "e8m0":
            raise PrepError(
                f"{self.root}: Quark checkpoint is not MXFP4 (global weight spec dtype={weight.get('dtype')!r}, "
                f"group_size={weight.get('group_size')!r}, scale_format={weight.get('scale_format')!r}; "
                "expected fp4 / 32 / e8m0)")

    def _shard_files(self) -> list[str]:
        index = self.root / INDEX_NAME
        self.weight_map: dict[str, str] | None = None
        try:
            raw = self._json(INDEX_NAME)
        except FileNotFoundError:
            raw = None
        if raw is not None:
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict) or not all(type(f) is str for f in weight_map.values()):
                raise PrepError(f"{index}: not a safetensors index (no weight_map object of tensor name -> file "
                                "name); re-download it")
            self.weight_map = weight_map
            files = sorted(set(weight_map.values()))
            for f in files:  # ../x, /etc/passwd, sub/x or a FIFO: refused before anything is opened
                self.member(f, INDEX_NAME)
        elif os.path.lexists(self.root / SINGLE_NAME):
            files = [SINGLE_NAME]
            self.member(SINGLE_NAME)
        elif os.path.lexists(self.root / MANIFEST_NAME):
            raise PrepError(f"{self.root}: is prep's conversion{self._converted_from()}, not a Quark source; convert "
                            "its source, or `prep revert` it to rebuild that source first")
        else:
            raise PrepError(f"{self.root}: no {INDEX_NAME} and no {SINGLE_NAME}")
        missing = [f for f in files if not (self.root / f).is_file()]
        if missing:
            raise PrepError(f"{self.root / missing[0]}: shard listed in the index is missing "
                            f"({len(missing)} missing); re-download the checkpoint")
        return files

    def _check_shards_agree(self) -> None:
        """No tensor in two shards (the later one would silently win), and the index's
        weight_map agrees with the shards: each tensor it lists is in the shard it names. (A
        tensor a shard holds but the index omits is kept: engines read every tensor of a shard.)"""
        if len(self.tensors) != sum(len(s.tensors) for s in self._shards.values()):
            seen: dict[str, str] = {}
            for fname, shard in self._shards.items():
                for name in shard.tensors:
                    if name in seen:
                        raise PrepError(f"{self.root}: tensor {_show(name)} is in two shards, {seen[name]} and {fname}; "
                                        "a stale or duplicated shard: re-download the checkpoint")
                    seen[name] = fname
        if self.weight_map is None:
            return
        tensors = self.tensors
        for name, fname in self.weight_map.items():
            info = tensors.get(name)
            if info is None or info.file != fname:
                where = f"it is in {info.file}" if info is not None else "no shard holds it"
                raise PrepError(f"{self.root / INDEX_NAME}: lists tensor {_show(name)} in {fname} but {where}; the index "
                                "and the shards disagree: re-download the checkpoint")

    def source_name(self, name: str) -> str:
        """The source's own name of ``name`` (a key of :attr:`tensors`), for messages and ``revert``."""
        return self.wrapper.source_name(name) if self.wrapper else name

    def _language_names(self, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        """``tensors`` under the family's names (:meth:`Wrapper.inner_name`), in the same order; a
        name without the prefix keeps it (no module names it: refused with the others later), and
        one that would then be two tensors' is refused here."""
        out: dict[str, TensorInfo] = {}
        for name, info in tensors.items():
            inner = self.wrapper.inner_name(name)
            key = name if inner is None else inner
            if key in out:
                raise PrepError(f"{self.root}: tensor {_show(out[key].name)} and {_show(name)} are the same tensor of "
                                f"the language model, with and without {self.wrapper.prefix!r}; re-export the "
                                "checkpoint without the stray one")
            out[key] = info
        return out

    def _converted_from(self) -> str:
        """`` of PATH`` for a folder prep converted (its manifest's source path), else ``""``."""
        try:
            path = json.loads(read_regular(self.root / MANIFEST_NAME, MAX_JSON_BYTES))["source"]["path"]
        except (OSError, ValueError, KeyError, TypeError, FileTooLargeError):
            return ""
        return f" of {path}" if isinstance(path, str) and path.isprintable() else ""

    # ------------------------------------------------------------------ reading
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PrepError(f"{self.root}: tensor {name} is missing from the checkpoint") from None

    def spans(self, names: list[str], gap: int = 1 << 20) -> list[tuple[int, int, int]]:
        """(fd, start, stop) of the bytes of ``names`` in their files, in file order, tensors less
        than ``gap`` bytes apart merged into one span (reading a small gap costs less than another
        request)."""
        spans = sorted((t.file, t.offset, t.offset + t.nbytes) for t in (self.info(n) for n in names))
        merged: list[list] = []
        for f, a, b in spans:
            if merged and merged[-1][0] == f and a - merged[-1][2] < gap:
                merged[-1][2] = max(merged[-1][2], b)
            else:
                merged.append([f, a, b])
        return [(self._shards[f].fd, a, b) for f, a, b in merged if b > a]

    def cuts_columns(self, name: str, cols: slice | None) -> bool:
        """Whether ``cols`` is a proper column window of source tensor ``name`` (not None, not
        its whole width): a read of it reads whole rows and cuts them."""
        if cols is None:
            return False
        shape = self.info(name).shape
        width = shape[-1] if len(shape) > 1 else 1  # a 1-D tensor is read as a column [N, 1] (see read)
        return not (cols.start in (0, None) and cols.stop is not None and cols.stop >= width)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, or a block of its rows / columns (columns are cut from the rows read).

        With ``out`` (a view of the right shape, e.g. one expert's rows in a stacked tensor),
        the bytes land there: read straight in when ``out`` is contiguous and all columns are
        wanted, else copied in. Returns ``out``."""
        info = self.info(name)
        as_column = len(info.shape) == 1 and (cols is not None or (out is not None and out.dim() == 2))
        if not self.cuts_columns(name, cols):
            cols = None  # the whole width: a plain row read
        if as_column:
            # A 1-D tensor a group holds is planned as a column [N, 1] (an FP8 linear's per-channel
            # scale, which the engine holds as [N, 1] and splits with its weight's rows): same bytes.
            if out is not None and out.is_contiguous():
                self._shards[info.file].read(info, rows, out.view(-1))
                return out
            t = self._shards[info.file].read(info, rows).unsqueeze(1)
            if out is None:
                return t
            out.copy_(t)
            return out
        if out is not None and cols is None and out.is_contiguous():
            return self._shards[info.file].read(info, rows, out)
        t = self._shards[info.file].read(info, rows)
        t = t if cols is None else t[:, cols]
        if out is None:
            return t.contiguous()
        out.copy_(t)
        return out

    def file_records(self) -> dict[str, SourceFile]:
        """Each file's size (the manifest's ``source.files``), with its xxh3-128 hash for every side
        file (a few MB: what a later ``--force``, ``verify`` and ``revert`` tell the user's edits
        by); the shards by their size only."""
        files = {}
        for fname in sorted(set(self.files) | {p.name for p in self.side_files()}):
            p = self.root / fname
            files[fname] = SourceFile(p.stat().st_size, None if fname in self.files else file_xxh3(p))
        return files

    def side_files(self) -> list[pathlib.Path]:
        """The side files present (copied into the output: a symlink out of the folder or a FIFO
        is refused, not copied or waited on)."""
        return [self.member(f, "side file") for f in SIDE_FILES if os.path.lexists(self.root / f)]

    def side_bytes(self) -> int:
        """Bytes of the side files (config, tokenizer, ...) that go out with a conversion."""
        return sum(os.path.getsize(f) for f in self.side_files())

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.root / f) for f in self.files)
