"""The engine under failure: no request outlives its call, a failing device step fails only its
own requests and the engine keeps serving, limits on n, the rejection counter."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_greedy

from jax_paged import LLM, BeamSearchParams, SamplingParams
from jax_paged.memory import block_manager as bm

VOCAB = 256


def _prompts(n, seed=0, lo=2, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _ids(p):
    return {"prompt_token_ids": p}


def _assert_clean(llm):
    """No request left, every block free or evictable, the block manager consistent."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.requests == {}
    state = engine.state.blocks
    bm.check_invariants(state)
    assert not bool(np.asarray(state.live).any())
    assert int(bm.num_free_blocks(state)) == engine.num_blocks - 1
    assert engine.scheduler.num_free_blocks == engine.num_blocks - 1


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    return LLM(str(path), num_kv_blocks=40, block_size=4, max_num_seqs=4, max_n=8)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of 6 prompts, run with no fault."""
    prompts = _prompts(6)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([_ids(p) for p in prompts], sp)
    return prompts, sp, [o.outputs[0].token_ids for o in outs]


def test_unexpected_add_failure_is_that_prompts_error_and_leaves_no_orphans(llm, monkeypatch):
    engine = llm.engine
    real = engine.add_request

    def add(rid, prompt, params=None):
        if prompt == _ids([7, 7, 7]):
            raise TypeError("TextInputSequence must be str")
        return real(rid, prompt, params)

    monkeypatch.setattr(engine, "add_request", add)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([_ids([5, 6, 7]), _ids([8, 9]), _ids([7, 7, 7])], sp)
    assert [len(o.outputs[0].token_ids) for o in outs[:2]] == [6, 6]
    assert outs[2].error == "TypeError: TextInputSequence must be str" and not outs[2].outputs
    _assert_clean(llm)
    before = engine.get_metrics()["generated_tokens"]
    later = llm.generate(_ids([10, 11]), SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(later[0].outputs[0].token_ids) == 5
    assert engine.get_metrics()["generated_tokens"] - before == 5


def test_a_call_that_fails_aborts_every_request_it_added(llm, monkeypatch):
    engine = llm.engine
    real_step = engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    aborted = engine.get_metrics()["num_aborted"]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([_ids(p) for p in _prompts(5, seed=3)], sp)
    assert engine.get_metrics()["num_aborted"] - aborted == 5
    monkeypatch.undo()
    engine.step()  # frees the aborted slots on the device
    _assert_clean(llm)


def test_iter_generate_stopped_early_aborts_the_rest(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [_ids(p) for p in _prompts(5, seed=4)]
    it = llm.iter_generate(prompts + [_ids([VOCAB + 5])], sp)
    i, first = next(it)  # the rejected prompt comes back first
    assert i == 5 and "out of range" in first.error
    i, out = next(it)
    assert out.finished and len(out.outputs[0].token_ids) == 8
    it.close()
    assert llm.engine.requests == {}
    llm.engine.step()
    _assert_clean(llm)


def _inject_fault(monkeypatch, engine, kind: str, nth: int):
    """The ``nth`` compiled call of ``kind`` runs (consuming the donated state), then raises."""
    real = engine.runner.wait  # every compiled call ends there
    seen = []

    def wait(launched):
        out = real(launched)
        if launched.kind == kind:
            seen.append(1)
            if len(seen) == nth:
                raise RuntimeError(f"injected fault in {kind}")
        return out

    monkeypatch.setattr(engine.runner, "wait", wait)
    return seen


@pytest.mark.parametrize(("kind", "nth"), [("mixed", 1), ("mixed", 2), ("mixed", 3), ("decode", 1)])
def test_failing_device_step_fails_only_its_requests(llm, reference, monkeypatch, kind, nth):
    prompts, sp, ref = reference
    engine = llm.engine
    failures = engine.get_metrics()["num_step_failures"]
    seen = _inject_fault(monkeypatch, engine, kind, nth)
    outs = llm.generate([_ids(p) for p in prompts], sp)
    assert len(seen) >= nth
    failed = [o for o in outs if o.error is not None]
    assert failed and len(failed) < len(outs)
    for o, r in zip(outs, ref, strict=True):
        if o.error is None:
            assert o.outputs[0].token_ids == r
        else:
            assert f"injected fault in {kind}" in o.error and o.finished
            assert o.outputs[0].finish_reason == "abort"
    m = engine.get_metrics()
    assert m["num_step_failures"] == failures + 1
    monkeypatch.undo()
    _assert_clean(llm)
    again = llm.generate([_ids(p) for p in prompts], sp)  # and it keeps serving
    assert [o.outputs[0].token_ids for o in again] == ref


def test_failing_bookkeeping_call_fails_no_request(llm, reference, monkeypatch):
    """A fault in the call before scheduling (cache, free, fork, prefix lookup) belongs to no
    request: everyone re-prefills and finishes with the same output."""
    prompts, sp, ref = reference
    _inject_fault(monkeypatch, llm.engine, "prepare", 2)
    outs = llm.generate([_ids(p) for p in prompts], sp)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.get_metrics()["num_step_failures"] >= 1
    monkeypatch.undo()
    _assert_clean(llm)


def test_failing_step_with_n_and_beams(llm, monkeypatch):
    engine = llm.engine
    _inject_fault(monkeypatch, engine, "mixed", 2)
    sp = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate([_ids(p) for p in _prompts(3, seed=5)], sp)
    assert any(o.error for o in outs)
    monkeypatch.undo()
    _assert_clean(llm)
    _inject_fault(monkeypatch, engine, "mixed", 2)
    res = llm.beam_search(
        [_ids([5, 6, 7, 8]), _ids([9, 10])], BeamSearchParams(beam_width=2, max_tokens=4)
    )
    assert any(r.error and "injected" in r.error for r in res)
    monkeypatch.undo()
    _assert_clean(llm)


def test_limit_on_n_and_beam_width_and_the_rejection_counter(llm):
    engine = llm.engine
    rejected = engine.get_metrics()["num_rejected"]
    outs = llm.generate(
        [_ids([5, 6]), _ids([]), _ids([5, 6])],
        [SamplingParams(n=9), SamplingParams(), SamplingParams(n=8, max_tokens=2)],
    )
    assert "n=9 is more than max_n=8" in outs[0].error
    assert "empty" in outs[1].error
    assert outs[2].error is None and len(outs[2].outputs) == 8
    assert engine.get_metrics()["num_rejected"] == rejected + 2
    with pytest.raises(ValueError, match="beam_width=9 is more than max_n=8"):
        llm.beam_search([_ids([5, 6])], BeamSearchParams(beam_width=9, max_tokens=4))
    with pytest.raises(ValueError, match="max_n"):
        LLM(llm.engine.loaded, max_n=0)


@pytest.mark.slow  # the fast tier keeps the one-call-per-step test with arrivals
def test_device_calls_per_step(tiny_llama):
    """Admitting 16 requests that hit the prefix cache into an idle engine costs two calls
    (one lookup for all, then the step that takes the hits); a steady decode phase makes one
    call per step."""
    path, _ = tiny_llama
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_seqs=16, max_decode_steps=4)
    engine = llm.engine
    shared = _prompts(1, seed=7, lo=40, hi=41)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(_ids(shared + [3]), sp)  # caches the shared prefix's blocks
    for i in range(16):
        engine.add_request(f"r{i}", _ids(shared + [4 + i, 5]), sp)
    calls = []
    while engine.has_unfinished_requests():
        before = engine.get_metrics()
        engine.step()
        after = engine.get_metrics()
        calls.append(after["num_device_calls"] - before["num_device_calls"])
        if len(calls) == 1:
            assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 16 * 40
    assert calls[0] == 2
    # Then decode only, 4 tokens per call, one call a step (the last adds the idle free).
    assert calls[1:-1] == [1] * (len(calls) - 2) and len(calls) >= 3
    assert calls[-1] == 2
    assert engine.get_metrics()["device_calls_per_step"] > 0


def test_one_device_call_per_step_while_requests_arrive(tiny_llama):
    """A busy engine makes one device call per step while a request arrives every step
    (through `add_request`, as a server adds them): frees, forks of n > 1 requests,
    prefix-cache hits and the lookups that find them all ride in the step's own program."""
    path, model = tiny_llama
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_seqs=16, max_decode_steps=4)
    engine = llm.engine
    rng = np.random.default_rng(3)
    shared = _prompts(1, seed=8, lo=24, hi=25)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(_ids(shared + [3]), greedy)  # caches the shared prefix's blocks
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("long", _ids(_prompts(1, seed=9)[0]), long)
    engine.step()
    hits0 = engine.get_metrics()["prefix_cache_hits"]
    calls, expected = [], {}
    for i in range(40):
        kind = i % 3
        if kind == 0:  # a prompt that hits the cached prefix
            prompt = shared + [int(t) for t in rng.integers(3, VOCAB, size=3)]
            sp = greedy
        elif kind == 1:  # n = 2: one prefill, then a fork
            prompt, sp = (
                _prompts(1, seed=100 + i, lo=6, hi=12)[0],
                SamplingParams(temperature=0.0, n=2, max_tokens=5, ignore_eos=True),
            )
        else:
            prompt, sp = _prompts(1, seed=200 + i)[0], greedy
        engine.add_request(f"a{i}", _ids(prompt), sp)
        expected[f"a{i}"] = (prompt, sp)
        before = engine.get_metrics()["num_device_calls"]
        for out in engine.step():
            if out.finished and out.request_id in expected:
                p, q = expected.pop(out.request_id)
                assert len(out.outputs) == q.n
                assert [len(c.token_ids) for c in out.outputs] == [q.max_tokens] * q.n
                if q.n == 1:
                    assert out.outputs[0].token_ids == hf_greedy(model, p, q.max_tokens)
        calls.append(engine.get_metrics()["num_device_calls"] - before)
    assert calls == [1] * len(calls)
    assert engine.get_metrics()["prefix_cache_hits"] - hits0 >= 10 * 24
    while engine.has_unfinished_requests():
        engine.step()
    _assert_clean(llm)


