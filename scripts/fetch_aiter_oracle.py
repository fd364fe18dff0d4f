#!/usr/bin/env python3
"""Fetch the aiter files the tests use as an oracle, without installing aiter.

`amd-aiter` cannot be imported without ROCm (its package init raises RuntimeError), and
installing it beside amd-quark breaks `import quark` on such a machine. Its layout functions
are plain torch files, so we download the pinned wheel with pip and unpack only the files the
tests load by path (see tests/aiter_oracle.py) into `.cache/aiter-oracle/`.

    python scripts/fetch_aiter_oracle.py [--dest DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

AITER_WHEEL = "amd-aiter==0.1.7.post2.dev18"
# Files (or folder prefixes) taken from the wheel.
WANTED = ("aiter/ops/shuffle.py", "aiter/utility/fp4_utils.py", "aiter/ops/triton/")
REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO / ".cache" / "aiter-oracle"


def fetch(dest: pathlib.Path) -> pathlib.Path:
    marker = dest / "WHEEL"
    if marker.is_file() and marker.read_text().strip() == AITER_WHEEL:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", AITER_WHEEL, "-d", tmp],
            check=True,
        )
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith(WANTED):
                    zf.extract(name, staging)
        (staging / "WHEEL").write_text(AITER_WHEEL + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=pathlib.Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    print(fetch(args.dest))


if __name__ == "__main__":
    main()
