"""scripts/bench_sharing.py end to end at its smallest: the JSON's keys, sharing and hits > 0."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "bench_sharing", ROOT / "scripts/bench_sharing.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_sharing_smallest(capsys):
    bench = _load_script()
    rc = bench.main(
        [
            "--workloads=sharegpt",
            "--scale=0.125",
            "--num-prompts=3",
            "--ns=4",
            "--beam-widths=",
            "--prefix-requests=4",
            "--prefix-len=64",
            "--suffix-len=4,8",
            "--prefix-max-tokens=4",
            "--repeats=1",
            "--zero-hit-repeats=1",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("run", "sharing", "prefix_caching", "zero_hit_cost", "total_seconds"):
        assert key in res
    row = res["sharing"]["parallel"]["sharegpt"]["4"]
    assert row["saving_pct"] > 0
    assert row["preemptions"] == 0
    assert res["sharing"]["paper_figure15_pct"]["parallel"]["alpaca"]["4"] == 8.5
    pc = res["prefix_caching"]
    assert pc["caching_on"]["prefix_cache_hit_rate"] > 0
    assert pc["caching_off"]["prefix_cache_hit_rate"] == 0
    assert pc["caching_on"]["compile_seconds_in_timed_runs"] == 0
    for k in ("output_tokens_per_s", "requests_per_s", "mean_ttft_s", "median_ttft_s"):
        assert pc["caching_on"][k] > 0 and pc["caching_off"][k] > 0
    assert pc["throughput_ratio_on_over_off"] > 0
    zh = res["zero_hit_cost"]
    assert zh["caching_on"]["prefix_cache_hit_rate"] == 0
    assert isinstance(zh["relative_throughput_cost"], float)
