"""The functional block manager: KV-cache blocks, block tables, refcounts, copy-on-write, and
the prefix cache's storage (its lookups and inserts: `prefix_cache`; its eviction queue and
hash-table buckets: `eviction`), as a pytree of JAX arrays changed only by pure, vectorised
functions.

Every op is `op(state, ...) -> (state, results...)`, jittable, usable inside `lax.scan` and
`while_loop`, and vectorised over the batch with cumsums and scatters: the per-step cost grows
with the number of sequence slots `S` and blocks per sequence `P`, not with the pool size `N`
(see "Costs" below; the one O(N) step, compacting the eviction queue, is amortised).

How tokens map to blocks and slots (block_size bs = 4, sequence in slot 2)::

    tokens (positions)   0  1  2  3 | 4  5  6  7 | 8  9
    logical block        0           1            2         (seq_lens[2] = 10)
    block_tables[2]    [ 7,          3,           9,   0, 0 ]  (unused entries hold 0)
    slot of position p = block_tables[2, p // bs] * bs + p % bs
    position 9        -> block 9, offset 1 -> slot 37

Physical block 0 is the null block (`NULL_BLOCK`): it is never handed out, unused table entries
point at it, and padding tokens write into it (their slot is 0).

Where the blocks live::

    in use:     ref_counts[b] > 0; b appears in ref_counts[b] block-table rows of live slots.
    free:       ref_counts[b] == 0, b not cached; b is in free_stack[:num_free] (LIFO).
    evictable:  ref_counts[b] == 0, b cached (a full block whose K/V may be reused by a later
                prompt with the same prefix); found by prefix match, evicted least recently
                freed first when the free stack runs dry. `evict_queue` lists them in the
                order they were freed (a ring; entries of blocks revived since are stale and
                skipped when popped, or dropped by a compaction when the ring fills; see
                `eviction`).

The cache holds no references: refcount == number of block-table entries pointing at the block.

Allocation order (`reserve`): requests are granted first come, first served in `priority`
order (default: slot order), as a prefix. Walking the requests in that order, each one that
needs blocks is granted while the running total of blocks needed still fits in
`num_free_blocks`; once one does not fit, no later request that needs blocks is granted (no
overtaking). Requests that need no block (decode inside a private partial block) always
succeed. Granted sequences take their blocks in grant order from the top of the free stack
(the copy-on-write block first, then the new logical blocks in order); when the stack runs
short, just enough of the least recently freed cached blocks are first evicted onto its top
(oldest on top, so they are handed out first, then the rest of the stack).

Prefix cache: a full block's key is a 32-bit hash of its tokens chained with its parent's key
(`prefix_cache.block_hashes`), stored in a direct-mapped table of `hash_table_size` buckets.
The hash only finds a candidate: a match also checks the block's stored tokens and that its
stored parent is the block matched one position earlier, in the incarnation it extended
(`block_gen` / `parent_gen`), so by induction the whole prefix is equal token for token and a
hash or bucket collision can only cost a miss, never give a request another request's K/V.
(Within one `free`, deeper logical blocks are queued for eviction first, so parents usually
outlive their cached children. A sliding window, `drop_out_of_window`, frees a sequence's
oldest blocks first; a child whose parent was then evicted and cached again for another
prefix no longer matches.)

Costs: reserve, token_slots, free, fork, match and insert are O(S * P) (plus O(M * P * bs)
token compares for match/insert). Eviction pops the queue in windows of `evict_chunk` entries,
O(evicted + stale entries skipped). A `free` that would overflow the queue ring first compacts
it, O(N), at most once per N queued blocks (amortised O(1)). Nothing else touches all N blocks
(scatters into the state's own [N] arrays are in place when the state is donated or carried
through a `scan`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_paged.memory.eviction import compact_queue, evict

# Re-exported: tests and debugging call `block_manager.check_invariants`.
from jax_paged.memory.invariants import check_invariants as check_invariants

NULL_BLOCK = 0

_I32_MAX = np.iinfo(np.int32).max


@struct.dataclass
class BlockManagerState:
    """Block tables, refcounts, free pool and prefix cache of a paged KV cache.

    Attributes:
      block_tables: i32[S, P] physical block of each logical block of each slot (0 = none).
      seq_lens: i32[S] tokens with reserved K/V slots per slot (0 for free slots).
      live: bool[S] the slot holds a sequence.
      ref_counts: i32[N] block-table entries pointing at each block.
      free_stack: i32[N] free, uncached block ids in `free_stack[:num_free]`; top = next out.
      num_free: i32[] size of the free stack.
      num_evictable: i32[] cached blocks with refcount 0 (reusable after eviction).
      cached: bool[N] block is in the prefix cache (full, keyed, findable by `match_prefix`).
      block_hash: u32[N] chained key of a cached block (`prefix_cache.block_hashes`).
      block_chain: u32[N] its chain value before the final mix (`prefix_cache.chain_values`),
        from which the keys of the blocks after it continue as they fill.
      block_parent: i32[N] physical block before a cached block in its sequence (0 for roots).
      block_gen: i32[N] how many times each block has been cached (its incarnation).
      parent_gen: i32[N] the parent's ``block_gen`` when a cached block was cached: a block
        extends its parent only while these agree (the parent may be evicted first and its id
        cached again for another prefix; see the module docstring).
      block_tokens: i32[N, bs] token ids of a cached block (verified on every match).
      evict_queue: i32[C] ring (C = 2N) of evictable blocks, least recently freed first, from
        `queue_head` for `queue_len` entries; stale entries (block revived, re-queued or
        evicted since) are skipped.
      queue_pos: i32[N] ring index of an evictable block's live entry (an entry at index q
        for block b is live iff b is evictable and queue_pos[b] == q); unspecified otherwise.
      queue_head: i32[] ring index of the oldest entry.
      queue_len: i32[] entries in the ring, stale ones included.
      hash_table: i32[H] direct-mapped bucket -> cached block id (0 = empty); H a power of two.
      block_size: static tokens per block.
      evict_chunk: static queue entries examined per eviction round.
    """

    block_tables: jax.Array
    seq_lens: jax.Array
    live: jax.Array
    ref_counts: jax.Array
    free_stack: jax.Array
    num_free: jax.Array
    num_evictable: jax.Array
    cached: jax.Array
    block_hash: jax.Array
    block_chain: jax.Array
    block_parent: jax.Array
    block_gen: jax.Array
    parent_gen: jax.Array
    block_tokens: jax.Array
    evict_queue: jax.Array
    queue_pos: jax.Array
    queue_head: jax.Array
    queue_len: jax.Array
    hash_table: jax.Array
    block_size: int = struct.field(pytree_node=False, default=16)
    evict_chunk: int = struct.field(pytree_node=False, default=256)

    @property
    def num_blocks(self) -> int:
        return self.ref_counts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


class Reservation(NamedTuple):
    """What `reserve` tells the scheduler and the KV cache.

    Attributes:
      ok: bool[S] the slot got room for all its new tokens, or asked for none. False: the slot
        is untouched (preempt it, or retry later).
      cow_src, cow_dst: i32[S] copy block `cow_src` into `cow_dst` (`KVCache.copy_blocks`)
        before writing; (0, 0) = no copy.
    """

    ok: jax.Array
    cow_src: jax.Array
    cow_dst: jax.Array


def init_state(
    num_blocks: int,
    block_size: int,
    max_seqs: int,
    max_blocks_per_seq: int,
    *,
    hash_table_size: int | None = None,
    evict_chunk: int = 256,
) -> BlockManagerState:
    """An empty manager: all blocks but the null block free; they come out as 1, 2, 3, ..."""
    if num_blocks < 2:
        raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the null block)")
    if block_size < 1 or max_seqs < 1 or max_blocks_per_seq < 1:
        raise ValueError(f"{block_size=}, {max_seqs=}, {max_blocks_per_seq=} must be >= 1")
    if hash_table_size is None:
        hash_table_size = 1 << int(np.ceil(np.log2(2 * num_blocks)))
    if hash_table_size < 1 or hash_table_size & (hash_table_size - 1):
        raise ValueError(f"{hash_table_size=} must be a power of two")
    if evict_chunk < 1:
        raise ValueError(f"{evict_chunk=} must be >= 1")
    n = num_blocks
    stack = np.zeros(n, np.int32)
    stack[: n - 1] = np.arange(n - 1, 0, -1)  # top of stack (index n-2) is block 1
    return BlockManagerState(
        block_tables=jnp.zeros((max_seqs, max_blocks_per_seq), jnp.int32),
        seq_lens=jnp.zeros(max_seqs, jnp.int32),
        live=jnp.zeros(max_seqs, bool),
        ref_counts=jnp.zeros(n, jnp.int32),
        free_stack=jnp.asarray(stack),
        num_free=jnp.int32(n - 1),
        num_evictable=jnp.int32(0),
        cached=jnp.zeros(n, bool),
        block_hash=jnp.zeros(n, jnp.uint32),
        block_chain=jnp.zeros(n, jnp.uint32),
        block_parent=jnp.zeros(n, jnp.int32),
        block_gen=jnp.zeros(n, jnp.int32),
        parent_gen=jnp.zeros(n, jnp.int32),
        block_tokens=jnp.zeros((n, block_size), jnp.int32),
        evict_queue=jnp.zeros(2 * n, jnp.int32),
        queue_pos=jnp.zeros(n, jnp.int32),
        queue_head=jnp.int32(0),
        queue_len=jnp.int32(0),
        hash_table=jnp.zeros(hash_table_size, jnp.int32),
        block_size=block_size,
        evict_chunk=min(evict_chunk, 2 * n),
    )


@jax.jit
def num_free_blocks(state: BlockManagerState) -> jax.Array:
    """i32[]: blocks a reservation can take now (free stack + evictable cached blocks)."""
    return state.num_free + state.num_evictable


def sole_blocks(state: BlockManagerState) -> jax.Array:
    """i32[S]: blocks only this slot holds (refcount 1): what freeing it gives back to the pool
    (free or evictable); blocks shared by forks or prefix hits are not counted."""
    t = state.block_tables
    sole = (t != NULL_BLOCK) & (state.ref_counts[t] == 1)
    return jnp.where(state.live, jnp.sum(sole, axis=1, dtype=jnp.int32), 0)


def _cdiv(a, b):
    return (a + b - 1) // b


def _excl_cumsum(x):
    c = jnp.cumsum(x)
    return c - x


def first_occurrence(scratch, ids, valid, order, drop):
    """Marks, among valid entries sharing an id, the one with the smallest `order` (also used by
    `prefix_cache`).

    `scratch` is an array indexed by id whose values at the valid ids are dead (overwritten);
    `drop` is an out-of-bounds index. Returns (scratch, first bool like ids).
    """
    idx = jnp.where(valid, ids, drop)
    scratch = scratch.at[idx].set(_I32_MAX, mode="drop")
    scratch = scratch.at[idx].min(order, mode="drop")
    first = valid & (scratch[jnp.clip(ids, 0, scratch.shape[0] - 1)] == order)
    return scratch, first


# ---------------------------------------------------------------------------------------------
# Reserve and slots.


def _plan(state, num_new):
    p = state.max_blocks_per_seq
    bs = state.block_size
    num_new = jnp.maximum(jnp.asarray(num_new, jnp.int32), 0)
    want = num_new > 0
    lens = state.seq_lens
    old_nb = _cdiv(lens, bs)
    new_len = lens + num_new
    new_nb = _cdiv(new_len, bs)
    valid = want & (new_nb <= p)
    last = jnp.take_along_axis(state.block_tables, jnp.clip(old_nb - 1, 0, p - 1)[:, None], 1)
    last = last[:, 0]
    cow = valid & (lens % bs != 0) & (state.ref_counts[last] > 1)
    need = jnp.where(valid, new_nb - old_nb + cow, 0)
    return want, valid, old_nb, new_nb, need, cow, last, new_len


@jax.jit
def reserve(
    state: BlockManagerState, num_new: jax.Array, *, priority: jax.Array | None = None
) -> tuple[BlockManagerState, Reservation]:
    """Makes room for `num_new[s]` more tokens in each slot s (0 = untouched).

    A free slot with num_new > 0 becomes live (an empty sequence that grows). Blocks are taken
    only where a sequence crosses into a new block; writing into a shared partial last block
    first gives the sequence a private copy (copy-on-write; the pair is returned). When every
    sharer of a partial block writes in the same call, the lowest slot keeps the original.

    All or nothing per sequence, granted in `priority` order (i32[S], smaller first, ties by
    slot; default slot order) as described in the module docstring. A request past the block
    table (`max_blocks_per_seq`) fails. Running out of blocks is reported in `ok`, never
    corrupts the state.

    Example (bs = 4, free stack top 5, 6, ...; slot 0 holds 3 tokens in block 2, rc 1)::

        num_new = [3, 5]    slot 0: tokens 3..5 -> fills block 2, takes block 5
                            slot 1 (free): tokens 0..4 -> takes blocks 6, 7
    """
    s, p = state.block_tables.shape
    n = state.num_blocks
    want, valid, old_nb, new_nb, need, cow, last, new_len = _plan(state, num_new)
    slots = jnp.arange(s, dtype=jnp.int32)
    order = slots if priority is None else jnp.argsort(priority, stable=True).astype(jnp.int32)
    cum = jnp.zeros(s, jnp.int32).at[order].set(jnp.cumsum(need[order]))
    granted = valid & ((need == 0) | (cum <= num_free_blocks(state)))

    # Copy-on-write; if all sharers of a block write now, the lowest slot keeps it.
    cow_g = cow & granted
    rc = state.ref_counts.at[jnp.where(cow_g, last, n)].add(-1, mode="drop")
    all_cow = cow_g & (rc[last] == 0)
    # queue_pos of in-use blocks is dead, so it serves as scratch.
    scratch, keeper = first_occurrence(state.queue_pos, last, all_cow, slots, n)
    rc = rc.at[jnp.where(keeper, last, n)].add(1, mode="drop")
    do_cow = cow_g & ~keeper

    take = jnp.where(granted, new_nb - old_nb + do_cow, 0)
    off = jnp.zeros(s, jnp.int32).at[order].set(_excl_cumsum(take[order]))
    total = take.sum()
    state = state.replace(ref_counts=rc, queue_pos=scratch)
    state = evict(state, jnp.clip(total - state.num_free, 0, state.num_evictable))
    top = state.num_free
    stack = state.free_stack

    def pop(rank):
        return stack[jnp.clip(top - 1 - rank, 0, n - 1)]

    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    is_new = granted[:, None] & (j >= old_nb[:, None]) & (j < new_nb[:, None])
    new_blk = pop(off[:, None] + do_cow[:, None] + j - old_nb[:, None])
    bt = jnp.where(is_new, new_blk, state.block_tables)
    dst = jnp.where(do_cow, pop(off), 0)
    src = jnp.where(do_cow, last, 0)
    is_last = do_cow[:, None] & (j == (old_nb - 1)[:, None])
    bt = jnp.where(is_last, dst[:, None], bt)
    rc = state.ref_counts.at[jnp.where(is_new, new_blk, n)].set(1, mode="drop")
    rc = rc.at[jnp.where(do_cow, dst, n)].set(1, mode="drop")
    state = state.replace(
        block_tables=bt,
        seq_lens=jnp.where(granted, new_len, state.seq_lens),
        live=state.live | granted,
        ref_counts=rc,
        num_free=top - total,
    )
    return state, Reservation(ok=granted | ~want, cow_src=src, cow_dst=dst)


@jax.jit
def token_slots(state: BlockManagerState, seq_idx: jax.Array, positions: jax.Array) -> jax.Array:
    """i32[T] KV slot of each (sequence slot, position) pair: `bt[p // bs] * bs + p % bs`.

    Pairs outside the slot range or outside [0, seq_lens[seq]) (padding) get slot 0, a slot of
    the null block.
    """
    s, p = state.block_tables.shape
    bs = state.block_size
    seq_idx = jnp.asarray(seq_idx, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    seq_c = jnp.clip(seq_idx, 0, s - 1)
    valid = (seq_idx >= 0) & (seq_idx < s) & (positions >= 0)
    valid &= positions < state.seq_lens[seq_c]
    blk = state.block_tables[seq_c, jnp.clip(positions // bs, 0, p - 1)]
    return jnp.where(valid, blk * bs + positions % bs, 0)


# ---------------------------------------------------------------------------------------------
# Free and fork.


def _release(state: BlockManagerState, ent: jax.Array, blk: jax.Array) -> BlockManagerState:
    """Drops one reference for each entry of the flat ``blk`` (i32[E]) where ``ent`` (bool[E]),
    listed in release order. Blocks whose refcount reaches 0 go onto the free stack, or, if
    cached, to the eviction queue's tail, in that order. Block tables are left to the caller."""
    n = state.num_blocks
    rc = state.ref_counts.at[jnp.where(ent, blk, n)].add(-1, mode="drop")
    zero = ent & (rc[blk] == 0)
    e = jnp.arange(blk.shape[0], dtype=jnp.int32)
    qpos, first = first_occurrence(state.queue_pos, blk, zero, e, n)
    was_cached = state.cached[blk]
    push = first & ~was_cached
    ev = first & was_cached
    stack = state.free_stack.at[jnp.where(push, state.num_free + _excl_cumsum(push), n)].set(
        blk, mode="drop"
    )
    n_push = push.sum(dtype=jnp.int32)
    n_ev = ev.sum(dtype=jnp.int32)
    # Queue the newly evictable blocks at the ring's tail (compacting first if it is full).
    c = state.evict_queue.shape[0]
    state = state.replace(queue_pos=qpos)
    state = jax.lax.cond(state.queue_len + n_ev > c, compact_queue, lambda st: st, state)
    tail = (state.queue_head + state.queue_len + _excl_cumsum(ev)) % c
    return state.replace(
        evict_queue=state.evict_queue.at[jnp.where(ev, tail, c)].set(blk, mode="drop"),
        queue_pos=state.queue_pos.at[jnp.where(ev, blk, n)].set(tail, mode="drop"),
        queue_len=state.queue_len + n_ev,
        ref_counts=rc,
        free_stack=stack,
        num_free=state.num_free + n_push,
        num_evictable=state.num_evictable + n_ev,
    )


