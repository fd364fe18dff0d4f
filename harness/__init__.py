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

This package imports prep's and layouts' private names where a check needs them: it is the
test of those names, not a user of their public interface.
"""

import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent  # the checkout: prep, layouts, .venv-*, .cache
