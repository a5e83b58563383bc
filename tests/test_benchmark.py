"""scripts/benchmark.py: the KV-utilisation accounting on hand-computed cases, the latency
statistics, and a --quick run of the whole script (tiny model, all three systems, plots)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts/benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_under_test"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_utilisation_constant_state(bench):
    # 10 of 20 slots hold tokens from t=1 to t=3; before that the state ramps up from empty.
    m = bench.KVMeter(0.0)
    m.sample(1.0, 10, 20, 40)
    m.sample(3.0, 10, 20, 40)
    # tokens: 0.5*10*1 + 10*2 = 25; allocated: 0.5*20*1 + 20*2 = 50; budget: 40*3 = 120
    assert m.utilisation() == pytest.approx(0.5)
    assert m.budget_utilisation() == pytest.approx(25 / 120)


def test_utilisation_trapezoid_and_release(bench):
    # A sequence grows from 16 to 48 cached tokens in blocks of 16 slots; then is freed.
    m = bench.KVMeter(10.0)
    m.sample(10.0, 16, 16, 64, running=1)  # zero-length first interval
    m.sample(12.0, 48, 48, 64, running=1)  # fully used blocks: exactly 100%
    assert m.utilisation() == pytest.approx(1.0)
    m.sample(13.0, 0, 0, 64, running=0)
    # tokens: (16+48)/2*2 + 48/2*1 = 64 + 24 = 88; allocated: the same.
    assert m.utilisation() == pytest.approx(1.0)
    m.sample(14.0, 10, 32, 64, running=2)
    # +(0+10)/2 tokens, +(0+32)/2 slots
    assert m.utilisation() == pytest.approx((88 + 5) / (88 + 16))
    assert m.peak_running == 2
    assert m.budget_utilisation() == pytest.approx(93 / (64 * 4))


def test_utilisation_contiguous_reservation(bench):
    # Two sequences each reserve max_model_len = 100 slots; 30 and 10 tokens cached, then the
    # short one finishes (its row stays reserved, its tokens no longer count).
    m = bench.KVMeter(0.0)
    m.sample(0.0, 40, 200, 200)
    m.sample(1.0, 40, 200, 200)
    m.sample(2.0, 31, 200, 200)
    assert m.utilisation() == pytest.approx((40 + (40 + 31) / 2) / 400)


def test_utilisation_nothing_allocated(bench):
    m = bench.KVMeter(0.0)
    assert m.utilisation() is None and m.budget_utilisation() is None
    m.sample(1.0, 0, 0, 0)
    assert m.utilisation() is None


def test_paged_meter_sees_only_the_partial_last_blocks(bench, tiny_llama):
    """Driving the paged engine (chunked prefills, decode loops finishing sequences in the
    middle, a pool tight enough to make arrivals wait), every sample of the meter holds each
    running sequence's written tokens and, beyond them, less than one block per sequence."""
    from bench_support.workloads import Request  # on the path once `bench` is loaded

    import models

    loaded = models.load(str(tiny_llama[0]))
    args = SimpleNamespace(
        max_model_len=128,
        max_num_batched_tokens=32,
        max_decode_steps=8,
        no_prefix_caching=True,
        async_scheduling=False,
        precompile=False,
    )
    system = bench.PagedSystem(loaded, 24 * 8, 8, args, max_num_seqs=6)
    seen = []
    allocated = system.allocated

    def record():
        slots = allocated()
        seen.append((slots, system.held_tokens(), len(system.engine.scheduler.running)))
        return slots

    system.allocated = record
    rng = np.random.default_rng(0)
    reqs = [
        Request(rng.integers(3, 200, int(p)).tolist(), int(o))
        for p, o in zip(rng.integers(5, 40, 10), rng.integers(1, 30, 10), strict=True)
    ]
    run = bench.drive(system, reqs)
    assert run["output_tokens"] == sum(r.max_tokens for r in reqs)
    assert any(n < 10 for *_, n in seen) and any(t > 0 for _, t, _ in seen)
    for slots, tokens, n in seen:
        assert 0 <= slots - tokens < 8 * max(n, 1), (slots, tokens, n)


def test_latency_stats(bench):
    run = dict(
        arrival_at={"a": 0.0, "b": 1.0},
        # a: first token at 0.5, then 2 more at 1.5 (one step made both), then 1 at 2.0
        # b: a single token at 1.25
        times={"a": [(0.5, 1), (1.5, 3), (2.0, 4)], "b": [(1.25, 1)]},
    )
    s = bench.latency_stats(run)
    assert s["ttft_ms"]["mean"] == pytest.approx((500 + 250) / 2)
    assert s["tpot_ms"]["mean"] == pytest.approx(1500 / 3)
    assert s["itl_ms"]["mean"] == pytest.approx((500 + 500 + 500) / 3)
    assert s["itl_ms"]["p50"] == pytest.approx(500)


def test_gpu_mode_says_no_gpu(bench, capsys):
    if bench.jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    res = bench.run(["--gpu"])
    assert "needs a CUDA GPU" in res["skipped"]


@pytest.mark.slow
def test_quick_run(bench, capsys, tmp_path):
    out_json = tmp_path / "res.json"
    rc = bench.main(["--quick", "--plots", str(tmp_path / "plots"), "--output", str(out_json)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads(out_json.read_text()) == res
    assert len(res["run"]["commit"]) == 40 and res["run"]["machine"]["cpu_model"]
    w = res["workload"]
    assert w["name"] == "sharegpt" and w["num_requests"] == 12
    off = res["offline"]
    assert set(off["systems"]) == {"paged", "contiguous", "hf"}
    # Same weights, same ids, greedy: every system makes the same tokens.
    assert off["tokens_match_rate"] == {"paged": 1.0, "contiguous": 1.0, "hf": 1.0}
    for name, row in off["systems"].items():
        for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            assert row[k] > 0, (name, k)
        assert row["total_tokens_per_s"] > row["output_tokens_per_s"]
        assert row["compile_seconds_in_timed_runs"] == 0
        assert 0 < row["share_of_matmul_peak"] < 1
    for name in ("paged", "contiguous"):
        row = off["systems"][name]
        assert 0 < row["kv_utilisation"] <= 1.0
        assert 0 < row["kv_budget_utilisation"] <= row["kv_utilisation"]
        assert row["compile_seconds"] > 0 and row["compiled_variants"] > 0
        assert row["kv_budget_tokens"] <= off["kv_budget_tokens"]
    assert off["systems"]["contiguous"]["rows"] == 8
    assert off["systems"]["contiguous"]["peak_running"] == 8
    assert off["systems"]["paged"]["peak_running"] > 8  # paging admits more at the same budget
    assert (
        off["systems"]["paged"]["kv_utilisation"] > off["systems"]["contiguous"]["kv_utilisation"]
    )
    assert off["paged_over_contiguous"] > 0 and off["paged_over_hf"] > 0
    assert set(res["goals"]) == {
        "paged_kv_utilisation_at_least_96pct",
        "paged_over_contiguous_at_least_2_5",
        "paged_over_hf_at_least_1_8",
    }
    for p in res["plots"]:
        assert Path(p).stat().st_size > 1000
    assert {Path(p).name for p in res["plots"]} == {
        "benchmark_throughput.png",
        "benchmark_kv_utilisation.png",
    }
