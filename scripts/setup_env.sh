#!/usr/bin/env bash
# Create (or refresh) .venv on the CPU: what prep and the demo need; with --atom also what ATOM's code
# needs to run on the CPU (scripts/check_atom_serve.py, check_atom_install.py); with --tests also the test
# tools and the oracles the tests compare against. Each step says what it installs and how long it
# took; pip's own output is shown only when a step fails.
# torch is pinned to the 2.13.0 CPU wheel first: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TESTS=0
ATOM=0
for arg in "$@"; do
  case "$arg" in
    --tests) TESTS=1; ATOM=1 ;;  # the suite runs ATOM's server start-up (tests/test_atom_serve.py)
    --atom) ATOM=1 ;;
    *) echo "setup_env.sh: unknown option $arg (use --tests, --atom)" >&2; exit 2 ;;
  esac
done

# Run a step quietly, saying what it is and how long it took; show its output only if it fails.
step() {
  local what=$1; shift
  local log t0; log=$(mktemp); t0=$(date +%s)
  printf 'setup: %s ... ' "$what" >&2
  if ! "$@" >"$log" 2>&1; then echo "failed:" >&2; cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
  echo "ok ($(( $(date +%s) - t0 )) s)" >&2
}
have() { .venv/bin/python -c "$1" >/dev/null 2>&1; }

[ -x .venv/bin/python ] || step "virtual environment .venv" "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
have "import torch; assert torch.__version__.startswith('2.13.0')" || step "torch 2.13.0 (CPU wheel)" "${PIP[@]}" torch==2.13.0
have "import layouts, prep, click, tqdm, xxhash, huggingface_hub" || step "prep and layouts (editable)" "${PIP[@]}" -e .
# What ATOM's server and model code import on the CPU (ATOM itself is not on PyPI: the checks run
# its pinned source tree from ../shared/oracles): its declared server dependencies, pillow (its
# API server imports PIL), transformers and triton (prep.reference and the tests use them too).
if [ "$ATOM" = 1 ]; then
  have "import zmq, msgspec, fastapi, uvicorn, psutil, prometheus_client, setproctitle, PIL, transformers, triton" \
    || step "ATOM's CPU dependencies: pyzmq, msgspec, fastapi, uvicorn, psutil, prometheus_client, setproctitle, pillow, transformers 5.24.0, triton (ATOM's kernels import it)" \
      "${PIP[@]}" pyzmq msgspec "fastapi>=0.115,<0.137" uvicorn psutil "prometheus_client>=0.25,<0.26" setproctitle \
      pillow transformers==5.24.0 "triton>=3.8"
fi
[ "$TESTS" = 1 ] || exit 0

have "import pytest, xdist, hypothesis, triton" \
  || step "test tools: pytest, pytest-xdist, hypothesis, triton (for the interpreter)" "${PIP[@]}" -e '.[dev]'
# Oracles the tests compare against. amd-quark (Quark's own MXFP4 exporter) installs normally;
# aiter's layout/quant files are unpacked, not installed (`import aiter` needs ROCm, and an
# installed aiter breaks `import quark` on such a machine).
have "import quark" || step "oracle: amd-quark 0.13" "${PIP[@]}" amd-quark==0.13
step "oracle: aiter's files from the pinned amd-aiter wheel" .venv/bin/python scripts/fetch_aiter_oracle.py
# transformers' own DeepseekV3, the independent reference for `prep run` (tests only).
have "import transformers; assert transformers.__version__ == '5.24.0'" \
  || step "oracle: transformers 5.24.0 (DeepseekV3)" "${PIP[@]}" transformers==5.24.0
