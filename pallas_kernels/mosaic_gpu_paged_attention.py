"""Paged attention on Hopper-class GPUs in Pallas's Mosaic GPU backend: decode and ragged.

The same contract as every other implementation (`pallas_kernels.paged_attention`): ragged
batches (prefill chunks and decode tokens mixed) and decode, stacked pages ``[L, KVH, N, bs, D]``
read in place through a possibly traced layer index, GQA, sliding windows, soft cap, split keys
(flash-decoding). It takes 16-bit pages (bfloat16, float16); the dispatch keeps float32 pages and
shapes outside its limits (below) on the Triton kernel.

Design (Hopper, sm_90a)
-----------------------
One CUDA block (one warpgroup, 128 threads) per *(query block, KV head, key split)*, the grid of
the Triton kernel. A query block is ``block_q`` consecutive tokens of one sequence times the
``G = H // KVH`` query heads of one KV head, flattened into the ``M = 64`` rows a warpgroup MMA
(WGMMA) takes::

    row r of a block  ->  token  r // G  of the block,  query head  kv_head * G + r % G

so each K/V page is read once for all ``G`` heads of its group (decode: ``block_q = 1``, ``G``
rows used; ragged: ``block_q = 64 // G``). The keys a block can see, ``[lo, hi)`` (sliding-window
start, causal end), are walked in *compute blocks* of ``bk = max(64, bs)`` keys (``bk / bs``
pages), divided evenly among the splits.

* **Pages by TMA.** Each page of a compute block is one TMA copy (``copy_gmem_to_smem``) from
  ``k_pages[layer, kv_head, page]`` (the page id read from the block table in global memory, the
  layer a traced scalar) into its rows of a 128-byte-swizzled SMEM tile; the ``bk / bs`` copies
  of a block arrive on one mbarrier (``num_arrivals = bk / bs``). Nothing is gathered or sliced
  outside the kernel: the TMA descriptor covers the whole stacked array.
* **Multi-stage pipeline.** K and V have ``num_stages`` SMEM slots each (2 or 3, by the SMEM
  budget) with a barrier per slot; the first ``num_stages`` blocks are issued up front and block
  ``i + num_stages`` is issued into slot ``i % num_stages`` as soon as block ``i``'s P.V MMA has
  completed, so the copies of the next blocks overlap the math of this one. K and V have separate
  barriers: the Q.K^T MMA and the softmax run while V is still arriving.
* **WGMMA** for both products: ``S = Q K^T`` with Q and K from SMEM (K^T read through a
  transposed SMEM descriptor), accumulating in float32 registers; ``P V`` with P (rounded to
  the page dtype) written to SMEM and V from SMEM, into a fresh float32 accumulator that is
  added to the rescaled running output. (Accumulating in place, `pl.run_state` on the running
  output, would save those adds, but no jax interpreter runs `run_state` yet, and the kernel
  that is tested should be the kernel that runs.)
* **Online softmax** in base 2 (``exp2``, ``log2(e)`` folded into the scale) on the WGMMA
  register layout; masking by position from iotas: row ``r`` sees key ``k`` when
  ``r >= G * (k - pos0)`` (causal: ``r // G >= k - pos0``), ``r < G * num_q`` (a real token)
  and, with a window, ``r < G * (W + k - pos0)``. Masked logits are replaced (a select, so NaN
  in unseen K never leaks) and masked probabilities are exactly 0. The V rows of the first and
  last compute block outside ``[lo, hi)`` are zeroed in SMEM before the P.V MMA (the null block
  and stale tails may hold NaN, and ``0 * NaN`` is NaN). Rows that see no key output 0.
* **Splits.** Each split writes its normalised output and its ``(m, l)``; a small `jnp` epilogue
  merges them exactly as the Triton kernel does.

Not done: warp specialisation (a TMA producer warpgroup, two consumers ping-ponging softmax and
MMAs, as in jax's dense FlashAttention-3 example) would hide the softmax behind the other
consumer's MMAs: it pays for long ragged prefill, less for decode (bound by the K/V read). Decode
blocks use only ``G`` of the 64 WGMMA rows; that costs tensor-core time, not memory traffic.

Blackwell (sm_100) would change: the accumulators move to tensor memory (``tcgen05_mma`` with
``plgpu.TMEM`` accumulators instead of WGMMA registers), which frees registers for larger
``M``/``bk``; pages could come in with TMA gather4 (four rows per descriptor, Blackwell only)
instead of one TMA per page; a 2-CTA cluster could share the K/V of one KV head between two
query blocks. None of that is implemented here.

Limits: `supports` (16-bit pages, head dim 64 or 128, block size a power of 2 in [8, 128]).

Interpret mode and lowering (what the CPU can check)
----------------------------------------------------
``interpret=True`` (or an ``InterpretGPUParams``, e.g. with ``detect_races=True``) runs the kernel
in Pallas's Mosaic GPU interpreter (jax >= 0.10): simulated GMEM/SMEM, TMA copies, mbarriers
(arrival counts, and that every completed phase is observed), WGMMA (as a float32 matmul of the
SMEM operands), grid points one after another; the race detector checks SMEM accesses between
TMA and threads. jax 0.10.2's interpreter has no rule for ``layout_cast`` and cannot read a
transposed WGMMA operand, so in interpret mode (on every jax version, so CI checks one kernel)
the layout casts are left out and K^T is written to an SMEM tile by the threads instead of read
through a transposed descriptor; the rest of the body is the one that runs on the GPU.

The interpreter does not check register layouts, WGMMA shape/tiling rules, SMEM capacity or the
PTX: `jax.export(..., platforms=["cuda"])` lowers the kernel through Mosaic GPU on a CPU-only
machine (a ``mosaic_gpu_v2`` custom call in the module; tests/test_mosaic_gpu_kernel.py), which
checks layouts, tilings and WGMMA shapes; only a GPU checks the PTX and the hardware. The
interpreter and the lowering pass under jax 0.10.2 and 0.11.2; on an H200 (jax 0.11.2) the tests
pass compiled (its speed there: README, "GPU kernels on an H200").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.layout import decode_as_ragged, merge_splits, query_blocks, stacked_pages

try:  # jax >= 0.10: Pallas's Mosaic GPU interpreter
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - older jax
    InterpretGPUParams = None

__all__ = [
    "InterpretGPUParams",
    "mosaic_gpu_paged_attention_decode",
    "mosaic_gpu_ragged_paged_attention",
    "supports",
]

_LOG2E = math.log2(math.e)
# A finite "minus infinity": exp2(MASK - m) underflows to 0, and MASK - MASK stays 0 (not NaN).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Programs wanted in flight on a big GPU (an H200 has 132 SMs) before splitting keys further.
_TARGET_PROGRAMS = 2 * 132
_ROWS = 64  # M of one warpgroup's WGMMA: query rows of a block
_SWIZZLE = 128  # bytes: one 64-element row of a 16-bit tile
_SMEM_BUDGET = 200 * 1024  # of the 227 KiB an H100/H200 block may use
_DTYPES = (jnp.bfloat16, jnp.float16)
_HEAD_DIMS = (64, 128)


def supports(page_size: int, head_dim: int, dtype, group: int = 1) -> bool:
    """Whether the kernel takes these shapes: 16-bit pages, ``D`` in (64, 128), ``bs`` a power
    of 2 in [8, 128], at most 64 query heads per KV head."""
    return (
        jnp.dtype(dtype) in map(jnp.dtype, _DTYPES)
        and head_dim in _HEAD_DIMS
        and 8 <= page_size <= 128
        and page_size & (page_size - 1) == 0
        and 1 <= group <= _ROWS
    )


def _tile_transforms(dtype):
    """SMEM tiling for WGMMA operands: 8 rows x 128 bytes, 128-byte swizzle."""
    cols = _SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(_SWIZZLE))


def _paged_attention_kernel(
    q_ref,  # GMEM [NQB, KVH, M, D] query rows of each block and KV head
    k_ref,  # GMEM [L, KVH, N, bs, D] all layers' pages
    v_ref,  # GMEM [L, KVH, N, bs, D]
    tables_ref,  # GMEM i32[NQB, P_pad] each block's sequence's block table, whole blocks
    meta_ref,  # GMEM i32[NQB, 4] (pos0, num_q, layer, 0)
    o_ref,  # GMEM [NQB, KVH, S, M, D] normalised output of each split
    m_ref,  # GMEM f32[NQB, KVH, S, M] running max (base 2) of each split
    l_ref,  # GMEM f32[NQB, KVH, S, M] softmax denominator of each split
    q_smem,  # SMEM [M, D]
    k_smem,  # SMEM [stages, bk, D]
    v_smem,  # SMEM [stages, bk, D]
    p_smem,  # SMEM [M, bk] probabilities in the page dtype
    o_smem,  # SMEM [M, D] output staging
    m_smem,  # SMEM f32[M]
    l_smem,  # SMEM f32[M]
    q_barrier,  # one arrival: the Q copy
    k_barriers,  # [stages], bk / bs arrivals: the page copies of one compute block
    v_barriers,  # [stages]
    *kt_smem,  # interpret mode only: SMEM [D, bk], K^T written by the threads
    group: int,
    page_size: int,
    num_splits: int,
    num_stages: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: bool,
):
    m_rows, head_dim = q_smem.shape
    bk = k_smem.shape[1]
    ppb = bk // page_size
    dtype = p_smem.dtype
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    split = lax.axis_index("s")

    def layout(x, lay):  # jax 0.10's interpreter has no layout_cast rule
        return x if interpret else plgpu.layout_cast(x, lay)

    def iota(shape, dim):
        return layout(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)

    pos0 = meta_ref[b, 0]
    num_q = meta_ref[b, 1]
    layer = meta_ref[b, 2]  # in [0, L): clamped by the wrapper
    # Keys the block can see: [lo, hi). hi is one past the last valid query's position.
    hi = jnp.minimum(pos0 + num_q, tables_ref.shape[1] * page_size)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    hi = jnp.maximum(hi, lo)  # num_q == 0: empty range
    first_cb = lax.div(lo, jnp.int32(bk))
    num_cb = lax.div(hi + (bk - 1), jnp.int32(bk)) - first_cb
    per_split = lax.div(num_cb + (num_splits - 1), jnp.int32(num_splits))
    cb_start = first_cb + split * per_split
    num_steps = jnp.maximum(jnp.minimum(per_split, first_cb + num_cb - cb_start), 0)

    def issue(step):
        """Starts the TMA copies of compute block ``cb_start + step`` into its slot."""
        cb = cb_start + step
        slot = lax.rem(step, jnp.int32(num_stages))
        for pages_smem, pages_ref, barriers in (
            (k_smem, k_ref, k_barriers),
            (v_smem, v_ref, v_barriers),
        ):
            for j in range(ppb):
                page = tables_ref[b, cb * ppb + j]
                plgpu.copy_gmem_to_smem(
                    pages_ref.at[layer, h, page],
                    pages_smem.at[slot, pl.ds(j * page_size, page_size)],
                    barriers.at[slot],
                )

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_barrier)
    for step in range(num_stages):
        pl.when(step < num_steps)(functools.partial(issue, jnp.int32(step)))

    plgpu.barrier_wait(q_barrier)

    if soft_cap is None:
        logit_scale = scale * _LOG2E
    else:
        logit_scale = scale / soft_cap
    rows = iota((m_rows, bk), 0)  # [M, bk]
    cols = iota((m_rows, bk), 1)  # [M, bk]
    valid_rows = rows < group * num_q  # a real token of the block

    def body(step, carry):
        o, m_prev, l_prev = carry  # [M, D], [M], [M]
        slot = lax.rem(step, jnp.int32(num_stages))
        k0 = (cb_start + step) * bk  # position of the compute block's first key
        plgpu.barrier_wait(k_barriers.at[slot])
        if interpret:
            kt_smem[0][...] = k_smem[slot].T
            plgpu.commit_smem()
            k_t = kt_smem[0]
        else:
            k_t = k_smem.at[slot].transpose((1, 0))

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_t)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((m_rows, bk), jnp.float32)) * logit_scale  # [M, bk]
        if soft_cap is not None:
            s = jnp.tanh(s) * (soft_cap * _LOG2E)
        # Row r (token r // G) sees key k0 + c when r // G >= k0 + c - pos0 (causal) and, with a
        # window, r // G < W + k0 + c - pos0; both are compares of r with G * (...).
        key_off = cols + (k0 - pos0)  # [M, bk] key position minus the block's first position
        visible = (rows >= key_off * group) & valid_rows
        if sliding_window is not None:
            visible &= rows < (key_off + sliding_window) * group
        s = jnp.where(visible, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [M]
        alpha = jnp.exp2(m_prev - m_next)  # [M]
        p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
        l_next = alpha * l_prev + p.sum(axis=1)
        o = o * lax.broadcast_in_dim(alpha, o.shape, [0])  # rescaled while V arrives

        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when((k0 < lo) | (k0 + bk > hi))
        def _():  # V rows outside [lo, hi) may be garbage (NaN): zero them before P.V
            key_pos = iota((bk, head_dim), 0) + k0
            v = v_smem[slot]
            v_smem[slot] = jnp.where((key_pos >= lo) & (key_pos < hi), v, jnp.zeros_like(v))

        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()  # P and the zeroed V rows visible to the MMA

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]  # waits for the MMA: the slot is free again

        o = o + pl.run_scoped(pv, plgpu.ACC((m_rows, head_dim), jnp.float32))

        @pl.when(step + num_stages < num_steps)
        def _():
            issue(step + num_stages)

        return o, m_next, l_next

    o = layout(jnp.zeros((m_rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m = layout(jnp.full((m_rows,), _MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = layout(jnp.zeros((m_rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    o, m, l = lax.fori_loop(0, num_steps, body, (o, m, l))

    l_safe = jnp.where(l > 0, l, 1.0)
    o_smem[...] = (o / lax.broadcast_in_dim(l_safe, o.shape, [0])).astype(o_smem.dtype)
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


def _num_stages(bk: int, head_dim: int, itemsize: int, out_itemsize: int) -> int:
    """K/V pipeline depth (2 or 3) that fits the SMEM budget beside Q, P and the output."""
    fixed = _ROWS * head_dim * (itemsize + out_itemsize) + _ROWS * bk * itemsize  # Q, O, P
    per_stage = 2 * bk * head_dim * itemsize
    return max(2, min(3, (_SMEM_BUDGET - fixed) // per_stage))


def _default_splits(num_programs: int, max_compute_blocks: int) -> int:
    """Key splits so that about `_TARGET_PROGRAMS` programs run, never more than key blocks."""
    want = max(1, _TARGET_PROGRAMS // max(num_programs, 1))
    return max(1, min(1 << (want - 1).bit_length(), max_compute_blocks))


def _interpret_params(interpret):
    if interpret is True:
        return InterpretGPUParams()
    return interpret or None


def _attend_blocks(q_blocks, k_pages, v_pages, tables, meta, *, num_splits, num_stages, **kw):
    """Runs the kernel over all (query block, KV head, split) and merges the splits.

    q_blocks ``[NQB, KVH, M, D]``; pages ``[L, KVH, N, bs, D]``; tables ``i32[NQB, P_pad]``;
    meta ``i32[NQB, 4]``. Returns ``[NQB, KVH, M, D]`` in the pages' dtype.
    """
    nqb, kvh, m_rows, d = q_blocks.shape
    bs = k_pages.shape[3]
    bk = max(_ROWS, bs)
    dtype = q_blocks.dtype
    out_dtype = dtype if num_splits == 1 else jnp.float32
    interpret = _interpret_params(kw.pop("interpret"))
    tiles = _tile_transforms(dtype)
    scratch = [
        plgpu.SMEM((m_rows, d), dtype, transforms=tiles),  # q
        plgpu.SMEM((num_stages, bk, d), dtype, transforms=tiles),  # k
        plgpu.SMEM((num_stages, bk, d), dtype, transforms=tiles),  # v
        plgpu.SMEM((m_rows, bk), dtype, transforms=tiles),  # p
        plgpu.SMEM((m_rows, d), out_dtype),  # o
        plgpu.SMEM((m_rows,), jnp.float32),  # m
        plgpu.SMEM((m_rows,), jnp.float32),  # l
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=bk // bs, num_barriers=num_stages),  # k
        plgpu.Barrier(num_arrivals=bk // bs, num_barriers=num_stages),  # v
    ]
    if interpret is not None:
        scratch.append(plgpu.SMEM((d, bk), dtype, transforms=tiles))  # K^T
    kernel = functools.partial(
        _paged_attention_kernel,
        page_size=bs,
        num_splits=num_splits,
        num_stages=num_stages,
        interpret=interpret is not None,
        **kw,
    )
    o, m, l = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows, d), out_dtype),
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((nqb, kvh, num_splits, m_rows), jnp.float32),
        ],
        scratch_types=scratch,
        grid=(nqb, kvh, num_splits),
        grid_names=("b", "h", "s"),
        interpret=interpret,
        kernel_name=f"mosaic_paged_attention_bk{bk}_s{num_splits}",
    )(q_blocks, k_pages, v_pages, tables, meta)
    if num_splits == 1:
        return o[:, :, 0]
    return merge_splits(o, m, l, dtype)


_STATIC = tuple("scale sliding_window soft_cap interpret block_q num_splits num_stages".split())


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_gpu_ragged_paged_attention(
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
    interpret=False,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (prefill, chunked prefill, mixed with decode) on a flat batch.

    Sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its row j sits at position
    ``kv_lens[s] - q_len_s + j`` and sees keys ``k <= pos`` (and ``pos - k < sliding_window``).
    Rows at or past ``cu_q_lens[num_seqs]`` output 0. Inputs are assumed valid (checked by
    `pallas_kernels.paged_attention`, with `supports` for this kernel's limits).

    Args:
      q: ``[T, H, D]`` in the pages' dtype (bfloat16 or float16).
      k_pages, v_pages: ``[L, KVH, N, bs, D]``, the pages of all layers (``[KVH, N, bs, D]`` is
        one layer, ``L = 1``).
      block_tables: ``i32[S, P]``; kv_lens: ``i32[S]`` (this step's rows included);
        cu_q_lens: ``i32[S+1]``; num_seqs: ``i32[]``.
      scale, sliding_window, soft_cap: as in `pallas_kernels.reference`.
      layer: the layer whose pages are read, an int in ``[0, L)`` or a traced ``i32[]``
        (clamped to ``[0, L)``), addressed by the TMA copies in the stacked pages.
      interpret: False (compile for the GPU), True or an ``InterpretGPUParams`` (run in Pallas's
        Mosaic GPU interpreter on the CPU).
      block_q: query tokens per block, ``block_q * G <= 64`` (default 1 when ``T <= S``, a decode
        step, else ``64 // G``).
      num_splits: key splits per query block (default from the grid size).
      num_stages: K/V pipeline slots (default 2 or 3, by SMEM).
    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    Raises:
      ValueError: shapes or dtypes outside `supports`, or a bad ``block_q``/``num_splits``/
        ``num_stages``.
    """
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    t, h, d = q.shape
    _, kvh, _, bs, _ = k_pages.shape
    s, p = block_tables.shape
    group = h // kvh
    if q.dtype != k_pages.dtype or not supports(bs, d, q.dtype, group):
        raise ValueError(
            f"mosaic_gpu kernel: {q.dtype=} and {k_pages.dtype=} must be one of bfloat16/float16, "
            f"head_dim={d} in {_HEAD_DIMS}, block_size={bs} a power of 2 in [8, 128], "
            f"{group=} query heads per KV head <= {_ROWS}"
        )
    if block_q is None:
        block_q = 1 if t <= s else _ROWS // group
    if not 1 <= block_q * group <= _ROWS:
        raise ValueError(f"{block_q=} times {group=} query heads per KV head must be in [1, 64]")
    bk = max(_ROWS, bs)
    ppb = bk // bs
    itemsize = jnp.dtype(q.dtype).itemsize
    if num_stages is None:
        num_stages = _num_stages(bk, d, itemsize, 4)
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be >= 1")
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
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, _ROWS - block_q * group), (0, 0)))
    # Whole compute blocks per table; the padding reads block 0 and is masked.
    tables = jnp.pad(block_tables[blocks.seq], ((0, 0), (0, -p % ppb)))  # [NQB, P_pad]

    splits = num_splits or _default_splits(nqb * kvh, -(-p // ppb))
    if splits < 1:
        raise ValueError(f"{num_splits=} must be >= 1")
    o = _attend_blocks(
        q_blocks,
        k_pages,
        v_pages,
        tables,
        meta,
        num_splits=splits,
        num_stages=num_stages,
        group=group,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )

    # Rows back to tokens: token t is row tok_off[t] of block tok_blk[t].
    o = o[:, :, : block_q * group].reshape(nqb, kvh, block_q, group, d)
    o = o.transpose(0, 2, 1, 3, 4).reshape(nqb * block_q, h, d)  # [NQB*bq, H, D]
    out = o[blocks.tok_blk * block_q + blocks.tok_off]  # [T, H, D]
    return jnp.where(blocks.live[:, None, None], out, jnp.zeros_like(out))  # padding rows: 0


def mosaic_gpu_paged_attention_decode(q, k_pages, v_pages, block_tables, kv_lens, **options):
    """Decode paged attention: query b at position ``kv_lens[b] - 1``; ``kv_lens[b] == 0`` -> 0.

    The ragged kernel on one-row sequences (`layout.decode_as_ragged`) with ``block_q = 1``: one
    block of the ``G`` heads of a KV head per sequence, key splits as the grid needs.

    Args:
      q: ``[B, H, D]``; k_pages, v_pages: ``[L, KVH, N, bs, D]`` (or ``[KVH, N, bs, D]``);
        block_tables: ``i32[B, P]``; kv_lens: ``i32[B]`` (the current token included).
      options: the keywords of `mosaic_gpu_ragged_paged_attention` but ``block_q``.
    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    return decode_as_ragged(
        mosaic_gpu_ragged_paged_attention,
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        block_q=1,
        **options,
    )
