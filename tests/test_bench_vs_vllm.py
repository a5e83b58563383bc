"""scripts/bench_vs_vllm.py: jax-paged's side at its smallest (the JSON's shape, the run
metadata), and the vLLM worker's protocol and errors. vLLM itself is never installed in CI
(it lives in a venv of its own, scripts/setup_vllm.sh)."""

from __future__ import annotations

import json
import sys

import bench_vs_vllm
import pytest
from bench_support.vllm_peer import OfflineVLLM


@pytest.mark.slow
def test_quick_run_without_vllm(tiny_llama, capsys):
    path, _ = tiny_llama
    assert bench_vs_vllm.main(["--quick", "--no-vllm", f"--model={path}"]) == 0
    res = json.loads(capsys.readouterr().out)
    ours = res["results"]["2"]["jax-paged"]
    assert ours["output_tokens_per_s"] > 0 and ours["decode_tokens_per_s"] > 0
    assert ours["prefill_s"] > 0 and len(ours["runs"]) == 1
    assert "paired_ratio" not in res["results"]["2"] and "vllm" not in res
    assert res["run"]["commit"] and res["run"]["machine"]["cpu_count"] >= 1


def test_missing_vllm_python_names_the_setup_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="setup_vllm.sh"):
        OfflineVLLM(tmp_path, dtype="float32", max_num_seqs=2, max_model_len=64,
                    python=str(tmp_path / "no-python"))  # fmt: skip


def test_worker_reports_its_start_up_failure(tmp_path):
    """The worker under a Python without vLLM (this one): its error comes back, not a hang."""
    with pytest.raises(RuntimeError, match="vLLM worker: .*vllm"):
        OfflineVLLM(tmp_path, dtype="float32", max_num_seqs=2, max_model_len=64,
                    python=sys.executable, log=tmp_path / "log")  # fmt: skip
