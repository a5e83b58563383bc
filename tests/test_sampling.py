"""On-device sampling against a float64 numpy reference of vLLM's semantics."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged.entrypoints.sampling_params import SamplingParams as SP
from jax_paged.sampling.logit_processing import compute_prompt_logprobs, process_logits
from jax_paged.sampling.sampler import (
    SamplingTensors,
    init_state,
    is_stop_token,
    reached_max_tokens,
    sample,
    set_rows,
    update_counts,
)

sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "max_candidates"))
process_jit = jax.jit(process_logits, static_argnames=("max_candidates",))
KEY = jax.random.key(0)


def padded(rows, width=None):
    """list of int lists -> i32[len(rows), width] padded with -1."""
    width = max([len(r) for r in rows] + [0]) if width is None else width
    out = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return jnp.asarray(out)


set_rows_jit = jax.jit(set_rows)


def make_state(prompts, outputs, vocab_size, pad_to=None, track_tokens=True):
    """A state whose first rows hold these prompts and outputs (fixed widths: few compiles)."""
    b = len(prompts) if pad_to is None else pad_to
    state = init_state(b, vocab_size, track_tokens=track_tokens)
    slots = jnp.arange(len(prompts), dtype=jnp.int32)
    return set_rows_jit(state, slots, padded(prompts, 16), padded(outputs, 8))


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def ref_process(logits, p: SP, prompt, output, eos=()):
    """float64 reference of the logits a row draws from (greedy rows: the penalised logits)."""
    x = np.asarray(logits, np.float64).copy()
    v = x.shape[0]
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
    if len(output) < p.min_tokens and stops:
        x[sorted(stops)] = -np.inf
    counts = np.bincount(np.asarray(output, int), minlength=v).astype(np.float64)
    seen = counts > 0
    in_context = seen.copy()
    in_context[list(prompt)] = True
    r = p.repetition_penalty
    x = np.where(in_context, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * seen
    if p.is_greedy:
        return x
    x = x / p.temperature
    probs = softmax(x)
    x[probs < p.min_p * probs.max()] = -np.inf
    if p.top_k != -1:
        kth = np.sort(x)[::-1][min(p.top_k, v) - 1]
        x[x < kth] = -np.inf
    if p.top_p < 1:
        order = np.argsort(-x, kind="stable")
        probs = softmax(x)[order]
        before = np.cumsum(probs) - probs
        x[order[before >= p.top_p]] = -np.inf
    return x


# A mix of every processing step; rows are reused by several tests.
PARAMS = [
    SP(temperature=0.0),
    SP(temperature=0.7, top_k=5, seed=1),
    SP(temperature=1.3, top_p=0.6, seed=2),
    SP(temperature=1.0, min_p=0.15, seed=3),
    SP(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02, seed=4),
    SP(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),
    SP(temperature=0.5, repetition_penalty=0.6, frequency_penalty=-0.4, top_p=0.95, seed=5),
    SP(temperature=1.0, top_k=1, seed=6),
    SP(temperature=2.0, top_p=0.3, top_k=40, presence_penalty=-1.5, seed=7),
    SP(temperature=0.8, min_tokens=3, stop_token_ids=[7], seed=8),
]
# Most tests share these shapes so that `sample` compiles only a few times.
B, V = len(PARAMS), 64
EOS = (1,)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    b = len(PARAMS)
    logits = rng.normal(0, 3, (b, V)).astype(np.float32)
    logits[:, 1] += 4.0  # make EOS likely so min_tokens matters
    prompts = [list(rng.integers(0, V, rng.integers(1, 12))) for _ in range(b)]
    outputs = [list(rng.integers(0, V, rng.integers(0, 6))) for _ in range(b)]
    outputs[9] = [5]  # fewer than min_tokens
    return logits, prompts, outputs


@pytest.mark.parametrize("max_candidates", [256, 3])
def test_process_logits_matches_reference(max_candidates):
    # 256 >= V: all candidates (a sort). 3: the top_k candidate path, with the bisection fallback
    # for rows whose kept set does not fit in the candidates.
    for seed in range(3):
        logits, prompts, outputs = _batch(seed)
        tensors = SamplingTensors.from_params(
            PARAMS, vocab_size=V, eos_token_ids=EOS, request_uids=range(len(PARAMS))
        )
        state = make_state(prompts, outputs, V)
        got = np.asarray(
            process_jit(jnp.asarray(logits), tensors, state, max_candidates=max_candidates)
        )
        for i, p in enumerate(PARAMS):
            want = ref_process(logits[i], p, prompts[i], outputs[i], EOS)
            np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"{i}")
            fin = np.isfinite(want)
            np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-5, atol=1e-5)


def test_reference_on_hand_computed_case():
    # probs of [ln 4, ln 3, ln 2, ln 1] are [.4, .3, .2, .1]; top_p=0.65: mass before each
    # token is [0, .4, .7, .9] -> keep the first two. min_p=0.3: 0.3 * .4 = .12 -> drop .1.
    x = np.log([4.0, 3.0, 2.0, 1.0])
    assert np.isfinite(ref_process(x, SP(top_p=0.65), [], [])).tolist() == [1, 1, 0, 0]
    assert np.isfinite(ref_process(x, SP(min_p=0.3), [], [])).tolist() == [1, 1, 1, 0]
    assert np.isfinite(ref_process(x, SP(top_k=3), [], [])).tolist() == [1, 1, 1, 0]
    # repetition 2 on tokens 0 (prompt) and 3 (output, also frequency 1 and presence 0.5):
    y = ref_process(
        np.array([2.0, -1.0, 0.5, -2.0]),
        SP(temperature=0, repetition_penalty=2, frequency_penalty=1, presence_penalty=0.5),
        [0],
        [3, 3],
    )
    np.testing.assert_allclose(y, [1.0, -1.0, 0.5, -4.0 - 2.0 - 0.5])


def test_bisection_cutoffs_equal_sorted_cutoffs():
    # The sort-free fallback against the sorted formulation, with -inf entries and ties.
    from jax_paged.sampling.logit_processing import _bisect_cutoffs, _cutoffs

    x = np.random.default_rng(2).normal(0, 2, (6, 300)).astype(np.float32)
    x[0, :100] = -np.inf
    x[1, :40] = x[1, 40]  # a 41-way tie
    x[2] = np.round(x[2])  # many ties
    top_k = jnp.asarray([300, 7, 100, 300, 1, 41], jnp.int32)
    top_p = jnp.asarray([0.9, 1.0, 0.5, 0.3, 0.2, 0.999], jnp.float32)
    xs = jnp.asarray(x)
    got = jax.jit(_bisect_cutoffs)(xs, top_k, top_p)
    srt = jnp.flip(jnp.sort(xs, axis=1), axis=1)
    want, _ = _cutoffs(srt, jax.nn.logsumexp(xs, axis=1), top_k, top_p, 300)
    np.testing.assert_array_equal(got, want)


def test_greedy_is_argmax_with_lowest_id_on_ties():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    logits[2, [10, 50, 60]] = 50.0  # tie: torch.argmax / np.argmax give 10
    logits[3, :] = 0.0  # all tied: 0
    params = [SP(temperature=0.0)] * (B - 2) + [SP(temperature=1.0, seed=1), None]
    tensors = SamplingTensors.from_params(params, vocab_size=V)
    state = init_state(B, V)
    out = sample_jit(jnp.asarray(logits), tensors, state, KEY)
    want = np.argmax(logits, axis=1)
    assert want[2] == 10 and want[3] == 0
    greedy_rows = [i for i in range(B) if i != B - 2]
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy_rows], want[greedy_rows])
    # All-greedy batch (no random numbers drawn) agrees.
    tensors = SamplingTensors.from_params([SP(temperature=0.0)] * B, vocab_size=V)
    out = sample_jit(jnp.asarray(logits), tensors, state, KEY)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


@pytest.mark.parametrize(
    "p",
    [
        SP(top_k=4),
        SP(top_p=0.7),
        SP(min_p=0.2),
        SP(temperature=0.6, top_k=6, top_p=0.8),
        SP(temperature=1.5, repetition_penalty=1.4, presence_penalty=1.0),
    ],
    ids=["top_k", "top_p", "min_p", "combined", "penalties"],
)
def test_samples_follow_the_filtered_distribution(p):
    v, n = 16, 4000
    rng = np.random.default_rng(7)
    row = rng.normal(0, 1.5, v).astype(np.float32)
    prompt, output = [0, 1], [2]
    want = softmax(ref_process(row, p, prompt, output))
    params = [SP(**{**p.to_dict(), "seed": i}) for i in range(n)]
    tensors = SamplingTensors.from_params(params, vocab_size=v)
    state = make_state([prompt] * n, [output] * n, v)
    out = sample_jit(jnp.broadcast_to(jnp.asarray(row), (n, v)), tensors, state, KEY)
    counts = np.bincount(np.asarray(out.tokens), minlength=v)
    assert not np.any(counts[want == 0]), "sampled outside the allowed set"
    support = want > 0
    expected = n * want[support]
    chi2 = np.sum((counts[support] - expected) ** 2 / expected)
    # df <= 15; P(chi2 > 45) < 1e-4 under the null. Deterministic: fixed seeds.
    assert chi2 < 45, (chi2, counts, np.round(expected))


def test_penalty_state_updates_on_device():
    # set_rows with outputs == set_rows with none, then update_counts per token (in a scan).
    prompts, outputs = [[3, 4, 4], [9], [1]], [[5, 6, 5], [], [2, 2]]
    direct = make_state(prompts, outputs, 16, pad_to=4)
    state = make_state(prompts, [[]] * 3, 16, pad_to=4)
    steps = padded([[o[t] if t < len(o) else 0 for o in outputs] + [0] for t in range(3)])
    active = jnp.asarray([[t < len(o) for o in outputs] + [False] for t in range(3)])

    def body(s, xs):
        return update_counts(s, *xs), None

    scanned, _ = jax.lax.scan(body, state, (steps, active))
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(direct.num_generated, [3, 0, 2, 0])
    assert direct.output_counts[0, 5] == 2 and direct.output_counts[2, 2] == 2
    assert direct.prompt_mask[0, [3, 4]].all() and direct.prompt_mask.sum() == 4
    # Re-setting a slot replaces it completely.
    reset = set_rows(direct, jnp.asarray([0, -1]), padded([[7], [8]]), padded([[], []]))
    assert reset.prompt_mask[0].sum() == 1 and reset.output_counts[0].sum() == 0
    assert int(reset.num_generated[0]) == 0 and reset.prompt_mask[1, 9]


def test_untracked_state_ignores_penalties():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)).astype(np.float32))
    params = [SP(temperature=0, repetition_penalty=2.0)] * B
    tensors = SamplingTensors.from_params(params, vocab_size=V)
    state = make_state([[1, 2], [3]], [[4], []], V, pad_to=B, track_tokens=False)
    assert state.output_counts is None and state.prompt_mask is None
    np.testing.assert_array_equal(state.num_generated[:3], [1, 0, 0])
    state = update_counts(state, jnp.zeros(B, jnp.int32), jnp.ones(B, bool))
    np.testing.assert_array_equal(state.num_generated[:3], [2, 1, 1])
    out = sample_jit(logits, tensors, state, KEY)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), axis=1))


def _decode(logits_fn, tensors, state, steps, key=KEY):
    """A device-side decode loop: sample, record, repeat (no host round trip)."""

    @jax.jit
    def run(tensors, state):
        def body(state, t):
            out = sample(logits_fn(t, state), tensors, state, key)
            b = out.tokens.shape[0]
            state = update_counts(state, out.tokens, jnp.ones(b, bool))
            return state, (out.tokens, is_stop_token(tensors, out.tokens))

        return jax.lax.scan(body, state, jnp.arange(steps))

    return run(tensors, state)


def test_min_tokens_and_ignore_eos():
    v, eos = 16, 3
    base = np.zeros(v, np.float32)
    base[eos] = 30.0  # EOS first,
    base[7] = 20.0  # then stop id 7,
    base[9] = 10.0  # then 9.
    params = [
        SP(temperature=0, min_tokens=2),
        SP(temperature=0, min_tokens=2, ignore_eos=True),
        SP(temperature=0, min_tokens=3, stop_token_ids=[7]),
        SP(temperature=0, min_tokens=1, stop_token_ids=[eos], ignore_eos=True),
        SP(temperature=0.5, min_tokens=3, stop_token_ids=[7], seed=0),
    ]
    tensors = SamplingTensors.from_params(params, vocab_size=v, eos_token_ids=[eos])
    state = init_state(len(params), v)
    logits = jnp.broadcast_to(jnp.asarray(base), (len(params), v))
    _, (tokens, stops) = _decode(lambda t, s: logits, tensors, state, 4)
    tokens, stops = np.asarray(tokens).T, np.asarray(stops).T
    np.testing.assert_array_equal(tokens[0], [7, 7, eos, eos])  # EOS masked for 2 tokens
    np.testing.assert_array_equal(stops[0], [0, 0, 1, 1])
    np.testing.assert_array_equal(tokens[1], [eos] * 4)  # ignore_eos: EOS neither masked...
    np.testing.assert_array_equal(stops[1], [0] * 4)  # ...nor a stop
    np.testing.assert_array_equal(tokens[2], [9, 9, 9, eos])  # EOS and 7 masked for 3
    # ignore_eos, but EOS listed in stop_token_ids: a stop again, masked for 1 token.
    np.testing.assert_array_equal(tokens[3], [7, eos, eos, eos])
    np.testing.assert_array_equal(stops[3], [0, 1, 1, 1])
    assert not np.isin(tokens[4, :3], [eos, 7]).any()
    max_t = SamplingTensors.from_params(
        [SP(max_tokens=2), SP(max_tokens=None)], vocab_size=v, request_uids=[0, 1]
    )
    st = set_rows(init_state(2, v), jnp.arange(2), padded([[0], [0]]), padded([[1, 2], [1, 2]]))
    np.testing.assert_array_equal(reached_max_tokens(max_t, st), [True, False])


@functools.partial(jax.jit, static_argnames=("steps", "max_candidates"))
def _history_decode(tensors, state, key, table, *, steps, max_candidates):
    """``steps`` sampling steps in one ``lax.scan`` with logits that depend only on each row's
    own history (a stand-in model): row logits = a window of ``table[t]`` chosen by a hash of
    the row's generated tokens. Returns tokens i32[steps, B]."""
    v = state.output_counts.shape[1]

    def body(state, t):
        h = jnp.sum(state.output_counts * jnp.arange(v), axis=1) % (table.shape[1] - v)
        logits = jnp.take(table[t], h[:, None] + jnp.arange(v)[None, :])
        out = sample(logits, tensors, state, key, max_candidates=max_candidates)
        return update_counts(state, out.tokens, jnp.ones_like(out.tokens, bool)), out.tokens

    return jax.lax.scan(body, state, jnp.arange(steps))[1]


