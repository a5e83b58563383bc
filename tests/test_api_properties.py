"""Property-based test of the public API (hypothesis): random mixes of good and bad requests,
sampling parameters, early stops, aborts and pool sizes.

Every example runs its requests through `LLM.generate`, `LLM.iter_generate` stopped early, or
`LLMEngine` directly with aborts in between, on an engine with a tight or a roomy KV pool, and
checks that:

* no exception escapes except a per-request ``error`` (or a ``ValueError`` from
  `SamplingParams` itself, at construction);
* every good request that was not aborted has exactly the outputs of an ample-pool run of the
  good requests alone (greedy or seeded sampling: both are deterministic per request);
* at the end no request is left, every block is free or evictable, the scheduler agrees with
  the device, and the block manager's invariants hold.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import full_suite_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models
from jax_paged import LLM, SamplingParams
from jax_paged.memory import block_manager as bm

MAX_LEN = 48
BS = 4
MAX_N = 3
MAX_LOGPROBS = 2


@dataclasses.dataclass(frozen=True)
class Good:
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy
    n: int
    stop_token: int | None
    logprobs: int | None
    ignore_eos: bool

    def request(self):
        sp = SamplingParams(
            temperature=0.0 if self.seed is None else 0.8,
            seed=self.seed,
            n=self.n,
            max_tokens=self.max_tokens,
            stop_token_ids=[] if self.stop_token is None else [self.stop_token],
            logprobs=self.logprobs,
            ignore_eos=self.ignore_eos,
        )
        return {"prompt_token_ids": list(self.prompt)}, sp


# Bad requests the engine must reject one by one, each naming what is wrong.
BAD = [
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [300]}, SamplingParams(), "out of range"),
    ({"prompt_token_ids": [-1, 5]}, SamplingParams(), "out of range"),
    ({"prompt_token_ids": [1.5]}, SamplingParams(), "list of integers"),
    ({"prompt_token_ids": list(range(3, 3 + MAX_LEN))}, SamplingParams(), "max_model_len"),
    ({"prompt": "words"}, SamplingParams(), "tokenizer"),
    ({"tokens": [1]}, SamplingParams(), "unknown keys"),
    (42, SamplingParams(), "prompt must be"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(n=MAX_N + 1), "max_n"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=5), "max_logprobs"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    ({"prompt_token_ids": [5, 6]}, {"temperature": 0.0}, "SamplingParams"),
]

# SamplingParams that must not even construct.
BAD_PARAMS = [
    dict(temperature=-1.0),
    dict(top_p=0.0),
    dict(n=0),
    dict(max_tokens=0),
    dict(logprobs=-2),
    dict(stop_token_ids=["x"]),
]

goods = st.builds(
    Good,
    # A small alphabet, so that prompts share prefixes and the prefix cache gets hits.
    prompt=st.lists(st.integers(3, 12), min_size=1, max_size=16).map(tuple),
    max_tokens=st.integers(1, 12),
    seed=st.one_of(st.none(), st.integers(0, 3)),
    n=st.integers(1, MAX_N),
    stop_token=st.one_of(st.none(), st.integers(3, 255)),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    ignore_eos=st.booleans(),
)
entries = st.one_of(goods, goods, goods, st.integers(0, len(BAD) - 1).map(lambda i: ("bad", i)))
batches = st.tuples(
    st.sampled_from(["generate", "iter_generate", "engine"]),
    st.lists(entries, min_size=1, max_size=6),
    st.integers(0, 6),  # iter_generate: outputs taken before stopping; engine: steps before aborts
    st.lists(st.booleans(), min_size=6, max_size=6),  # engine: which requests to abort
)


def _key(out):
    return [
        (c.token_ids, c.finish_reason, None if c.logprobs is None else len(c.logprobs))
        for c in out.outputs
    ]


@pytest.fixture(scope="module")
def llms(tiny_llama):
    path, _ = tiny_llama
    loaded = models.load(str(path))
    common = dict(block_size=BS, max_model_len=MAX_LEN, max_n=MAX_N, max_logprobs=MAX_LOGPROBS)
    return {
        # 13 usable blocks = 52 tokens: one longest request fits, four do not: preemption.
        "tight": LLM(loaded, num_kv_blocks=14, max_num_seqs=4, **common),
        "roomy": LLM(loaded, num_kv_blocks=48, max_num_seqs=6, **common),
        "ample": LLM(loaded, num_kv_blocks=512, max_num_seqs=16, **common),
    }


def _assert_clean(llm):
    engine = llm.engine
    assert engine.step() == []  # an idle step frees what the last aborts left
    assert not engine.has_unfinished_requests() and engine.requests == {}
    state = engine.state.blocks
    bm.check_invariants(state)
    assert not bool(np.asarray(state.live).any())
    assert int(bm.num_free_blocks(state)) == engine.num_blocks - 1
    assert engine.scheduler.num_free_blocks == engine.num_blocks - 1


@settings(
    max_examples=200 if full_suite_run() else 25,  # the fast tier runs an eighth
    deadline=None,
    derandomize=True,  # the same examples on every CI run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(pool=st.sampled_from(["tight", "roomy"]), batch=batches, bad_params=st.data())
def test_good_requests_unaffected_by_bad_ones_aborts_and_pool_size(llms, pool, batch, bad_params):
    mode, items, k, abort = batch
    llm, ample = llms[pool], llms["ample"]
    # SamplingParams validate at construction: a bad one never reaches the engine.
    with pytest.raises(ValueError):
        SamplingParams(**bad_params.draw(st.sampled_from(BAD_PARAMS)))

    reqs = [BAD[e[1]][:2] if isinstance(e, tuple) else e.request() for e in items]
    good = [i for i, e in enumerate(items) if isinstance(e, Good)]
    ref = {}
    if good:
        outs = ample.generate([reqs[i][0] for i in good], [reqs[i][1] for i in good])
        ref = {i: _key(o) for i, o in zip(good, outs, strict=True)}

    def check_bad(i, out):
        assert out.error is not None and BAD[items[i][1]][2] in out.error, (items[i], out.error)

    if mode == "generate":
        outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs])
        for i, out in enumerate(outs):
            if i in ref:
                assert out.error is None and _key(out) == ref[i]
            else:
                check_bad(i, out)
    elif mode == "iter_generate":
        it = llm.iter_generate([r[0] for r in reqs], [r[1] for r in reqs])
        for _, (i, out) in zip(range(k), it, strict=False):
            assert out.finished
            if i in ref:
                assert out.error is None and _key(out) == ref[i]
            else:
                check_bad(i, out)
        it.close()
    else:
        engine = llm.engine
        added = {}
        for i, (prompt, sp) in enumerate(reqs):
            try:
                engine.add_request(f"prop-{i}", prompt, sp)
                added[f"prop-{i}"] = i
            except ValueError as e:
                assert i not in ref and BAD[items[i][1]][2] in str(e)
        assert set(added.values()) == set(ref)
        done = {}
        for _ in range(k):
            for out in engine.step():
                if out.finished:
                    done[added[out.request_id]] = out
        aborted = set()
        for rid, i in added.items():
            if abort[i] and i not in done:
                assert engine.abort(rid)
                aborted.add(i)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[added[out.request_id]] = out
        assert set(done) | aborted == set(ref) and not set(done) & aborted
        for i, out in done.items():
            assert out.error is None and _key(out) == ref[i]
    _assert_clean(llm)
    _assert_clean(ample)
