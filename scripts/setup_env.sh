#!/usr/bin/env bash
# Create (or refresh) .venv on the CPU: what prep and the demo need; with --atom also what ATOM's code
# needs to run on the CPU (python -m harness check-engine atom, check-atom-matrix); with --tests also the test
# tools and the oracles the tests compare against. Each step says what it installs and how long it
# took; pip's own output is shown only when a step fails.
# torch is pinned to the 2.13.0 CPU wheel first: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TESTS=0
ATOM=0
SGLANG=0
VLLM=0
# --engine NAME is --NAME: what python -m harness check-engine NAME needs.
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--engine" ]; then
    [ $# -ge 2 ] || { echo "setup_env.sh: --engine needs a name (atom, sglang or vllm)" >&2; exit 2; }
    args+=("--$2"); shift 2
  else
    args+=("$1"); shift
  fi
done
for arg in ${args[@]+"${args[@]}"}; do
  case "$arg" in
    --tests) TESTS=1; ATOM=1; SGLANG=1; VLLM=1 ;;  # the suite runs ATOM's start-up, SGLang's and vLLM's loaders
    --atom) ATOM=1 ;;
    --sglang) SGLANG=1; ATOM=1 ;;  # .venv-sglang reads .venv's packages (transformers, triton, ...)
    --vllm) VLLM=1; ATOM=1 ;;  # .venv-vllm likewise
    *) echo "setup_env.sh: unknown option $arg (use --tests, --atom, --sglang, --vllm or --engine NAME)" >&2; exit 2 ;;
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
# HTTP clients (and what they import) that SGLang's and vLLM's code imports at start-up: .venv has them
# only after --tests (amd-quark pulls them in), so `--engine sglang` or `--engine vllm` alone installs
# them in the engine's own venv, pinned, without dependencies like the rest.
HTTP_PKGS=(urllib3==2.8.0 requests==2.34.2 charset-normalizer==3.5.3 certifi==2026.10.19.post1 aiohttp==3.14.5
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4
  yarl==1.25.1)
# SGLang's model and loader code for python -m harness check-engine sglang, in a venv of
# its own on top of .venv's packages (a .pth file): SGLang pins another transformers and
# huggingface_hub than prep's tests, and its GPU packages (sgl-kernel, flashinfer, CUDA torch) are
# stand-ins on the CPU, so sglang and the pure-Python packages its DeepSeek code imports are
# installed without their dependencies.
if [ "$SGLANG" = 1 ]; then
  [ -x .venv-sglang/bin/python ] || step "virtual environment .venv-sglang" "$PY" -m venv .venv-sglang
  .venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
    > "$(.venv-sglang/bin/python -c "import site; print(site.getsitepackages()[0])")/prep-main-venv.pth"
  .venv-sglang/bin/python -c "import sglang, einops, orjson, pybase64, gguf, openai, compressed_tensors, requests, \
aiohttp, dill, sentencepiece" >/dev/null 2>&1 \
    || step "SGLang 0.5.23 and the pure-Python packages its DeepSeek code imports (no dependencies)" \
      .venv-sglang/bin/python -m pip install --disable-pip-version-check --no-deps sglang==0.5.23 \
      compressed-tensors==0.18.0 distro==1.9.0 einops==0.8.2 gguf==0.19.0 httpcore==1.0.9 httpx==0.29.0 \
      ipython==9.18.1 loguru==0.7.3 openai==2.8.0 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 \
      pybase64==1.5.1 sniffio==1.3.1 traitlets==5.16.1 transformers==5.19.0 huggingface_hub==1.33.0 \
      tokenizers==0.23.2 dill==0.4.1 sentencepiece==0.2.3 "${HTTP_PKGS[@]}"
  .venv/bin/python scripts/fetch_aiter_oracle.py >/dev/null  # aiter's Triton MXFP4 quant, for SGLang's w_kc/w_vc
fi
# vLLM's model and loader code for python -m harness check-engine vllm, the same way:
# vllm (its compiled extensions link a CUDA torch and are stand-ins on the CPU) and the
# pure-Python packages its DeepSeek code imports, without their dependencies, on top of .venv.
if [ "$VLLM" = 1 ]; then
  [ -x .venv-vllm/bin/python ] || step "virtual environment .venv-vllm" "$PY" -m venv .venv-vllm
  .venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
    > "$(.venv-vllm/bin/python -c "import site; print(site.getsitepackages()[0])")/prep-main-venv.pth"
  .venv-vllm/bin/python -c "import vllm, cachetools, cbor2, compressed_tensors, einops, loguru, cpuinfo, pybase64, \
urllib3, requests, aiohttp, cloudpickle" >/dev/null 2>&1 \
    || step "vLLM 0.34.0 and the pure-Python packages its DeepSeek code imports (no dependencies)" \
      .venv-vllm/bin/python -m pip install --disable-pip-version-check --no-deps vllm==0.34.0 cachetools==8.0.2 \
      cbor2==6.3.0 compressed-tensors==0.17.0 einops==0.8.2 loguru==0.7.3 py-cpuinfo==9.0.0 pybase64==1.5.1 \
      uvloop==0.23.0 cloudpickle==3.1.3 "${HTTP_PKGS[@]}"
  .venv/bin/python scripts/fetch_aiter_oracle.py >/dev/null  # aiter's Triton quant and GEMM (v2's W_UK/W_UV)
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
