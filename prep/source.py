"""Reading a source checkpoint: resolve it (local folder or Hugging Face repo id), check that it
is a Quark MXFP4 checkpoint whose shards are all present and whole, and read tensors lazily.

Tensors are read with ``pread`` into fresh buffers, a block of rows at a time: no shard is
loaded whole, and nothing is memory-mapped (mapped pages that were read would stay resident).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from layouts.safetensors_file import SafetensorsFile, SafetensorsFileError, TensorInfo

from .errors import PrepError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied next to the converted weights (the engine's tokenizer and generation settings).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "configuration_deepseek.py", "modeling_deepseek.py")


class ShardFile(SafetensorsFile):
    """A safetensors file of a checkpoint (layouts' pread reader) whose errors are prep's
    one-line errors: a truncated download or a changed file is named, with what to do."""

    def __init__(self, path: pathlib.Path):
        try:
            super().__init__(path)
        except SafetensorsFileError as e:
            raise PrepError(f"{e}: re-download it") from None

    def get(self, name: str) -> torch.Tensor:
        try:
            return super().get(name)
        except KeyError:
            raise PrepError(f"{self.path}: no tensor {name}") from None

    def read(self, info: TensorInfo, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        try:
            return super().read(info, rows, out)
        except SafetensorsFileError as e:
            raise PrepError(str(e)) from None


def resolve(src: str, revision: str | None = None) -> tuple[pathlib.Path, dict[str, Any]]:
    """A local folder, or a Hugging Face repo id fetched through huggingface_hub's cache
    (honours HF_HUB_OFFLINE; downloads only safetensors, JSON and tokenizer files)."""
    path = pathlib.Path(src).expanduser()
    if path.is_dir():
        return path.resolve(), {"kind": "directory", "path": str(path.resolve())}
    if path.exists():
        raise PrepError(f"{src}: not a directory; give a checkpoint folder or a Hugging Face repo id")
    if src.count("/") != 1 or src.startswith((".", "/")):
        raise PrepError(f"{src}: no such directory (and not a Hugging Face repo id like org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a dependency of prep
        raise PrepError(f"{src}: huggingface_hub is needed to resolve repo ids ({e})") from None
    try:
        local = snapshot_download(src, revision=revision,
                                  allow_patterns=["*.safetensors", "*.json", "tokenizer.*", "*.py"])
    except Exception as e:  # hub errors come in many classes; the message is what helps
        raise PrepError(f"{src}: could not resolve through huggingface_hub: {e}".splitlines()[0]) from None
    return pathlib.Path(local), {"kind": "hf", "repo_id": src, "revision": revision or "main",
                                 "snapshot": pathlib.Path(local).name}


class SourceCheckpoint:
    """An opened Quark MXFP4 checkpoint: its config, tensor table and lazy readers."""

    def __init__(self, root: pathlib.Path, origin: dict[str, Any] | None = None):
        self.root = root
        self.origin = origin or {"kind": "directory", "path": str(root)}
        self.config = self._read_config()
        self.quant_config = self.config.get("quantization_config") or {}
        self._check_quark_mxfp4()
        self.files = self._shard_files()
        self._shards = {fname: ShardFile(self.root / fname) for fname in self.files}
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards.values():
            self.tensors.update(shard.tensors)

    @classmethod
    def open(cls, src: str, revision: str | None = None) -> "SourceCheckpoint":
        root, origin = resolve(src, revision)
        return cls(root, origin)

    # ------------------------------------------------------------------ validation
    def _read_config(self) -> dict[str, Any]:
        p = self.root / "config.json"
        if not p.is_file():
            raise PrepError(f"{self.root}: no config.json; is this a Hugging Face checkpoint folder?")
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise PrepError(f"{p}: not valid JSON ({e})") from None

    def _check_quark_mxfp4(self) -> None:
        qc = self.quant_config
        if qc.get("quant_method") != "quark":
            raise PrepError(
                f"{self.root}: not a Quark checkpoint (config.json quantization_config.quant_method is "
                f"{qc.get('quant_method')!r}, expected 'quark'); prep converts AMD Quark MXFP4 checkpoints")
        weight = (qc.get("global_quant_config") or {}).get("weight") or {}
        if weight.get("dtype") != "fp4" or weight.get("group_size") != 32 or weight.get("scale_format") != "e8m0":
            raise PrepError(
                f"{self.root}: Quark checkpoint is not MXFP4 (global weight spec dtype={weight.get('dtype')!r}, "
                f"group_size={weight.get('group_size')!r}, scale_format={weight.get('scale_format')!r}; "
                "expected fp4 / 32 / e8m0)")

    def _shard_files(self) -> list[str]:
        index = self.root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise PrepError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.root / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            raise PrepError(f"{self.root}: no {INDEX_NAME} and no {SINGLE_NAME}")
        missing = [f for f in files if not (self.root / f).is_file()]
        if missing:
            raise PrepError(f"{self.root / missing[0]}: shard listed in the index is missing "
                            f"({len(missing)} missing); re-download the checkpoint")
        return files

    # ------------------------------------------------------------------ reading
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PrepError(f"{self.root}: tensor {name} is missing from the checkpoint") from None

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, or a block of its rows / columns (columns are cut from the rows read).

        With ``out`` (a view of the right shape, e.g. one expert's rows in a stacked tensor),
        the bytes land there: read straight in when ``out`` is contiguous and all columns are
        wanted, else copied in. Returns ``out``."""
        info = self.info(name)
        if cols is not None and cols.start in (0, None) and cols.stop is not None and cols.stop >= info.shape[-1]:
            cols = None  # the whole width: a plain row read
        if out is not None and cols is None and out.is_contiguous():
            return self._shards[info.file].read(info, rows, out)
        t = self._shards[info.file].read(info, rows)
        t = t if cols is None else t[:, cols]
        if out is None:
            return t.contiguous()
        out.copy_(t)
        return out

    def fingerprint(self, hash_files: bool = False) -> dict[str, Any]:
        """Where the source came from, and each file's size (and xxh3-128 hash on request)."""
        import xxhash

        files = {}
        for fname in sorted(set(self.files) | {f for f in SIDE_FILES if (self.root / f).is_file()}):
            p = self.root / fname
            entry: dict[str, Any] = {"size": p.stat().st_size}
            if hash_files:
                h = xxhash.xxh3_128()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 24), b""):
                        h.update(chunk)
                entry["xxh3_128"] = h.hexdigest()
            files[fname] = entry
        return {**self.origin, "files": files}

    def side_files(self) -> list[pathlib.Path]:
        return [self.root / f for f in SIDE_FILES if (self.root / f).is_file()]

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.root / f) for f in self.files)
