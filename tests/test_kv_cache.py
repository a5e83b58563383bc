"""KV pages: sizing, in-place writes at block-manager slots, block copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged.memory import block_manager as bm
from jax_paged.memory.kv_cache import (
    KVCache,
    bytes_per_block,
    copy_blocks,
    num_blocks_for_budget,
    scatter,
    write,
)


def test_sizing_from_a_budget():
    # 2 (K and V) * 3 layers * 2 heads * 16 tokens * 8 dims * 2 bytes = 3072 bytes per block.
    assert bytes_per_block(3, 2, 8, 16, jnp.bfloat16) == 3072
    assert num_blocks_for_budget(10 * 3072 + 5, 3, 2, 8, 16, jnp.bfloat16) == 10
    c = KVCache.create(3, 2, 8, memory_bytes=10 * 3072, dtype=jnp.bfloat16)
    assert c.k.shape == (3, 2, 10, 16, 8) and c.k.dtype == jnp.bfloat16
    assert c.nbytes == 10 * 3072 and c.num_blocks == 10 and c.block_size == 16
    with pytest.raises(ValueError, match="memory_bytes"):
        KVCache.create(3, 2, 8, memory_bytes=3072)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.create(3, 2, 8, num_blocks=4, memory_bytes=1 << 20)


# A bfloat16 pool on the CPU is written by the native library (XLA's CPU scatter would widen the
# whole pool); float32 and float16 by XLA's scatter. Each must land exactly the same.
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_lands_at_slots_in_place_and_padding_goes_to_the_null_block(dtype):
    c = KVCache.create(2, 3, 4, block_size=4, num_blocks=5, dtype=dtype)
    rng = np.random.default_rng(0)
    k = np.asarray(jnp.asarray(rng.normal(size=(7, 3, 4)), dtype), np.float32)
    v = np.asarray(jnp.asarray(rng.normal(size=(7, 3, 4)), dtype), np.float32)
    slots = np.array([5, 6, 0, 19, 8, 0, 20])  # slots 0: padding; 20: past the pool, dropped
    old = c.k
    c = write(c, 1, k, v, slots)
    assert old.is_deleted()  # donated: updated in place
    assert c.k.dtype == dtype
    want_k, want_v = np.zeros(c.k.shape, np.float32), np.zeros(c.v.shape, np.float32)
    for t, sl in enumerate(slots[:-1]):
        want_k[1, :, sl // 4, sl % 4] = k[t]
        want_v[1, :, sl // 4, sl % 4] = v[t]
    # Real blocks hold exactly the written tokens; block 0 (padding) holds garbage.
    np.testing.assert_array_equal(np.asarray(c.k, np.float32)[:, :, 1:], want_k[:, :, 1:])
    np.testing.assert_array_equal(np.asarray(c.v, np.float32)[:, :, 1:], want_v[:, :, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_in_a_scan_over_layers(dtype):
    """The layer index traced, as in the models' scanned layers."""
    c = KVCache.create(3, 2, 8, block_size=4, num_blocks=6, dtype=dtype)
    rows = jnp.arange(3 * 2 * 2 * 8, dtype=jnp.float32).reshape(3, 2, 2, 8)
    slots = jnp.array([9, 22])

    def body(cache, layer):
        return scatter(cache, layer, rows[layer], rows[layer] + 0.5, slots), None

    c, _ = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(3)), donate_argnums=0)(c)
    k, v = np.asarray(c.k, np.float32), np.asarray(c.v, np.float32)
    for layer in range(3):
        for t, sl in enumerate([9, 22]):
            np.testing.assert_array_equal(k[layer, :, sl // 4, sl % 4], rows[layer, t])
            np.testing.assert_array_equal(v[layer, :, sl // 4, sl % 4], rows[layer, t] + 0.5)
    assert np.count_nonzero(k) == np.count_nonzero(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_all_layers_and_heads_and_skips_null_pairs(dtype):
    c = KVCache.create(2, 2, 3, block_size=2, num_blocks=6, dtype=dtype)
    rng = np.random.default_rng(1)
    c = c.replace(
        k=jnp.asarray(rng.normal(size=c.k.shape), dtype),
        v=jnp.asarray(rng.normal(size=c.v.shape), dtype),
    )
    k0, v0 = np.asarray(c.k, np.float32), np.asarray(c.v, np.float32)
    # 2 -> 5 and a chain 4 -> 1 -> 3: block 3 gets block 1's old contents.
    c = copy_blocks(c, jnp.array([2, 0, 4, 0, 1]), jnp.array([5, 0, 1, 0, 3]))
    want_k, want_v = k0.copy(), v0.copy()
    want_k[:, :, 5], want_v[:, :, 5] = k0[:, :, 2], v0[:, :, 2]
    want_k[:, :, 1], want_v[:, :, 1] = k0[:, :, 4], v0[:, :, 4]
    want_k[:, :, 3], want_v[:, :, 3] = k0[:, :, 1], v0[:, :, 1]
    assert c.k.dtype == dtype
    np.testing.assert_array_equal(np.asarray(c.k, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(c.v, np.float32), want_v)


def test_block_manager_slots_and_pages_reproduce_dense_kv():
    """Reserve, copy-on-write and write for a forked pair; reading each sequence back through
    its block table gives exactly its own K."""
    L, kvh, d, bs = 2, 1, 2, 4
    st = bm.init_state(12, bs, 3, 4)
    cache = KVCache.create(L, kvh, d, block_size=bs, num_blocks=12)
    dense = {0: [], 1: []}
    rng = np.random.default_rng(2)

    @jax.jit
    def step(st, cache, num_new, seq, pos, k):
        st, res = bm.reserve(st, num_new)
        cache = copy_blocks(cache, res.cow_src, res.cow_dst)
        slots = bm.token_slots(st, seq, pos)
        for layer in range(L):
            cache = write(cache, layer, k * (layer + 1), -k, slots)
        return st, cache, res.ok

    def run(num_new):
        seq, pos = [], []
        for s in range(3):
            seq += [s] * num_new[s]
            pos += list(range(int(st.seq_lens[s]), int(st.seq_lens[s]) + num_new[s]))
        t = 8
        seq += [-1] * (t - len(seq))
        pos += [-1] * (t - len(pos))
        k = rng.normal(size=(t, kvh, d)).astype(np.float32)
        out = step(st, cache, jnp.array(num_new), jnp.array(seq), jnp.array(pos), k)
        for i, s in enumerate(seq):
            if s >= 0:
                dense[s].append(k[i])
        return out

    st, cache, ok = run([6, 0, 0])
    st, _ = bm.fork(st, jnp.array([0]), jnp.array([1]))
    dense[1] = list(dense[0])
    st, cache, ok = run([1, 3, 0])  # both write into shared block 2: slot 0 keeps, 1 copies
    assert np.asarray(ok).all()
    bm.check_invariants(st)
    kk = np.asarray(cache.k)
    for s in (0, 1):
        n = int(st.seq_lens[s])
        slots = np.asarray(bm.token_slots(st, jnp.full(n, s), jnp.arange(n)))
        got = kk[1][:, slots // bs, slots % bs].transpose(1, 0, 2)
        np.testing.assert_array_equal(got, 2 * np.stack(dense[s]))
