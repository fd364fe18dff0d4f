#!/usr/bin/env bash
# Set up .venv if needed and run the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --tests
exec .venv/bin/python -m pytest -q "$@"
