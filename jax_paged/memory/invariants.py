"""Host-side checks of a `block_manager.BlockManagerState`, for tests and debugging.

`check_invariants` asserts, in numpy on the host, every property the block manager's ops keep
(see the `block_manager` docstring for where blocks live): tables and lengths agree, the null
block only leads a sequence and is never handed out, refcounts equal the block-table
references, every block is exactly one of free / in use / evictable, and the prefix cache's
buckets, parents and eviction order are consistent. `block_manager` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from jax_paged.memory.eviction import eviction_order

if TYPE_CHECKING:
    from jax_paged.memory.block_manager import BlockManagerState


def check_invariants(state: BlockManagerState, window_drops: bool = False) -> None:
    """Asserts the state's invariants on the host (numpy); for tests and debugging.

    ``window_drops``: `drop_out_of_window` may have run, which frees parents before their
    cached children, so the parent-outlives-child properties are not asserted."""
    # Imported here: block_manager imports this module (to re-export this function).
    from jax_paged.memory.block_manager import NULL_BLOCK

    st = jax.device_get(state)
    bt = np.asarray(st.block_tables)
    lens = np.asarray(st.seq_lens)
    live = np.asarray(st.live)
    rc = np.asarray(st.ref_counts)
    cached = np.asarray(st.cached)
    n = rc.shape[0]
    s, p = bt.shape
    bs = st.block_size
    nf = int(st.num_free)
    ne = int(st.num_evictable)
    nb = -(-lens // bs)
    assert (nb <= p).all(), "sequence longer than its block table"
    assert (lens[~live] == 0).all() and (bt[~live] == 0).all(), "free slot holds blocks"
    used = np.arange(p)[None, :] < nb[:, None]
    assert (bt[~used] == NULL_BLOCK).all(), "stale block-table entry"
    # Within a sequence's blocks the null block may only lead (blocks a sliding window
    # dropped, `drop_out_of_window`), and never covers the last two.
    held = used & (bt != NULL_BLOCK)
    lead = used & (np.cumsum(held, axis=1) == 0)
    assert ((used & ~held) == lead).all(), "null block inside a sequence"
    assert (lead.sum(1) <= np.maximum(nb - 2, 0)).all(), "null block among the last two"
    counts = np.bincount(bt[held], minlength=n)
    assert (counts == rc).all(), "refcount != block-table references"
    for row in bt:
        r = row[row != 0]
        assert len(set(r.tolist())) == len(r), "block twice in one table"
    stack = np.asarray(st.free_stack)[:nf]
    assert len(set(stack.tolist())) == nf, "block twice on the free stack"
    on_stack = np.zeros(n, bool)
    on_stack[stack] = True
    assert not on_stack[NULL_BLOCK] and rc[NULL_BLOCK] == 0 and not cached[NULL_BLOCK]
    assert not (on_stack & (rc > 0)).any(), "block free and referenced"
    assert not (on_stack & cached).any(), "cached block on the free stack"
    evictable = cached & (rc == 0)
    assert ne == evictable.sum(), "num_evictable"
    assert nf + evictable.sum() + (rc > 0).sum() == n - 1, "free + used != total"
    table = np.asarray(st.hash_table)
    hsize = table.shape[0]
    hashes = np.asarray(st.block_hash)
    parent = np.asarray(st.block_parent)
    gen, pgen = np.asarray(st.block_gen), np.asarray(st.parent_gen)
    order = {b: i for i, b in enumerate(eviction_order(st))}
    assert sorted(order) == np.flatnonzero(evictable).tolist(), "eviction queue != evictable"
    for b in np.flatnonzero(cached):
        assert table[hashes[b] & (hsize - 1)] == b, "cached block not in its bucket"
        assert gen[b] >= 1, "cached block not counted in block_gen"
        # A parent freed before its child (sliding-window drops) may have been evicted, or
        # evicted and cached again (a new incarnation): the child then matches nothing.
        pb = parent[b]
        assert pb == 0 or pgen[b] <= gen[pb], "parent_gen ahead of the parent's block_gen"
        if not window_drops:  # then parents outlive their cached children
            assert pb == 0 or (cached[pb] and pgen[b] == gen[pb]), "cached block's parent gone"
            if pb and evictable[b] and evictable[pb]:
                assert order[b] < order[pb], "parent would be evicted before its child"
    assert np.count_nonzero(table) == cached.sum(), "stale hash-table entry"
