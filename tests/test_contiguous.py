"""The contiguous-cache baseline engine (`bench_support.contiguous`) against HF transformers' greedy
decoding on a tiny random Llama, and its static-batch bookkeeping.

The oracle is HF transformers (torch, CPU): these tests fail, not skip, when it is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from bench_support.contiguous import ContiguousEngine, kv_bytes_per_token
from conftest import hf_greedy

import models
from jax_paged import SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def workload(tiny_llama):
    """12 prompts of mixed lengths and max_tokens with HF's greedy continuations (EOS id 2
    stops them, as in HF)."""
    _, model = tiny_llama
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist() for _ in range(12)]
    max_tokens = [int(x) for x in rng.integers(1, 40, size=12)]
    ref = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    return prompts, max_tokens, ref


def _run(eng, prompts, max_tokens, **kw):
    params = [SamplingParams(temperature=0.0, max_tokens=m, **kw) for m in max_tokens]
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("rows,steps", [(3, 8), (8, 32), (1, 1)])
def test_greedy_matches_hf(tiny_llama, workload, rows, steps):
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    loaded = models.load(str(path))
    eng = ContiguousEngine(
        loaded, max_model_len=96, num_kv_slots=96 * rows + 50, max_decode_steps=steps
    )
    assert eng.num_rows == rows
    got, outs = _run(eng, prompts, max_tokens)
    assert got == ref
    for o, g, m in zip(outs, got, max_tokens, strict=True):
        assert o.finished
        reason = o.outputs[0].finish_reason
        assert reason == ("stop" if len(g) < m else "length") or (g[-1] == 2 and reason == "stop")
    m = eng.get_metrics()
    assert m["num_batches"] == -(-len(prompts) // rows)
    assert m["peak_running"] == rows
    assert m["num_finished"] == len(prompts)
    assert not eng.has_unfinished_requests()
    assert eng.kv_stats()["reserved"] == 0


def test_ignore_eos_forces_lengths_and_matches_hf(tiny_llama, workload):
    path, model = tiny_llama
    prompts, max_tokens, _ = workload
    loaded = models.load(str(path))
    eng = ContiguousEngine(loaded, max_model_len=96, num_kv_slots=96 * 4)
    got, _ = _run(eng, prompts[:6], max_tokens[:6], ignore_eos=True)
    assert [len(g) for g in got] == max_tokens[:6]
    ref = [
        hf_greedy(model, p, m, eos=False) for p, m in zip(prompts[:6], max_tokens[:6], strict=True)
    ]
    assert got == ref


def test_static_batch_waits_for_its_longest_member(tiny_llama):
    path, _ = tiny_llama
    loaded = models.load(str(path))
    eng = ContiguousEngine(loaded, max_model_len=64, num_kv_slots=128, max_decode_steps=4)
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)
    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    eng.add_request("a", [5, 6, 7], p)
    eng.add_request("b", [8, 9], long)
    eng.add_request("c", [10, 11, 12, 13], p)
    seen = []
    while eng.has_unfinished_requests():
        outs = eng.step()
        stats = eng.kv_stats()
        seen.append((sorted(o.request_id for o in outs if o.finished), stats))
    # Batch 1 = a, b: a finishes after its second token but keeps its row reserved until b is
    # done; c waits for the whole batch.
    reserved = [st["reserved"] for _, st in seen]
    assert reserved[0] == 2 * 64
    finished_order = [rid for ids, _ in seen for rid in ids]
    assert finished_order == ["a", "b", "c"]
    b_done = next(i for i, (ids, _) in enumerate(seen) if "b" in ids)
    assert all(r == 2 * 64 for r in reserved[:b_done])
    # While only b runs, one unfinished member: its prompt + tokens whose K/V is cached.
    _, st = seen[1]
    assert st["running"] == 1 and st["tokens"] == 2 + (1 + 4) - 1
    assert eng.get_metrics()["num_batches"] == 2


def test_budget_and_rejections(tiny_llama):
    path, _ = tiny_llama
    loaded = models.load(str(path))
    per_tok = kv_bytes_per_token(loaded.config, loaded.model.dtype)
    assert per_tok == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, f32
    eng = ContiguousEngine(loaded, max_model_len=32, kv_cache_memory_bytes=100 * per_tok)
    assert eng.num_rows == 3 and eng.kv_bytes == 3 * 32 * per_tok
    with pytest.raises(ValueError, match="holds no sequence"):
        ContiguousEngine(loaded, max_model_len=32, num_kv_slots=31)
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("x", [1, 2], SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match="no room"):
        eng.add_request("x", list(range(3, 35)), SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("x", [], SamplingParams(temperature=0.0))
    # max_tokens is cut to what max_model_len leaves.
    out = eng.generate(
        [list(range(3, 30))], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 32 - 27
