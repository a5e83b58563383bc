"""The plain-jnp reference: hand-computed cases first, then dense attention over contiguous K/V.

`make_paged_case` and `dense_attention` are also used by tests/test_gpu_kernel.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ---------------------------------------------------------------------------------------------
# Shared builders: a paged cache holding known contiguous K/V, and an independent dense oracle.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PagedCase:
    """Random contiguous K/V per sequence, scattered into shuffled pages.

    Attributes:
      k, v: per sequence ``[L_s, KVH, D]`` float64 (after rounding to the case dtype).
      k_pages, v_pages: ``[KVH, N, bs, D]`` in the case dtype; unused slots hold garbage.
      block_tables: ``i32[S, P]``, unused entries 0 (the null block).
      kv_lens: ``i32[S]``.
    """

    k: list[np.ndarray]
    v: list[np.ndarray]
    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array


def make_paged_case(
    rng: np.random.Generator,
    lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    share_prefix: bool = True,
    null_fill: float | None = None,
    extra_pages: int = 1,
) -> PagedCase:
    """Builds a paged cache for sequences of ``lens`` tokens.

    Physical blocks are a random permutation of 1..N-1, so tables are shuffled and
    non-contiguous. With ``share_prefix`` every sequence with at least one full block shares its
    first block (same physical id, same content), as after a prefix-cache hit or a fork.
    ``null_fill`` fills block 0 (e.g. NaN, to prove it is never read unmasked); other unused
    slots hold large random garbage.
    """
    bs, kvh, d = block_size, num_kv_heads, head_dim
    num_logical = [math.ceil(n / bs) for n in lens]
    p = max(max(num_logical, default=1), 1) + extra_pages
    shared = share_prefix and sum(n >= bs for n in lens) >= 2
    n_blocks = 1 + sum(num_logical) - (sum(n >= bs for n in lens) - 1 if shared else 0)
    n_blocks += 3  # a few never-used blocks of garbage
    perm = rng.permutation(np.arange(1, n_blocks))
    k_pages = rng.normal(scale=30.0, size=(kvh, n_blocks, bs, d))
    v_pages = rng.normal(scale=30.0, size=(kvh, n_blocks, bs, d))
    if null_fill is not None:
        k_pages[:, 0] = null_fill
        v_pages[:, 0] = null_fill
    prefix_k = rng.normal(size=(bs, kvh, d))
    prefix_v = rng.normal(size=(bs, kvh, d))
    tables = np.zeros((len(lens), p), np.int32)
    ks, vs = [], []
    next_id, shared_id = 0, None
    for s, n in enumerate(lens):
        k = rng.normal(size=(n, kvh, d))
        v = rng.normal(size=(n, kvh, d))
        for j in range(num_logical[s]):
            if shared and j == 0 and n >= bs:
                if shared_id is None:
                    shared_id = perm[next_id]
                    next_id += 1
                tables[s, 0] = shared_id
                k[:bs], v[:bs] = prefix_k, prefix_v
            else:
                tables[s, j] = perm[next_id]
                next_id += 1
        for pos in range(n):
            blk, off = tables[s, pos // bs], pos % bs
            k_pages[:, blk, off] = k[pos]
            v_pages[:, blk, off] = v[pos]
        ks.append(k)
        vs.append(v)
    k_pages = jnp.asarray(k_pages, dtype)
    v_pages = jnp.asarray(v_pages, dtype)

    def rounded(x):  # the values the kernels actually see
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    return PagedCase(
        k=[rounded(k) for k in ks],
        v=[rounded(v) for v in vs],
        k_pages=k_pages,
        v_pages=v_pages,
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(lens, jnp.int32),
    )


def dense_attention(
    q: np.ndarray,  # [Q, H, D] float64
    k: np.ndarray,  # [L, KVH, D]
    v: np.ndarray,  # [L, KVH, D]
    positions: np.ndarray,  # [Q]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:  # [Q, H, D]
    """Causal attention of queries at ``positions`` over contiguous K/V, in float64 numpy."""
    nq, h, d = q.shape
    g = h // k.shape[1]
    k = np.repeat(k, g, axis=1)  # [L, H, D]
    v = np.repeat(v, g, axis=1)
    logits = scale * np.einsum("qhd,lhd->hql", q, k)  # [H, Q, L]
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    key = np.arange(k.shape[0])
    mask = key[None, :] <= positions[:, None]  # [Q, L]
    if sliding_window is not None:
        mask &= positions[:, None] - key[None, :] < sliding_window
    logits = np.where(mask[None], logits, -np.inf)
    out = np.zeros((h, nq, d))
    seen = mask.any(axis=1)
    if seen.any():
        lg = logits[:, seen]
        w = np.exp(lg - lg.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[:, seen] = np.einsum("hql,lhd->hqd", w, v)
    return out.transpose(1, 0, 2)


def dense_decode(case: PagedCase, q: np.ndarray, **kw) -> np.ndarray:  # [B, H, D]
    out = np.zeros(q.shape)
    for b, n in enumerate(np.asarray(case.kv_lens)):
        out[b] = dense_attention(q[b : b + 1], case.k[b], case.v[b], np.array([n - 1]), **kw)[0]
    return out


def dense_ragged(case: PagedCase, q: np.ndarray, cu: np.ndarray, num_seqs: int, **kw):
    out = np.zeros(q.shape)  # [T, H, D]; padding rows stay 0
    for s in range(num_seqs):
        a, b = cu[s], cu[s + 1]
        n = int(case.kv_lens[s])
        pos = n - (b - a) + np.arange(b - a)
        out[a:b] = dense_attention(q[a:b], case.k[s], case.v[s], pos, **kw)
    return out


def rand_q(rng, shape, dtype):
    q = jnp.asarray(rng.normal(size=shape), dtype)
    return q, np.asarray(q.astype(jnp.float32), np.float64)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases (D = 2, block size 2; arithmetic in the comments).
# ---------------------------------------------------------------------------------------------


def _tiny_pages():
    """Pages [KVH=1, N=4, bs=2, D=2]; one sequence of 3 tokens in blocks 3 then 1.

    token 0: k=[1, 0], v=[4, 0]   (block 3, offset 0)
    token 1: k=[0, 1], v=[0, 8]   (block 3, offset 1)
    token 2: k=[1, 1], v=[2, 2]   (block 1, offset 0)
    Blocks 0 and 2 and the tail of block 1 hold 100s (garbage that must stay masked).
    """
    k = np.full((1, 4, 2, 2), 100.0, np.float32)
    v = np.full((1, 4, 2, 2), 100.0, np.float32)
    k[0, 3, 0], v[0, 3, 0] = [1, 0], [4, 0]
    k[0, 3, 1], v[0, 3, 1] = [0, 1], [0, 8]
    k[0, 1, 0], v[0, 1, 0] = [1, 1], [2, 2]
    return jnp.asarray(k), jnp.asarray(v), jnp.array([[3, 1, 0]], jnp.int32)


def test_decode_hand_two_keys():
    k, v, bt = _tiny_pages()
    # kv_len 2: the query sees tokens 0 and 1. q = [ln 3, 0], scale 1:
    # logits = [ln 3, 0] -> softmax = [3/4, 1/4] -> out = 3/4 [4, 0] + 1/4 [0, 8] = [3, 2].
    q = jnp.array([[[math.log(3.0), 0.0]]], jnp.float32)
    out = paged_attention_decode_reference(q, k, v, bt, jnp.array([2], jnp.int32), scale=1.0)
    np.testing.assert_allclose(out[0, 0], [3.0, 2.0], rtol=1e-6)


def test_decode_hand_three_keys_crossing_blocks_and_scale():
    k, v, bt = _tiny_pages()
    # kv_len 3: tokens 0, 1 (block 3) and 2 (block 1). q = [ln 2, ln 2], scale 1/2:
    # q.k = [ln 2, ln 2, 2 ln 2]; times 1/2 -> [ln 2 / 2, ln 2 / 2, ln 2]
    # exp -> [sqrt2, sqrt2, 2]; sum = 2 sqrt2 + 2
    # out = (sqrt2 [4, 0] + sqrt2 [0, 8] + 2 [2, 2]) / (2 sqrt2 + 2)
    r = math.sqrt(2.0)
    want = np.array([4 * r + 4, 8 * r + 4]) / (2 * r + 2)
    q = jnp.array([[[math.log(2.0)] * 2]], jnp.float32)
    out = paged_attention_decode_reference(q, k, v, bt, jnp.array([3], jnp.int32), scale=0.5)
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-6)


def test_decode_hand_gqa_heads_share_kv():
    k, v, bt = _tiny_pages()
    # H = 2 query heads on KVH = 1. kv_len 1: only token 0 is visible, so both heads output
    # v0 = [4, 0] whatever their queries are (softmax over one key is 1).
    q = jnp.array([[[5.0, -3.0], [-7.0, 2.0]]], jnp.float32)
    out = paged_attention_decode_reference(q, k, v, bt, jnp.array([1], jnp.int32), scale=1.0)
    np.testing.assert_allclose(out[0], [[4.0, 0.0], [4.0, 0.0]], rtol=1e-6)


def test_decode_hand_zero_length_gives_zeros():
    k, v, bt = _tiny_pages()
    q = jnp.ones((1, 1, 2), jnp.float32)
    out = paged_attention_decode_reference(q, k, v, bt, jnp.array([0], jnp.int32), scale=1.0)
    np.testing.assert_array_equal(out, 0.0)


def test_decode_hand_sliding_window():
    k, v, bt = _tiny_pages()
    # kv_len 3, query at position 2. Window 1: only key 2 (2 - 2 < 1) -> out = v2 = [2, 2].
    # Window 2: keys 1, 2 (2 - 1 < 2). q = [0, 0] -> equal weights -> ([0, 8] + [2, 2]) / 2.
    q = jnp.zeros((1, 1, 2), jnp.float32)
    n = jnp.array([3], jnp.int32)
    out1 = paged_attention_decode_reference(q, k, v, bt, n, scale=1.0, sliding_window=1)
    out2 = paged_attention_decode_reference(q, k, v, bt, n, scale=1.0, sliding_window=2)
    np.testing.assert_allclose(out1[0, 0], [2.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(out2[0, 0], [1.0, 5.0], rtol=1e-6)


def test_decode_hand_soft_cap():
    k, v, bt = _tiny_pages()
    # kv_len 2, q = [1000, 0], scale 1, cap 1: q.k = [1000, 0] -> cap*tanh(x/cap) = [1, 0]
    # (tanh(1000) = 1 in float32) -> softmax = [e, 1] / (e + 1)
    # out = (e [4, 0] + [0, 8]) / (e + 1). Without the cap, out would be v0 = [4, 0].
    e = math.e
    q = jnp.array([[[1000.0, 0.0]]], jnp.float32)
    out = paged_attention_decode_reference(
        q, k, v, bt, jnp.array([2], jnp.int32), scale=1.0, soft_cap=1.0
    )
    np.testing.assert_allclose(out[0, 0], [4 * e / (e + 1), 8 / (e + 1)], rtol=1e-6)


def test_ragged_hand_prefill_is_causal_and_padding_is_zero():
    k, v, bt = _tiny_pages()
    # One sequence, q_len 3 = kv_len 3 (a whole prefill), then 2 padding rows; q = 0 so each
    # row averages the values it may see:
    # row 0 (pos 0): v0 = [4, 0]
    # row 1 (pos 1): ([4, 0] + [0, 8]) / 2 = [2, 4]
    # row 2 (pos 2): ([4, 0] + [0, 8] + [2, 2]) / 3 = [2, 10/3]
    # rows 3, 4: padding -> 0.
    q = jnp.zeros((5, 1, 2), jnp.float32)
    out = ragged_paged_attention_reference(
        q, k, v, bt, jnp.array([3], jnp.int32), jnp.array([0, 3], jnp.int32), 1, scale=1.0
    )
    want = [[4, 0], [2, 4], [2, 10 / 3], [0, 0], [0, 0]]
    np.testing.assert_allclose(out[:, 0], want, rtol=1e-6)


def test_ragged_hand_chunk_continues_after_cached_tokens():
    k, v, bt = _tiny_pages()
    # Chunked prefill: 2 tokens already cached, this step's chunk is 1 token (kv_len 3,
    # q_len 1) so its row sits at position 2 and sees all 3 keys; q = 0 -> [2, 10/3].
    # A second slot (S=2) is dead (num_seqs=1) and its cu entry is garbage (99).
    q = jnp.zeros((2, 1, 2), jnp.float32)
    bt2 = jnp.concatenate([bt, bt])
    out = ragged_paged_attention_reference(
        q,
        k,
        v,
        bt2,
        jnp.array([3, 3], jnp.int32),
        jnp.array([0, 1, 99], jnp.int32),
        jnp.int32(1),
        scale=1.0,
    )
    np.testing.assert_allclose(out[:, 0], [[2, 10 / 3], [0, 0]], rtol=1e-6)


def test_null_block_nan_never_leaks():
    rng = np.random.default_rng(0)
    case = make_paged_case(
        rng, [5, 16, 0], block_size=8, num_kv_heads=1, head_dim=8, null_fill=np.nan
    )
    q, q64 = rand_q(rng, (3, 2, 8), jnp.float32)
    out = paged_attention_decode_reference(
        q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, scale=0.3
    )
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, dense_decode(case, q64, scale=0.3), **TOL[jnp.float32])


# ---------------------------------------------------------------------------------------------
# Against dense attention over contiguous K/V.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size,kvh,group,head_dim,dtype,window,cap",
    [
        (8, 2, 1, 64, jnp.float32, None, None),
        (16, 3, 3, 64, jnp.bfloat16, None, None),
        (32, 2, 4, 128, jnp.float32, 40, None),
        (16, 1, 8, 128, jnp.bfloat16, None, 5.0),
        (16, 2, 4, 64, jnp.float32, 7, 2.0),
    ],
)
def test_decode_matches_dense(block_size, kvh, group, head_dim, dtype, window, cap):
    rng = np.random.default_rng(block_size * 100 + group)
    bs = block_size
    lens = [0, 1, bs - 1, bs, bs + 1, 517]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype
    )
    q, q64 = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = paged_attention_decode_reference(
        q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, **kw
    )
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(out.astype(jnp.float32), dense_decode(case, q64, **kw), **TOL[dtype])


def mixed_batch(bs: int):
    """A ragged step: a fresh prefill, a chunk after 520 cached tokens, decode tokens at lengths
    1, bs, bs + 1, an idle sequence (q_len 0) in the middle, then padding rows and a dead slot.

    Returns (kv_lens, q_lens, num_seqs, num_rows).
    """
    q_lens = [37, 20, 1, 0, 1, 1, 0]
    kv_lens = [37, 540, 1, bs - 1, bs, bs + 1, 0]
    return kv_lens, q_lens, 6, sum(q_lens) + 5


@pytest.mark.parametrize(
    "block_size,kvh,group,head_dim,dtype,window,cap",
    [
        (16, 2, 1, 64, jnp.float32, None, None),
        (8, 3, 3, 64, jnp.bfloat16, None, 3.0),
        (32, 1, 8, 128, jnp.float32, 33, None),
    ],
)
def test_ragged_matches_dense(block_size, kvh, group, head_dim, dtype, window, cap):
    rng = np.random.default_rng(7 + block_size)
    kv_lens, q_lens, num_seqs, rows = mixed_batch(block_size)
    case = make_paged_case(
        rng, kv_lens, block_size=block_size, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype
    )
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu[num_seqs + 1 :] = 0  # entries past num_seqs are garbage and must be ignored
    q, q64 = rand_q(rng, (rows, kvh * group, head_dim), dtype)
    kw = dict(scale=0.2, sliding_window=window, soft_cap=cap)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, jnp.asarray(cu))
    out = ragged_paged_attention_reference(*args, jnp.int32(num_seqs), **kw)
    want = dense_ragged(case, q64, cu, num_seqs, **kw)
    np.testing.assert_allclose(out.astype(jnp.float32), want, **TOL[dtype])
    np.testing.assert_array_equal(out[cu[num_seqs] :], 0)
    if block_size == 16:  # chunking the per-token gather (a memory bound) changes nothing
        small = ragged_paged_attention_reference(
            *args, jnp.int32(num_seqs), max_chunk_bytes=1, **kw
        )
        np.testing.assert_allclose(small, out, atol=1e-6)


def test_decode_equals_ragged_with_one_token_per_sequence():
    rng = np.random.default_rng(3)
    case = make_paged_case(rng, [3, 9, 30], block_size=8, num_kv_heads=2, head_dim=16)
    q, _ = rand_q(rng, (3, 4, 16), jnp.float32)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    dec = paged_attention_decode_reference(*args, scale=0.25)
    rag = ragged_paged_attention_reference(*args, jnp.arange(4, dtype=jnp.int32), 3, scale=0.25)
    np.testing.assert_allclose(dec, rag, atol=1e-6)


def test_reference_jits_once_per_shape():
    rng = np.random.default_rng(4)
    case = make_paged_case(rng, [3, 9], block_size=8, num_kv_heads=1, head_dim=16)
    q, _ = rand_q(rng, (2, 2, 16), jnp.float32)
    f = jax.jit(
        lambda q, n: paged_attention_decode_reference(
            q, case.k_pages, case.v_pages, case.block_tables, n, scale=0.25
        )
    )
    a = f(q, case.kv_lens)
    b = f(q, case.kv_lens - 1)  # new lengths, same shapes: no retrace
    assert f._cache_size() == 1
    assert not np.allclose(a, b)