def test_waiting_prompts_do_not_change_the_compiled_step(tiny_llama):
    """A mixed step compiles the same program whether or not prompts wait to be looked up
    (an online run must not meet a new variant when the queue empties or fills), and a
    lookup of waiting prompts still finds their cached prefix."""
    path, _ = tiny_llama
    llm = LLM(
        str(path),
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_decode_steps=1,
    )
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    shared = _prompts(1, seed=21, lo=9, hi=10)[0]
    llm.generate(_ids(shared + [3]), sp)  # nothing waits: every step without a lookup

    def mixed_programs():
        return {k for k in engine.get_metrics()["compile_seconds_by_program"] if "mixed" in k}

    known = mixed_programs()
    hits = engine.get_metrics()["prefix_cache_hits"]
    for i in range(4):  # 8 tokens a step: free slots, and prompts waiting for the budget
        engine.add_request(f"w{i}", _ids(shared + [4 + i] * 6), sp)
    while engine.has_unfinished_requests():
        engine.step()
    assert mixed_programs() == known
    assert engine.get_metrics()["prefix_cache_hits"] - hits >= 4 * 8
    _assert_clean(llm)


@pytest.mark.slow  # the fast tier keeps the one-call-per-step test with arrivals
def test_host_to_device_bytes_of_a_decode_step_do_not_grow_with_max_model_len(tiny_llama):
    """A steady decode step ships the step's differences, not tables sized by the model
    length: the same bytes at max_model_len 64 and 1024."""
    path, _ = tiny_llama
    sent = []
    for max_len in (64, 1024):
        llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_seqs=4, max_model_len=max_len)
        engine = llm.engine
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("r", _ids([5, 6, 7, 8, 9]), sp)
        engine.step()  # the prefill
        before = engine.get_metrics()
        engine.step()  # a decode loop
        after = engine.get_metrics()
        assert after["num_steps"] - before["num_steps"] == 1
        sent.append(after["host_to_device_bytes"] - before["host_to_device_bytes"])
        assert after["host_to_device_bytes_per_step"] > 0
        llm.engine.abort("r")
    assert sent[0] == sent[1] and sent[0] < 4096


