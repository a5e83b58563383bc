"""scripts/bench_decode.py at its smallest on a tiny HF Llama: the JSON's keys, positive
throughputs, HF and jax-paged agreeing on the first greedy tokens; and the weight copy to HF
reading per-layer and stacked layer parameters alike."""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "scripts/bench_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_decode_quick(tiny_llama, capsys):
    path, _ = tiny_llama
    bench = _load_script()
    assert bench.main(["--quick", f"--model={path}"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in (
        "results",
        "best_paged",
        "best_hf",
        "best_paged_over_best_hf",
        "hf_matches_first_tokens",
        "goals",
        "max_program_compile_seconds",
        "total_seconds",
    ):
        assert key in res, key
    assert res["batch_sizes"] == [4] and res["max_tokens"] == 8 and res["repeats"] == 1
    run = res["run"]  # what the figures came from: commit, machine (with its bandwidth), versions
    assert len(run["commit"]) == 40 and run["versions"]["jax"] and run["machine"]["cpu_count"]
    assert run["machine"]["memory_bandwidth_gb_s"] == pytest.approx(
        res["read_bandwidth_gb_s"], abs=0.01
    )
    assert res["pools"] == ["64_blocks", "64MiB"]
    assert 20 <= res["prompt_words"][0] <= res["prompt_words"][1] <= 60
    assert res["hf_matches_first_tokens"] is True
    row = res["results"]["4"]
    assert row["paged_pools_agree"]
    assert row["hf_batch_first_tokens_match_rate"] == 1.0
    for pool in res["pools"]:
        p = row["paged"][pool]
        assert p["output_tokens_per_s"] > 0
        assert p["output_tokens_per_run"] == 4 * 8
        assert p["holds_batch"] and p["preemptions_in_timed_runs"] == 0
        assert p["compile_seconds"] > 0 and p["compiled_variants"] > 0
        assert p["compile_seconds_in_timed_runs"] == 0
    assert row["paged"]["64_blocks"]["num_kv_blocks"] == max(64, row["blocks_needed"])
    for v in (
        row["paged_tokens_per_s"],
        row["dense_bound"]["tokens_per_s"],
        row["paged_share_of_bound"],
        row["hf"]["output_tokens_per_s"],
        row["paged_over_hf"],
        res["best_paged_over_best_hf"],
    ):
        assert v > 0
    assert row["pool_spread"] >= 0
    # One repeat: the paired (within-repeat) figures are that repeat's own ratios.
    slowest = min(row["paged"][pool]["runs_tokens_per_s"][0] for pool in res["pools"])
    fastest = max(row["paged"][pool]["runs_tokens_per_s"][0] for pool in res["pools"])
    assert row["paired"]["pool_spread"] == pytest.approx(fastest / slowest - 1, abs=1e-3)
    steps = row["pool_steps"]
    assert steps["rounds"] == 2 and sorted(steps["pools"]) == sorted(res["pools"])
    for pool in res["pools"]:
        s = steps["pools"][pool]
        assert s["num_kv_blocks"] >= row["paged"][pool]["num_kv_blocks"]
        assert len(s["runs_step_seconds"]) == 2 and s["step_seconds"] > 0
    medians = [s["step_seconds"] for s in steps["pools"].values()]
    assert steps["spread"] == pytest.approx(max(medians) / min(medians) - 1)
    assert res["goals"]["pool_step_spread_under_5pct"] == (steps["spread"] < 0.05)
    ratios = [  # from the runs as reported, rounded to 1 us
        statistics.median(
            a / b
            for a, b in zip(
                s["runs_step_seconds"],
                steps["pools"][res["pools"][0]]["runs_step_seconds"],
                strict=True,
            )
        )
        for s in steps["pools"].values()
    ]
    assert steps["paired_spread"] == pytest.approx(max(ratios) / min(ratios) - 1, abs=0.01)
    assert res["goals"]["paired_pool_step_spread_under_5pct"] == (steps["paired_spread"] < 0.05)
    assert res["goals"]["paired_pool_spread_under_5pct"] == (row["paired"]["pool_spread"] < 0.05)
    dense = steps["runs_dense_bound_step_seconds"]
    assert len(dense) == 2 and steps["dense_bound_step_seconds"] > 0
    slow = [max(steps["pools"][p]["runs_step_seconds"][r] for p in res["pools"]) for r in (0, 1)]
    want = sorted(dense[r] / slow[r] for r in (0, 1))
    assert steps["paired_share_of_bound"] == pytest.approx(sum(want) / 2, rel=0.05)  # rounded runs
    # The K/V the decode steps must read, priced at the measured bandwidth, added to the bound.
    assert res["read_bandwidth_gb_s"] > 0 and len(steps["kv_read_floor_seconds"]) == 2
    floor = steps["kv_read_floor_seconds"]
    assert 0 < floor[0] < floor[1]  # round 2 reads longer contexts
    want = sorted((dense[r] + floor[r]) / slow[r] for r in (0, 1))
    assert steps["paired_share_of_bound_with_kv_read"] == pytest.approx(sum(want) / 2, rel=0.05)
    # The native kernel's one-time build is reported apart from the programs' compile times.
    native = res["native_cpu_kernel"]
    assert native["available"] and native["build_error"] is None
    assert isinstance(native["was_cached"], bool) and native["seconds"] >= 0
    hf_run = row["hf"]["runs_tokens_per_s"][0]
    assert row["paired"]["paged_over_hf"] == pytest.approx(slowest / hf_run, rel=1e-3)


def test_paired_spread_cancels_drift_and_averages_noise():
    """Three alike pools over 41 rounds whose speed drifts 2x, each pool with its own 5% noise:
    the paired spread stays small where the naive figure (median over rounds of each round's
    max / min - 1) is several times larger; a real 10% difference shows as about 10%."""
    bench = _load_script()
    rng = np.random.default_rng(0)
    drift = rng.uniform(1.0, 2.0, 41)
    alike = {n: list(drift * rng.normal(1.0, 0.05, 41)) for n in "abc"}
    old = statistics.median(
        max(v[r] for v in alike.values()) / min(v[r] for v in alike.values()) - 1 for r in range(41)
    )
    assert bench.paired_spread(alike) < 0.05 < 0.07 < old
    assert max(max(v) / min(v) for v in alike.values()) > 1.5  # the drift the pairing cancels
    slower = {"a": alike["a"], "b": [1.1 * x for x in alike["a"]], "c": alike["a"]}
    assert bench.paired_spread(slower) == pytest.approx(0.1)


def test_kv_bytes_per_step_counts_windows():
    bench = _load_script()
    from models.config import ModelConfig

    kw = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_heads=4, head_dim=2)
    full = ModelConfig(model_type="llama", num_layers=2, num_kv_heads=2, **kw)
    ctx = np.array([3, 10])
    # 2 layers x 13 keys x (K and V) x 2 KV heads x 2 dims x 4 bytes
    assert bench.kv_bytes_per_step(full, ctx, 4) == 2 * 13 * 2 * 2 * 2 * 4
    windowed = ModelConfig(
        model_type="llama", num_layers=2, num_kv_heads=2, layer_windows=[4, None], **kw
    )
    assert bench.kv_bytes_per_step(windowed, ctx, 2) == (3 + 4 + 13) * 2 * 2 * 2 * 2


def test_hf_tensors_per_layer_and_stacked_agree():
    from flax import nnx

    import models

    bench = _load_script()
    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
    )
    flat = bench._flat_params(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    is_idx = bench._is_index
    # Whichever form the model has today, build the other one from it.
    if any(p[0] == "layers" and any(is_idx(x) for x in p[1:]) for p, _ in flat):
        groups, other = defaultdict(dict), []
        for p, a in flat:
            if p[0] == "layers":
                i = next(k for k, x in enumerate(p) if is_idx(x))
                groups[p[:i] + p[i + 1 :]][int(p[i])] = np.asarray(a)
            else:
                other.append((p, a))
        other += [(p, np.stack([g[i] for i in range(3)])) for p, g in groups.items()]
    else:
        other = []
        for p, a in flat:
            if p[0] == "layers":
                other += [(("layers", i, *p[1:]), np.asarray(a)[i]) for i in range(3)]
            else:
                other.append((p, a))
    a, b = bench.hf_tensors(flat, 3), bench.hf_tensors(other, 3)
    assert sorted(a) == sorted(b)
    assert "model.layers.2.self_attn.q_proj.weight" in a
    assert a["model.layers.1.mlp.down_proj.weight"].shape == (16, 24)  # HF's [out, in]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
