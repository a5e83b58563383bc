"""The prefix cache on top of the block manager: full blocks keyed by their tokens and their
parent's key, looked up and matched by new prompts, inserted as sequences fill blocks.

Keys: a full block's key is a 32-bit hash of its tokens chained with its parent's key
(`block_hashes`), stored in the block manager's direct-mapped table (`hash_table`). The hash
only finds a candidate; a match also checks the block's stored tokens and that its stored
parent, in the incarnation it extended, is the block matched one position earlier (see
`block_manager`'s docstring), so a collision can only cost a miss. Cached blocks that no
sequence holds are evictable: the block manager's `reserve` evicts them least recently freed
first when the free stack runs dry.

All ops are pure and jittable, ``op(state, ...) -> (state, results...)`` on a
`block_manager.BlockManagerState`, O(M * P * bs) for M prompts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged.memory.block_manager import NULL_BLOCK, BlockManagerState, first_occurrence
from jax_paged.memory.eviction import hash_bucket

_MIX_A = 0x85EBCA6B
_MIX_B = 0xC2B2AE35
_TOKEN_STEP = 0x9E3779B9
_CHAIN = 0x01000193  # odd, so invertible mod 2**32


def _mix32(x):
    """murmur3's 32-bit finaliser (uint32 in, uint32 out)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_MIX_A)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(_MIX_B)
    return x ^ (x >> 16)


def block_digests(tokens: jax.Array, block_size: int) -> jax.Array:
    """d_j, a mix of each full block's tokens and their offsets: i32[..., K * bs] -> u32[..., K]."""
    *lead, length = tokens.shape
    k = length // block_size
    t = tokens[..., : k * block_size].reshape(*lead, k, block_size).astype(jnp.uint32)
    offs = jnp.arange(block_size, dtype=jnp.uint32) * jnp.uint32(_TOKEN_STEP)
    return _mix32(_mix32(t + offs).sum(-1, dtype=jnp.uint32))


def chain_values(d: jax.Array, base: jax.Array | int = 0) -> jax.Array:
    """H_j = H_{j-1} * C + d_j (mod 2**32) along the last axis of ``d`` (u32[..., K]), from
    H_{-1} = ``base`` (u32[...]). The chain is linear, so all of it is one cumsum:
    H_j = C**(j+1) * base + C**j * sum_{k<=j} d_k * C**-k."""
    k = d.shape[-1]
    c_inv = pow(_CHAIN, -1, 1 << 32)
    c_pow = np.array([pow(_CHAIN, j, 1 << 32) for j in range(k + 1)], np.uint64)
    c_inv_pow = np.array([pow(c_inv, j, 1 << 32) for j in range(k)], np.uint64)
    c_pow = jnp.asarray(c_pow.astype(np.uint32))
    c_inv_pow = jnp.asarray(c_inv_pow.astype(np.uint32))
    h = jnp.cumsum(d * c_inv_pow, axis=-1, dtype=jnp.uint32) * c_pow[:k]
    return h + jnp.asarray(base, jnp.uint32)[..., None] * c_pow[1:]


def block_hashes(tokens: jax.Array, block_size: int) -> jax.Array:
    """Chained keys of the full blocks of token rows: i32[..., K * bs] -> u32[..., K].

    With d_j = `block_digests` and the chain H_j = H_{j-1} * C + d_j (`chain_values`, H_{-1} =
    0), key_j = mix(H_j).
    """
    return _mix32(chain_values(block_digests(tokens, block_size)))


