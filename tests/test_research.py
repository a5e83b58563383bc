"""The research API reports what it could not do: refused reservations, refused prompts and
per-row statuses of `PagedDecoder` (tiny Llama, block size 16, max_len 32, 4 rows)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from jax_paged import SamplingParams
from jax_paged.entrypoints.research import PagedDecoder, RowStatus
from jax_paged.memory import block_manager as bm

B, MAX_LEN, BS, STEPS = 4, 32, 16, 8
LMAX = MAX_LEN  # every test pads to this width, so each decoder compiles one prefill
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(dec, params, state, prompts, lens):
    return dec.prefill(params, state, prompts, lens)


@functools.partial(jax.jit, static_argnums=0)
def _decode(dec, params, state):
    return jax.lax.scan(lambda s, _: dec.decode_step(params, s), state, None, length=STEPS)


@pytest.fixture(scope="module")
def decoders(tiny_llama):
    """ "ample": the default pool (every row can reach max_len); "tight": 3 usable blocks."""
    path, _ = tiny_llama
    model = models.load(str(path)).model
    return {
        "ample": PagedDecoder(model, max_seqs=B, max_len=MAX_LEN, block_size=BS),
        "tight": PagedDecoder(model, max_seqs=B, max_len=MAX_LEN, block_size=BS, num_blocks=4),
    }


def _prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    out = np.zeros((B, LMAX), np.int32)
    for r, n in enumerate(lens):
        n = min(max(n, 0), LMAX)
        out[r, :n] = rng.integers(3, 256, size=n)
    return out


def _run(dec, prompts, lens, params=GREEDY):
    """prefill + STEPS decode steps -> (state, first i32[B], tokens i32[STEPS, B])."""
    state = dec.init(params)
    state, first = _prefill(dec, dec.params, state, jnp.asarray(prompts), jnp.asarray(lens))
    prefilled = state
    state, toks = _decode(dec, dec.params, state)
    return prefilled, state, np.asarray(first), np.asarray(toks)


def _status(state):
    return [RowStatus(int(s)) for s in np.asarray(state.status)]


def test_refused_prefill_rows_produce_nothing(decoders):
    """4 usable-block pool minus the null block = 3 blocks; four 20-token prompts need 2 each:
    row 0 is served, rows 1-3 are refused (first come, first served) and say so."""
    lens = np.full(B, 20, np.int32)
    prompts = _prompts(lens)
    _, _, ref_first, ref_toks = _run(decoders["ample"], prompts, lens)
    assert (ref_first >= 0).all() and (ref_toks >= 0).all()

    dec = decoders["tight"]
    pre, state, first, toks = _run(dec, prompts, lens)
    assert first.tolist() == [ref_first[0], -1, -1, -1]
    assert _status(pre) == [RowStatus.RUNNING] + [RowStatus.NO_BLOCKS] * 3
    assert np.asarray(pre.active).tolist() == [True, False, False, False]
    assert (toks[:, 1:] == -1).all()
    assert toks[:, 0].tolist() == ref_toks[:, 0].tolist()
    assert _status(state) == [RowStatus.RUNNING] + [RowStatus.NO_BLOCKS] * 3
    assert dec.describe(state)[1:] == ["stopped: no KV blocks (the pool ran out)"] * 3
    blocks = state.device.blocks
    bm.check_invariants(blocks)
    assert np.asarray(blocks.live).tolist() == [True, False, False, False]
    assert np.asarray(blocks.seq_lens).tolist() == [20 + STEPS, 0, 0, 0]
    state = dec.release(state)
    bm.check_invariants(state.device.blocks)
    assert int(bm.num_free_blocks(state.device.blocks)) == dec.num_blocks - 1
    assert _status(state) == [RowStatus.UNUSED] * B


def test_prompt_longer_than_max_len_is_refused(decoders):
    dec = decoders["ample"]
    state = dec.init(GREEDY)
    wide = np.zeros((B, MAX_LEN + 1), np.int32)
    ones = np.ones(B, np.int32)
    for fn in (dec.prefill, jax.jit(dec.prefill)):  # the width is static even under jit
        with pytest.raises(ValueError, match=r"33 tokens wide; with max_len=32 .* at most 31"):
            fn(dec.params, state, wide, ones)
    prompts = _prompts([3, 32, 0, 0])
    with pytest.raises(ValueError, match=r"row 1: prompt is 32 tokens; with max_len=32 .* 31"):
        dec.prefill(dec.params, state, prompts, np.array([3, 32, 0, 0], np.int32))
    with pytest.raises(ValueError, match=r"prompt is 40 tokens; with max_len=32"):
        dec.prefill(dec.params, state, prompts, jnp.array([3, 40, 0, 0]))  # concrete jax array
    narrow = prompts[:, :8]
    with pytest.raises(ValueError, match=r"prompt_lens\[2\]=9 is more than the prompts' width 8"):
        dec.prefill(dec.params, state, narrow, [3, 0, 9, 0])
    with pytest.raises(ValueError, match=r"prompt_lens\[3\]=-1 is negative"):
        dec.prefill(dec.params, state, narrow, [3, 0, 0, -1])
    with pytest.raises(ValueError, match="max_seqs=4"):
        dec.prefill(dec.params, state, narrow[:2], [3, 0])


def test_traced_invalid_lengths_get_a_status(decoders):
    """Under jit the lengths are traced: rows < 0, > Lmax or > max_len - 1 produce nothing."""
    dec = decoders["ample"]
    lens = np.array([5, -1, LMAX + 1, MAX_LEN], np.int32)
    prompts = _prompts(lens)
    _, _, ref_first, ref_toks = _run(dec, prompts, np.array([5, 0, 0, 0], np.int32))
    pre, state, first, toks = _run(dec, prompts, lens)
    assert first.tolist() == [ref_first[0], -1, -1, -1]
    assert _status(pre) == [RowStatus.RUNNING] + [RowStatus.INVALID_PROMPT] * 3
    assert toks[:, 0].tolist() == ref_toks[:, 0].tolist()
    assert (toks[:, 1:] == -1).all()
    assert _status(state) == [RowStatus.RUNNING] + [RowStatus.INVALID_PROMPT] * 3
    assert dec.describe(state)[1].startswith("invalid prompt length")
    blocks = state.device.blocks
    bm.check_invariants(blocks)
    assert np.asarray(blocks.live).tolist() == [True, False, False, False]


def _emitted(first, toks, r):
    seq = [int(first[r]), *toks[:, r].tolist()]
    n = seq.index(-1) if -1 in seq else len(seq)
    assert all(t == -1 for t in seq[n:]), "a stopped row produced a token"
    return seq[:n]


def test_statuses_say_why_rows_stopped(decoders):
    """Row 0 hits a stop token, row 1 its max_tokens, row 2 max_len; row 3 runs on."""
    dec = decoders["ample"]
    lens = np.array([4, 6, MAX_LEN - 4, 3], np.int32)
    prompts = _prompts(lens, seed=1)
    _, _, ref_first, ref_toks = _run(dec, prompts, lens)
    ref = [[int(ref_first[r]), *ref_toks[:, r].tolist()] for r in range(B)]
    k = next(i for i in range(2, STEPS) if ref[0][i] not in ref[0][:i])
    stop = ref[0][k]

    def params(stop_max_tokens, len_max_tokens):
        return [
            SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                           max_tokens=stop_max_tokens),
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3),
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=len_max_tokens),
            GREEDY,
        ]  # fmt: skip

    _, state, first, toks = _run(dec, prompts, lens, params(100, 100))
    got = [_emitted(first, toks, r) for r in range(B)]
    assert got[0] == ref[0][: k + 1]
    assert got[1] == ref[1][:3]
    assert got[2] == ref[2][:4]  # 28 prompt tokens + 4 = max_len
    assert got[3] == ref[3]
    want = [RowStatus.STOP, RowStatus.MAX_TOKENS, RowStatus.MAX_LEN, RowStatus.RUNNING]
    assert _status(state) == want
    assert np.asarray(state.active).tolist() == [False, False, False, True]
    assert dec.describe(state) == [
        "stopped: stop token (EOS or stop_token_ids)",
        "stopped: max_tokens reached",
        "stopped: max_len reached",
        "running",
    ]
    bm.check_invariants(state.device.blocks)

    # Precedence: a stop token at max_tokens says STOP; max_tokens at max_len says MAX_TOKENS.
    _, state, first, toks = _run(dec, prompts, lens, params(k + 1, 4))
    assert _emitted(first, toks, 0) == ref[0][: k + 1]
    assert _emitted(first, toks, 2) == ref[2][:4]
    assert _status(state)[:3] == [RowStatus.STOP, RowStatus.MAX_TOKENS, RowStatus.MAX_TOKENS]


def test_pool_running_dry_in_decode_stops_only_that_row(decoders):
    """Prefill takes all 3 blocks; row 1 (16 tokens, a full block) needs a fourth at its first
    decode step and stops with NO_BLOCKS; rows 0 and 2 stay inside their blocks and go on."""
    lens = np.array([3, BS, 5, 0], np.int32)
    prompts = _prompts(lens, seed=2)
    _, _, ref_first, ref_toks = _run(decoders["ample"], prompts, lens)
    dec = decoders["tight"]
    pre, state, first, toks = _run(dec, prompts, lens)
    assert first.tolist() == ref_first.tolist()
    assert _status(pre) == [RowStatus.RUNNING] * 3 + [RowStatus.UNUSED]
    assert int(bm.num_free_blocks(pre.device.blocks)) == 0
    assert toks[:, 0].tolist() == ref_toks[:, 0].tolist()
    assert toks[:, 2].tolist() == ref_toks[:, 2].tolist()
    assert (toks[:, 1] == -1).all() and (toks[:, 3] == -1).all()
    assert _status(state) == [
        RowStatus.RUNNING,
        RowStatus.NO_BLOCKS,
        RowStatus.RUNNING,
        RowStatus.UNUSED,
    ]
    assert dec.describe(state)[3] == "unused (prompt_len 0)"
    blocks = state.device.blocks
    bm.check_invariants(blocks)
    assert np.asarray(blocks.seq_lens).tolist() == [3 + STEPS, BS, 5 + STEPS, 0]
    state = dec.release(state)
    bm.check_invariants(state.device.blocks)
    assert int(bm.num_free_blocks(state.device.blocks)) == dec.num_blocks - 1
    assert _status(state) == [RowStatus.UNUSED] * B
    assert not np.asarray(state.active).any()


def test_release_then_prefill_again_gives_the_same_tokens(decoders):
    """`release` clears the rows' sampling history too: a second prefill on the released
    state counts max_tokens from zero and reproduces the first run."""
    dec = decoders["ample"]
    lens = np.array([5, 9, 3, 7], np.int32)
    prompts = _prompts(lens, seed=3)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    _, state, first, toks = _run(dec, prompts, lens, params)
    assert _status(state) == [RowStatus.MAX_TOKENS] * B
    state = dec.release(state)
    state, first2 = _prefill(dec, dec.params, state, jnp.asarray(prompts), jnp.asarray(lens))
    state, toks2 = _decode(dec, dec.params, state)
    np.testing.assert_array_equal(np.asarray(first2), first)
    np.testing.assert_array_equal(np.asarray(toks2), toks)
    bm.check_invariants(state.device.blocks)
