"""The batch layouts every implementation shares, derived in one place.

Pages
    ``[L, KVH, N, bs, D]``, the pages of all layers, read through a ``layer`` index; one layer's
    ``[KVH, N, bs, D]`` is a stack of one. `stacked_pages` gives the 5-D view and the layer.

Ragged batch
    ``q[T, H, D]`` where sequence ``s`` owns rows ``cu_q_lens[s]:cu_q_lens[s + 1]`` and its row
    ``j`` sits at position ``kv_lens[s] - q_len_s + j``; rows at or past ``cu_q_lens[num_seqs]``
    are padding (zeros). `ragged_rows` is the one derivation of the row -> (sequence, position)
    mapping; each implementation takes the form it needs from it:

    * reference: each row's sequence and position (`RaggedRows.seq`, `RaggedRows.pos`);
    * XLA path and GPU kernel: `query_blocks`, blocks of up to ``block_q`` rows of one sequence;
    * TPU ragged kernel: the cleaned offsets, each sequence's first position and each program's
      sequences, computed here outside the kernel and passed in as scalar-prefetch operands.

Decode
    One query per sequence, query ``b`` at position ``kv_lens[b] - 1``: a ragged batch of
    one-row sequences (`decode_as_ragged`), which is how the reference, the XLA path and the GPU
    kernel run it. (The TPU kernel has a decode grid of its own.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "QueryBlocks",
    "RaggedRows",
    "decode_as_ragged",
    "merge_splits",
    "query_blocks",
    "ragged_rows",
    "stacked_pages",
]


def stacked_pages(k_pages: jax.Array, v_pages: jax.Array, layer):
    """``[L, KVH, N, bs, D]`` views of the pages (one layer's become a stack of one, a bitcast)
    and the layer as ``i32[]``, clamped into [0, L) (a wild page address would fault)."""
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_pages.shape[0] - 1)
    return k_pages, v_pages, layer


def _count_le(sorted_: jax.Array, x: jax.Array) -> jax.Array:
    """``searchsorted(sorted_, x, side="right")`` as i32: how many entries are <= each x.

    One fused compare-and-count ([len(x), len(sorted_)], 512 x 257 at most in the engine)
    instead of jnp's default binary search, a while loop that XLA runs op by op: in a decode
    step the attention of every layer ran two of them.
    """
    return jnp.sum(sorted_[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


class RaggedRows(NamedTuple):
    """A ragged batch's rows mapped to their sequences (S slots, T rows)."""

    cu: jax.Array  # i32[S+1] query offsets; entries past num_seqs flattened to the end (sorted)
    q_len: jax.Array  # i32[S] rows of each sequence (0 past num_seqs)
    pos0: jax.Array  # i32[S] position of each sequence's first row, kv_lens - q_len
    num_seqs: jax.Array  # i32[] live sequences, clipped into [0, S]
    seq: jax.Array  # i32[T] each row's sequence (clipped into [0, S) for padding rows)
    pos: jax.Array  # i32[T] each row's position; -1 for padding rows (they see no key)
    live: jax.Array  # bool[T] False for padding rows


def ragged_rows(
    num_tokens: int,
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array | int,  # i32[] or i32[1]
) -> RaggedRows:
    """Maps each row of a ragged batch to its sequence and position (see `RaggedRows`).

    Entries of ``cu_q_lens`` past ``num_seqs`` may hold anything: they are ignored.
    """
    s = kv_lens.shape[0]
    n_live = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, s)
    cu = cu_q_lens.astype(jnp.int32)
    cu = jnp.where(jnp.arange(s + 1) <= n_live, cu, cu[n_live])  # [S+1], sorted
    q_len = cu[1:] - cu[:-1]  # [S]
    pos0 = kv_lens.astype(jnp.int32) - q_len  # [S]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    # Row t belongs to the first s with t < cu[s+1]; side="right" skips empty sequences.
    seq = jnp.clip(_count_le(cu[1:], rows), 0, s - 1)
    live = (rows >= cu[0]) & (rows < cu[s])
    pos = jnp.where(live, pos0[seq] + (rows - cu[seq]), -1)
    return RaggedRows(cu, q_len, pos0, n_live, seq, pos, live)


class QueryBlocks(NamedTuple):
    """A ragged batch cut into NB query blocks of up to ``block_q`` rows of one sequence."""

    seq: jax.Array  # i32[NB] each block's sequence
    row0: jax.Array  # i32[NB] its first row in the flat batch
    num: jax.Array  # i32[NB] its rows (0 for unused blocks)
    pos0: jax.Array  # i32[NB] the position of its first row
    tok_blk: jax.Array  # i32[T] each row's block
    tok_off: jax.Array  # i32[T] each row's offset in its block
    live: jax.Array  # bool[T] False for padding rows


def query_blocks(
    num_tokens: int,
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array | int,  # i32[]
    block_q: int,
) -> QueryBlocks:
    """Splits each live sequence's rows into blocks of <= ``block_q`` rows (the query blocks of
    the XLA path and the GPU kernel). NB = (T + min(S, T) * (bq - 1)) // bq bounds the blocks
    any batch needs; blocks past the last live one are unused (``num == 0``)."""
    s = kv_lens.shape[0]
    nb = max(1, (num_tokens + min(s, num_tokens) * (block_q - 1)) // block_q)
    r = ragged_rows(num_tokens, kv_lens, cu_q_lens, num_seqs)
    cu_blk = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(-(-r.q_len // block_q))])
    blk = jnp.arange(nb, dtype=jnp.int32)
    blk_seq = jnp.clip(_count_le(cu_blk, blk) - 1, 0, s - 1)
    first = (blk - cu_blk[blk_seq]) * block_q  # first row's offset in its sequence
    blk_num = jnp.where(blk < cu_blk[s], jnp.clip(r.q_len[blk_seq] - first, 0, block_q), 0)
    off = jnp.arange(num_tokens, dtype=jnp.int32) - r.cu[r.seq]  # each row's offset in its seq
    tok_blk = jnp.where(r.live, cu_blk[r.seq] + off // block_q, 0)
    row0, pos0 = r.cu[blk_seq] + first, r.pos0[blk_seq] + first
    return QueryBlocks(blk_seq, row0, blk_num, pos0, tok_blk, off % block_q, r.live)


def decode_as_ragged(
    ragged_fn: Callable[..., jax.Array],
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] or [KVH, N, bs, D]
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[B, P]
    kv_lens: jax.Array,  # i32[B]
    **options,
) -> jax.Array:  # [B, H, D]
    """The decode form through ``ragged_fn``: row b is sequence b's one query (``q_len = 1``), so
    it sits at position ``kv_lens[b] - 1``; ``options`` go to ``ragged_fn`` unchanged."""
    b = q.shape[0]
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
    return ragged_fn(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, jnp.int32(b), **options)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merges flash-decoding key splits: o f32[NQB, KVH, S, M, D] (each split's normalised
    output), m and l f32[NQB, KVH, S, M] (its running max, base 2, and softmax denominator) ->
    [NQB, KVH, M, D] in ``dtype``. Each split is weighted by ``l_s * 2^(m_s - max m)``; an empty
    split has l = 0, and a row no split saw gives 0."""
    m_max = m.max(axis=2, keepdims=True)  # [NQB, KVH, 1, M]
    w = l * jnp.exp2(m - m_max)  # [NQB, KVH, S, M]; 0 for empty splits
    total = w.sum(axis=2)  # [NQB, KVH, M]
    o = (o * w[..., None]).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return o.astype(dtype)
