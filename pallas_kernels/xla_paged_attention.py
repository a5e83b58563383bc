"""Paged attention in plain XLA whose cost follows the live context, not the block table: the
CPU default (``impl="xla"``).

The reference (`reference.py`) gathers every query token's whole block table, ``P * bs`` keys,
however short the sequence: exact and simple, the oracle, but its cost grows with
``max_model_len``. This version walks the keys in chunks of ``pages_per_chunk`` blocks with an
online softmax, in a ``lax.while_loop`` whose trip count is the longest live context in the batch
(a traced value, so one compiled program serves every length)::

    chunk c covers logical blocks [c*C, (c+1)*C) of every token's own sequence
    for c in [first chunk any token can see, last chunk any token can see]:
        k, v   = pages[:, table[token, c*C:(c+1)*C]]          [T, KVH, C*bs, D]
        s      = scale * q.k  (soft cap), masked by position / window
        m, l, acc  <- online-softmax update

Masked logits become -inf and masked V rows are zeroed first, so garbage (even NaN) in the null
block or past a sequence's length never reaches the output. Rows that see no key give 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["xla_paged_attention_decode", "xla_ragged_paged_attention"]


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "pages_per_chunk")
)
def xla_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [KVH, N, bs, D]
    v_pages: jax.Array,  # [KVH, N, bs, D]
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int = 8,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (contract of docs/DESIGN.md); see the module docstring."""
    t, h, d = q.shape
    kvh, _, bs, _ = k_pages.shape
    s, p = block_tables.shape
    g = h // kvh
    c = min(pages_per_chunk, p)
    ck = c * bs  # keys per chunk

    rows = jnp.arange(t, dtype=jnp.int32)
    # Entries past num_seqs may be garbage: flatten them to the end offset (keeps cu sorted).
    n_live = jnp.clip(num_seqs, 0, s)
    cu_q_lens = jnp.where(jnp.arange(s + 1) <= n_live, cu_q_lens, cu_q_lens[n_live])
    # Row t belongs to the sequence whose [cu[s], cu[s+1]) holds it.
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    seq = jnp.clip(seq, 0, s - 1)
    live = (rows < cu_q_lens[n_live]) & (rows >= cu_q_lens[0])
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])  # [T] query positions
    pos = jnp.where(live, pos, -1)
    tables = block_tables[seq]  # [T, P]

    qf = q.astype(jnp.float32).reshape(t, kvh, g, d) * scale
    lo = jnp.where(pos >= 0, pos - (sliding_window or 1 << 30) + 1, 1 << 30)
    first = jnp.clip(jnp.min(lo), 0, None) // ck
    last = jnp.max(pos) // ck  # -1 when no row is live: the loop does not run

    def body(ci, carry):
        m, l, acc = carry
        blk = ci * c + jnp.arange(c, dtype=jnp.int32)  # [C] logical blocks of this chunk
        ids = jnp.take(tables, jnp.clip(blk, 0, p - 1), axis=1)  # [T, C]
        kpos = ci * ck + jnp.arange(ck, dtype=jnp.int32)  # [C*bs]
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < p * bs)  # [T, C*bs]
        if sliding_window is not None:
            mask &= pos[:, None] - kpos[None, :] < sliding_window
        k = k_pages[:, ids].reshape(kvh, t, ck, d)  # [KVH, T, C*bs, D]
        v = v_pages[:, ids].reshape(kvh, t, ck, d)
        k = jnp.where(mask[None, :, :, None], k.astype(jnp.float32), 0.0)
        v = jnp.where(mask[None, :, :, None], v.astype(jnp.float32), 0.0)
        sc = jnp.einsum("tkgd,ktnd->tkgn", qf, k)  # [T, KVH, G, C*bs]
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        pr = jnp.exp(sc - m_safe[..., None])  # masked -> 0
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + pr.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgn,ktnd->tkgd", pr, v)
        return m_new, l, acc

    init = (
        jnp.full((t, kvh, g), -jnp.inf, jnp.float32),
        jnp.zeros((t, kvh, g), jnp.float32),
        jnp.zeros((t, kvh, g, d), jnp.float32),
    )
    _, l, acc = lax.fori_loop(first, last + 1, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


def xla_paged_attention_decode(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,  # i32[B, P]
    kv_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int = 8,
) -> jax.Array:  # [B, H, D]
    """Decode form: one query per sequence, as a ragged batch of one-row sequences."""
    b = q.shape[0]
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    return xla_ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        cu,
        jnp.int32(b),
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
    )
