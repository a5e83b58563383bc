#!/usr/bin/env bash
# The GPU check: every GPU kernel test on the hardware, the kernel benchmark and the engine end
# to end, as JSON in one folder (scripts/gpu_check.py says what each stage does).
#
#   bash scripts/gpu_check.sh OUT_DIR             # on a CUDA machine
#   bash scripts/gpu_check.sh OUT_DIR --dry-run   # on a CPU: tiny shapes, Pallas interpreter
#
# Python: $PYTHON, else .venv/bin/python where it exists, else python3. On a GPU run, where that
# Python's jax sees no GPU, the [gpu] extra is installed first (needs a package index).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT_DIR [--dry-run] [gpu_check.py options]}
shift
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
case " $* " in
  *" --dry-run "*) ;;
  *)
    if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
      echo "jax sees no GPU: installing the [gpu] extra" >&2
      "$PY" -m pip install -q -e ".[gpu]"
    fi
    ;;
esac
exec "$PY" scripts/gpu_check.py --out "$OUT" "$@"
