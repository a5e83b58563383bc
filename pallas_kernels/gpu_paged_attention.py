"""Paged attention on GPUs in Pallas (Triton lowering): decode and ragged, flash-decoding splits.

Lowering choice
---------------
This kernel uses Pallas's **Triton** backend (`pl.pallas_call` with `plgpu.CompilerParams`), not
Mosaic GPU, for three reasons:

* It runs on every CUDA GPU jax supports (Ampere, Ada, Hopper, Blackwell); Mosaic GPU kernels
  need Hopper (sm_90) or newer. On GPUs older than Hopper this same kernel is what runs.
* It runs in Pallas's interpreter on the CPU with ``interpret=True``, so CI (no GPU) checks the
  kernel's arithmetic, masking and indexing against the reference on every commit.
* The same code runs on jax 0.10.2 (CI) and 0.11.2 (the H200 machine): both its interpreter
  and its lowering to Triton IR for an H200 are tested under each (tests/test_gpu_kernel.py).
  jax 0.11.2 already emits a DeprecationWarning at lowering (the Triton backend is to be
  replaced by Mosaic GPU); it still lowers and runs. A Mosaic GPU variant (TMA page copies,
  warp-specialised pipelining) is the follow-up for Hopper and newer once the Triton backend
  goes; the dispatch in `pallas_kernels.ops` would then pick by compute capability and keep
  this kernel for pre-Hopper GPUs.

How it works
------------
Queries are cut into *query blocks*: ``block_q`` consecutive query tokens of one sequence times
the ``G = H // KVH`` query heads that share one KV head, flattened into ``M`` rows (padded to a
power of two >= 16, which Triton's `dot` needs)::

    row r of a block  ->  token  r // G  of the block,  query head  kv_head * G + r % G

so every K/V page is loaded once for all heads of its group. The blocks come from
`pallas_kernels.layout.query_blocks` (as in the XLA path). Decode is the special case
``block_q == 1`` with one block per sequence: `gpu_paged_attention_decode` is the ragged kernel
on one-row sequences (`layout.decode_as_ragged`). The grid is ``(query blocks, KVH, splits)``. Each
program walks its share of the key range in *compute blocks* of ``pages_per_block`` pages
(``bk = pages_per_block * bs`` keys), gathering the pages through the block table, and keeps an
online softmax (running max ``m``, sum ``l``, output ``o``) in base 2 (``exp2`` with ``log2(e)``
folded into the scale). The visible key range of a block ``[lo, hi)`` (causal end, sliding-window
start) is divided evenly among the ``num_splits`` programs of the last grid axis
(flash-decoding), so one long sequence still fills the GPU; a small `jnp` epilogue merges the
splits with their ``(m, l)`` and scatters rows back to ``[T, H, D]``.

Layers: ``k_pages``/``v_pages`` are the pages of all layers stacked, ``[L, KVH, N, bs, D]`` (a
single layer's ``[KVH, N, bs, D]`` is taken as ``L = 1``), plus a ``layer`` index that may be
traced (the counter of a `lax.scan` over layers). The K/V block of a program is one KV head's
pages of *all* layers, ``[L, N, bs, D]``: for the Triton lowering that is just a base pointer
into the stacked array, nothing is copied. The layer travels in the per-block ``meta`` row and
is one more term of the gather's address (``k_pages_ref[layer, pages]``). Slicing
``k_pages[layer]`` outside the kernel instead would make XLA copy the layer's whole pool before
every call, every layer, every step.

Masking is by position, never by sentinel: keys past ``hi`` may come from the null block 0 or a
stale page tail, so their probabilities are set to exactly 0 and their V rows to 0 (garbage may
be NaN). A row that sees no key (``kv_lens == 0``, padding rows) outputs 0.

Inputs are checked once, by `pallas_kernels.paged_attention` (with the kernel's own limits: block
size and head dim powers of 2, head dim >= 16); this module checks only its tuning knobs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layout import decode_as_ragged, merge_splits, query_blocks, stacked_pages

__all__ = ["gpu_paged_attention_decode", "gpu_ragged_paged_attention"]

_LOG2E = math.log2(math.e)
# A finite "minus infinity": exp2(MASK - m) underflows to 0, and MASK - MASK stays 0 (not NaN).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Programs wanted in flight on a big GPU (an H200 has 132 SMs) before splitting keys further.
_TARGET_PROGRAMS = 2 * 132


def _paged_attention_kernel(
    q_ref,  # [M, D] query rows of one query block and one KV head
    k_pages_ref,  # [L, N, bs, D] this KV head's pages, all layers
    v_pages_ref,  # [L, N, bs, D]
    block_table_ref,  # [P_pad] the block's sequence's block table
    meta_ref,  # [4] (pos0, num_q, layer, _): first token's position, valid tokens, layer
    o_ref,  # [M, D] normalised output of this split
    m_ref,  # [M] running max (base 2) of this split
    l_ref,  # [M] softmax denominator of this split
    *,
    group: int,
    pages_per_block: int,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    split = pl.program_id(2)
    m_rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[2]
    bk = pages_per_block * page_size

    pos0 = meta_ref[0]
    num_q = meta_ref[1]
    layer = meta_ref[2]  # in [0, L): clamped by the wrapper
    # Keys the block can see: [lo, hi). hi is one past the last valid query's position.
    hi = jnp.minimum(pos0 + num_q, block_table_ref.shape[0] * page_size)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    hi = jnp.maximum(hi, lo)  # num_q == 0: empty range
    first_cb = lo // bk
    num_cb = pl.cdiv(hi, bk) - first_cb
    per_split = pl.cdiv(num_cb, num_splits)
    cb_start = first_cb + split * per_split
    cb_end = jnp.minimum(cb_start + per_split, first_cb + num_cb)

    rows = jnp.arange(m_rows, dtype=jnp.int32)  # [M]
    row_tok = rows // group  # [M] token of the block each row belongs to
    row_pos = pos0 + row_tok  # [M] query position
    row_valid = row_tok < num_q  # [M] False for padding rows and tokens past the sequence
    q = q_ref[...]  # [M, D]
    if soft_cap is None:
        logit_scale = scale * _LOG2E
    else:
        logit_scale = scale / soft_cap

    def body(cb, carry):
        o_prev, m_prev, l_prev = carry  # [M, D], [M], [M]
        pages = block_table_ref[pl.ds(cb * pages_per_block, pages_per_block)]  # [ppb]
        k = k_pages_ref[layer, pages].reshape(bk, head_dim)  # [bk, D]
        v = v_pages_ref[layer, pages].reshape(bk, head_dim)  # [bk, D]
        # allow_tf32=False: float32 pages get IEEE float32 dots (Triton's default is TF32, about
        # 1e-3 off); 16-bit pages are unaffected.
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * logit_scale  # [M, bk] f32, base 2
        if soft_cap is not None:
            s = jnp.tanh(s) * (soft_cap * _LOG2E)
        key_pos = cb * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        visible = (key_pos[None, :] <= row_pos[:, None]) & row_valid[:, None]  # [M, bk]
        if sliding_window is not None:
            visible &= row_pos[:, None] - key_pos[None, :] < sliding_window
        s = jnp.where(visible, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))  # [M]
        alpha = jnp.exp2(m_prev - m_next)  # [M]
        p = jnp.where(visible, jnp.exp2(s - m_next[:, None]), 0.0)  # [M, bk]
        l_next = alpha * l_prev + p.sum(axis=-1)
        v = jnp.where((key_pos < hi)[:, None], v, jnp.zeros_like(v))  # garbage past hi
        o_next = alpha[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
        return o_next, m_next, l_next

    o = jnp.zeros((m_rows, head_dim), jnp.float32)
    m = jnp.full((m_rows,), _MASK_VALUE, jnp.float32)
    l = jnp.zeros((m_rows,), jnp.float32)
    o, m, l = jax.lax.fori_loop(cb_start, cb_end, body, (o, m, l))
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _prev_pow2(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _attend_blocks(
    kernel,  # _paged_attention_kernel with its static options bound
    q_blocks: jax.Array,  # [NQB, KVH, M, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D]
    v_pages: jax.Array,  # [L, KVH, N, bs, D]
    block_tables: jax.Array,  # i32[NQB, P_pad] each block's sequence's table, whole blocks
    meta: jax.Array,  # i32[NQB, 4] (pos0, num_q, layer, 0), layer in [0, L)
    num_splits: int,
    **launch,  # pallas_call's compiler_params, interpret and name
) -> jax.Array:  # [NQB, KVH, M, D] in q dtype
    """Runs the kernel over all query blocks and key splits, and merges the splits."""
    nqb, kvh, m_rows, d = q_blocks.shape
    num_layers, _, n, bs, _ = k_pages.shape
    out_dtype = q_blocks.dtype if num_splits == 1 else jnp.float32
    o, m, l = pl.pallas_call(
        kernel,
        grid=(nqb, kvh, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, m_rows, d), lambda b, h, s: (b, h, 0, 0)),  # q
            # KV head h's pages of every layer: a pointer offset, the layer is picked inside.
            pl.BlockSpec((num_layers, None, n, bs, d), lambda b, h, s: (0, h, 0, 0, 0)),  # k
            pl.BlockSpec((num_layers, None, n, bs, d), lambda b, h, s: (0, h, 0, 0, 0)),  # v
            pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, s: (b, 0)),  # block_tables
            pl.BlockSpec((None, 4), lambda b, h, s: (b, 0)),  # meta
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, m_rows, d), lambda b, h, s: (b, h, s, 0, 0)),  # o
            pl.BlockSpec((None, None, None, m_rows), lambda b, h, s: (b, h, s, 0)),  # m
            pl.BlockSpec((None, None, None, m_rows), lambda b, h, s: (b, h, s, 0)),  # l
        ],
        out_shape=[
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows, d), out_dtype),
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows), jnp.float32),
        ],
        **launch,
    )(q_blocks, k_pages, v_pages, block_tables, meta)
    if num_splits == 1:
        return o[:, :, 0]
    return merge_splits(o, m, l, q_blocks.dtype)


def _default_splits(num_programs: int, max_compute_blocks: int) -> int:
    """Key splits so that about `_TARGET_PROGRAMS` programs run, never more than key blocks."""
    want = max(1, _TARGET_PROGRAMS // max(num_programs, 1))
    return max(1, min(_next_pow2(want), _next_pow2(max_compute_blocks)))


def _default_pages_per_block(page_size: int) -> int:
    """About 64 keys per compute block, and at least 16 (Triton's dot needs N >= 16)."""
    return max(1, max(64, page_size) // page_size)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "block_q",
        "pages_per_block",
        "num_splits",
        "num_warps",
        "num_stages",
    ),
)
def gpu_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or [KVH, N, bs, D]: L = 1)
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array = 0,  # int or i32[]
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (prefill, chunked prefill, mixed with decode) on a flat batch.

    Sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its row j sits at position
    ``kv_lens[s] - q_len_s + j`` and sees keys ``k <= pos`` (and ``pos - k < sliding_window``).
    Rows at or past ``cu_q_lens[num_seqs]`` output 0. Inputs are assumed valid (checked by
    `pallas_kernels.paged_attention`: ``bs`` and ``D`` powers of 2, ``D >= 16``).

    Args:
      q: ``[T, H, D]`` float32, bfloat16 or float16.
      k_pages, v_pages: ``[L, KVH, N, bs, D]``, the pages of all layers in ``q.dtype``
        (``[KVH, N, bs, D]`` is one layer, ``L = 1``).
      block_tables: ``i32[S, P]``; kv_lens: ``i32[S]`` (this step's rows included);
        cu_q_lens: ``i32[S+1]``; num_seqs: ``i32[]``.
      scale, sliding_window, soft_cap: as in `pallas_kernels.reference`.
      layer: the layer whose pages are read, an int in ``[0, L)`` or a traced ``i32[]`` (e.g. a
        `lax.scan` counter; clamped to ``[0, L)``). The kernel addresses it in the stacked
        pages; nothing is sliced out.
      interpret: run in the Pallas interpreter (CPU tests).
      block_q: query tokens per query block (power of 2; default 1 when ``T <= S``, a decode
        step, else about 64 rows per block).
      pages_per_block: pages per compute block (power of 2; default: about 64 keys).
      num_splits: key splits per query block (flash-decoding; default from the grid size).
      num_warps, num_stages: Triton launch parameters.
    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    Raises:
      ValueError: ``block_q`` or ``pages_per_block`` not a power of 2, or too few keys per
        compute block (``pages_per_block * bs < 16``).
    """
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    t, h, d = q.shape
    _, kvh, _, bs, _ = k_pages.shape
    s, p = block_tables.shape
    group = h // kvh
    ppb = pages_per_block or _default_pages_per_block(bs)
    if ppb & (ppb - 1) or ppb * bs < 16:
        raise ValueError(f"{pages_per_block=} must be a power of 2 with {bs=} * it >= 16")
    if block_q is None:
        block_q = 1 if t <= s else _prev_pow2(max(1, 64 // group))
    if block_q & (block_q - 1):
        raise ValueError(f"{block_q=} must be a power of 2")
    m_rows = max(16, _next_pow2(block_q * group))
    blocks = query_blocks(t, kv_lens, cu_q_lens, num_seqs, block_q)
    nqb = blocks.seq.shape[0]
    layers = jnp.broadcast_to(layer, (nqb,))
    meta = jnp.stack([blocks.pos0, blocks.num, layers, jnp.zeros_like(layers)], axis=1)

    # Gather q rows into blocks: [NQB, bq] token indices (T = zero row for padding).
    j = jnp.arange(block_q)[None, :]
    tok = jnp.where(j < blocks.num[:, None], blocks.row0[:, None] + j, t)  # [NQB, bq]
    q_pad = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])  # [T+1, H, D]
    q_blocks = q_pad[tok].reshape(nqb, block_q, kvh, group, d)
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(nqb, kvh, block_q * group, d)
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, m_rows - block_q * group), (0, 0)))
    # Whole compute blocks per table; the padding reads block 0 and is masked.
    tables = jnp.pad(block_tables[blocks.seq], ((0, 0), (0, -p % ppb)))  # [NQB, P_pad]

    splits = num_splits or _default_splits(nqb * kvh, pl.cdiv(p, ppb))
    softmax = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    kernel = functools.partial(
        _paged_attention_kernel, group=group, pages_per_block=ppb, num_splits=splits, **softmax
    )
    launch = dict(
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_m{m_rows}_bk{ppb * bs}_s{splits}",
    )
    o = _attend_blocks(kernel, q_blocks, k_pages, v_pages, tables, meta, splits, **launch)

    # Rows back to tokens: token t is row tok_off[t] of block tok_blk[t].
    o = o[:, :, : block_q * group].reshape(nqb, kvh, block_q, group, d)
    o = o.transpose(0, 2, 1, 3, 4).reshape(nqb * block_q, h, d)  # [NQB*bq, H, D]
    out = o[blocks.tok_blk * block_q + blocks.tok_off]  # [T, H, D]
    return jnp.where(blocks.live[:, None, None], out, jnp.zeros_like(out))  # padding rows: 0


def gpu_paged_attention_decode(q, k_pages, v_pages, block_tables, kv_lens, **options):
    """Decode paged attention: query b at position ``kv_lens[b] - 1``; ``kv_lens[b] == 0`` -> 0.

    The ragged kernel on one-row sequences (`layout.decode_as_ragged`) with ``block_q = 1``: one
    query block of the ``G`` heads of a KV head per sequence, key splits as the grid needs.

    Args:
      q: ``[B, H, D]``; k_pages, v_pages: ``[L, KVH, N, bs, D]``, the pages of all layers
        (``[KVH, N, bs, D]`` is one layer, ``L = 1``); block_tables: ``i32[B, P]``;
        kv_lens: ``i32[B]`` (the current token included).
      options: the keywords of `gpu_ragged_paged_attention` but ``block_q``: ``scale``,
        ``sliding_window``, ``soft_cap``, ``layer``, ``interpret``, ``pages_per_block``,
        ``num_splits``, ``num_warps``, ``num_stages``.
    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    return decode_as_ragged(
        gpu_ragged_paged_attention, q, k_pages, v_pages, block_tables, kv_lens, block_q=1, **options
    )
