"""`scripts/gpu_check.sh --dry-run`: every stage of the GPU check runs on the CPU (tiny shapes,
the Pallas interpreter) and writes its JSON, so the script is known to work before a GPU is at
hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == [
        "env",
        "kernel_tests",
        "bench_kernel",
        "engine",
        "engine_tests",
    ]
    assert all(s["ok"] for s in summary["stages"]), summary
    kernel_tests = json.loads((tmp_path / "kernel_tests.json").read_text())
    assert kernel_tests["counts"].get("passed", 0) >= 3
    assert set(kernel_tests["counts"]) <= {"passed", "skipped"}
    bench = json.loads((tmp_path / "bench_kernel.json").read_text())
    assert bench["cases"] and bench["prefill_cases"] and bench["matmul_tflops"] > 0
    assert not bench["cases"][0]["errors"] and not bench["prefill_cases"][0]["errors"]
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert len(engine["runs"]) == 3 and not any(r["errors"] for r in engine["runs"])
    assert engine["programs"] and engine["attention_impl"] == "gpu"
    assert json.loads((tmp_path / "env.json").read_text())["backend"] == "cpu"
