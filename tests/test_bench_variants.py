"""Smoke test of scripts/bench_variants.py: a short mixed run finishes every request and stays
within the compiled-variant goal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_variants.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_mixed_run_stays_within_the_variant_goal():
    mod = _load()
    args = ["--num-requests", "80", "--max-num-seqs", "16", "--mean-prompt", "60"]
    out = mod.run(args + ["--max-num-batched-tokens", "128"])
    assert out["finished"] == 80 and out["output_tokens"] > 80
    assert len(out["run"]["commit"]) == 40
    assert out["compiled_variants"] == len(out["compile_seconds_by_program"])
    assert out["goal_met"] and out["unplanned_variants"] == [], out["compile_seconds_by_program"]
    assert out["compiled_variants"] <= out["planned_variants"]
    kinds = {name.split("(")[0] for name in out["compile_seconds_by_program"]}
    assert {"decode", "mixed"} <= kinds
    assert out["max_num_batched_tokens"] == 128


def test_workload_is_mixed_and_seeded():
    mod = _load()
    a = mod.make_workload(200, 512, 100.0, 30.0, seed=1)
    b = mod.make_workload(200, 512, 100.0, 30.0, seed=1)
    assert [p for p, _ in a] == [p for p, _ in b]
    params = [sp for _, sp in a]
    assert any(sp.temperature == 0 for sp in params) and any(sp.temperature > 0 for sp in params)
    assert any(sp.logprobs for sp in params) and any(sp.n == 2 for sp in params)
    lens = [len(p) for p, _ in a]
    assert min(lens) >= 1 and max(lens) <= 1024 and max(lens) > 4 * min(lens)
