"""What the TPU kernels (`tpu_decode`, `tpu_ragged`) share: page copies, chunk streaming, the
online-softmax step, scratch, argument normalisation and the `pallas_call` around a kernel.

How the kernels work
--------------------
* Block tables, lengths or offsets, and the layer index are scalar-prefetch operands
  (`pltpu.PrefetchScalarGridSpec`): they sit in SMEM, so the kernel can turn a logical page into
  a physical one before it issues the copy.
* K/V pages stay in HBM (`memory_space=pl.ANY`) as the pages of *all* layers,
  `[L, KVH, N, bs, D]` (one layer's `[KVH, N, bs, D]` is taken as `L = 1`); the layer is part of
  each page copy's source address (`k_hbm.at[layer, kv_head, page]`), so the layer may be a
  traced scalar (a `lax.scan` counter) and no layer is ever sliced out of the stack (which XLA
  would materialise as a copy of the layer's whole pool per call).
* A *chunk* is `pages_per_chunk` consecutive logical pages of one sequence
  (`ct = pages_per_chunk * bs` keys); its pages are copied one DMA per page (`PageCopier`) into
  a VMEM buffer `[2, pages_per_chunk, bs, D]` (K and V each), double-buffered: chunk n+1 is in
  flight while chunk n is computed. Only the pages holding keys some query can see are copied
  (skipped: pages past the length, pages before a sliding window, pages after a causal horizon);
  the rest of the buffer holds stale data that masking keeps out.
* One program streams the chunks of *several* sequences back to back (`stream_chunks`),
  prefetching across sequence boundaries, so only the first chunk of a program waits on HBM.
  Programs are independent, so both grid axes are "parallel" (megacore may split them).
* Online softmax in float32 across chunks (`accumulate`); all `G = H // KVH` query heads of a
  KV head go through one matmul with the chunk's keys, so each K/V page is read once per KV head.
* Masking is by position, never by sentinel: masked logits become a finite large negative value
  and their probabilities are set to exactly 0; V rows outside the copied key range are zeroed
  before `p @ v` (`load_chunk`), so garbage (even NaN) in the null block, in a partial last page
  or in stale buffer slots never reaches the output. A row that sees no key outputs 0.

Scratch, in kernel-argument order after the output (`Scratch`): the K and V
double buffers, their DMA semaphores `[k/v, slot]`, and the running `m`, `l` (f32, replicated
over 128 lanes, as Mosaic likes 2-D f32 tiles) and `acc` (f32) of the program's query rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.layout import stacked_pages

__all__ = [
    "STATIC",
    "Options",
    "PageCopier",
    "Scratch",
    "Setup",
    "accumulate",
    "load_chunk",
    "normalise",
    "round_up",
    "run",
    "setup",
    "stream_chunks",
]

# Finite, so `exp(m_prev - m_new)` stays a number for rows that have seen no key yet.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128  # m and l are kept replicated over one vreg's lanes.
_DEFAULT_CHUNK_TOKENS = 256
# Static arguments of both public functions (each adds its own blocking knob).
STATIC = ("scale", "sliding_window", "soft_cap", "interpret", "pages_per_chunk")


class Options(NamedTuple):
    """A kernel's static options."""

    scale: float  # softmax scale applied to q . k
    sliding_window: int | None  # key k is seen from position p when p - k < sliding_window
    soft_cap: float | None  # logits = soft_cap * tanh(scale * q.k / soft_cap)
    pages_per_seq: int  # P, the width of the block tables


class PageCopier:
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


class Scratch(NamedTuple):
    """A kernel's scratch refs, in the order `_scratch` lays them out."""

    k_buf: object  # [2, pages_per_chunk, bs, D] VMEM
    v_buf: object  # [2, pages_per_chunk, bs, D] VMEM
    sems: object  # DMA [2 (k, v), 2 (slot)]
    m: object  # f32[*rows, 128] running max, replicated over lanes
    l: object  # f32[*rows, 128] running denominator
    acc: object  # f32[*rows, D] running un-normalised output

    def copier(self, k_hbm, v_hbm, layer, kv_head, page_of: Callable) -> PageCopier:
        return PageCopier(k_hbm, v_hbm, self.k_buf, self.v_buf, self.sems, layer, kv_head, page_of)

    def init_stats(self):
        self.m[...] = jnp.full(self.m.shape, MASK_VALUE, jnp.float32)
        self.l[...] = jnp.zeros(self.l.shape, jnp.float32)
        self.acc[...] = jnp.zeros(self.acc.shape, jnp.float32)


def _scratch(k_pages, pages_per_chunk: int, rows_shape: tuple[int, ...]) -> list:
    """The scratch shapes of `Scratch` for `rows_shape` query rows."""
    block_size, head_dim = k_pages.shape[-2:]
    buf = pltpu.VMEM((2, pages_per_chunk, block_size, head_dim), k_pages.dtype)
    stats = pltpu.VMEM((*rows_shape, _LANES), jnp.float32)
    acc = pltpu.VMEM((*rows_shape, head_dim), jnp.float32)
    return [buf, buf, pltpu.SemaphoreType.DMA((2, 2)), stats, stats, acc]


