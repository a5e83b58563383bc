"""Plain-`jnp` paged attention: the oracle every kernel is tested against, and the CPU path.

Both forms follow docs/DESIGN.md:

* decode: one query per sequence, ``q[B, H, D]``, the query at position ``kv_lens[b] - 1``;
* ragged: a flattened batch ``q[T, H, D]`` where sequence ``s`` owns rows
  ``cu_q_lens[s]:cu_q_lens[s + 1]`` and its row ``j`` sits at position
  ``kv_lens[s] - q_len_s + j``. Rows at or past ``cu_q_lens[num_seqs]`` are padding (zeros).

The decode form runs as the ragged one on one-row sequences, and the ragged rows' sequences and
positions come from `pallas_kernels.layout.ragged_rows`, the mapping every implementation shares.

How it is computed: every query token gathers the K/V pages of its own sequence through the
block table (``[KVH, P * bs, D]`` per token) and attends with a dense masked softmax in float32.
Gathering per token wastes nothing in decode (one token per sequence) and keeps one code path for
prefill, chunked prefill and mixed batches; to bound memory the tokens go through ``lax.map`` in
chunks sized so one chunk's gathered K and V stay under ``max_chunk_bytes``.

Masking is by length, never by sentinel: unused block-table entries point at the null block 0
whose contents are garbage, so masked probabilities are exactly 0 and masked V rows are zeroed
before the weighted sum (a NaN in garbage must not leak through ``0 * NaN``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.layout import decode_as_ragged, ragged_rows, stacked_pages

__all__ = ["paged_attention_decode_reference", "ragged_paged_attention_reference"]

_DEFAULT_MAX_CHUNK_BYTES = 512 * 1024 * 1024


def _attend_tokens(
    q: jax.Array,  # [C, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D]
    v_pages: jax.Array,  # [L, KVH, N, bs, D]
    tables: jax.Array,  # i32[C, P], each token's own sequence's block table
    pos: jax.Array,  # i32[C], position of each query token; -1 for a row that sees nothing
    *,
    layer: jax.Array,  # i32[]
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:  # [C, H, D] in q.dtype
    """Dense masked attention of C query tokens, each over its own sequence's pages."""
    c, h, d = q.shape
    _, kvh, _, bs, _ = k_pages.shape
    p = tables.shape[1]
    g = h // kvh
    # Gather: [C, P, KVH, bs, D] -> [KVH, C, P*bs, D]; key index k is the token position k.
    # Computed in float32 whatever the input dtype: exact enough to be the oracle, and XLA's CPU
    # matmuls run float32 several times faster than bfloat16 (the cast fuses into the gather).
    k = k_pages[layer, :, tables].transpose(2, 0, 1, 3, 4).reshape(kvh, c, p * bs, d)
    v = v_pages[layer, :, tables].transpose(2, 0, 1, 3, 4).reshape(kvh, c, p * bs, d)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    qg = q.reshape(c, kvh, g, d).astype(jnp.float32)  # query head h = kv head h // g
    logits = jnp.einsum(
        "ckgd,kctd->ckgt", qg, k, precision=jax.lax.Precision.HIGHEST
    )  # [C, KVH, G, P*bs]
    logits = logits * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key_pos = jnp.arange(p * bs, dtype=jnp.int32)  # [P*bs]
    mask = key_pos[None, :] <= pos[:, None]  # [C, P*bs]
    if sliding_window is not None:
        mask &= pos[:, None] - key_pos[None, :] < sliding_window
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)  # [C, KVH, G, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no visible key
    e = jnp.where(mask[:, None, None, :], jnp.exp(logits - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)  # [C, KVH, G, 1]
    probs = e / jnp.where(denom > 0, denom, 1.0)  # all-zero row -> output 0
    v = jnp.where(mask[None, :, :, None], v, 0.0)  # [KVH, C, P*bs, D]
    out = jnp.einsum(
        "ckgt,kctd->ckgd", probs, v, precision=jax.lax.Precision.HIGHEST
    )  # [C, KVH, G, D]
    return out.reshape(c, h, d).astype(q.dtype)


def _chunk_size(num_tokens: int, k_pages: jax.Array, num_pages_per_seq: int, max_bytes: int):
    _, kvh, _, bs, d = k_pages.shape
    per_token = 2 * kvh * num_pages_per_seq * bs * d * 4  # K and V gathered, f32 upper bound
    return max(1, min(num_tokens, max_bytes // max(per_token, 1)))


def _attend_all(q, k_pages, v_pages, tables, pos, layer, max_chunk_bytes, **kw):
    """Runs `_attend_tokens` over all T tokens in memory-bounded chunks (``kw``: its options)."""
    t = q.shape[0]
    if t == 0:
        return jnp.zeros_like(q)
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    c = _chunk_size(t, k_pages, tables.shape[1], max_chunk_bytes)
    attend = functools.partial(_attend_tokens, k_pages=k_pages, v_pages=v_pages, layer=layer, **kw)
    if c >= t:
        return attend(q, tables=tables, pos=pos)
    # lax.map(batch_size=c) vmaps over c tokens at a time: the per-token kernel is [1, H, D].
    return jax.lax.map(
        lambda x: attend(x[0][None], tables=x[1][None], pos=x[2][None])[0],
        (q, tables, pos),
        batch_size=c,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "max_chunk_bytes")
)
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [KVH, N, bs, D] or [L, KVH, N, bs, D]
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    layer: jax.Array | int = 0,  # i32[]: the layer of stacked pages
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_chunk_bytes: int = _DEFAULT_MAX_CHUNK_BYTES,
) -> jax.Array:  # [T, H, D]
    """Ragged attention over a flattened batch (prefill, chunked prefill, mixed with decode).

    Args:
      q: ``[T, H, D]`` query rows; sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``.
      k_pages, v_pages: ``[KVH, N, bs, D]`` or ``[L, KVH, N, bs, D]`` (with ``layer``), the
        queries' K/V already written.
      block_tables: ``i32[S, P]``.
      kv_lens: ``i32[S]`` cached tokens per sequence including this step's ``q_len_s`` tokens;
        row j of sequence s sits at position ``kv_lens[s] - q_len_s + j`` and sees keys
        ``k <= pos`` (and ``pos - k < sliding_window`` with a window).
      cu_q_lens: ``i32[S+1]`` query start offsets, ``cu_q_lens[0] == 0``.
      num_seqs: ``i32[]`` live sequences; rows at or past ``cu_q_lens[num_seqs]`` output 0.
      layer: ``i32[]`` or int, the layer of stacked pages.
      scale: softmax scale applied to ``q . k``.
      sliding_window: optional; key k is seen when ``pos - k < sliding_window``.
      soft_cap: optional; ``logits = soft_cap * tanh(scale * q.k / soft_cap)``.
      max_chunk_bytes: memory bound for the per-token gather (static).
    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    rows = ragged_rows(q.shape[0], kv_lens, cu_q_lens, num_seqs)
    tables = block_tables.astype(jnp.int32)[rows.seq]  # [T, P]
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return _attend_all(q, k_pages, v_pages, tables, rows.pos, layer, max_chunk_bytes, **kw)


def paged_attention_decode_reference(q, k_pages, v_pages, block_tables, kv_lens, **options):
    """Decode attention: query b sits at position ``kv_lens[b] - 1``; ``kv_lens[b] == 0`` -> 0.

    The ragged reference on one-row sequences (`layout.decode_as_ragged`).

    Args:
      q: ``[B, H, D]`` one query token per sequence.
      k_pages, v_pages: ``[KVH, N, bs, D]`` one layer's pages, or ``[L, KVH, N, bs, D]`` all
        layers' with ``layer`` picking one (gathered in place, never sliced).
      block_tables: ``i32[B, P]`` physical block of each logical block (unused entries 0).
      kv_lens: ``i32[B]`` cached tokens per sequence, the current one included.
      options: the keywords of `ragged_paged_attention_reference`: ``layer`` (``i32[]`` or
        int, the layer of stacked pages), ``scale`` (softmax scale applied to ``q . k``),
        ``sliding_window`` (key k is seen when ``pos - k < sliding_window``), ``soft_cap``
        (``logits = soft_cap * tanh(scale * q.k / soft_cap)``), ``max_chunk_bytes`` (memory
        bound for the per-token gather).
    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    return decode_as_ragged(
        ragged_paged_attention_reference, q, k_pages, v_pages, block_tables, kv_lens, **options
    )
