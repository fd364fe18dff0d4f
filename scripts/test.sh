#!/usr/bin/env bash
# Set up .venv if needed and run the test suite (CPU only), one pytest-xdist worker per core.
#   bash scripts/test.sh                          # everything, in parallel
#   bash scripts/test.sh tests/test_convert.py    # one file (any pytest arguments pass through)
#   bash scripts/test.sh -n 0 tests/test_x.py     # serially, e.g. to use a debugger
# worksteal: a worker that runs out of tests takes half of the other's queue, so the few slow
# files (Quark export, the reference engine, aiter's GEMMs) do not leave one core idle at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --tests
# Bytecode is written (some images set PYTHONDONTWRITEBYTECODE, this machine's among them): the
# engine checks start ~20 Python processes that import ATOM from the pinned tree unpacked under
# pytest's temporary folder, which has no .pyc; without this every one of them compiled ATOM from
# source again (a TP 2 start-up 7.7 -> 6.1 s; the ATOM serve tests 31.2 -> 26.6 s, measured).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -n auto --dist worksteal "$@"