def stream_chunks(
    copier: PageCopier,
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


def load_chunk(copier: PageCopier, slot, chunk, k_start, k_end):
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


def _online_softmax_step(q, k, v, mask, m_prev, l_prev, acc_prev, opts: Options):
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
    s = s * opts.scale
    if opts.soft_cap is not None:
        s = opts.soft_cap * jnp.tanh(s / opts.soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    alpha = jnp.exp(m_prev - m)  # [R, 1]
    p = jnp.where(mask, jnp.exp(s - m), 0.0)  # [R, ct]; exactly 0 where masked
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
    return m, l, alpha * acc_prev + pv


def accumulate(stats: Scratch, rows, q, k, v, mask, opts: Options):
    """`_online_softmax_step` of query rows `q [R, D]` on the running stats at `stats.*[rows]`
    (an index or `...`, selecting `[R, 128]` of m and l and `[R, D]` of acc)."""
    m_prev, l_prev = stats.m[rows], stats.l[rows]  # [R, 128]
    m, l, acc = _online_softmax_step(
        q, k, v, mask, m_prev[:, :1], l_prev[:, :1], stats.acc[rows], opts
    )
    stats.m[rows] = jnp.broadcast_to(m, m_prev.shape)
    stats.l[rows] = jnp.broadcast_to(l, l_prev.shape)
    stats.acc[rows] = acc


def normalise(stats: Scratch):
    """`acc / l` of all rows (f32 `[*rows, D]`), 0 for rows that saw no key (`l == 0`)."""
    acc, l = stats.acc[...], stats.l[...][..., :1]
    return jnp.where(l > 0.0, acc / jnp.where(l > 0.0, l, 1.0), 0.0)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Setup(NamedTuple):
    """A public function's normalised arguments and its kernel's static options."""

    k_pages: jax.Array  # [L, KVH, N, bs, D]
    v_pages: jax.Array  # [L, KVH, N, bs, D]
    layer: jax.Array  # i32[1] in [0, L) (SMEM)
    num_kv_heads: int  # KVH
    group: int  # G = H // KVH query heads per KV head
    pages_per_chunk: int
    interpret: bool  # run in the TPU interpreter
    opts: Options


def setup(
    q,  # [B or T, H, D]
    k_pages,  # [L, KVH, N, bs, D] or [KVH, N, bs, D]
    v_pages,  # like k_pages
    layer,  # int or i32[]
    pages_per_chunk: int | None,
    interpret: bool,
    opts: Options,
) -> Setup:
    """Normalises a public function's arguments: `[L, KVH, N, bs, D]` views of the pages (one
    layer's as a stack of one), the clamped layer as `i32[1]` and pages per chunk (checked to lie
    in [1, P]; default about 256 keys)."""
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    pages_per_seq = opts.pages_per_seq
    if pages_per_chunk is None:
        pages_per_chunk = max(1, min(pages_per_seq, _DEFAULT_CHUNK_TOKENS // block_size))
    elif not 1 <= pages_per_chunk <= pages_per_seq:
        raise ValueError(f"{pages_per_chunk=} must be in [1, {pages_per_seq}]")
    group = q.shape[1] // num_kv_heads
    layer = layer.reshape(1)
    return Setup(k_pages, v_pages, layer, num_kv_heads, group, pages_per_chunk, interpret, opts)


def run(
    kernel: Callable,  # (*prefetch, layer, q, k_hbm, v_hbm, o, *scratch, opts) -> None
    su: Setup,
    prefetch: tuple[jax.Array, ...],  # i32 vectors for SMEM; the layer is added last
    q: jax.Array,  # the queries, laid out for `q_spec`; the output is alike
    q_spec: pl.BlockSpec,  # a program's block of q, and of the output
    grid: tuple[int, int],  # (KVH, programs per KV head)
    rows_shape: tuple[int, ...],  # a program's query rows, for m, l and acc
    name: str,
) -> jax.Array:  # like q
    """Runs a TPU kernel: pages left in HBM, both grid axes parallel."""
    if su.interpret:  # pallas_call reads the mode when it is built
        mode = pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
    else:
        mode = contextlib.nullcontext()
    pages_spec = pl.BlockSpec(memory_space=pl.ANY)  # K and V stay in HBM
    with mode:
        call = pl.pallas_call(
            functools.partial(kernel, opts=su.opts),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(prefetch) + 1,
                grid=grid,
                in_specs=[q_spec, pages_spec, pages_spec],
                out_specs=q_spec,
                scratch_shapes=_scratch(su.k_pages, su.pages_per_chunk, rows_shape),
            ),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            name=name,
        )
    return call(*prefetch, su.layer, q, su.k_pages, su.v_pages)
