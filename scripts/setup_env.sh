#!/usr/bin/env bash
# Create (or refresh) .venv with everything prep, its tests and benchmarks need, on the CPU.
# torch is pinned to the 2.13.0 CPU wheel first: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Run a command quietly; show its output only if it fails.
quiet() {
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
quiet "${PIP[@]}" torch==2.13.0
quiet "${PIP[@]}" -e '.[dev]'
.venv/bin/python -c "import torch, layouts, prep"
# Oracles the tests compare against. amd-quark (Quark's own MXFP4 exporter) installs normally;
# aiter's layout/quant files are unpacked, not installed (`import aiter` needs ROCm, and an
# installed aiter breaks `import quark` on such a machine).
.venv/bin/python -c "import quark" >/dev/null 2>&1 || quiet "${PIP[@]}" amd-quark==0.13
quiet .venv/bin/python scripts/fetch_aiter_oracle.py
# transformers' own DeepseekV3, the independent reference for `prep run` (tests only).
.venv/bin/python -c "import transformers; assert transformers.__version__ == '5.24.0'" >/dev/null 2>&1 \
  || quiet "${PIP[@]}" transformers==5.24.0
