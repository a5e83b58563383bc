"""The TPU decode kernel: one query token per sequence (machinery in `tpu_common`).

Grid `(KVH, B_pad // seqs_per_block)`: q is viewed as `[B, KVH, G, D]` and a program gets the
`[seqs_per_block, G, D]` queries of `seqs_per_block` sequences for one KV head; it streams their
chunks back to back, query b seeing keys `[kv_lens[b] - window, kv_lens[b])`. Padded sequences
get length 0: no copies, zero output, sliced off.

Only the first chunk of each program waits on HBM unhidden; there is no split of one long
sequence across programs (flash-decoding), so `KVH * ceil(B / seqs_per_block)` programs is all
the parallelism a decode step has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tpu_common as tc

__all__ = ["tpu_paged_attention_decode"]


def _decode_kernel(block_tables_ref, kv_lens_ref, layer_ref, *refs, opts):
    """One program: KV head `h = program_id(0)`, sequences `i*bb ... i*bb+bb-1` (`i =
    program_id(1)`).

    Refs: scalar prefetch (SMEM) `block_tables_ref i32[B_pad * P]` (row-major `[B_pad, P]`),
    `kv_lens_ref i32[B_pad]`, `layer_ref i32[1]`; then `q [bb, G, D]`; `k_hbm`, `v_hbm`
    `[L, KVH, N, bs, D]` in HBM; `o [bb, G, D]`; scratch as `tc.Scratch` with rows `[bb, G]`.
    `opts`: `tc.Options`.
    """
    q_ref, k_hbm, v_hbm, o_ref, *scratch = refs
    h, blk = pl.program_id(0), pl.program_id(1)
    bb = q_ref.shape[0]
    stats = tc.Scratch(*scratch)
    capacity = opts.pages_per_seq * stats.k_buf.shape[2]

    def seq_of(item):
        return blk * bb + jnp.minimum(item, bb - 1)

    def key_range(item):
        # The query sits at position length-1 and sees [length - window, length).
        length = jnp.clip(kv_lens_ref[seq_of(item)], 0, capacity)
        if opts.sliding_window is None:
            return jnp.int32(0), length
        return jnp.maximum(length - opts.sliding_window, 0), length

    def page_of(item, logical):
        return block_tables_ref[seq_of(item) * opts.pages_per_seq + logical]

    copier = stats.copier(k_hbm, v_hbm, layer_ref[0], h, page_of)
    ct = copier.chunk_tokens
    stats.init_stats()

    def process(item, chunk, k_start, k_end, slot):
        k, v = tc.load_chunk(copier, slot, chunk, k_start, k_end)
        kpos = chunk * ct + lax.broadcasted_iota(jnp.int32, (1, ct), 1)
        mask = jnp.logical_and(kpos >= k_start, kpos < k_end)  # [1, ct], same for all G heads
        tc.accumulate(stats, item, q_ref[item], k, v, mask, opts)  # q [G, D]

    tc.stream_chunks(copier, jnp.int32(0), lambda item: item < bb, key_range, process)
    o_ref[...] = tc.normalise(stats).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(*tc.STATIC, "seqs_per_block"))
def tpu_paged_attention_decode(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[B, P]
    kv_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array = 0,  # int or i32[]
    interpret: bool = False,
    seqs_per_block: int | None = None,
    pages_per_chunk: int | None = None,
) -> jax.Array:  # [B, H, D]
    """Decode paged attention on TPU: query b sits at position `kv_lens[b] - 1`.

    Inputs are assumed valid (checked by `pallas_kernels.paged_attention`, which also requires
    `bs` to be a multiple of 8).

    Args:
      q: `[B, H, D]` one query token per sequence; float32, bfloat16 or float16.
      k_pages, v_pages: `[L, KVH, N, bs, D]` the pages of all layers (q's dtype);
        `[KVH, N, bs, D]` is one layer (`L = 1`).
      block_tables: `i32[B, P]` physical block of each logical block (unused entries 0).
      kv_lens: `i32[B]` cached tokens per sequence including the current one; 0 gives zeros.
      scale: softmax scale applied to `q . k`.
      sliding_window: optional; key k is seen when `pos - k < sliding_window`.
      soft_cap: optional; `logits = soft_cap * tanh(scale * q.k / soft_cap)`.
      layer: the layer whose pages are read: an int in `[0, L)` or a traced `i32[]` (e.g. a
        `lax.scan` counter; clamped to `[0, L)`). It is a scalar-prefetch operand and part of
        each page DMA's source address; nothing is sliced out of the stacked pages.
      interpret: run in the TPU interpreter (CPU tests).
      seqs_per_block: sequences streamed by one program (default `min(B, 8)`).
      pages_per_chunk: pages per DMA chunk, in `[1, P]` (default: about 256 keys).
    Returns:
      `[B, H, D]` in q's dtype.
    Raises:
      ValueError: `seqs_per_block` or `pages_per_chunk` out of range.
    """
    batch, num_heads, head_dim = q.shape
    opts = tc.Options(scale, sliding_window, soft_cap, block_tables.shape[1])
    su = tc.setup(q, k_pages, v_pages, layer, pages_per_chunk, interpret, opts)
    if seqs_per_block is not None and seqs_per_block < 1:
        raise ValueError(f"{seqs_per_block=} must be positive")
    if batch == 0:
        return jnp.zeros_like(q)

    bb = seqs_per_block or min(batch, 8)
    padded = tc.round_up(batch, bb)
    pad = padded - batch
    # Padded sequences get length 0: no copies, zero output, sliced off below.
    q4 = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(padded, su.num_kv_heads, su.group, -1)
    prefetch = (jnp.pad(block_tables, ((0, pad), (0, 0))).reshape(-1), jnp.pad(kv_lens, (0, pad)))
    q_spec = pl.BlockSpec((bb, None, su.group, head_dim), lambda h, i, *_: (i, h, 0, 0))
    grid = (su.num_kv_heads, padded // bb)
    name = "tpu_paged_attention_decode"
    out = tc.run(_decode_kernel, su, prefetch, q4, q_spec, grid, (bb, su.group), name)
    # out: [B_pad, KVH, G, D]
    return out.reshape(padded, num_heads, head_dim)[:batch]
