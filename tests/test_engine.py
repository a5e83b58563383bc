"""The engine end to end on a tiny random HF Llama, against HF transformers' greedy decoding.

The oracle is HF transformers (torch, CPU): these tests fail, not skip, when it is missing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_greedy

from jax_paged import LLM, SamplingParams
from jax_paged.memory import block_manager as bm

VOCAB = 256


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def workload(tiny_llama):
    """20 prompts of mixed lengths and max_tokens, with HF's greedy continuations."""
    _, model = tiny_llama
    prompts = _prompts(20)
    rng = np.random.default_rng(1)
    max_tokens = [int(x) for x in rng.integers(1, 24, size=20)]
    ref = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    return prompts, max_tokens, ref


@pytest.fixture(scope="module")
def shared_llm(tiny_llama):
    """One engine for the tests that need no configuration of their own: 128 blocks of 4
    tokens, 8 sequences, prefill in chunks of 8 tokens. Each test leaves its pool empty."""
    path, _ = tiny_llama
    return LLM(str(path), num_kv_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)


def _generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _assert_pool_empty(llm):
    """Every block is back in the pool and the device state is consistent."""
    engine = llm.engine
    state = engine.state.blocks
    bm.check_invariants(state, window_drops=engine.runner.opts.drop_window is not None)
    assert int(bm.num_free_blocks(state)) == engine.num_blocks - 1
    assert not bool(np.asarray(state.live).any())
    assert engine.scheduler.num_free_blocks == engine.num_blocks - 1


def test_greedy_matches_hf_under_preemption(tiny_llama, workload):
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    # 24 blocks of 4 tokens: far less than 8 sequences of up to 62 tokens need.
    llm = LLM(str(path), num_kv_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    got = _generate(llm, prompts, max_tokens)
    assert got == ref
    assert llm.get_metrics()["num_preemptions"] > 0
    _assert_pool_empty(llm)


def test_greedy_matches_hf_alone_and_tiny_chunks(tiny_llama, workload):
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    # One request at a time, prefill in chunks of 3 tokens, one decode step per host call.
    llm = LLM(
        str(path),
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=1,
        max_num_batched_tokens=3,
        max_decode_steps=1,
    )
    got = _generate(llm, prompts[:8], max_tokens[:8])
    assert got == ref[:8]
    assert llm.get_metrics()["num_preemptions"] == 0
    _assert_pool_empty(llm)


def test_chunked_prefill_with_decodes_mixed(tiny_llama, workload):
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    llm = LLM(str(path), num_kv_blocks=200, block_size=8, max_num_seqs=4, max_num_batched_tokens=5)
    got = _generate(llm, prompts, max_tokens)
    assert got == ref
    _assert_pool_empty(llm)


def test_abort_and_streaming_steps(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_seqs=4, max_decode_steps=4)
    engine = llm.engine
    prompts = _prompts(4, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=20))
    seen = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for o in outs:
            seen.setdefault(o.request_id, []).append(len(o.outputs[0].token_ids))
        if steps == 2:
            assert engine.abort("r1") and not engine.abort("r1")
    assert "r1" not in seen or len(seen["r1"]) <= 2
    for rid in ("r0", "r2", "r3"):
        assert seen[rid] == sorted(seen[rid]) and seen[rid][-1] == 20 or seen[rid][-1] < 20
    _assert_pool_empty(llm)