@jax.jit
def free(state: BlockManagerState, mask: jax.Array) -> BlockManagerState:
    """Ends the sequences of the live slots in `mask` (bool[S]); other slots are untouched.

    Blocks whose refcount reaches 0 go onto the free stack, or, if cached, become evictable.
    Both in the order (logical block descending, then slot ascending): a freed sequence's
    uncached blocks come back out in table order, and cached blocks deeper in a sequence are
    evicted before the blocks they extend (so a cached block's parent outlives it).
    """
    p = state.max_blocks_per_seq
    m = jnp.asarray(mask, bool) & state.live
    bt = state.block_tables
    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    # Entries a sliding window dropped (`drop_out_of_window`) hold the null block: skipped.
    ent = m[:, None] & (j < _cdiv(state.seq_lens, state.block_size)[:, None]) & (bt != NULL_BLOCK)
    # Release order: logical block descending, then slot ascending. Deeper blocks first, so a
    # cached child is always queued before its parent (evicted first).
    state = _release(state, ent.T[::-1].reshape(-1), bt.T[::-1].reshape(-1))
    return state.replace(
        block_tables=jnp.where(m[:, None], 0, bt),
        seq_lens=jnp.where(m, 0, state.seq_lens),
        live=state.live & ~m,
    )


def window_dead_blocks(seq_lens: jax.Array, block_size: int, window: int) -> jax.Array:
    """i32[S]: how many leading blocks of sequences of ``seq_lens`` tokens a sliding
    ``window`` no longer needs (`drop_out_of_window`); works on numpy arrays and ints too.

    The next query sits at position ``seq_lens`` or later and sees keys after
    ``seq_lens - window``, so block j is dead once ``(j + 1) * bs <= seq_lens - window + 1``.
    The last two blocks are always kept: the prefix cache keys each block as it fills from the
    chain value of the block before it."""
    xp = jnp if isinstance(seq_lens, jax.Array) else np
    nb = (seq_lens + block_size - 1) // block_size
    return xp.maximum(xp.minimum(nb - 2, (seq_lens - window + 1) // block_size), 0)


@functools.partial(jax.jit, static_argnames=("window", "band"))
def drop_out_of_window(
    state: BlockManagerState, window: int, band: int | None = None
) -> BlockManagerState:
    """Returns to the pool the blocks of live sequences that fell out of a sliding ``window``
    (static; every layer attends through the same one), leaving the null block in their
    table entries: entries ``[0, window_dead_blocks(seq_lens))`` of every live slot.

    Blocks whose refcount reaches 0 go onto the free stack, or, if cached, become evictable, in
    the order (slot ascending, then logical block descending). ``band`` (static): look only at
    the last ``band`` dead entries of each slot, O(S * band) instead of O(S * P); right when the
    earlier ones were dropped before (a decode step adds at most one dead block per slot).
    """
    p = state.max_blocks_per_seq
    hi = window_dead_blocks(state.seq_lens, state.block_size, window)  # [S]
    k = p if band is None else min(band, p)
    if band is None:
        j = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], state.block_tables.shape)
    else:
        j = hi[:, None] - k + jnp.arange(k, dtype=jnp.int32)[None, :]  # [S, k]
    rows = jnp.arange(state.max_seqs)[:, None]
    blk = state.block_tables[rows, jnp.clip(j, 0, p - 1)]
    ent = state.live[:, None] & (j >= 0) & (j < hi[:, None]) & (blk != NULL_BLOCK)
    state = _release(state, ent[:, ::-1].reshape(-1), blk[:, ::-1].reshape(-1))
    s = state.max_seqs
    return state.replace(
        block_tables=state.block_tables.at[jnp.where(ent, rows, s), j].set(NULL_BLOCK, mode="drop")
    )