def lookup_blocks(state: BlockManagerState, tokens, num_tokens) -> tuple[jax.Array, jax.Array]:
    """(candidate blocks i32[M, k], matched blocks i32[M]): the cached chain of each prompt's
    whole blocks (tokens: i32[M, K], row i valid up to num_tokens[i]), at most
    (num_tokens - 1) // bs of them; k = min(P, K // bs). Changes nothing."""
    p = state.block_tables.shape[1]
    bs = state.block_size
    tokens = jnp.asarray(tokens, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    mm, length = tokens.shape
    k = min(p, length // bs)
    if k == 0:
        return jnp.zeros((mm, 0), jnp.int32), jnp.zeros(mm, jnp.int32)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    keys = block_hashes(tokens[:, : k * bs], bs)  # [M, k]
    cand = state.hash_table[hash_bucket(keys, state.hash_table.shape[0])]
    prev = jnp.concatenate([jnp.zeros((mm, 1), jnp.int32), cand[:, :-1]], axis=1)
    same = (state.block_tokens[cand] == tokens[:, : k * bs].reshape(mm, k, bs)).all(-1)
    good = (cand != NULL_BLOCK) & state.cached[cand] & (state.block_hash[cand] == keys)
    good &= same & (state.block_parent[cand] == prev)
    good &= state.parent_gen[cand] == state.block_gen[prev]  # the parent's same incarnation
    good &= j < jnp.clip((num_tokens - 1) // bs, 0, k)[:, None]
    return cand, jnp.cumprod(good, axis=1).sum(1, dtype=jnp.int32)


@jax.jit
def lookup_prefix(
    state: BlockManagerState, tokens: jax.Array, num_tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """What `match_prefix` would find, changing nothing: tokens: i32[M, K] prompts, row i
    valid up to num_tokens[i]. Returns (cached tokens i32[M], blocks i32[M] among them that are
    evictable now, i.e. that matching would take out of the free pool)."""
    return prefix_hits(state, *lookup_blocks(state, tokens, num_tokens))


def prefix_hits(state: BlockManagerState, cand: jax.Array, matched: jax.Array):
    """(cached tokens i32[M], evictable blocks among them i32[M]) of a `lookup_blocks` result."""
    ent = jnp.arange(cand.shape[1], dtype=jnp.int32)[None, :] < matched[:, None]
    revive = (ent & (state.ref_counts[cand] == 0)).sum(1, dtype=jnp.int32)
    return matched * state.block_size, revive


@jax.jit
def match_prefix(
    state: BlockManagerState, slots: jax.Array, tokens: jax.Array, num_tokens: jax.Array
) -> tuple[BlockManagerState, jax.Array, jax.Array]:
    """Starts sequences in free slots from the longest cached prefix of their prompts.

    slots: i32[M] free slots (-1 = padding row); tokens: i32[M, K] prompts, row i valid up to
    num_tokens[i]. Matches whole blocks only, and at most (num_tokens - 1) // bs of them, so at
    least one prompt token is left to compute (its logits are needed). The slot becomes live
    with the matched blocks (references taken; evictable ones revived) and
    seq_lens = matched blocks * bs, even when nothing matched.

    Returns (state, num_cached_tokens i32[M], ok bool[M]); rows with ok False (slot out of
    range, live, or repeated) change nothing and report 0 cached tokens.
    """
    cand, matched = lookup_blocks(state, tokens, num_tokens)
    return take_prefix(state, slots, cand, matched)


def take_prefix(
    state: BlockManagerState, slots: jax.Array, cand: jax.Array, matched: jax.Array
) -> tuple[BlockManagerState, jax.Array, jax.Array]:
    """`match_prefix` given what `lookup_blocks` found (cand: i32[M, k], matched: i32[M]) on
    this same state: starts each free slot of ``slots`` (i32[M], -1 = padding) from its first
    ``matched`` blocks. Returns (state, num_cached_tokens i32[M], ok bool[M])."""
    s, p = state.block_tables.shape
    n = state.num_blocks
    slots = jnp.asarray(slots, jnp.int32)
    mm = slots.shape[0]
    sc = jnp.clip(slots, 0, s - 1)
    ok = (slots >= 0) & (slots < s) & ~state.live[sc]
    _, ok = first_occurrence(jnp.zeros(s, jnp.int32), slots, ok, jnp.arange(mm), s)
    k = cand.shape[1]
    bs = state.block_size
    matched = jnp.where(ok, matched, 0)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    ent = j < matched[:, None]
    blocks = jnp.where(ent, cand, 0)
    revive = ent & (state.ref_counts[cand] == 0)
    scratch, first = first_occurrence(  # revived blocks leave the queue: their entries go stale
        state.queue_pos, cand, revive, jnp.arange(mm * k, dtype=jnp.int32).reshape(mm, k), n
    )
    rows = jnp.zeros((mm, p), jnp.int32).at[:, :k].set(blocks)
    dst = jnp.where(ok, sc, s)
    state = state.replace(
        block_tables=state.block_tables.at[dst].set(rows, mode="drop"),
        seq_lens=state.seq_lens.at[dst].set(matched * bs, mode="drop"),
        live=state.live.at[dst].set(True, mode="drop"),
        ref_counts=state.ref_counts.at[jnp.where(ent, cand, n)].add(1, mode="drop"),
        num_evictable=state.num_evictable - first.sum(dtype=jnp.int32),
        queue_pos=scratch,
    )
    return state, matched * bs, ok


@jax.jit
def cache_full_blocks(
    state: BlockManagerState, slots: jax.Array, tokens: jax.Array, num_tokens: jax.Array
) -> BlockManagerState:
    """Adds the full blocks of live sequences to the prefix cache.

    slots: i32[M] live slots (-1 = padding); tokens: i32[M, K] each sequence's tokens from
    position 0, valid up to num_tokens[i], whose K/V must already be written. Every block fully
    inside min(num_tokens, seq_lens) and not yet cached is keyed and inserted. A block is only
    cached if all blocks before it in its sequence are (a chain stops at the first block whose
    bucket holds another block; on a tie for an empty bucket the highest block id wins).
    """
    s, p = state.block_tables.shape
    bs = state.block_size
    slots = jnp.asarray(slots, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    mm, length = tokens.shape
    k = min(p, length // bs)
    if k == 0:
        return state
    sc = jnp.clip(slots, 0, s - 1)
    ok = (slots >= 0) & (slots < s) & state.live[sc]
    nfull = jnp.minimum(num_tokens, state.seq_lens[sc]) // bs
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    blocks = state.block_tables[sc, :k]
    # A chain stops at a null entry (blocks a sliding window dropped lead the table).
    ent = ok[:, None] & (j < nfull[:, None]) & (jnp.cumprod(blocks != NULL_BLOCK, axis=1) > 0)
    parents = jnp.concatenate([jnp.zeros((mm, 1), jnp.int32), blocks[:, :-1]], axis=1)
    toks = tokens[:, : k * bs].reshape(mm, k, bs)
    chains = chain_values(block_digests(tokens[:, : k * bs], bs))
    return _insert(state, blocks, parents, toks, chains, ent)


def cache_new_blocks(
    state: BlockManagerState, seq_tokens: jax.Array, old_lens: jax.Array, max_new: int
) -> BlockManagerState:
    """Adds the blocks that became full since ``old_lens`` to the prefix cache, as they fill.

    seq_tokens: i32[S, P * bs] each slot's tokens by position (at least those of its blocks
    from ``old_lens // bs`` on); old_lens: i32[S] each slot's ``seq_lens`` before the tokens
    whose K/V was just written; max_new (static): the most blocks one slot can have filled
    since (1 per decode step; ``ceil(chunk / bs) + 1`` for a chunk). Blocks ``old_lens // bs``
    up to ``seq_lens // bs`` of every live slot are keyed from their tokens and the chain value
    of the block before them, which must be cached (else the chain has stopped there and
    nothing is added), and inserted as `cache_full_blocks` would. O(S * max_new * bs),
    independent of P.
    """
    s, p = state.block_tables.shape
    bs = state.block_size
    k = min(max_new, p)
    first = old_lens // bs  # [S] the first block that may be new
    nfull = jnp.where(state.live, state.seq_lens // bs, 0)
    j = first[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]  # [S, k] logical blocks
    rows = jnp.arange(s)[:, None]
    blocks = state.block_tables[rows, jnp.clip(j, 0, p - 1)]
    prev = state.block_tables[jnp.arange(s), jnp.clip(first - 1, 0, p - 1)]
    prev = jnp.where(first > 0, prev, NULL_BLOCK)
    base_ok = (first == 0) | state.cached[prev]
    ent = (j < nfull[:, None]) & base_ok[:, None]
    parents = jnp.concatenate([prev[:, None], blocks[:, :-1]], axis=1)
    pos = j[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [S, k, bs]
    toks = seq_tokens[rows[:, :, None], jnp.clip(pos, 0, seq_tokens.shape[1] - 1)]
    base = jnp.where(first > 0, state.block_chain[prev], 0)
    chains = chain_values(block_digests(toks.reshape(s, k * bs), bs), base)
    return _insert(state, blocks, parents, toks, chains, ent)


def _insert(state: BlockManagerState, blocks, parents, toks, chains, ent) -> BlockManagerState:
    """Inserts ``blocks`` (i32[M, k], consecutive blocks of one sequence per row) where ``ent``,
    with their parents (i32[M, k]), tokens (i32[M, k, bs]) and chain values (u32[M, k]).
    Entries already cached pass; a row's chain stops at its first entry whose bucket holds
    another block (on a tie for an empty bucket the highest block id wins)."""
    n = state.num_blocks
    hsize = state.hash_table.shape[0]
    keys = _mix32(chains)
    bucket = hash_bucket(keys, hsize)
    already = ent & state.cached[blocks]
    claim = ent & ~already & (state.hash_table[bucket] == 0)
    table = state.hash_table.at[jnp.where(claim, bucket, hsize)].max(blocks, mode="drop")
    won = claim & (table[bucket] == blocks)
    chain = jnp.cumprod(already | won | ~ent, axis=1).astype(bool)
    commit = won & chain
    cached = state.cached.at[jnp.where(commit, blocks, n)].set(True, mode="drop")
    revert = won & ~cached[blocks]
    table = table.at[jnp.where(revert, bucket, hsize)].set(0, mode="drop")
    cidx = jnp.where(commit, blocks, n)
    # A new incarnation for each committed block (set, not add: a block shared by several rows
    # commits once), then each records its parent's, its parent possibly committed just now.
    gen = state.block_gen.at[cidx].set(state.block_gen[blocks] + 1, mode="drop")
    return state.replace(
        block_gen=gen,
        parent_gen=state.parent_gen.at[cidx].set(gen[parents], mode="drop"),
        cached=cached,
        hash_table=table,
        block_hash=state.block_hash.at[cidx].set(keys, mode="drop"),
        block_chain=state.block_chain.at[cidx].set(chains, mode="drop"),
        block_parent=state.block_parent.at[cidx].set(parents, mode="drop"),
        block_tokens=state.block_tokens.at[cidx].set(toks, mode="drop"),
    )