def test_seeded_rows_do_not_depend_on_the_batch():
    v, steps = 256, 6
    table = jnp.asarray(np.random.default_rng(3).normal(0, 2, (steps, 4096)).astype(np.float32))
    target = SP(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=1234)
    others = [SP(temperature=0), SP(top_k=3, seed=9), SP(top_p=0.999, min_p=0.0, seed=5)]
    others += [SP(frequency_penalty=1.0, seed=77), None, SP(temperature=0.1, top_k=2, seed=0)]

    def run(params, pos, pad_to=8, max_candidates=256, key=KEY):
        tensors = SamplingTensors.from_params(
            params, vocab_size=v, eos_token_ids=[0], request_uids=range(len(params)), pad_to=pad_to
        )
        state = make_state([[5, 6]] * len(params), [[]] * len(params), v, pad_to=pad_to)
        out = _history_decode(
            tensors, state, key, table, steps=steps, max_candidates=max_candidates
        )
        return np.asarray(out[:, pos])

    alone = run([target], 0)
    assert len(set(alone.tolist())) > 1
    np.testing.assert_array_equal(run([others[0], target, others[1]], 1, pad_to=3), alone)
    np.testing.assert_array_equal(run(others[1:] + [target], 5), alone)
    # A small candidate set forces the bisection fallback for some rows and not for others.
    np.testing.assert_array_equal(run([target] + others, 0, max_candidates=4), alone)
    np.testing.assert_array_equal(run(others[::-1] + [target], 6, max_candidates=4), alone)
    # The engine key only matters for rows without a seed.
    np.testing.assert_array_equal(run([target], 0, key=jax.random.key(99)), alone)
    # A different seed gives different tokens.
    other = SP(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=1235)
    assert (run([other], 0) != alone).any()


