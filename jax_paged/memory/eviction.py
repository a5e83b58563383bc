"""The prefix cache's eviction queue and hash-table buckets, on a `block_manager.BlockManagerState`.

A cached block that no sequence holds (refcount 0) is *evictable*: a later prompt with the same
prefix can still find it (`prefix_cache.match_prefix` revives it), but when the free stack runs
dry `block_manager.reserve` evicts such blocks, least recently freed first, onto the free stack
(`evict`). The order lives in ``evict_queue``, a ring of C = 2N block ids, oldest at
``queue_head``, ``queue_len`` entries long; ``queue_pos[b]`` is the ring index of block b's
live entry. `block_manager.free` appends newly evictable blocks at the tail. An entry whose
block was revived, re-queued or evicted since is *stale* (`entry_live` is False): `evict`
skips it when popping, and when an append would overflow the ring, `compact_queue` first drops
all stale entries (O(N), at most once per N queued blocks: amortised O(1)). `evict` pops in
windows of ``evict_chunk`` entries, O(evicted + stale entries skipped).

Buckets: a cached block sits in bucket ``hash_bucket(block_hash[b], H)`` of the direct-mapped
``hash_table`` (H a power of two; the keys are `prefix_cache.block_hashes`); eviction empties
its bucket.

All device functions are pure and jittable (``state -> state``); `eviction_order` is a
host-side view for tests and debugging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jax_paged.memory.block_manager import BlockManagerState


def hash_bucket(keys, table_size):
    """u32[...] keys -> i32[...] their buckets in [0, table_size) (a power of two)."""
    return (keys & jnp.uint32(table_size - 1)).astype(jnp.int32)


def entry_live(state: BlockManagerState, q):
    """bool like q (i32[...] ring indices): the queue entry at q names an evictable block."""
    b = state.evict_queue[q]
    return state.cached[b] & (state.ref_counts[b] == 0) & (state.queue_pos[b] == q)


def evict(state: BlockManagerState, count) -> BlockManagerState:
    """Moves the `count` (i32[]) least recently freed evictable blocks onto the free stack.

    The oldest ends on top (handed out first). Requires count <= num_evictable. Pops the queue
    in windows of `evict_chunk` entries, skipping stale ones; zero rounds when count == 0.
    """
    n = state.num_blocks
    c = state.evict_queue.shape[0]
    w = state.evict_chunk
    hsize = state.hash_table.shape[0]
    base = state.num_free
    ar = jnp.arange(w, dtype=jnp.int32)

    def cond(carry):
        _, done = carry
        return done < count

    def body(carry):
        st, done = carry
        q = (st.queue_head + ar) % c
        live = (ar < st.queue_len) & entry_live(st, q)
        rank = done + jnp.cumsum(live) - live  # global age rank among popped, 0 = oldest
        take = live & (rank < count)
        blk = st.evict_queue[q]
        # Advance past everything examined, or just past the last block taken.
        last = jnp.max(jnp.where(take, ar, -1))
        adv = jnp.where(done + live.sum() <= count, jnp.minimum(w, st.queue_len), last + 1)
        pos = jnp.where(take, base + count - 1 - rank, n)
        drop = jnp.where(take, blk, n)
        st = st.replace(
            free_stack=st.free_stack.at[pos].set(blk, mode="drop"),
            cached=st.cached.at[drop].set(False, mode="drop"),
            hash_table=st.hash_table.at[
                jnp.where(take, hash_bucket(st.block_hash[blk], hsize), hsize)
            ].set(0, mode="drop"),
            queue_head=(st.queue_head + adv) % c,
            queue_len=st.queue_len - adv,
        )
        return st, done + take.sum(dtype=jnp.int32)

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state.replace(num_free=state.num_free + count, num_evictable=state.num_evictable - count)


def compact_queue(state: BlockManagerState) -> BlockManagerState:
    """Drops the stale entries of the eviction queue, keeping order; O(N)."""
    c = state.evict_queue.shape[0]
    n = state.num_blocks
    ar = jnp.arange(c, dtype=jnp.int32)
    q = (state.queue_head + ar) % c
    live = (ar < state.queue_len) & entry_live(state, q)
    new = jnp.cumsum(live) - live
    blk = state.evict_queue[q]
    return state.replace(
        evict_queue=state.evict_queue.at[jnp.where(live, new, c)].set(blk, mode="drop"),
        queue_pos=state.queue_pos.at[jnp.where(live, blk, n)].set(new, mode="drop"),
        queue_head=jnp.int32(0),
        queue_len=live.sum(dtype=jnp.int32),
    )


def eviction_order(state: BlockManagerState) -> list[int]:
    """Host-side: the evictable blocks, next to be evicted first (live queue entries)."""
    st = jax.device_get(state)
    queue, pos = np.asarray(st.evict_queue), np.asarray(st.queue_pos)
    rc, cached = np.asarray(st.ref_counts), np.asarray(st.cached)
    c = queue.shape[0]
    out = []
    for i in range(int(st.queue_len)):
        q = (int(st.queue_head) + i) % c
        b = int(queue[q])
        if cached[b] and rc[b] == 0 and pos[b] == q:
            out.append(b)
    return out
