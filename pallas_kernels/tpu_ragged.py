"""The TPU ragged kernel: prefill, chunked prefill and mixed prefill/decode batches (machinery
in `tpu_common`).

Grid `(KVH, T_pad // queries_per_block)`: q is transposed to `[KVH, G, T, D]` so that a
program's `[G, bq, D]` block folds into `[G * bq, D]` rows without a relayout. A program streams
the chunks of every sequence owning one of its rows `[i * bq, (i + 1) * bq)`, masking the rows
of the other sequences.

The ragged layout comes from `layout.ragged_rows`, computed once outside the kernel and passed in
as scalar-prefetch operands: the query offsets (cleaned past `num_seqs`), each sequence's first
position, and each program's sequences `[first, end)`.

A program computes its whole `[G * bq, ct]` score tile against each chunk of each sequence
overlapping its rows, so a block of bq decode tokens costs bq times the decode form's matmul and
exp work (the copies are the same). Batches of only decode tokens belong in the decode form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tpu_common as tc
from pallas_kernels.layout import RaggedRows, ragged_rows

__all__ = ["tpu_ragged_paged_attention"]


def _ragged_kernel(
    block_tables_ref, cu_ref, pos0_ref, first_seq_ref, end_seq_ref, layer_ref, *refs, opts
):
    """One program: KV head `h = program_id(0)`, rows `i*bq ... i*bq+bq-1` (`i = program_id(1)`).

    Refs: scalar prefetch (SMEM) `block_tables_ref i32[S * P]` (row-major `[S, P]`),
    `cu_ref i32[S+1]` (query offsets, flat past num_seqs), `pos0_ref i32[S]` (each sequence's
    first position), `first_seq_ref`, `end_seq_ref i32[T_pad // bq]` (each program's
    sequences), `layer_ref i32[1]`; then `q [G, bq, D]`; `k_hbm`, `v_hbm` `[L, KVH, N, bs, D]`
    in HBM; `o [G, bq, D]`; scratch as `tc.Scratch` with rows `[G * bq]`. `opts`: `tc.Options`.
    """
    q_ref, k_hbm, v_hbm, o_ref, *scratch = refs
    h, blk = pl.program_id(0), pl.program_id(1)
    g, bq, d = q_ref.shape
    rows = g * bq
    num_slots = pos0_ref.shape[0]
    stats = tc.Scratch(*scratch)
    capacity = opts.pages_per_seq * stats.k_buf.shape[2]
    row_lo = blk * bq  # this program's rows: [row_lo, row_hi)
    row_hi = row_lo + bq
    end_seq = end_seq_ref[blk]

    def seq_rows(seq):
        """(q_start, q_end, first_pos): rows of seq and the position of its row q_start."""
        s = jnp.clip(seq, 0, num_slots - 1)
        return cu_ref[s], cu_ref[s + 1], pos0_ref[s]

    def key_range(seq):
        # Rows of seq in this block: [r0, r1). Row r sits at first_pos + r - q_start; the last
        # sees keys up to its own position, the first back to its window's start.
        q_start, q_end, first_pos = seq_rows(seq)
        r0, r1 = jnp.maximum(q_start, row_lo), jnp.minimum(q_end, row_hi)
        k_end = jnp.clip(first_pos + (r1 - q_start), 0, capacity)
        if opts.sliding_window is None:
            k_start = jnp.int32(0)
        else:
            k_start = jnp.maximum(first_pos + (r0 - q_start) - opts.sliding_window + 1, 0)
        return k_start, jnp.where(r1 > r0, k_end, 0)

    def page_of(seq, logical):
        return block_tables_ref[seq * opts.pages_per_seq + logical]

    copier = stats.copier(k_hbm, v_hbm, layer_ref[0], h, page_of)
    ct = copier.chunk_tokens
    stats.init_stats()

    def process(seq, chunk, k_start, k_end, slot):
        k, v = tc.load_chunk(copier, slot, chunk, k_start, k_end)
        q_start, q_end, first_pos = seq_rows(seq)
        # Flattened row R = head * bq + t holds token row_lo + t of query head (h, head).
        # (An iota over [G, bq, ct] folded to [rows, ct] avoids a vector remainder.)
        row = row_lo + lax.broadcasted_iota(jnp.int32, (g, bq, ct), 1).reshape(rows, ct)
        pos = first_pos + (row - q_start)  # [rows, ct]
        kpos = chunk * ct + lax.broadcasted_iota(jnp.int32, (rows, ct), 1)
        mask = (row >= q_start) & (row < q_end) & (kpos <= pos) & (kpos < k_end)
        if opts.sliding_window is not None:
            mask &= pos - kpos < opts.sliding_window
        tc.accumulate(stats, ..., q_ref[...].reshape(rows, d), k, v, mask, opts)

    tc.stream_chunks(copier, first_seq_ref[blk], lambda seq: seq < end_seq, key_range, process)
    o_ref[...] = tc.normalise(stats).reshape(g, bq, d).astype(o_ref.dtype)


def _program_seqs(rows: RaggedRows, bq: int, num_programs: int):
    """Each program's sequences `[first, end)` (`i32[num_programs]` each): those owning one of
    its rows `[i * bq, (i + 1) * bq)`; empty for a program of padding rows only."""
    total = rows.cu[-1]  # live rows
    lo = jnp.arange(num_programs, dtype=jnp.int32) * bq  # < T
    last = jnp.clip(jnp.minimum(lo + bq, total) - 1, 0, None)  # the program's last live row
    some = lo < total
    return jnp.where(some, rows.seq[lo], 0), jnp.where(some, rows.seq[last] + 1, 0)


@functools.partial(jax.jit, static_argnames=(*tc.STATIC, "queries_per_block"))
def tpu_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array = 0,  # int or i32[]
    interpret: bool = False,
    queries_per_block: int | None = None,
    pages_per_chunk: int | None = None,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention on TPU (prefill, chunked prefill, mixed prefill and decode).

    Inputs are assumed valid, as for `tpu_paged_attention_decode`.

    Args:
      q: `[T, H, D]` query rows; sequence s owns rows `cu_q_lens[s]:cu_q_lens[s+1]`.
      k_pages, v_pages: `[L, KVH, N, bs, D]` the pages of all layers (or `[KVH, N, bs, D]`,
        `L = 1`), the queries' own K/V written.
      block_tables: `i32[S, P]`.
      kv_lens: `i32[S]` cached tokens per sequence including this step's `q_len_s`; row j of
        sequence s sits at position `kv_lens[s] - q_len_s + j` and sees keys `k <= pos`
        (and `pos - k < sliding_window` with a window).
      cu_q_lens: `i32[S+1]` nondecreasing query offsets, `cu_q_lens[0] == 0`.
      num_seqs: `i32[]` or `i32[1]` live sequences; rows at or past `cu_q_lens[num_seqs]` give 0.
      scale, sliding_window, soft_cap, layer, interpret: as in `tpu_paged_attention_decode`.
      queries_per_block: query rows per program, a multiple of 8 (default `min(64, T)` rounded
        up to 16).
      pages_per_chunk: as in `tpu_paged_attention_decode`.
    Returns:
      `[T, H, D]` in q's dtype.
    Raises:
      ValueError: `queries_per_block` not a multiple of 8, `pages_per_chunk` out of range.
    """
    num_tokens, num_heads, head_dim = q.shape
    opts = tc.Options(scale, sliding_window, soft_cap, block_tables.shape[1])
    su = tc.setup(q, k_pages, v_pages, layer, pages_per_chunk, interpret, opts)
    if queries_per_block is not None and (queries_per_block < 8 or queries_per_block % 8):
        raise ValueError(f"{queries_per_block=} must be a positive multiple of 8")
    if num_tokens == 0:
        return jnp.zeros_like(q)

    bq = queries_per_block or min(64, tc.round_up(num_tokens, 16))
    padded = tc.round_up(num_tokens, bq)
    # Head-major [KVH, G, T, D]: a block [G, bq, D] folds into [G * bq, D] along tiled rows.
    q4 = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    q4 = q4.reshape(padded, su.num_kv_heads, su.group, head_dim).transpose(1, 2, 0, 3)
    rows = ragged_rows(num_tokens, kv_lens, cu_q_lens, num_seqs)
    prefetch = (
        block_tables.reshape(-1),
        rows.cu,
        rows.pos0,
        *_program_seqs(rows, bq, padded // bq),
    )
    q_spec = pl.BlockSpec((None, su.group, bq, head_dim), lambda h, i, *_: (h, 0, i, 0))
    grid = (su.num_kv_heads, padded // bq)
    name = "tpu_ragged_paged_attention"
    out = tc.run(_ragged_kernel, su, prefetch, q4, q_spec, grid, (su.group * bq,), name)
    out = out.transpose(2, 0, 1, 3).reshape(padded, num_heads, head_dim)  # [KVH, G, T_pad, D] ->
    return out[:num_tokens]