@jax.jit
def fork(
    state: BlockManagerState, parent: jax.Array, child: jax.Array
) -> tuple[BlockManagerState, jax.Array]:
    """Copies live slot `parent[i]` into free slot `child[i]` (n>1 sampling, beams).

    The child shares every block of the parent (refcounts go up); the first write into a shared
    partial last block copies it (see `reserve`). Returns ok bool[M]: False for pairs out of
    range (use -1 to pad), with a dead parent, a live child, or a child repeated earlier in
    the list; those pairs do nothing.
    """
    s, p = state.block_tables.shape
    n = state.num_blocks
    parent = jnp.asarray(parent, jnp.int32)
    child = jnp.asarray(child, jnp.int32)
    mm = parent.shape[0]
    pc = jnp.clip(parent, 0, s - 1)
    cc = jnp.clip(child, 0, s - 1)
    ok = (parent >= 0) & (parent < s) & (child >= 0) & (child < s)
    ok &= state.live[pc] & ~state.live[cc]
    _, ok = first_occurrence(jnp.zeros(s, jnp.int32), child, ok, jnp.arange(mm), s)
    rows = state.block_tables[pc]
    lens = state.seq_lens[pc]
    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    ent = ok[:, None] & (j < _cdiv(lens, state.block_size)[:, None]) & (rows != NULL_BLOCK)
    dst = jnp.where(ok, cc, s)
    return (
        state.replace(
            block_tables=state.block_tables.at[dst].set(rows, mode="drop"),
            seq_lens=state.seq_lens.at[dst].set(lens, mode="drop"),
            live=state.live.at[dst].set(True, mode="drop"),
            ref_counts=state.ref_counts.at[jnp.where(ent, rows, n)].add(1, mode="drop"),
        ),
        ok,
    )