def test_cached_heads_filter_is_bounded(tiny_llama):
    """The host's filter of first blocks ever cached stops growing: past its bound it is
    dropped and every waiting prompt is looked up, hits still found."""
    path, _ = tiny_llama
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_seqs=4)
    llm.engine.scheduler.max_cached_heads = 3
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = _prompts(5, seed=11, lo=10, hi=11)
    llm.generate([_ids(p) for p in prompts], sp)
    assert llm.engine.scheduler.cached_heads is None
    out = llm.generate(_ids(prompts[0] + [9, 9]), sp)[0]
    assert out.num_cached_tokens == 8
    _assert_clean(llm)


def test_precompile_covers_every_variant_an_online_run_meets(tiny_llama):
    """``precompile=True`` compiles the variants up front (mixed at every token bucket, decode
    at every row bucket, the idle prepare): requests of every length arriving while others
    decode then compile nothing more, and make the tokens an engine compiling on first use
    makes."""
    path, _ = tiny_llama
    kw = dict(num_kv_blocks=512, block_size=4, max_num_seqs=16, max_num_batched_tokens=128)
    llm = LLM(str(path), precompile=True, max_decode_steps=4, **kw)
    engine = llm.engine
    names = set(engine.get_metrics()["compile_seconds_by_program"])
    # On a CPU (`backend.padded_size`): mixed at 16, 24, 32, 48, 64, 96, 128 tokens; decode at
    # 8, 12, 16 rows; the idle prepare.
    mixed = sorted(int(n.split("(")[1].split(",")[0]) for n in names if n.startswith("mixed"))
    decode = sorted(int(n.split("(")[1].split(",")[0]) for n in names if n.startswith("decode"))
    assert mixed == [16, 24, 32, 48, 64, 96, 128] and decode == [8, 12, 16]
    assert any(n.startswith("prepare") for n in names)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(2, 200, 24)]
    sp = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    outs = {}
    for i, p in enumerate(prompts):  # one arrival per step, so batches of every size form
        engine.add_request(f"r{i}", _ids(p), sp)
        for o in engine.step():
            outs[o.request_id] = o
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert set(engine.get_metrics()["compile_seconds_by_program"]) == names
    lazy = LLM(str(path), max_decode_steps=4, **kw).generate([_ids(p) for p in prompts], sp)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(24)] == [
        o.outputs[0].token_ids for o in lazy
    ]
    _assert_clean(llm)
    with pytest.raises(ValueError, match="precompile"):
        LLM(str(path), precompile="yes")
