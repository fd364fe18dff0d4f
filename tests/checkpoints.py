"""The suite's generated checkpoints, each spec written once per test process and copied after.

``prep.testing.write_checkpoint`` is deterministic (the same spec gives the same bytes:
``test_synth.py::test_deterministic_and_seed_sensitive`` pins it), and the suite asked it for the
same few specs 93 times, 0.5-1 s each (tensors drawn and MXFP4-quantized): 86 s of the
suite's test time on two workers. A copy of the first write is the same files, made in
milliseconds, and fresh (a test may edit or damage its copy). ``test_synth.py`` calls the real
function: it is what is tested there.
"""

from __future__ import annotations

import atexit
import functools
import pathlib
import shutil
import tempfile
from typing import Callable

from prep.testing import SynthSpec
from prep.testing import write_checkpoint as _write

_CACHE: dict[SynthSpec, pathlib.Path] = {}


@functools.cache
def _root() -> pathlib.Path:
    """This process's folder of first writes, removed when it exits."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="prep-test-checkpoints-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def write_checkpoint(spec: SynthSpec, out_dir: str | pathlib.Path,
                     progress: Callable[[int, int], None] | None = None) -> pathlib.Path:
    """:func:`prep.testing.write_checkpoint`'s files in ``out_dir``, from this process's copy of
    ``spec``'s first write (the real function where ``progress`` is asked for, or ``out_dir`` is
    not absent or empty: its own refusal)."""
    out = pathlib.Path(out_dir)
    if progress is not None or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        return _write(spec, out, progress)
    cached = _CACHE.get(spec)
    if cached is None:
        cached = _write(spec, _root() / str(len(_CACHE)))
        _CACHE[spec] = cached
    shutil.copytree(cached, out, copy_function=shutil.copyfile, dirs_exist_ok=True)
    return out
