"""The engines' real code on the CPU, checking prep's converted folders: test support, shipped in
neither distribution (pyproject.toml's and runtime/pyproject.toml's package lists name ``prep``
and ``layouts`` only).

One command, run from the checkout (``python -m harness --help``)::

    .venv/bin/python -m harness check-engine {atom,sglang,vllm} --source SRC --converted OUT

Per engine, a module that builds the engine's real model code on a CPU without ROCm and loads
it both ways (the engine's own loader on SRC, its door on OUT): :mod:`harness.atom`,
:mod:`harness.sglang`, :mod:`harness.vllm`. What they share: :mod:`harness.stand_ins` (what
stands in for aiter's compiled modules and GPU-only packages), :mod:`harness.mi355x` (the platform
as one MI355X), :mod:`harness.sources` (ATOM's and aiter's pinned source trees),
:mod:`harness.compare` (the byte comparison) and :mod:`harness.report` (the one output format).
The test suite runs these processes forked from one server per kind, which made their imports
once (:mod:`harness.forkserver`).

This package imports prep's and layouts' private names where a check needs them: it is the
test of those names, not a user of their public interface.
"""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent  # the checkout: prep, layouts, .venv-*, .cache


def pythonpath(current: str | None) -> str:
    """``current`` (a PYTHONPATH, or None) with the checkout first: how a process started by
    another Python finds the harness, prep and layouts as ``python -m harness`` does."""
    return os.pathsep.join(p for p in (str(REPO), current) if p)

_AT_EXIT: list[bool] = []


def freeze_imports() -> None:
    """Leave what is alive now (the engine's modules, torch's, transformers') out of every later
    garbage collection: the engines' loaders call ``gc.collect()`` around each load (vLLM's
    ``BaseModelLoader.load_model`` twice), and with vLLM imported each call walked its millions of
    objects for ~0.33 s (1.3 s of a 12 s check, profiled); ATOM's forked workers collected what
    the server process had imported (a TP 2 serve check 16.8 -> 13.1 s). Nothing a load makes is
    frozen until the next call. Unfrozen at exit: what is still frozen when the interpreter ends
    is never finalized, and Triton's bindings then print "nanobind: leaked 4 instances" to
    stderr, under the one-line refusals the tests read."""
    import atexit
    import gc

    gc.freeze()  # no collect first: the little garbage of the imports is not worth a walk
    if not _AT_EXIT:
        atexit.register(gc.unfreeze)
        _AT_EXIT.append(True)
