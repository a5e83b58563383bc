"""Exact tests of the block manager on tiny pools: block ids, free order, grants, sharing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_manager_ref import block_keys

from jax_paged.memory import block_manager as bm
from jax_paged.memory import eviction
from jax_paged.memory import prefix_cache as pc


def _bt(state):
    return np.asarray(state.block_tables).tolist()


def _reserve(state, num_new, **kw):
    state, res = bm.reserve(state, jnp.asarray(num_new, jnp.int32), **kw)
    bm.check_invariants(state)
    return state, np.asarray(res.ok).tolist(), np.asarray(res.cow_src), np.asarray(res.cow_dst)


def _stack(state):
    """Free stack, next block out first."""
    return np.asarray(state.free_stack)[: int(state.num_free)][::-1].tolist()


def test_init_hands_out_1_2_3_and_never_the_null_block():
    st = bm.init_state(5, 4, max_seqs=2, max_blocks_per_seq=8)
    assert int(bm.num_free_blocks(st)) == 4
    assert _stack(st) == [1, 2, 3, 4]
    st, ok, _, _ = _reserve(st, [16, 0])
    assert ok == [True, True]
    assert _bt(st)[0][:4] == [1, 2, 3, 4] and int(bm.num_free_blocks(st)) == 0
    st, ok, _, _ = _reserve(st, [1, 1])  # pool empty: both refused, untouched
    assert ok == [False, False]
    assert np.asarray(st.seq_lens).tolist() == [16, 0]
    assert np.asarray(st.live).tolist() == [True, False]


def test_reserve_takes_blocks_only_on_boundary_crossings():
    st = bm.init_state(8, 4, 3, 4)
    st, ok, _, _ = _reserve(st, [3, 5, 0])
    # slot 0: tokens 0..2 -> [1]; slot 1: tokens 0..4 -> [2, 3]; slot 2 untouched.
    assert ok == [True, True, True]
    assert _bt(st) == [[1, 0, 0, 0], [2, 3, 0, 0], [0, 0, 0, 0]]
    st, ok, _, _ = _reserve(st, [1, 3, 0])  # slot 0 fills block 1; slot 1 fills block 3
    assert _bt(st) == [[1, 0, 0, 0], [2, 3, 0, 0], [0, 0, 0, 0]] and int(st.num_free) == 4
    st, ok, _, _ = _reserve(st, [1, 1, 0])  # both cross: slot order 4, 5
    assert _bt(st) == [[1, 4, 0, 0], [2, 3, 5, 0], [0, 0, 0, 0]]
    assert np.asarray(st.seq_lens).tolist() == [5, 9, 0]


def test_grants_are_a_prefix_in_priority_order():
    # 4 usable blocks, bs 4. Needs: slot 0: 2, slot 1: 3, slot 2: 1.
    st = bm.init_state(5, 4, 3, 4)
    st1, ok, _, _ = _reserve(st, [8, 12, 4])
    # Slot order: cum 2, 5, 6 -> only slot 0; slot 2 would fit but may not overtake slot 1.
    assert ok == [True, False, False]
    assert _bt(st1) == [[1, 2, 0, 0], [0] * 4, [0] * 4]
    st2, ok, _, _ = _reserve(st, [8, 12, 4], priority=jnp.array([2, 0, 1]))
    # Order 1, 2, 0: cum 3, 4, 6 -> slots 1 and 2, taking blocks in grant order.
    assert ok == [False, True, True]
    assert _bt(st2) == [[0] * 4, [1, 2, 3, 0], [4, 0, 0, 0]]


def test_requests_needing_no_block_always_succeed():
    st = bm.init_state(3, 4, 2, 4)
    st, ok, _, _ = _reserve(st, [1, 4])  # pool now empty
    st, ok, _, _ = _reserve(st, [1, 1])  # slot 0 writes inside block 1; slot 1 needs a block
    assert ok == [True, False]
    assert np.asarray(st.seq_lens).tolist() == [2, 4]


def test_request_past_the_block_table_fails():
    st = bm.init_state(16, 4, 2, 2)
    st, ok, _, _ = _reserve(st, [9, 8])
    assert ok == [False, True] and _bt(st) == [[0, 0], [1, 2]]


def test_free_returns_blocks_in_table_order():
    st = bm.init_state(8, 2, 3, 4)
    st, *_ = _reserve(st, [5, 3, 0])  # slot 0: [1, 2, 3]; slot 1: [4, 5]
    st = bm.free(st, jnp.array([True, False, False]))
    bm.check_invariants(st)
    assert _stack(st) == [1, 2, 3, 6, 7]
    st = bm.free(st, jnp.array([True, True, True]))  # slot 0 again: no-op; slot 2: dead
    assert _stack(st) == [4, 5, 1, 2, 3, 6, 7]
    st, *_ = _reserve(st, [0, 0, 6])
    assert _bt(st)[2] == [4, 5, 1, 0]


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block():
    st = bm.init_state(10, 4, 4, 4)
    st, *_ = _reserve(st, [6, 0, 0, 0])  # slot 0: [1, 2], 2 tokens in block 2
    st, ok = bm.fork(st, jnp.array([0, 0, 1, 0]), jnp.array([1, 2, 3, 1]))
    bm.check_invariants(st)
    # (1 -> 3): parent 1 was dead before the call; (0 -> 1) twice: only the first counts.
    assert np.asarray(ok).tolist() == [True, True, False, False]
    assert np.asarray(st.ref_counts)[:3].tolist() == [0, 3, 3]
    # Only slot 1 writes: it copies block 2 into a fresh block 3.
    st, ok, src, dst = _reserve(st, [0, 1, 0, 0])
    assert (src.tolist(), dst.tolist()) == ([0, 2, 0, 0], [0, 3, 0, 0])
    assert _bt(st)[:3] == [[1, 2, 0, 0], [1, 3, 0, 0], [1, 2, 0, 0]]
    # Slots 0 and 2 (the last sharers of block 2) both write: slot 0 keeps it, slot 2 copies.
    st, ok, src, dst = _reserve(st, [1, 0, 3, 0])
    assert (src.tolist(), dst.tolist()) == ([0, 0, 2, 0], [0, 0, 4, 0])
    assert _bt(st)[:3] == [[1, 2, 0, 0], [1, 3, 0, 0], [1, 4, 5, 0]]
    assert np.asarray(st.ref_counts)[:6].tolist() == [0, 3, 1, 1, 1, 1]


def test_fork_at_a_block_boundary_needs_no_copy():
    st = bm.init_state(10, 4, 2, 4)
    st, *_ = _reserve(st, [8, 0])
    st, _ = bm.fork(st, jnp.array([0]), jnp.array([1]))
    st, ok, src, dst = _reserve(st, [1, 1])
    assert dst.tolist() == [0, 0] and _bt(st) == [[1, 2, 3, 0], [1, 2, 4, 0]]


def test_copy_on_write_is_all_or_nothing():
    st = bm.init_state(4, 4, 2, 4)
    st, *_ = _reserve(st, [6, 0])  # [1, 2]; one block left
    st, _ = bm.fork(st, jnp.array([0]), jnp.array([1]))
    # Slot 0 writes 3 tokens: copy of block 2 (1 block) + next block (1 block) = 2 > 1.
    st, ok, src, dst = _reserve(st, [3, 0])
    assert ok == [False, True] and dst.tolist() == [0, 0]
    assert _bt(st) == [[1, 2, 0, 0], [1, 2, 0, 0]]


def test_token_slots_follow_the_docstring_diagram():
    st = bm.init_state(16, 4, 3, 5)
    st = st.replace(
        block_tables=st.block_tables.at[2, :3].set(jnp.array([7, 3, 9])),
        seq_lens=st.seq_lens.at[2].set(10),
    )
    seq = jnp.array([2, 2, 2, 2, -1, 2, 0, 3])
    pos = jnp.array([0, 3, 4, 9, 0, 10, 0, 0])
    # 7*4+0, 7*4+3, 3*4+0, 9*4+1; padding, past the length, empty slot, out of range -> 0.
    assert bm.token_slots(st, seq, pos).tolist() == [28, 31, 12, 37, 0, 0, 0, 0]


def _prompt(*blocks):
    return [t for b in blocks for t in b]


A, B, C, D = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]


def _match(st, slot, toks, n=None):
    row = np.zeros((1, 16), np.int32)
    row[0, : len(toks)] = toks
    n = len(toks) if n is None else n
    st, cached, ok = pc.match_prefix(st, jnp.array([slot]), row, jnp.array([n]))
    bm.check_invariants(st)
    return st, int(cached[0]), bool(ok[0])


def _insert(st, slot, toks):
    row = np.zeros((1, 16), np.int32)
    row[0, : len(toks)] = toks
    st = pc.cache_full_blocks(st, jnp.array([slot]), row, jnp.array([len(toks)]))
    bm.check_invariants(st)
    return st


def test_prefix_cache_hit_keeps_one_token_to_compute():
    st = bm.init_state(8, 4, 3, 4)
    toks = _prompt(A, B, [5, 5])
    st, cached, ok = _match(st, 0, toks)
    assert (cached, ok) == (0, True) and bool(st.live[0])
    st, *_ = _reserve(st, [10, 0, 0])  # [1, 2, 3]
    st = _insert(st, 0, toks)
    assert np.asarray(st.cached)[:4].tolist() == [False, True, True, False]
    st, cached, _ = _match(st, 1, _prompt(A, B, C))  # A, B hit; C computed
    assert cached == 8 and _bt(st)[1] == [1, 2, 0, 0]
    st, cached, _ = _match(st, 2, _prompt(A, B))  # exact two blocks: B recomputed
    assert cached == 4 and _bt(st)[2] == [1, 0, 0, 0]
    assert np.asarray(st.ref_counts)[:4].tolist() == [0, 3, 2, 1]
    st, cached, ok = _match(st, 2, _prompt(A, B, C))  # slot 2 is live now
    assert (cached, ok) == (0, False)


def test_freed_cached_blocks_are_revived_then_evicted_lru_deepest_first():
    st = bm.init_state(6, 4, 3, 4)  # 5 usable blocks
    toks = _prompt(A, B, C, [9])
    st, *_ = _reserve(st, [13, 0, 0])  # [1, 2, 3, 4]
    st = _insert(st, 0, toks)
    st = bm.free(st, jnp.array([True, False, False]))
    bm.check_invariants(st)
    # Uncached 4 back on the stack; 1, 2, 3 evictable with C oldest, then B, then A.
    assert _stack(st) == [4, 5] and int(st.num_evictable) == 3
    assert int(bm.num_free_blocks(st)) == 5
    st, cached, _ = _match(st, 1, _prompt(A, D))  # revives 1 only
    assert cached == 4 and int(st.num_evictable) == 2
    st, *_ = _reserve(st, [0, 4, 0])  # slot 1: [1, 4]
    # Needs 3 with 1 on the stack: evicts 3 (C, oldest) and 2 (B) onto the stack's top.
    st, ok, _, _ = _reserve(st, [0, 0, 12])
    assert ok == [True, True, True] and _bt(st)[2] == [3, 2, 5, 0]
    assert int(st.num_evictable) == 0 and np.asarray(st.cached)[:4].tolist() == [0, 1, 0, 0]
    st, cached, _ = _match(st, 0, _prompt(A, B, C, [9]))
    assert cached == 4  # B and C are gone; A is still cached (in use by slot 1)


def test_collisions_cannot_give_another_prefix_s_kv():
    st = bm.init_state(10, 4, 4, 4)
    st, *_ = _reserve(st, [8, 4, 0, 0])  # slot 0: [1, 2] = A C; slot 1: [3] = B
    st = _insert(st, 0, _prompt(A, C))
    st = _insert(st, 1, B)
    st = bm.free(st, jnp.array([True, True, False, False]))
    # Forge a full 32-bit collision: the key of (B, C)'s second block now finds block 2
    # (tokens C, but extending A, not B).
    key = int(pc.block_hashes(jnp.array(_prompt(B, C)), 4)[1])
    bucket = key & (st.hash_table.shape[0] - 1)
    st = st.replace(
        hash_table=st.hash_table.at[bucket].set(2).at[int(st.block_hash[2]) & 15].set(0),
        block_hash=st.block_hash.at[2].set(key),
    )
    st, cached, _ = pc.match_prefix(
        st, jnp.array([2]), jnp.array([_prompt(B, C, [0, 0, 0, 0])]), jnp.array([9])
    )
    assert int(cached[0]) == 4  # B from block 3; block 2 rejected: its parent is 1, not 3
    # Same with a token mismatch: the key of (A, D) finds block 2 (A, C).
    key = int(pc.block_hashes(jnp.array(_prompt(A, D)), 4)[1])
    st = st.replace(
        hash_table=st.hash_table.at[key & (st.hash_table.shape[0] - 1)].set(2),
        block_hash=st.block_hash.at[2].set(key),
    )
    st, cached, _ = pc.match_prefix(
        st, jnp.array([3]), jnp.array([_prompt(A, D, [0, 0, 0, 0])]), jnp.array([9])
    )
    assert int(cached[0]) == 4


def test_block_hashes_match_the_python_chain():
    rng = np.random.default_rng(0)
    toks = rng.integers(-5, 50_000, (3, 40)).astype(np.int32)
    got = np.asarray(pc.block_hashes(jnp.asarray(toks), 8))
    for r in range(3):
        assert got[r].tolist() == block_keys(toks[r].tolist(), 8)
    # Chained: equal blocks after different prefixes get different keys.
    a = pc.block_hashes(jnp.array(_prompt(A, C)), 4)
    b = pc.block_hashes(jnp.array(_prompt(B, C)), 4)
    assert a[1] != b[1]


def test_100_decode_steps_in_scan_equal_100_calls():
    st = bm.init_state(24, 4, 6, 8, evict_chunk=2)
    st, *_ = _reserve(st, [5, 9, 3, 0, 0, 0])
    toks = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    st = pc.cache_full_blocks(st, jnp.array([0, 1]), toks, jnp.array([5, 9]))
    st = bm.free(st, jnp.array([True, False, False, False, False, False]))
    st, _ = bm.fork(st, jnp.array([1, 2, 2]), jnp.array([3, 4, 5]))
    rng = np.random.default_rng(0)
    steps = jnp.asarray((rng.random((100, 6)) < 0.6).astype(np.int32))

    def step(state, num_new):
        state, res = bm.reserve(state, num_new)
        return state, res

    scanned, res_scan = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(st, steps)
    one = jax.jit(step)
    loop, oks = st, []
    for i in range(100):
        loop, res = one(loop, steps[i])
        oks.append(res)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(loop), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(res_scan, zip(*oks, strict=True), strict=True):
        np.testing.assert_array_equal(a, np.stack(b))
    # The run went through copy-on-write and running out.
    assert (np.asarray(res_scan.cow_dst) > 0).any() and not np.asarray(res_scan.ok).all()
    bm.check_invariants(scanned)


def test_init_checks():
    with pytest.raises(ValueError, match="num_blocks"):
        bm.init_state(1, 4, 1, 1)
    with pytest.raises(ValueError, match="hash_table_size"):
        bm.init_state(8, 4, 1, 1, hash_table_size=12)


def test_eviction_queue_skips_revived_entries_and_compacts_when_full():
    st = bm.init_state(4, 2, 2, 3, evict_chunk=1)  # ring of 8 entries, 3 usable blocks
    toks = [5, 6, 7]
    st, *_ = _reserve(st, [3, 0])  # [1, 2]
    st = _insert(st, 0, toks)  # block 1 cached
    st = bm.free(st, jnp.array([True, False]))
    for _ in range(12):  # revive and free again: each round leaves a stale entry
        st, cached, _ = _match(st, 1, toks)
        assert cached == 2
        st = bm.free(st, jnp.array([False, True]))
        bm.check_invariants(st)
    assert int(st.queue_len) <= 8 and eviction.eviction_order(st) == [1]
    st, ok, _, _ = _reserve(st, [0, 6])  # needs all 3 blocks: 2 and 3, then evicts 1
    assert ok == [True, True]
    assert sorted(_bt(st)[1]) == [1, 2, 3] and int(st.num_evictable) == 0


def test_cache_new_blocks_as_they_fill_equals_caching_whole_rows():
    """Random chunked growth of 4 slots: caching each step's newly full blocks from the slots'
    token rows (`cache_new_blocks`, what the engine's steps do) leaves the same prefix cache as
    re-keying whole rows (`cache_full_blocks`) after every step. Distinct prompts and a large
    table, so no two blocks contend for a bucket (under contention the two may differ: whole
    rows retry a lost bucket on every call, new blocks try once)."""
    rng = np.random.default_rng(0)
    bs, s, p = 4, 4, 12
    seqs = rng.integers(0, 1000, (s, p * bs)).astype(np.int32)
    seq_tokens = jnp.asarray(seqs)
    inc = full = bm.init_state(64, bs, s, p, hash_table_size=1 << 16)
    lens = np.zeros(s, np.int32)
    # Under jit as the engine calls them (op by op, each step would dispatch hundreds of ops).
    cache_new = jax.jit(pc.cache_new_blocks, static_argnames="max_new")
    cache_full = jax.jit(pc.cache_full_blocks)
    for step in range(14):
        chunk = rng.integers(0, 6, s) if step % 3 else np.ones(s, np.int64)
        chunk = np.minimum(chunk, p * bs - lens).astype(np.int32)
        old = inc.seq_lens
        inc, res_a = bm.reserve(inc, jnp.asarray(chunk))
        full, res_b = bm.reserve(full, jnp.asarray(chunk))
        assert np.asarray(res_a.ok).all() and np.asarray(res_b.ok).all()
        lens += chunk
        inc = cache_new(inc, seq_tokens, old, max_new=int(chunk.max()) // bs + 1)
        full = cache_full(full, jnp.arange(s), seq_tokens, jnp.asarray(lens))
        bm.check_invariants(inc)
        for f in ("cached", "hash_table", "block_hash", "block_chain", "block_parent"):
            np.testing.assert_array_equal(getattr(inc, f), getattr(full, f), err_msg=f)
        np.testing.assert_array_equal(
            np.asarray(inc.block_tokens)[np.asarray(inc.cached)],
            np.asarray(full.block_tokens)[np.asarray(full.cached)],
        )
    nfull = lens // bs
    assert int(np.asarray(inc.cached).sum()) == nfull.sum()  # every full block is cached
    keys = np.asarray(pc.block_hashes(seq_tokens, bs))
    tables = np.asarray(inc.block_tables)
    for r in range(s):
        np.testing.assert_array_equal(
            np.asarray(inc.block_hash)[tables[r, : nfull[r]]], keys[r, : nfull[r]]
        )
    # A new prompt, slot 0's first 25 tokens and then others, matches slot 0's cached blocks
    # and grows from that prefix: its new blocks continue the chain.
    inc = bm.free(inc, jnp.asarray([False, False, False, True]))
    probe = np.zeros((1, p * bs), np.int32)
    probe[0, :25] = seqs[0, :25]
    inc, cached, ok = pc.match_prefix(inc, jnp.asarray([3]), jnp.asarray(probe), jnp.asarray([25]))
    assert bool(ok[0]) and int(cached[0]) == min(24, int(nfull[0]) * bs)
    old = inc.seq_lens
    inc, _ = bm.reserve(inc, jnp.asarray([0, 0, 0, 9], jnp.int32))
    row3 = np.concatenate([seqs[0, :24], rng.integers(1000, 2000, p * bs - 24)]).astype(np.int32)
    inc = pc.cache_new_blocks(inc, seq_tokens.at[3].set(row3), old, max_new=4)
    bm.check_invariants(inc)
    n3 = int(inc.seq_lens[3]) // bs
    got = np.asarray(inc.block_hash)[np.asarray(inc.block_tables)[3, :n3]]
    np.testing.assert_array_equal(got, np.asarray(pc.block_hashes(jnp.asarray(row3), bs))[:n3])
    assert np.asarray(inc.cached)[np.asarray(inc.block_tables)[3, :n3]].all()
