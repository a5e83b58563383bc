"""Smoke test of scripts/bench_async_overhead.py: the same requests through `LLM.generate` and
`AsyncLLM` (uncapped and with the decode-call cap) each make every token, and the JSON names
the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_async_overhead.py"


@pytest.mark.slow
def test_quick_run_makes_every_token_in_each_front(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_async_overhead", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out_file = tmp_path / "ao.json"
    # Compiling on first use keeps the smoke test short; the benchmark itself precompiles.
    out = mod.main(["--quick", "--no-precompile", "--output", str(out_file)])
    assert json.loads(out_file.read_text()) == json.loads(json.dumps(out))
    runs = out["runs"]
    assert set(runs) == {"LLM.generate", "AsyncLLM no cap", "AsyncLLM max_decode_wait_ms=50"}
    for name, r in runs.items():
        assert r["generated_tokens"] == 8 * 32, name  # --quick: 8 prompts x 32 tokens
        assert r["wall_s"] > 0 and r["num_device_calls"] >= 1, name
        assert r["compile_seconds"] >= 0 and r["compiled_variants"] >= 0, name
        # How many steps a front takes depends on when its requests reach the engine loop (and,
        # with --no-precompile, on compiles), so no ordering between the fronts is asserted.
        assert r["num_steps"] >= 1, name
    assert len(out["run"]["commit"]) == 40 and out["run"]["machine"]["memory_bandwidth_gb_s"] > 0
