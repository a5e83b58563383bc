"""Paged attention for TPU in Pallas (Mosaic TPU): decode and ragged (mixed prefill/decode).

Contracts (shapes, `kv_lens`, positions, window, soft cap, GQA) are those of docs/DESIGN.md.

How the kernels work
--------------------
* Block tables, lengths (and `cu_q_lens`, `num_seqs`) and the layer index are scalar-prefetch
  operands (`pltpu.PrefetchScalarGridSpec`): they sit in SMEM, so the kernel can turn a logical
  page into a physical one before it issues the copy.
* K/V pages stay in HBM (`memory_space=pl.ANY`) as the pages of *all* layers,
  `[L, KVH, N, bs, D]` (one layer's `[KVH, N, bs, D]` is taken as `L = 1`); the layer is part of
  each page copy's source address (`k_hbm.at[layer, kv_head, page]`), so the layer may be a
  traced scalar (a `lax.scan` counter) and no layer is ever sliced out of the stack (which XLA
  would materialise as a copy of the layer's whole pool per call).
* A *chunk* is `pages_per_chunk` consecutive logical pages of one sequence
  (`ct = pages_per_chunk * bs` keys); its pages are copied one DMA per page into a VMEM buffer
  `[2, pages_per_chunk, bs, D]` (K and V each), double-buffered: chunk n+1 is in flight while
  chunk n is computed. Only the pages holding keys some query can see are copied (skipped: pages
  past the length, pages before a sliding window, pages after a causal horizon); the rest of the
  buffer holds stale data that masking keeps out.
* One program streams the chunks of *several* sequences back to back (`seqs_per_block`
  sequences in decode, every sequence overlapping a block of `queries_per_block` rows in ragged),
  prefetching across sequence boundaries, so only the first chunk of a program waits on HBM.
  Programs are independent, so both grid axes are "parallel" (megacore may split them).
* Online softmax in float32 across chunks; all `G = H // KVH` query heads of a KV head go
  through one matmul with the chunk's keys (decode: `[G, D] x [D, ct]`; ragged:
  `[G * bq, D] x [D, ct]`), so each K/V page is read once per KV head.
* Masking is by position, never by sentinel: masked logits become a finite large negative value
  and their probabilities are set to exactly 0; V rows outside the copied key range are zeroed
  before `p @ v`, so garbage (even NaN) in the null block, in a partial last page or in stale
  buffer slots never reaches the output. A row that sees no key (length 0, padding row) outputs 0.

Grids
-----
* decode: `(KVH, B_pad // seqs_per_block)`; q is viewed as `[B, KVH, G, D]` and a program gets
  `[seqs_per_block, G, D]`.
* ragged: `(KVH, T_pad // queries_per_block)`; q is transposed to `[KVH, G, T, D]` so that a
  program's `[G, bq, D]` block folds into `[G * bq, D]` rows without a relayout.

Layout constraints (Mosaic TPU; the interpreter accepts anything)
-----------------------------------------------------------------
* `block_size` must be a multiple of 8 (checked): a page is `[bs, D]` tiles of `(8, 128)` and a
  chunk folds `[pages, bs, D] -> [pages * bs, D]`. For bfloat16 a multiple of 16 avoids packed-
  sublane relayouts.
* `head_dim` should be a multiple of 128 (lane width); 64 works but pads every vector to 128 lanes.
* `queries_per_block` must be a multiple of 8 (16 preferred for bfloat16).
* Block tables live in SMEM: `S * P` int32 must fit (SMEM is small, on the order of 1 MiB), as
  for jax's own TPU paged-attention kernels.
* `kv_lens` above `P * bs` are clamped to the table's capacity.

Limits worth knowing
--------------------
* Checked so far only in the TPU interpreter and by lowering to Mosaic MLIR on the CPU (see
  tests/test_tpu_kernel.py); Mosaic's layout passes and the speed are unchecked on hardware.
* A ragged program computes its whole `[G * bq, ct]` score tile against each chunk of each
  sequence overlapping its rows and masks the rows of other sequences, so a block of bq decode
  tokens costs bq times the decode form's matmul and exp work (the copies are the same). Batches
  of only decode tokens belong in the decode form.
* Only the first chunk of each program waits on HBM unhidden; there is no split of one long
  sequence across programs (flash-decoding), so `KVH * ceil(B / seqs_per_block)` programs
  is all the parallelism a decode step has.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import check_layer, stacked_pages

__all__ = ["tpu_paged_attention_decode", "tpu_ragged_paged_attention"]

# Finite, so `exp(m_prev - m_new)` stays a number for rows that have seen no key yet.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128  # m and l are kept replicated over one vreg's lanes, as Mosaic likes 2-D f32 tiles.
_DEFAULT_CHUNK_TOKENS = 256


# ---------------------------------------------------------------------------------------------
# Kernel pieces shared by both forms.


class _PageCopier:
    """Issues and awaits the per-page HBM -> VMEM copies of one chunk for one KV head."""

    def __init__(
        self,
        k_hbm,  # [L, KVH, N, bs, D] in HBM
        v_hbm,  # [L, KVH, N, bs, D] in HBM
        k_buf,  # [2, pages_per_chunk, bs, D] VMEM
        v_buf,  # [2, pages_per_chunk, bs, D] VMEM
        sems,  # DMA semaphores [2 (k, v), 2 (slot)]
        layer,  # i32 scalar (from SMEM), in [0, L)
        kv_head,  # i32 scalar
        page_of: Callable,  # (item, logical_page) -> physical block id
    ):
        self.k_hbm, self.v_hbm, self.k_buf, self.v_buf = k_hbm, v_hbm, k_buf, v_buf
        self.sems, self.layer, self.kv_head, self.page_of = sems, layer, kv_head, page_of
        _, self.pages_per_chunk, self.block_size, _ = k_buf.shape
        self.chunk_tokens = self.pages_per_chunk * self.block_size

    def _for_each_live_page(self, item, chunk, k_start, k_end, slot, method: str):
        bs = self.block_size
        # Positions are >= 0, so truncating division is floor division (and lowers without
        # the sign fix-up that `//` on traced ints needs).
        first_page = lax.div(k_start, bs)
        end_page = lax.div(k_end + bs - 1, bs)
        for i in range(self.pages_per_chunk):
            logical = chunk * self.pages_per_chunk + i
            live = jnp.logical_and(logical >= first_page, logical < end_page)

            @pl.when(live)
            def _(i=i, logical=logical):
                page = self.page_of(item, logical)
                for src, dst, kv in ((self.k_hbm, self.k_buf, 0), (self.v_hbm, self.v_buf, 1)):
                    copy = pltpu.make_async_copy(
                        src.at[self.layer, self.kv_head, page],  # [bs, D]
                        dst.at[slot, i],
                        self.sems.at[kv, slot],
                    )
                    getattr(copy, method)()

    def start(self, item, chunk, k_start, k_end, slot):
        self._for_each_live_page(item, chunk, k_start, k_end, slot, "start")

    def wait(self, item, chunk, k_start, k_end, slot):
        self._for_each_live_page(item, chunk, k_start, k_end, slot, "wait")


def _stream_chunks(
    copier: _PageCopier,
    first_item,  # i32 scalar
    item_valid: Callable,  # item -> bool: False ends the stream
    key_range: Callable,  # item -> (k_start, k_end): key positions some query of item may see
    process: Callable,  # (item, chunk, k_start, k_end, slot) -> None, after the chunk landed
):
    """Runs `process` over every chunk of every item, with the next chunk always in flight.

    Items are visited in order from `first_item` until `item_valid` fails; items with an empty key
    range are skipped. The chunks of an item are `k_start // ct ... ceil(k_end / ct) - 1`.
    """
    ct = copier.chunk_tokens

    def skip_empty(item):
        def is_empty(it):
            k_start, k_end = key_range(it)
            return jnp.logical_and(item_valid(it), k_end <= k_start)

        return lax.while_loop(is_empty, lambda it: it + 1, item)

    item0 = skip_empty(first_item)
    k_start0, k_end0 = key_range(item0)

    @pl.when(item_valid(item0))
    def _():
        copier.start(item0, lax.div(k_start0, ct), k_start0, k_end0, 0)

    def body(carry):
        item, chunk, k_start, k_end, slot = carry
        more = (chunk + 1) * ct < k_end
        next_item = lax.cond(more, lambda: item, lambda: skip_empty(item + 1))
        next_start, next_end = key_range(next_item)
        next_chunk = jnp.where(more, chunk + 1, lax.div(next_start, ct))

        @pl.when(item_valid(next_item))
        def _():
            copier.start(next_item, next_chunk, next_start, next_end, 1 - slot)

        copier.wait(item, chunk, k_start, k_end, slot)
        process(item, chunk, k_start, k_end, slot)
        return next_item, next_chunk, next_start, next_end, 1 - slot

    lax.while_loop(
        lambda carry: item_valid(carry[0]),
        body,
        (item0, lax.div(k_start0, ct), k_start0, k_end0, jnp.int32(0)),
    )


def _load_chunk(copier: _PageCopier, slot, chunk, k_start, k_end):
    """The landed chunk as `k, v [ct, D]`, V rows outside `[k_start, k_end)` zeroed."""
    k_buf, v_buf = copier.k_buf, copier.v_buf
    ct, d = copier.chunk_tokens, k_buf.shape[-1]
    k = k_buf[slot].reshape(ct, d)  # [ct, D]
    v = v_buf[slot].reshape(ct, d)  # [ct, D]
    # Stale or garbage rows would turn 0 * NaN into NaN in `p @ v`; K needs no care because
    # masked logits are replaced (a select), not multiplied.
    kpos = chunk * ct + lax.broadcasted_iota(jnp.int32, (ct, 1), 0)
    v_ok = jnp.logical_and(kpos >= k_start, kpos < k_end)  # [ct, 1]
    v = jnp.where(v_ok, v, jnp.zeros((), v.dtype))
    return k, v


def _online_softmax_step(q, k, v, mask, m_prev, l_prev, acc_prev, *, scale, soft_cap):
    """One flash-attention update of R query rows with one chunk of keys.

    Args:
      q: `[R, D]`; k, v: `[ct, D]` (same dtype as q); mask: bool broadcastable to `[R, ct]`.
      m_prev, l_prev: f32 `[R, 1]` running max (starts at the mask value) and denominator;
      acc_prev: f32 `[R, D]` running un-normalised output.
    Returns:
      `(m, l, acc)` with the same shapes.
    """
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )  # [R, ct]
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASK_VALUE)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    alpha = jnp.exp(m_prev - m)  # [R, 1]
    p = jnp.where(mask, jnp.exp(s - m), 0.0)  # [R, ct]; exactly 0 where masked
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
    return m, l, alpha * acc_prev + pv


def _normalise(acc, l):
    """`acc / l`, 0 for rows that saw no key (`l == 0`)."""
    return jnp.where(l > 0.0, acc / jnp.where(l > 0.0, l, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# Decode.


def _decode_kernel(
    # Scalar prefetch (SMEM).
    block_tables_ref,  # i32[B_pad * P], row-major [B_pad, P]
    kv_lens_ref,  # i32[B_pad]
    layer_ref,  # i32[1] the layer whose pages are read
    # Inputs.
    q_ref,  # [bb, G, D] queries of sequences i*bb ... i*bb+bb-1, KV head h
    k_hbm,  # [L, KVH, N, bs, D] in HBM
    v_hbm,  # [L, KVH, N, bs, D] in HBM
    # Output.
    o_ref,  # [bb, G, D]
    # Scratch.
    k_buf,  # [2, pages_per_chunk, bs, D] VMEM
    v_buf,  # [2, pages_per_chunk, bs, D] VMEM
    sems,  # DMA [2, 2]
    m_ref,  # f32[bb, G, 128], replicated over lanes
    l_ref,  # f32[bb, G, 128]
    acc_ref,  # f32[bb, G, D]
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
):
    h, blk = pl.program_id(0), pl.program_id(1)
    bb = q_ref.shape[0]
    bs = k_buf.shape[2]
    capacity = pages_per_seq * bs

    def seq_of(item):
        return blk * bb + jnp.minimum(item, bb - 1)

    def key_range(item):
        # The query sits at position length-1 and sees [length - window, length).
        length = jnp.clip(kv_lens_ref[seq_of(item)], 0, capacity)
        if sliding_window is None:
            return jnp.int32(0), length
        return jnp.maximum(length - sliding_window, 0), length

    def page_of(item, logical):
        return block_tables_ref[seq_of(item) * pages_per_seq + logical]

    copier = _PageCopier(k_hbm, v_hbm, k_buf, v_buf, sems, layer_ref[0], h, page_of)
    ct = copier.chunk_tokens

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def process(item, chunk, k_start, k_end, slot):
        k, v = _load_chunk(copier, slot, chunk, k_start, k_end)
        kpos = chunk * ct + lax.broadcasted_iota(jnp.int32, (1, ct), 1)
        mask = jnp.logical_and(kpos >= k_start, kpos < k_end)  # [1, ct], same for all G heads
        m, l, acc = _online_softmax_step(
            q_ref[item],  # [G, D]
            k,
            v,
            mask,
            m_ref[item][:, :1],
            l_ref[item][:, :1],
            acc_ref[item],
            scale=scale,
            soft_cap=soft_cap,
        )
        m_ref[item] = jnp.broadcast_to(m, m_ref.shape[1:])
        l_ref[item] = jnp.broadcast_to(l, l_ref.shape[1:])
        acc_ref[item] = acc

    _stream_chunks(copier, jnp.int32(0), lambda item: item < bb, key_range, process)
    o_ref[...] = _normalise(acc_ref[...], l_ref[...][:, :, :1]).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Ragged.


def _ragged_kernel(
    # Scalar prefetch (SMEM).
    block_tables_ref,  # i32[S * P], row-major [S, P]
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S + 1]
    num_seqs_ref,  # i32[1]
    layer_ref,  # i32[1] the layer whose pages are read
    # Inputs.
    q_ref,  # [G, bq, D] rows i*bq ... i*bq+bq-1 of the G query heads of KV head h
    k_hbm,  # [L, KVH, N, bs, D] in HBM
    v_hbm,  # [L, KVH, N, bs, D] in HBM
    # Output.
    o_ref,  # [G, bq, D]
    # Scratch.
    k_buf,  # [2, pages_per_chunk, bs, D] VMEM
    v_buf,  # [2, pages_per_chunk, bs, D] VMEM
    sems,  # DMA [2, 2]
    m_ref,  # f32[G * bq, 128], replicated over lanes
    l_ref,  # f32[G * bq, 128]
    acc_ref,  # f32[G * bq, D]
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
):
    h, blk = pl.program_id(0), pl.program_id(1)
    g, bq, d = q_ref.shape
    rows = g * bq
    num_slots = kv_lens_ref.shape[0]
    bs = k_buf.shape[2]
    capacity = pages_per_seq * bs
    row_lo = blk * bq  # this program's rows: [row_lo, row_hi)
    row_hi = row_lo + bq
    num_seqs = jnp.clip(num_seqs_ref[0], 0, num_slots)

    def seq_rows(seq):
        """(q_start, q_end, first_pos): rows of seq and the position of its row q_start."""
        s = jnp.clip(seq, 0, num_slots - 1)
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        return q_start, q_end, kv_lens_ref[s] - (q_end - q_start)

    def item_valid(seq):
        return jnp.logical_and(seq < num_seqs, cu_q_lens_ref[jnp.minimum(seq, num_slots)] < row_hi)

    def key_range(seq):
        # Rows of seq in this block: [r0, r1). Row r sits at first_pos + r - q_start; the last
        # sees keys up to its own position, the first back to its window's start.
        q_start, q_end, first_pos = seq_rows(seq)
        r0, r1 = jnp.maximum(q_start, row_lo), jnp.minimum(q_end, row_hi)
        k_end = jnp.clip(first_pos + (r1 - q_start), 0, capacity)
        if sliding_window is None:
            k_start = jnp.int32(0)
        else:
            k_start = jnp.maximum(first_pos + (r0 - q_start) - sliding_window + 1, 0)
        return k_start, jnp.where(r1 > r0, k_end, 0)

    def page_of(seq, logical):
        return block_tables_ref[seq * pages_per_seq + logical]

    copier = _PageCopier(k_hbm, v_hbm, k_buf, v_buf, sems, layer_ref[0], h, page_of)
    ct = copier.chunk_tokens

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def process(seq, chunk, k_start, k_end, slot):
        k, v = _load_chunk(copier, slot, chunk, k_start, k_end)
        q_start, q_end, first_pos = seq_rows(seq)
        # Flattened row R = head * bq + t holds token row_lo + t of query head (h, head).
        # (An iota over [G, bq, ct] folded to [rows, ct] avoids a vector remainder.)
        row = row_lo + lax.broadcasted_iota(jnp.int32, (g, bq, ct), 1).reshape(rows, ct)
        pos = first_pos + (row - q_start)  # [rows, ct]
        kpos = chunk * ct + lax.broadcasted_iota(jnp.int32, (rows, ct), 1)
        mask = (row >= q_start) & (row < q_end) & (kpos <= pos) & (kpos < k_end)
        if sliding_window is not None:
            mask &= pos - kpos < sliding_window
        m, l, acc = _online_softmax_step(
            q_ref[...].reshape(rows, d),
            k,
            v,
            mask,
            m_ref[...][:, :1],
            l_ref[...][:, :1],
            acc_ref[...],
            scale=scale,
            soft_cap=soft_cap,
        )
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    # The first sequence with a row at or past row_lo; later ones are found by the stream.
    first_seq = lax.while_loop(
        lambda s: jnp.logical_and(
            s < num_seqs, cu_q_lens_ref[jnp.minimum(s + 1, num_slots)] <= row_lo
        ),
        lambda s: s + 1,
        jnp.int32(0),
    )
    _stream_chunks(copier, first_seq, item_valid, key_range, process)
    out = _normalise(acc_ref[...], l_ref[...][:, :1])  # [rows, D]
    o_ref[...] = out.reshape(g, bq, d).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Wrappers.


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _interpret_context(interpret: bool):
    if interpret:
        return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
    return contextlib.nullcontext()


def _stacked(k_pages, v_pages, layer):
    """`[L, KVH, N, bs, D]` views of the pages and the clamped layer as `i32[1]` (SMEM)."""
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    return k_pages, v_pages, layer.reshape(1)


def _check_pages_and_options(
    q, k_pages, v_pages, *, sliding_window, soft_cap, pages_per_chunk, num_pages_per_seq
):
    if k_pages.ndim not in (4, 5):
        raise ValueError(
            f"k_pages must be [L, KVH, N, bs, D] or [KVH, N, bs, D]; got {k_pages.shape=}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    if q.ndim != 3:
        raise ValueError(f"q must be rank 3 [tokens, H, D]; got {q.shape=}")
    num_kv_heads, _, block_size, head_dim = k_pages.shape[-4:]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} must equal the pages' {head_dim=}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads={q.shape[1]} must be a multiple of {num_kv_heads=}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"{q.dtype=}, {k_pages.dtype=} and {v_pages.dtype=} must be equal")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q.dtype=} must be a floating dtype")
    if block_size % 8 != 0:
        raise ValueError(f"{block_size=} must be a multiple of 8 (TPU sublane tiling)")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be a positive int or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be positive or None")
    if pages_per_chunk is not None and not 1 <= pages_per_chunk <= num_pages_per_seq:
        raise ValueError(f"{pages_per_chunk=} must be in [1, {num_pages_per_seq}]")


def _check_int32(**arrays):
    for name, x in arrays.items():
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32; got {x.dtype}")


def _pages_per_chunk(pages_per_chunk: int | None, block_size: int, num_pages_per_seq: int) -> int:
    if pages_per_chunk is not None:
        return pages_per_chunk
    return max(1, min(num_pages_per_seq, _DEFAULT_CHUNK_TOKENS // block_size))


def _scratch(k_pages, pages_per_chunk, rows_shape):
    """K/V double buffers, their DMA semaphores, and m, l, acc for `rows_shape` query rows."""
    block_size, head_dim = k_pages.shape[-2:]
    buf = pltpu.VMEM((2, pages_per_chunk, block_size, head_dim), k_pages.dtype)
    stats = pltpu.VMEM((*rows_shape, _LANES), jnp.float32)
    return [
        buf,  # k_buf
        buf,  # v_buf
        pltpu.SemaphoreType.DMA((2, 2)),  # [k/v, slot]
        stats,  # m
        stats,  # l
        pltpu.VMEM((*rows_shape, head_dim), jnp.float32),  # acc
    ]


def tpu_paged_attention_decode(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    v_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    block_tables: jax.Array,  # i32[B, P]
    kv_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array = 0,  # int or i32[]
    interpret: bool = False,
    pages_per_chunk: int | None = None,
    seqs_per_block: int | None = None,
) -> jax.Array:  # [B, H, D]
    """Decode paged attention on TPU: query b sits at position `kv_lens[b] - 1`.

    Args:
      q: `[B, H, D]` one query token per sequence.
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
      pages_per_chunk: pages per DMA chunk (default: about 256 keys).
      seqs_per_block: sequences streamed by one program (default `min(B, 8)`).
    Returns:
      `[B, H, D]` in q's dtype.
    Raises:
      ValueError: bad shapes, dtypes or options; `layer` out of range or not an integer.
    """
    layer = check_layer(k_pages, layer)
    return _decode(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        layer,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        pages_per_chunk=pages_per_chunk,
        seqs_per_block=seqs_per_block,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "pages_per_chunk",
        "seqs_per_block",
    ),
)
def _decode(
    q,  # [B, H, D]
    k_pages,  # [L, KVH, N, bs, D] or [KVH, N, bs, D]
    v_pages,  # like k_pages
    block_tables,  # i32[B, P]
    kv_lens,  # i32[B]
    layer,  # int or i32[], checked
    *,
    scale,
    sliding_window,
    soft_cap,
    interpret,
    pages_per_chunk,
    seqs_per_block,
):  # [B, H, D]
    num_pages_per_seq = block_tables.shape[-1]
    _check_pages_and_options(
        q,
        k_pages,
        v_pages,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        num_pages_per_seq=num_pages_per_seq,
    )
    _check_int32(block_tables=block_tables, kv_lens=kv_lens)
    batch, num_heads, head_dim = q.shape
    k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    if block_tables.shape != (batch, num_pages_per_seq) or num_pages_per_seq < 1:
        raise ValueError(f"{block_tables.shape=} must be ({batch}, P >= 1)")
    if kv_lens.shape != (batch,):
        raise ValueError(f"{kv_lens.shape=} must be ({batch},)")
    if seqs_per_block is not None and seqs_per_block < 1:
        raise ValueError(f"{seqs_per_block=} must be positive")
    if batch == 0:
        return jnp.zeros_like(q)

    group = num_heads // num_kv_heads
    ppc = _pages_per_chunk(pages_per_chunk, block_size, num_pages_per_seq)
    bb = seqs_per_block or min(batch, 8)
    padded = _round_up(batch, bb)
    pad = padded - batch
    # Padded sequences get length 0: no copies, zero output, sliced off below.
    q4 = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(padded, num_kv_heads, group, head_dim)
    tables = jnp.pad(block_tables, ((0, pad), (0, 0))).reshape(-1)
    lens = jnp.pad(kv_lens, (0, pad))

    q_spec = pl.BlockSpec((bb, None, group, head_dim), lambda h, i, *_: (i, h, 0, 0))
    with _interpret_context(interpret):  # pallas_call reads the mode when it is built
        call = pl.pallas_call(
            functools.partial(
                _decode_kernel,
                scale=scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                pages_per_seq=num_pages_per_seq,
            ),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=(num_kv_heads, padded // bb),
                in_specs=[
                    q_spec,
                    pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY),
                ],
                out_specs=q_spec,
                scratch_shapes=_scratch(k_pages, ppc, (bb, group)),
            ),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
            name="tpu_paged_attention_decode",
        )
        out = call(tables, lens, layer, q4, k_pages, v_pages)  # [B_pad, KVH, G, D]
    return out.reshape(padded, num_heads, head_dim)[:batch]


def tpu_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    v_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
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
    pages_per_chunk: int | None = None,
    queries_per_block: int | None = None,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention on TPU (prefill, chunked prefill, mixed prefill and decode).

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
      scale, sliding_window, soft_cap, layer, interpret, pages_per_chunk: as in the decode form.
      queries_per_block: query rows per program, a multiple of 8 (default `min(64, T)` rounded
        up to 16).
    Returns:
      `[T, H, D]` in q's dtype.
    Raises:
      ValueError: as in the decode form.
    """
    layer = check_layer(k_pages, layer)
    return _ragged(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        cu_q_lens,
        num_seqs,
        layer,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        pages_per_chunk=pages_per_chunk,
        queries_per_block=queries_per_block,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "pages_per_chunk",
        "queries_per_block",
    ),
)
def _ragged(
    q,  # [T, H, D]
    k_pages,  # [L, KVH, N, bs, D] or [KVH, N, bs, D]
    v_pages,  # like k_pages
    block_tables,  # i32[S, P]
    kv_lens,  # i32[S]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[] or i32[1]
    layer,  # int or i32[], checked
    *,
    scale,
    sliding_window,
    soft_cap,
    interpret,
    pages_per_chunk,
    queries_per_block,
):  # [T, H, D]
    num_slots, num_pages_per_seq = block_tables.shape
    _check_pages_and_options(
        q,
        k_pages,
        v_pages,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        num_pages_per_seq=num_pages_per_seq,
    )
    _check_int32(block_tables=block_tables, kv_lens=kv_lens, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    if num_slots < 1 or num_pages_per_seq < 1:
        raise ValueError(f"{block_tables.shape=} must be [S >= 1, P >= 1]")
    if kv_lens.shape != (num_slots,):
        raise ValueError(f"{kv_lens.shape=} must be ({num_slots},)")
    if cu_q_lens.shape != (num_slots + 1,):
        raise ValueError(f"{cu_q_lens.shape=} must be ({num_slots + 1},)")
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"{num_seqs.shape=} must be () or (1,)")
    if queries_per_block is not None and (queries_per_block < 8 or queries_per_block % 8):
        raise ValueError(f"{queries_per_block=} must be a positive multiple of 8")
    num_tokens, num_heads, head_dim = q.shape
    k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    if num_tokens == 0:
        return jnp.zeros_like(q)

    group = num_heads // num_kv_heads
    ppc = _pages_per_chunk(pages_per_chunk, block_size, num_pages_per_seq)
    bq = queries_per_block or min(64, _round_up(num_tokens, 16))
    padded = _round_up(num_tokens, bq)
    # Head-major [KVH, G, T, D]: a block [G, bq, D] folds into [G * bq, D] along tiled rows.
    q4 = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    q4 = q4.reshape(padded, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)

    q_spec = pl.BlockSpec((None, group, bq, head_dim), lambda h, i, *_: (h, 0, i, 0))
    with _interpret_context(interpret):  # pallas_call reads the mode when it is built
        call = pl.pallas_call(
            functools.partial(
                _ragged_kernel,
                scale=scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                pages_per_seq=num_pages_per_seq,
            ),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=5,
                grid=(num_kv_heads, padded // bq),
                in_specs=[
                    q_spec,
                    pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY),
                ],
                out_specs=q_spec,
                scratch_shapes=_scratch(k_pages, ppc, (group * bq,)),
            ),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
            name="tpu_ragged_paged_attention",
        )
        out = call(
            block_tables.reshape(-1),
            kv_lens,
            cu_q_lens,
            num_seqs.reshape(1),
            layer,
            q4,
            k_pages,
            v_pages,
        )  # [KVH, G, T_pad, D]
    out = out.transpose(2, 0, 1, 3).reshape(padded, num_heads, head_dim)
    return out[:num_tokens]
