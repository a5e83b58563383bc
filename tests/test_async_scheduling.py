"""`EngineConfig.async_scheduling`: the host detokenises a step's outputs while the device runs
the next one. Outputs must be exactly those of the synchronous engine (greedy against HF in
test_hardening), whatever happens while a step is in flight: preemption, n > 1, aborts, stop
ids, log-probs; and nothing may leak."""

from __future__ import annotations

import numpy as np
import pytest

from jax_paged import LLM, SamplingParams
from jax_paged.memory import block_manager as bm

VOCAB = 256


def _ids(p):
    return {"prompt_token_ids": list(p)}


def _requests():
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(12):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(3, 40))).tolist()
        if i % 4 == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 30)), logprobs=2)
        elif i % 4 == 1:
            sp = SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=12, ignore_eos=True)
        elif i % 4 == 2:
            sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[prompt[0]])
        else:
            sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=25, ignore_eos=True)
        reqs.append((f"r{i}", prompt, sp))
    return reqs


def _run(path, async_scheduling: bool):
    """Requests arrive over the first steps; r5 is aborted while a step runs it; a small pool
    forces preemptions."""
    llm = LLM(
        str(path),
        num_kv_blocks=40,
        block_size=4,
        max_num_seqs=8,
        max_decode_steps=4,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    pending = _requests()
    final, steps = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, _ids(prompt), sp)
        if steps == 6:
            assert engine.abort("r5")
        for out in engine.step():
            final[out.request_id] = out
        steps += 1
    assert engine.step() == []
    assert not engine.has_unfinished_requests() and engine.requests == {}
    state = engine.state.blocks
    bm.check_invariants(state)
    assert int(bm.num_free_blocks(state)) == engine.num_blocks - 1
    assert engine.scheduler.num_free_blocks == engine.num_blocks - 1
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0
    assert 0.0 <= m["device_idle_share"] <= 1.0 and 0.0 <= m["host_late_share"] <= 1.0
    return final


def _summary(out):
    return [
        (
            c.token_ids,
            c.finish_reason,
            c.stop_reason,
            None
            if c.logprobs is None
            else [{k: round(v.logprob, 4) for k, v in d.items()} for d in c.logprobs],
        )
        for c in out.outputs
    ]


def test_async_outputs_equal_sync(tiny_llama):
    path, _ = tiny_llama
    sync, asyn = _run(path, False), _run(path, True)
    assert "r5" not in asyn or not asyn["r5"].finished or asyn["r5"].outputs
    done = {k for k, v in sync.items() if v.finished and k != "r5"}
    assert done == {k for k, v in asyn.items() if v.finished and k != "r5"}
    assert len(done) == 11
    for k in done:
        assert _summary(asyn[k]) == _summary(sync[k]), k


def test_async_scheduling_must_be_a_bool(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(path), async_scheduling="yes")


def test_serve_and_generate_pass_the_option_on():
    """`jax-paged serve --async-scheduling` and `scripts/generate.py --async-scheduling` give
    it to the engine (every other serve option maps to its EngineConfig field)."""
    import argparse

    import generate

    from jax_paged.engine.config import EngineConfig
    from jax_paged.serve import cli

    p = argparse.ArgumentParser()
    cli.add_serve_arguments(p)
    for flags, want in (([], False), (["--async-scheduling"], True)):
        kw = cli.engine_kwargs(p.parse_args(flags))
        assert kw["async_scheduling"] is want
        assert EngineConfig(**kw).async_scheduling is want
    args = generate.build_parser().parse_args(["--async-scheduling"])
    assert args.async_scheduling is True