def test_unseeded_rows_use_engine_key_and_uid():
    logits = jnp.zeros((B, V))
    state = init_state(B, V)
    uids = np.arange(100, 100 + B)
    perm = np.random.default_rng(0).permutation(B)

    def toks(uids, key):
        t = SamplingTensors.from_params([SP()] * B, vocab_size=V, request_uids=uids.tolist())
        return np.asarray(sample_jit(logits, t, state, key).tokens)

    a = toks(uids, KEY)
    assert len(set(a.tolist())) > 1
    np.testing.assert_array_equal(toks(uids[perm], KEY), a[perm])
    assert (toks(uids, jax.random.key(1)) != a).any()
    with pytest.raises(ValueError, match="request_uids"):
        SamplingTensors.from_params([SP()], vocab_size=V)


def test_seed_keys():
    t = SamplingTensors.from_params(
        [SP(seed=7), SP(seed=2**40 + 7), SP(seed=-1), SP(seed=7, temperature=0)], vocab_size=8
    )
    np.testing.assert_array_equal(t.seed_key[0], jax.random.key_data(jax.random.key(7)))
    np.testing.assert_array_equal(t.seed_key[1], [2**8, 7])  # all 64 bits are used
    np.testing.assert_array_equal(t.seed_key[2], [2**32 - 1, 2**32 - 1])
    np.testing.assert_array_equal(t.has_seed, [True, True, True, False])  # greedy: no seed