def test_seeded_sampling_reproducible_across_batches(shared_llm):
    llm = shared_llm
    prompts = _prompts(6, seed=5)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, sp)[0].outputs[0].token_ids
    other = [SamplingParams(temperature=0.7, max_tokens=5 + i) for i in range(5)]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[1:4]]
        + [{"prompt_token_ids": prompts[0]}]
        + [{"prompt_token_ids": p} for p in prompts[4:]],
        other[:3] + [sp] + other[3:],
    )
    assert mixed[3].outputs[0].token_ids == alone
    again = llm.generate({"prompt_token_ids": prompts[0]}, sp)[0].outputs[0].token_ids
    assert again == alone
    different = (
        llm.generate(
            {"prompt_token_ids": prompts[0]},
            SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone
    _assert_pool_empty(llm)


def test_n_samples_differ_and_are_reproducible(shared_llm):
    llm = shared_llm
    p = {"prompt_token_ids": _prompts(1, seed=9)[0]}
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    a = [c.token_ids for c in llm.generate(p, sp)[0].outputs]
    b = [c.token_ids for c in llm.generate(p, sp)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) == 3
    _assert_pool_empty(llm)


def test_stop_tokens_logprobs_and_finish_reasons(tiny_llama, workload, shared_llm):
    _, model = tiny_llama
    prompts, _, _ = workload
    llm = shared_llm
    ref = hf_greedy(model, prompts[0], 12)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    out = llm.generate(
        {"prompt_token_ids": prompts[0]},
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], logprobs=3),
    )[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert len(out.logprobs) == len(out.token_ids)
    for t, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert t in lp and lp[t].rank == 1  # greedy: the chosen token is the most likely
        assert len(lp) == 3
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)), rel=1e-5
    )
    # ignore_eos with min_tokens: runs to max_tokens.
    out = llm.generate(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    )[0].outputs[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    assert out.cumulative_logprob is None and out.logprobs is None  # not asked: not computed
    # logprobs=0: the sampled tokens' own log-probs (one entry each), summed as with top-3.
    own = llm.generate(
        [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}],
        [SamplingParams(temperature=0, max_tokens=5, logprobs=0), SamplingParams(max_tokens=5)],
    )
    first = own[0].outputs[0]
    assert [list(lp) for lp in first.logprobs] == [[t] for t in first.token_ids]
    assert first.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(first.token_ids, first.logprobs, strict=True)), rel=1e-5
    )
    assert first.cumulative_logprob < 0 and own[1].outputs[0].cumulative_logprob is None
    _assert_pool_empty(llm)


def test_prompt_logprobs_match_hf(tiny_llama, shared_llm):
    _, model = tiny_llama
    llm = shared_llm  # prefill in chunks of 8: the 20-token prompt's log-probs span 3 chunks
    prompt = _prompts(1, seed=11, lo=20, hi=21)[0]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2)
    )[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    ref = torch.log_softmax(logits, -1).numpy()
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        assert plp[i][prompt[i]].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert len(plp[i]) in (2, 3)
    _assert_pool_empty(llm)


def test_bad_requests_get_errors_and_others_complete(tiny_llama, workload):
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    # 11 usable blocks of 4 tokens: 44 tokens, less than max_model_len.
    llm = LLM(str(path), num_kv_blocks=12, block_size=4, max_num_seqs=4, max_model_len=64)
    g = min(range(len(prompts)), key=lambda i: len(prompts[i]) + max_tokens[i])
    good = {"prompt_token_ids": prompts[g]}
    bad_prompts = [
        ({"prompt_token_ids": []}, None, "empty"),
        ({"prompt_token_ids": list(range(3, 70))}, None, "max_model_len"),
        ({"prompt_token_ids": [5, VOCAB]}, None, "out of range"),
        ({"prompt_token_ids": [5, -1]}, None, "out of range"),
        ({"prompt_token_ids": [5, "a"]}, None, "list of integers"),
        ({"prompt_token_ids": prompts[0], "bogus": 1}, None, "unknown keys"),
        ("some text", None, "no tokenizer"),
        (12345, None, "prompt must be"),
        (good, {"max_tokens": 5}, "SamplingParams"),
        ({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=60), "KV blocks"),
        (good, SamplingParams(stop=["x"]), "tokenizer"),
        (good, SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    ]
    inputs = [good] + [b[0] for b in bad_prompts] + [good]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens[g])]
    params += [b[1] if b[1] is not None else SamplingParams(max_tokens=4) for b in bad_prompts]
    params += [SamplingParams(temperature=0, max_tokens=max_tokens[g])]
    outs = llm.generate(inputs, params)
    assert outs[0].outputs[0].token_ids == ref[g] == outs[-1].outputs[0].token_ids
    for o, (_, _, needle) in zip(outs[1:-1], bad_prompts, strict=True):
        assert o.error is not None and needle in o.error, (needle, o.error)
        assert o.finished and o.outputs == []
    _assert_pool_empty(llm)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_engine_config(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(path), block_size=0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(str(path), num_kv_blocks=1)
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        LLM(str(path), max_num_sequences=4)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(path), dtype="float8")
    with pytest.raises(MemoryError, match="GiB"):
        LLM(str(path), kv_cache_memory_bytes=1 << 50)


