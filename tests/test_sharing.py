"""Sharing KV blocks in the engine: prefix caching, n > 1 forks, copy-on-write, preemption.

Oracles: HF transformers' greedy continuations, and the same engine with caching off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from jax_paged import LLM, SamplingParams
from jax_paged.memory import block_manager as bm

BS = 4


def _shared_prefix_prompts(seed=0):
    """Prompts sharing system prompts that end on a block boundary, one past it, and inside."""
    rng = np.random.default_rng(seed)
    prompts = []
    for sys_len in (2 * BS, 2 * BS + 1, 3 * BS - 1, 5 * BS):
        system = rng.integers(3, 256, size=sys_len).tolist()
        for _ in range(3):
            prompts.append(system + rng.integers(3, 256, size=int(rng.integers(1, 7))).tolist())
    return prompts


def _run(llm, prompts, max_tokens=8, **kw):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw),
    )
    return outs


def _check_pool(llm):
    state = llm.engine.state.blocks
    bm.check_invariants(state)
    assert int(bm.num_free_blocks(state)) == llm.engine.num_blocks - 1
    assert not bool(np.asarray(state.live).any())


def test_prefix_caching_on_off_identical_and_hits(tiny_llama):
    path, hf = tiny_llama
    prompts = _shared_prefix_prompts()
    kw = dict(num_kv_blocks=96, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32)
    on = LLM(str(path), enable_prefix_caching=True, **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    got_on = _run(on, prompts)
    got_off = _run(off, prompts)
    ref = [hf_greedy(hf, p, 8) for p in prompts]
    assert [o.outputs[0].token_ids for o in got_off] == ref
    assert [o.outputs[0].token_ids for o in got_on] == ref
    # Later requests of each group find the system prompt's full blocks in the cache.
    cached = [o.num_cached_tokens for o in got_on]
    assert all(c % BS == 0 for c in cached)
    assert sum(cached) > 0 and all(o.num_cached_tokens == 0 for o in got_off)
    m = on.get_metrics()
    assert 0 < m["prefix_cache_hit_rate"] < 1 and off.get_metrics()["prefix_cache_hit_rate"] == 0
    # A second pass over the same prompts finds at least each system prompt's full blocks (a
    # request that computed its own copy of an already cached block leaves its later blocks
    # uncached: the block manager keeps one copy of each content).
    again = _run(on, prompts)
    assert [o.outputs[0].token_ids for o in again] == ref
    for p, o in zip(prompts, again, strict=True):
        assert 2 * BS <= o.num_cached_tokens <= (len(p) - 1) // BS * BS
    assert sum(o.num_cached_tokens for o in again) > sum(cached)
    _check_pool(on)
    _check_pool(off)


def test_prompt_logprobs_correct_with_cached_prefix(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(str(path), num_kv_blocks=64, block_size=BS, max_num_seqs=4)
    prompt = _shared_prefix_prompts(seed=3)[-1]
    _run(llm, [prompt], max_tokens=2)  # now the prompt's blocks are cached
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1)
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i][prompt[i]].logprob
        assert got == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
    _check_pool(llm)


def test_parallel_sampling_shares_prefill_and_stays_consistent(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), num_kv_blocks=128, block_size=BS, max_num_seqs=8, max_decode_steps=4)
    engine = llm.engine
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 256, size=4 * BS + 2).tolist()  # a partial last block to share
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt}, sp)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final = o
        bm.check_invariants(engine.state.blocks)  # after every step
    samples = [c.token_ids for c in final.outputs]
    assert len({tuple(s) for s in samples}) == 4 and all(len(s) == 10 for s in samples)
    # Reproducible: the same request again gives the same four samples.
    again = llm.generate({"prompt_token_ids": prompt}, sp)[0]
    assert [c.token_ids for c in again.outputs] == samples
    assert llm.get_metrics()["kv_sharing_saving"] > 0.2
    _check_pool(llm)


def test_n_greedy_samples_equal_hf_under_preemption(tiny_llama):
    """n=3 greedy: every sample is HF's greedy continuation, even when the pool is so small that
    forked sequences get preempted and recomputed."""
    path, hf = tiny_llama
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=int(rng.integers(5, 14))).tolist() for _ in range(4)]
    for caching in (True, False):
        llm = LLM(
            str(path),
            num_kv_blocks=20,
            block_size=BS,
            max_num_seqs=6,
            max_num_batched_tokens=16,
            enable_prefix_caching=caching,
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True),
        )
        for p, o in zip(prompts, outs, strict=True):
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=20,
                do_sample=False,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            assert [c.token_ids for c in o.outputs] == [ref] * 3
        assert llm.get_metrics()["num_preemptions"] > 0
        _check_pool(llm)


def test_abort_before_fork_returns_everything(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), num_kv_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=4)
    engine = llm.engine
    prompt = list(range(3, 3 + 3 * BS + 1))
    engine.add_request("x", {"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=4))
    engine.add_request("y", {"prompt_token_ids": prompt[:5]}, SamplingParams(max_tokens=4))
    engine.step()  # x is mid-prefill (4-token budget), its siblings not forked yet
    assert engine.abort("x")
    while engine.has_unfinished_requests():
        engine.step()
    _check_pool(llm)


def test_blocks_filled_inside_the_decode_loop_are_cached_as_they_fill(tiny_llama):
    """A prompt made of a running request's prompt and its first 30 generated tokens (all made
    inside multi-step decode loops) finds those blocks while that request still runs: they
    reached the prefix cache in the step that filled them, and no tokens crossed for it."""
    path, hf = tiny_llama
    llm = LLM(
        str(path),
        enable_prefix_caching=True,
        num_kv_blocks=64,
        block_size=BS,
        max_num_seqs=4,
        max_decode_steps=8,
    )
    eng = llm.engine
    first = list(range(3, 3 + 2 * BS + 1))
    eng.add_request("a", {"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=60))
    made: list[int] = []
    while len(made) < 32:
        for o in eng.step():
            made = list(o.outputs[0].token_ids)
    assert eng.requests["a"] and not eng.requests["a"].finished
    assert eng.get_metrics()["decode_loop_tokens"] >= 24
    probe = first + made[:30]
    eng.add_request("b", {"prompt_token_ids": probe}, SamplingParams(temperature=0, max_tokens=4))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["b"].num_cached_tokens == (len(probe) - 1) // BS * BS
    assert list(outs["b"].outputs[0].token_ids) == hf_greedy(hf, probe, 4)
    assert list(outs["a"].outputs[0].token_ids) == hf_greedy(hf, first, 60)
    _check_pool(llm)
