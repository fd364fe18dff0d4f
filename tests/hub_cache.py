"""A Hugging Face hub cache on disk, for resolving repo ids offline in tests."""

from __future__ import annotations

import pathlib
import shutil


def fake_hub_cache(tmp_path: pathlib.Path, src: pathlib.Path, repo: str = "amd/Tiny-DeepSeek-MXFP4",
                   commit: str = "0123456789abcdef0123456789abcdef01234567") -> tuple[pathlib.Path, str, str]:
    """A Hugging Face hub cache holding ``src`` as ``repo`` at ``commit`` (the layout
    huggingface_hub writes: refs/main -> commit, snapshots/<commit>/<files>). Point
    ``HF_HUB_CACHE`` at the returned folder and set ``HF_HUB_OFFLINE=1`` to resolve ``repo``."""
    cache = tmp_path / "hub"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo_dir / "snapshots" / commit)
    return cache, repo, commit
