"""Paged K/V storage: `k`, `v` of shape [L, KVH, N, bs, D] (see docs/DESIGN.md).

A token's K/V lives at a slot `block * bs + offset` (from `block_manager.token_slots`)::

    slots      [ 37,          0,          5 ]     (0 = padding, lands in the null block)
    block, off   (9, 1)       (0, 0)      (1, 1)
    k[l, h, 9, 1, :] = k_new[0, h, :]  for every KV head h

`write` and `copy_blocks` are jitted with the cache donated, so XLA updates the pages in place;
do not use a cache after passing it to them (use the returned one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_paged import backend
from pallas_kernels import cpu_paged_attention as cpu_kernels


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype=jnp.float32
) -> int:
    """Bytes of K plus V that one physical block holds over all layers."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


def num_blocks_for_budget(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=jnp.float32,
) -> int:
    """Physical blocks (null block included) that fit in `memory_bytes`."""
    per = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    n = int(memory_bytes) // per
    if n < 2:
        raise ValueError(
            f"{memory_bytes=} holds {n} blocks of {per} bytes; need >= 2 (block 0 is the null "
            "block): raise the budget or lower block_size"
        )
    return n


@struct.dataclass
class KVCache:
    """K/V pages of every layer.

    Attributes:
      k: [L, KVH, N, bs, D] keys, model dtype; `k[l]` is layer l's pages for the kernels.
      v: [L, KVH, N, bs, D] values.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        dtype=jnp.float32,
        sharding=None,
    ) -> KVCache:
        """Zeroed pages sized by a block count or a memory budget in bytes (exactly one)."""
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError(f"give exactly one of {num_blocks=} and {memory_bytes=}")
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(
                memory_bytes, num_layers, num_kv_heads, head_dim, block_size, dtype
            )
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the null block)")
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        zeros = functools.partial(jnp.zeros, shape, dtype)
        if sharding is not None:
            zeros = jax.jit(zeros, out_shardings=sharding)
        return cls(k=zeros(), v=zeros())

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def scatter(cache: KVCache, layer, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
    """The traceable form of `write` (call it inside your own jit; donate the cache there).
    Non-finite K/V values are stored as 0 (see below)."""
    bs = cache.block_size
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (cache.k.shape[1], cache.k.shape[4]):
        raise ValueError(
            f"{k.shape=}, {v.shape=} must be [T, KVH, D] = [T, {cache.k.shape[1]}, "
            f"{cache.k.shape[4]}]"
        )
    if slots.shape != k.shape[:1]:
        raise ValueError(f"{slots.shape=} must be [{k.shape[0]}]")
    slots = slots.astype(jnp.int32)
    blk, off = slots // bs, slots % bs
    # Non-finite K/V are stored as 0. A page's slots past its sequence's end keep what an
    # earlier owner wrote, and the XLA attention reads them with weight 0 (masked, not
    # zeroed); a NaN or inf there would turn 0 * x into NaN for a later, healthy sequence.
    k = jnp.where(jnp.isfinite(k), k, jnp.zeros((), k.dtype))
    v = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))
    # One scatter into the 5-D array (in place when donated). The advanced indices (layer, blk,
    # off) are split by a slice, so the indexed view is [T, KVH, D], the layout of k.
    return cache.replace(
        k=_scatter_rows(cache.k, layer, blk, off, k), v=_scatter_rows(cache.v, layer, blk, off, v)
    )


def _scatter_rows(pages: jax.Array, layer, blk, off, rows: jax.Array) -> jax.Array:
    """``pages.at[layer, :, blk, off].set(rows, mode="drop")``, in place."""
    if backend.native_kv_updates(pages):
        return cpu_kernels.write_rows(pages, layer, blk, off, rows)
    return pages.at[layer, :, blk, off].set(rows.astype(pages.dtype), mode="drop")


write = jax.jit(scatter, donate_argnums=0)
write.__doc__ = """write(cache, layer, k[T,KVH,D], v[T,KVH,D], slots i32[T]) -> cache.

Stores each token's K/V at its slot in layer `layer` (int, may be traced), in place (the cache
is donated); NaN and inf are stored as 0. Several tokens on one slot (padding, slot 0) leave
one of them there."""


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """The traceable form of `copy_blocks` (call it inside your own jit)."""
    src = jnp.asarray(src, jnp.int32)
    dst = jnp.asarray(dst, jnp.int32)

    # Gather all sources first, then scatter: chains (a->b, b->c) copy the old contents.
    # Padding pairs (0, 0) rewrite the null block with itself.
    def copy(pages):
        if backend.native_kv_updates(pages):
            return cpu_kernels.copy_pages(pages, src, dst)
        return pages.at[:, :, dst].set(pages[:, :, src])

    return cache.replace(k=copy(cache.k), v=copy(cache.v))


copy_blocks = jax.jit(copy_pages, donate_argnums=0)
copy_blocks.__doc__ = """copy_blocks(cache, src i32[M], dst i32[M]) -> cache.

Copies physical block src[i] into dst[i] in every layer and KV head (the copy-on-write pairs of
`block_manager.reserve`), in place. Pairs (0, 0) are no-ops; destinations must be distinct
(apart from 0)."""