def test_logprobs_are_raw_log_softmax():
    logits, prompts, outputs = _batch(4)
    # One row asking for log-probs makes the (static) top-5 run for every row.
    asking = [dataclasses.replace(PARAMS[0], logprobs=5)] + list(PARAMS[1:])
    tensors = SamplingTensors.from_params(
        asking, vocab_size=V, eos_token_ids=EOS, request_uids=range(len(PARAMS))
    )
    state = make_state(prompts, outputs, V)
    out = sample_jit(jnp.asarray(logits), tensors, state, KEY, num_top_logprobs=5)
    x = logits.astype(np.float64)
    lp = (
        x
        - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
        - x.max(1, keepdims=True)
    )
    tok = np.asarray(out.tokens)
    rows = np.arange(len(PARAMS))
    np.testing.assert_allclose(out.logprobs, lp[rows, tok], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.ranks, 1 + (lp > lp[rows, tok][:, None]).sum(1))
    order = np.argsort(-lp, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lp, order, 1), atol=1e-5)
    assert out.top_ids.shape == (len(PARAMS), 5) and out.top_ids.dtype == jnp.int32
    # Without logprobs requested the top arrays are empty.
    out0 = sample_jit(jnp.asarray(logits), tensors, state, KEY)
    assert out0.top_ids.shape == (len(PARAMS), 0)
    np.testing.assert_array_equal(out0.tokens, out.tokens)
    # With N static and a row asking for logprobs=0 only, the top-N is skipped at run time
    # (zeros); the sampled tokens and their own log-probs do not change.
    only_own = [dataclasses.replace(PARAMS[0], logprobs=0)] + list(PARAMS[1:])
    quiet = SamplingTensors.from_params(
        only_own, vocab_size=V, eos_token_ids=EOS, request_uids=range(len(PARAMS))
    )
    out1 = sample_jit(jnp.asarray(logits), quiet, state, KEY, num_top_logprobs=5)
    assert out1.top_ids.shape == (len(PARAMS), 5)
    np.testing.assert_array_equal(out1.top_ids, 0)
    np.testing.assert_array_equal(out1.tokens, out.tokens)
    np.testing.assert_allclose(out1.logprobs, out.logprobs)
    np.testing.assert_array_equal(out1.ranks, out.ranks)
    # No row asking at all (logprobs=None everywhere): nothing is computed, zeros come back.
    none = SamplingTensors.from_params(
        PARAMS, vocab_size=V, eos_token_ids=EOS, request_uids=range(len(PARAMS))
    )
    assert all(p.logprobs is None for p in PARAMS)
    out2 = sample_jit(jnp.asarray(logits), none, state, KEY, num_top_logprobs=5)
    np.testing.assert_array_equal(out2.tokens, out.tokens)
    np.testing.assert_array_equal(out2.logprobs, 0)
    np.testing.assert_array_equal(out2.ranks, 0)