def test_research_scan_decode_matches_hf(tiny_llama, workload):
    """The pure API: prefill, then 16 decode steps in a user's jit(lax.scan)."""
    import jax
    import jax.numpy as jnp

    import models
    from jax_paged.entrypoints.research import PagedDecoder

    path, _ = tiny_llama
    prompts, _, _ = workload
    loaded = models.load(str(path))
    _, hf = tiny_llama
    batch = prompts[:4]
    ref = [hf_greedy(hf, p, 17) for p in batch]
    dec = PagedDecoder(loaded.model, max_seqs=4, max_len=64, block_size=4)
    state = dec.init(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100))
    lens = np.array([len(p) for p in batch], np.int32)
    padded = np.zeros((4, lens.max()), np.int32)
    for i, p in enumerate(batch):
        padded[i, : len(p)] = p
    state, first = jax.jit(dec.prefill)(dec.params, state, jnp.asarray(padded), lens)

    @jax.jit
    def run(params, state):
        return jax.lax.scan(lambda s, _: dec.decode_step(params, s), state, None, length=16)

    state, toks = run(dec.params, state)
    got = np.concatenate([np.asarray(first)[None], np.asarray(toks)], axis=0).T.tolist()
    # HF stops at EOS (id 2); compare up to and including it.
    for g, r in zip(got, ref, strict=True):
        assert g[: len(r)] == r
    state = dec.release(state)
    assert int(bm.num_free_blocks(state.device.blocks)) == dec.num_blocks - 1


@pytest.mark.parametrize(
    "family",
    [
        "llama3_gqa4",
        # The fast tier's engines also run qwen2_tied (test_beam_search) and every family's
        # dense greedy tokens meet HF's (test_models_hf).
        pytest.param("llama_mha_tied_bias", marks=pytest.mark.slow),
        "mistral_window",
        pytest.param("qwen2_tied", marks=pytest.mark.slow),
        "qwen3_qknorm",
    ],
)
def test_engine_greedy_matches_hf_per_family(tiny_hf, family):
    """Every model family through the paged engine (block size 4, chunked prefill of 8 tokens,
    the Mistral prompts longer than its window of 8) equals HF's greedy tokens."""
    hf, folder = tiny_hf(family)
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (3, 11, 19)]
    llm = LLM(str(folder), num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    got = _generate(llm, prompts, [12, 12, 12])
    ref = [hf_greedy(hf, p, 12) for p in prompts]
    assert got == ref
    _assert_pool_empty(llm)


def test_bfloat16_kv_cache(tiny_llama, workload):
    """kv_cache_dtype="bfloat16" under a float32 model: twice the blocks in the same bytes, the
    same tokens from the native kernel and the reference over that cache, and HF's float32
    greedy tokens wherever K/V rounding does not tip a near tie (most of them)."""
    path, _ = tiny_llama
    prompts, max_tokens, ref = workload
    kw = dict(kv_cache_memory_bytes=1 << 20, block_size=4, max_num_seqs=8)
    f32 = LLM(str(path), **kw)
    bf16 = LLM(str(path), kv_cache_dtype="bfloat16", **kw)
    assert bf16.engine.num_blocks in (2 * f32.engine.num_blocks, 2 * f32.engine.num_blocks + 1)
    assert bf16.engine.state.kv.k.dtype == jnp.bfloat16
    got = _generate(bf16, prompts, max_tokens)
    oracle = LLM(str(path), kv_cache_dtype="bfloat16", attention_impl="reference", **kw)
    assert got == _generate(oracle, prompts, max_tokens)
    same = sum(g == r for g, r in zip(got, ref, strict=True))
    assert same >= 0.8 * len(ref), f"{same} of {len(ref)} requests match HF"
    _assert_pool_empty(bf16)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' must be one of"):
        LLM(str(path), kv_cache_dtype="fp8", **kw)
