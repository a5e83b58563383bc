"""The shared batch layouts (`pallas_kernels.layout`) against a plain-Python model of a ragged
batch: random query lengths (empty sequences included), ``num_seqs`` below the slot count with
garbage past it, padding rows past the last sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layout import query_blocks, ragged_rows

S, T = 6, 20  # fixed shapes (one compile); the batches' contents vary with the seed


def _random_batch(rng, s: int, t: int):
    """(kv_lens i32[S], cu_q_lens i32[S+1], num_seqs, q_lens of the live sequences)."""
    n = int(rng.integers(0, s + 1))
    q = rng.integers(0, 6, n)
    while q.sum() > t:
        q[int(np.argmax(q))] -= 1
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    cu = np.concatenate([cu, rng.integers(-5, 50, s - n)]).astype(np.int32)  # garbage past n
    kv = (rng.integers(0, 20, s) + np.concatenate([q, np.zeros(s - n, int)])).astype(np.int32)
    return kv, cu, n, q


def _rows_model(t: int, kv, cu, n, q):
    """Row -> (sequence, position) of the live rows."""
    rows = {}
    for s in range(n):
        for j in range(q[s]):
            rows[cu[s] + j] = (s, kv[s] - q[s] + j)
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_ragged_rows_match_a_python_model(seed):
    rng = np.random.default_rng(seed)
    s, t = S, T
    kv, cu, n, q = _random_batch(rng, s, t)
    r = ragged_rows(t, jnp.asarray(kv), jnp.asarray(cu), jnp.int32(n))
    want = _rows_model(t, kv, cu, n, q)
    live, seq, pos = np.asarray(r.live), np.asarray(r.seq), np.asarray(r.pos)
    assert int(r.num_seqs) == n
    for row in range(t):
        if row in want:
            assert live[row] and (seq[row], pos[row]) == want[row], row
        else:
            assert not live[row] and pos[row] == -1 and 0 <= seq[row] < s, row


@pytest.mark.parametrize("block_q", [1, 3, 8])
@pytest.mark.parametrize("seed", range(20))
def test_query_blocks_cover_each_sequence_in_order(seed, block_q):
    rng = np.random.default_rng(100 + seed)
    s, t = S, T
    kv, cu, n, q = _random_batch(rng, s, t)
    b = query_blocks(t, jnp.asarray(kv), jnp.asarray(cu), jnp.int32(n), block_q)
    seq, row0, num, pos0 = (np.asarray(a) for a in (b.seq, b.row0, b.num, b.pos0))
    want = [
        (i, cu[i] + f, min(block_q, q[i] - f), kv[i] - q[i] + f)
        for i in range(n)
        for f in range(0, q[i], block_q)
    ]
    used = [(seq[k], row0[k], num[k], pos0[k]) for k in range(len(seq)) if num[k] > 0]
    assert used == want
    assert len(seq) >= len(want) and (num[len(want) :] == 0).all()
    rows = _rows_model(t, kv, cu, n, q)
    tok_blk, tok_off, live = (np.asarray(a) for a in (b.tok_blk, b.tok_off, b.live))
    for row in range(t):
        assert live[row] == (row in rows)
        if row in rows:
            k = tok_blk[row]
            assert row0[k] + tok_off[row] == row and tok_off[row] < num[k]
