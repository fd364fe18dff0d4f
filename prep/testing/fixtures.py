"""What the tests do to checkpoints and commands beyond writing them: drop tensors, edit a side
file at the same size, rewrite a conversion as format 3, run a command and measure its peak
memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from safetensors.torch import save_file

from .write import _write_json

# Started by run_measured: runs the command and writes its ru_maxrss (KiB) to $PREP_MAXRSS_FILE.
# A child's ru_maxrss is at least its parent's resident size when it was forked (exec records the
# old address space's high-water mark), so the command is forked from this small interpreter,
# not from the caller (a test process holding torch and a checkpoint).
_LAUNCHER = """import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
with open(os.environ["PREP_MAXRSS_FILE"], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def drop_tensors(folder: Path, gone: Callable[[str], bool]) -> None:
    """Remove the tensors ``gone(name)`` picks from a written checkpoint's shards and its index (a
    checkpoint whose producer left them out: e.g. an MTP layer without its own head)."""
    from safetensors.torch import load_file

    index_path = Path(folder) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(Path(folder).glob("model-0000*.safetensors")):
        tensors = load_file(shard)
        if any(gone(n) for n in tensors):
            save_file({n: t for n, t in tensors.items() if not gone(n)}, shard, metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not gone(n)}
    _write_json(index_path, index)


def edit_at_same_size(path: Path) -> None:
    """A user's edit of a JSON side file that keeps its size: its first digit changed
    (``"temperature": 0.6`` -> ``0.7``), which a check by size alone cannot tell."""
    raw = Path(path).read_bytes()
    digit = next(i for i, b in enumerate(raw) if chr(b).isdigit())
    Path(path).write_bytes(raw[:digit] + (b"7" if raw[digit:digit + 1] != b"7" else b"8") + raw[digit + 1:])


def as_format_3(folder: Path) -> bytes:
    """Rewrite the converted ``folder`` (manifest format 4) as versions 1-3 wrote it: the source
    tensor table back inside the manifest as ``source.tensors``, ``prep-source.json`` removed,
    the completion marker resealed. Returns the manifest's new bytes. Rewrites the three files in
    place: give it a copy (never hard links of them)."""
    from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME, SOURCE_TABLE_NAME, manifest_hash

    m = json.loads((folder / MANIFEST_NAME).read_bytes())
    m["source"]["tensors"] = json.loads((folder / SOURCE_TABLE_NAME).read_bytes())["tensors"]
    del m["source"]["tensors_file"]
    m["format_version"] = 3
    raw = json.dumps(m, separators=(",", ":")).encode()
    (folder / MANIFEST_NAME).write_bytes(raw)
    marker = json.loads((folder / COMPLETE_NAME).read_bytes())
    (folder / COMPLETE_NAME).write_text(json.dumps({**marker, "manifest_sha256": manifest_hash(raw)}))
    (folder / SOURCE_TABLE_NAME).unlink()
    return raw


def run_measured(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[int, int, str]:
    """Run ``cmd`` as a process of its own, in ``cwd``: (exit code, its peak resident memory in
    bytes, its output). The peak is the kernel's high-water mark (``ru_maxrss``): anonymous
    memory and the mapped file pages it touched, as ``top`` and the OOM killer count them.
    (``python -m`` puts ``cwd`` first on the path, ahead of PYTHONPATH.)"""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "maxrss")
        proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, **(env or {}), "PREP_MAXRSS_FILE": where})
        with open(where) as f:
            peak = int(f.read()) * 1024
    return proc.returncode, peak, proc.stdout.decode(errors="replace")