def test_prompt_logprobs():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(7, 40)).astype(np.float32)
    nxt = rng.integers(0, 40, 7).astype(np.int32)
    f = jax.jit(compute_prompt_logprobs, static_argnums=2)
    lp, ranks, top_ids, top_lp = f(jnp.asarray(logits), jnp.asarray(nxt), 3)
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(7), nxt], atol=1e-5)
    np.testing.assert_array_equal(ranks, 1 + (ref > ref[np.arange(7), nxt][:, None]).sum(1))
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=1)[:, :3])
    np.testing.assert_allclose(top_lp, np.sort(ref, axis=1)[:, ::-1][:, :3], atol=1e-5)


def test_from_params_layout_and_errors():
    t = SamplingTensors.from_params(
        [SP(stop_token_ids=[9, 4], top_k=100, seed=1), None, SP(ignore_eos=True, seed=2)],
        vocab_size=50,
        eos_token_ids=[2],
        pad_to=5,
    )
    assert t.batch_size == 5 and t.stop_token_ids.shape == (5, 4)
    np.testing.assert_array_equal(t.stop_token_ids[0], [2, 4, 9, -1])
    np.testing.assert_array_equal(t.stop_token_ids[1:], -1)
    np.testing.assert_array_equal(t.top_k, [50] * 5)  # 100 clipped to V; -1 -> V
    np.testing.assert_array_equal(t.temperature, [1, 0, 1, 0, 0])  # empty slots are greedy
    assert jax.tree.structure(t) == jax.tree.structure(
        SamplingTensors.from_params([None] * 5, vocab_size=50)
    )
    with pytest.raises(ValueError, match="pad_to"):
        SamplingTensors.from_params([None] * 3, vocab_size=8, pad_to=2)
    with pytest.raises(ValueError, match="stop_width"):
        SamplingTensors.from_params(
            [SP(stop_token_ids=[1, 2, 3], seed=0)], vocab_size=8, stop_width=2
        )
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingTensors.from_params([None], vocab_size=8, eos_token_ids=[8])
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingTensors.from_params([SP(stop_token_ids=[8], seed=0)], vocab_size=8)
    with pytest.raises(ValueError, match=r"params\[0\]"):
        SamplingTensors.from_params([{"temperature": 0}], vocab_size=8)


@pytest.mark.parametrize("vocab", [1, 7, 256, 300, 49152 + 17])
def test_argmax_last_matches_argmax(vocab):
    """The two-level argmax equals argmax with NaN read as +inf: ties go to the lowest index,
    rows of -inf to 0, at vocabulary sizes below, at and past one block, and uneven."""
    from jax_paged.backend import argmax_last

    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 3, (9, vocab)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, rng.integers(vocab)] = np.nan
    x[3] = rng.standard_normal(vocab)
    x[3, -1] = 100.0  # the maximum in the padded last block
    x[4, :] = 5.0
    x[5, rng.integers(vocab, size=2)] = np.inf
    if vocab > 1:
        x[6, -1], x[6, :-1] = np.nan, -np.inf
    x[7, -1], x[7, 0] = np.nan, np.inf  # +inf first: NaN is its tie
    want = np.argmax(np.where(np.isnan(x), np.inf, x), axis=-1)
    got = jax.jit(argmax_last)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    # Leading batch axes work as with argmax.
    x3 = jnp.asarray(x).reshape(3, 3, vocab)
    np.testing.assert_array_equal(np.asarray(argmax_last(x3)), want.reshape(3, 3))
