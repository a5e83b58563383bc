"""scripts/bench_serving.py --quick: starts `jax-paged serve` on a tiny model, drives it with
Poisson and all-at-once request streams, and reports `vllm bench serve`'s metrics as JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_run_reports_vllm_bench_serve_metrics(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "scripts/bench_serving.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "result.json"
    result = bench.main(["--quick", "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    runs = result["servers"]["jax-paged"]["runs"]
    assert [(r["workload"], r["request_rate"]) for r in runs] == [
        ("random", "inf"),
        ("random", 20.0),
        ("shared_prefix", "inf"),
        ("shared_prefix", 20.0),
    ]
    for r in runs:
        assert r["completed"] == 16 and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] == 16 * 16  # ignore_eos: exactly max_tokens each
        assert r["total_input_tokens"] == 16 * 32
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p90", "p99"):
                assert r[f"{stat}_{metric}_ms"] >= 0
        assert r["median_ttft_ms"] <= r["median_e2el_ms"]


def test_poisson_arrivals_and_prompt_shapes():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "scripts/bench_serving.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = bench.arrival_times(4000, 4.0, seed=0)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # 4 req/s
    assert bench.arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    prompts = bench.make_prompts(50, 100, 0.2, (10, 20), 30, seed=1)
    assert all(80 <= len(p) <= 120 for p in prompts)
    assert all(p[:30] == prompts[0][:30] for p in prompts)
    assert all(10 <= t < 20 for p in prompts for t in p)


def test_head_to_head_rounds_merge_to_medians_and_paired_ratios():
    """--rounds: each server's numbers are medians over its rounds, and each goal's ratio is
    the median of the ratios within rounds (not the ratio of the medians)."""
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "scripts/bench_serving.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def rnd(tput, ttft):
        run = dict(workload="random", request_rate="inf", request_throughput=tput,
                   median_ttft_ms=ttft, p99_ttft_ms=2 * ttft, median_tpot_ms=10.0)  # fmt: skip
        return {"startup_s": 1.0, "runs": [run]}

    ours = [rnd(1.0, 100.0), rnd(2.0, 300.0), rnd(4.0, 200.0)]
    theirs = [rnd(2.0, 100.0), rnd(2.0, 100.0), rnd(2.0, 400.0)]
    merged = bench._merge_rounds(ours)
    assert merged["runs"][0]["request_throughput"] == 2.0
    assert merged["runs"][0]["median_ttft_ms"] == 200.0
    assert merged["runs"][0]["request_rate"] == "inf" and len(merged["rounds"]) == 3
    (row,) = bench._ratios(ours, theirs)
    assert row["request_throughput"] == 1.0  # per round 0.5, 1, 2
    assert row["median_ttft_ms"] == 1.0  # per round 1, 3, 0.5; medians' ratio would be 2
    assert row["median_ttft_ms_range"] == [0.5, 3.0]
