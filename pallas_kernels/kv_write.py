"""Writes new K/V into the paged cache at the slots the block manager hands out.

A slot is ``block_id * bs + offset_in_block``; flattening the page axes ``[N, bs]`` into one
``N * bs`` axis turns a slot into a plain row index, so the write is one scatter per tensor::

    k_pages [KVH, N, bs, D] --reshape--> [KVH, N*bs, D] --.at[:, slots].set(k^T)--> back

Padding tokens carry slots inside the null block 0, so no sentinel handling is needed; duplicate
slots there write garbage that is never read unmasked.

The scatter is in place when the caller donates the pages to its jitted step
(``jax.jit(step, donate_argnums=...)``); this function itself donates nothing, so calling it
eagerly leaves the inputs valid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["write_kv"]


@jax.jit
def write_kv(
    k_pages: jax.Array,  # [KVH, N, bs, D]
    v_pages: jax.Array,  # [KVH, N, bs, D]
    k: jax.Array,  # [T, KVH, D]
    v: jax.Array,  # [T, KVH, D]
    slots: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:  # ([KVH, N, bs, D], [KVH, N, bs, D])
    """Scatters ``k[t], v[t]`` into slot ``slots[t]`` of every KV head.

    Args:
      k_pages, v_pages: ``[KVH, N, bs, D]`` one layer's pages.
      k, v: ``[T, KVH, D]`` new keys and values (cast to the pages' dtype).
      slots: ``i32[T]`` in ``[0, N * bs)``; out-of-range slots are dropped.
    Returns:
      The updated ``(k_pages, v_pages)``.
    """
    kvh, n, bs, d = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    t = slots.shape[0] if slots.ndim == 1 else -1
    if slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"{slots.shape=} {slots.dtype=} must be a 1-D integer array")
    for name, x in (("k", k), ("v", v)):
        if x.shape != (t, kvh, d):
            raise ValueError(f"{name}.shape={x.shape} must be (T, KVH, D) = {(t, kvh, d)}")

    def scatter(pages, new):  # [KVH, N, bs, D], [T, KVH, D]
        flat = pages.reshape(kvh, n * bs, d)  # [KVH, N*bs, D]
        new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)  # [KVH, T, D]
        flat = flat.at[:, slots].set(new, mode="drop")
        return flat.reshape(kvh, n, bs, d)

    return scatter(k_pages, k), scatter(v_pages, v)
