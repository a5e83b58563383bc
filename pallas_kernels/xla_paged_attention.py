"""Paged attention in plain XLA whose cost follows the live context, not the block table: the
CPU default (``impl="xla"``).

The reference (`reference.py`) gathers every query token's whole block table, ``P * bs`` keys,
however short the sequence: exact and simple, the oracle, but its cost grows with
``max_model_len``. This version walks the keys in chunks of ``pages_per_chunk`` blocks with an
online softmax, in a ``lax.fori_loop`` whose trip count is the longest live context in the batch
(a traced value, so one compiled program serves every length).

The queries go in *query blocks* of ``block_q`` consecutive rows of one sequence (as in the GPU
kernel): a block gathers its sequence's pages once for all its rows, so a prefill chunk of 8
tokens reads each page once instead of 8 times, and its ``block_q * G`` query rows (G query
heads per KV head) make a real matmul. Decode steps (``T <= S``) use ``block_q = 1``::

    blocks     b = 0 .. NB-1, each (sequence, first row, rows <= block_q)   NB <= T/bq + S
    for chunk c in [first chunk any row can see, last chunk any row can see]:
        k, v   = pages[layer, :, table[seq(b), c*C:(c+1)*C]]   [NB, KVH, C*bs, D]
                 (K gathered transposed, [NB, KVH, D, C*bs]: q.k contracts over a major axis)
        s      = scale * q.k  (soft cap), masked by position / window  [NB, KVH, bq*G, C*bs]
        m, l, acc  <- online-softmax update
    rows back to tokens

With many query blocks the blocks go in tiles whose gathered chunk fits one core's L2 cache
(as Linux reports it), each tile with its own loop over its own chunks (`_tile_blocks`).

The pages are stacked over layers (``[L, KVH, N, bs, D]``) and gathered through ``layer`` as
whole ``(bs, D)`` rows of the flattened pool, so no per-layer copy of the pool is ever made.

Masked logits become -inf. A page that no row of a block sees (the null block, table entries
past a sequence's end or wholly before its window) is read from a page the sequence owns
instead, so garbage there, even NaN, never reaches the output through ``0 * NaN``. The unused
slots of an owned page must be finite: the engine's are (the pool starts at zero and
`jax_paged.memory.kv_cache.scatter` stores non-finite K/V as 0). Rows that see no key give 0.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.layout import decode_as_ragged, query_blocks, stacked_pages

__all__ = ["xla_paged_attention_decode", "xla_ragged_paged_attention"]


def _parse_cache_size(text: str) -> int:
    """Bytes of a Linux sysfs cache size such as ``"512K"``, ``"1M"`` or ``"524288"``."""
    text = text.strip().upper()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * unit


def _l2_cache_bytes(
    default: int = 1 << 20, root: str = "/sys/devices/system/cpu/cpu0/cache"
) -> int:
    """The L2 cache of one core (Linux sysfs), or ``default`` where it cannot be read."""
    for index in sorted(Path(root).glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                return _parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            pass
    return default


# Bytes of one gathered K (or V) chunk of a tile of query blocks: about one core's L2 cache, so
# that the chunk is still cached when q.k and p.v read it back. On 2 cores with 512 KiB of L2
# each, SmolLM2's 30 layers of decode attention at batch 64 took 0.8x the time in tiles of 16
# or 32 blocks (384 or 768 KiB of K) than in one tile of 64 (1.5 MiB).
_TILE_BYTES = _l2_cache_bytes()


def _tile_blocks(nb: int, chunk_bytes_per_block: int, budget: int = _TILE_BYTES) -> int:
    """Query blocks per tile (static): all ``nb`` when their chunk fits ``budget`` bytes, else
    the fewest equal tiles that fit (at least 8 blocks each)."""
    most = max(8, budget // max(1, chunk_bytes_per_block))
    if nb <= most:
        return nb
    return -(-nb // -(-nb // most))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "pages_per_chunk",
        "block_q",
        "tile_blocks",
    ),
)
def xla_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or one layer's [KVH, N, bs, D])
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    layer: jax.Array | int = 0,  # i32[]
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int = 2,
    block_q: int | None = None,
    tile_blocks: int | None = None,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (contract of docs/DESIGN.md); see the module docstring.

    ``block_q`` (static): query rows per block; default 1 for a decode step (``T <= S``), else
    8 (on 2 CPU cores, 30 layers of a 512-token prefill of 11 prompts of 21-70 tokens: 64 ms
    against 83 ms with 16, whose blocks carry more padding rows).

    ``tile_blocks`` (static): query blocks per tile of the chunk loop; default `_tile_blocks`'s
    choice, every block in one tile unless their gathered chunk outgrows the L2 cache.
    """
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    t, h, d = q.shape
    _, kvh, n, bs, _ = k_pages.shape
    s, p = block_tables.shape
    g = h // kvh
    c = min(pages_per_chunk, p)
    ck = c * bs  # keys per chunk
    bq = block_q or (1 if t <= s else 8)
    mr = bq * g  # query rows of a block per KV head
    # With a few rows per (block, KV head), as in decode with GQA, p.v is a tiny
    # [M, C*bs] x [C*bs, D] matmul, and XLA's CPU batched matmul costs more per call than a
    # fused multiply-and-reduce over the keys.
    small = mr <= 8
    # The pool as rows of one (bs, D) page each, row (layer * KVH + head) * N + block: a
    # bitcast, and gathering whole rows runs about twice as fast on the CPU as a 5-D gather.
    k_rows = k_pages.reshape(-1, bs * d)
    v_rows = v_pages.reshape(-1, bs * d)

    blk_seq, blk_row0, blk_num, blk_pos0, tok_blk, tok_off, live = query_blocks(
        t, kv_lens.astype(jnp.int32), cu_q_lens, num_seqs, bq
    )
    nb = blk_seq.shape[0]
    j = jnp.arange(bq, dtype=jnp.int32)
    valid = j[None, :] < blk_num[:, None]  # [NB, bq]
    tok = jnp.where(valid, blk_row0[:, None] + j[None, :], t)  # [NB, bq]; t = a zero row
    qp = jnp.concatenate([q.astype(jnp.float32) * scale, jnp.zeros((1, h, d), jnp.float32)])
    qb = qp[tok].reshape(nb, bq, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(nb, kvh, mr, d)
    pos = jnp.where(valid, blk_pos0[:, None] + j[None, :], -1)  # [NB, bq]
    row_pos = jnp.repeat(pos, g, axis=1)  # [NB, bq*G], row r is query r // G of the block
    tables = block_tables[blk_seq]  # [NB, P]

    head_row = (layer * kvh + jnp.arange(kvh, dtype=jnp.int32)) * n  # [KVH] first row of head

    def attend(qb, pos, row_pos, tables):
        """The chunk loop over one tile of query blocks: (l, acc) of the online softmax."""
        nb = qb.shape[0]
        lo = jnp.where(pos >= 0, pos - (sliding_window or 1 << 30) + 1, 1 << 30)
        first = jnp.clip(jnp.min(lo), 0, None) // ck
        last = jnp.max(pos) // ck  # -1 when no row is live: the loop does not run
        # The page holding each block's last live row: the sequence owns it (that row's K/V was just
        # written there). Pages no row of the block sees are read from it instead (see `body`).
        own_page = jnp.take_along_axis(
            tables, jnp.clip(jnp.max(pos, axis=1) // bs, 0, p - 1)[:, None], 1
        )

        def body(ci, carry):
            m, l, acc = carry
            blk = ci * c + jnp.arange(c, dtype=jnp.int32)  # [C] logical blocks of this chunk
            ids = jnp.take(tables, jnp.clip(blk, 0, p - 1), axis=1)  # [NB, C]
            kpos = ci * ck + jnp.arange(ck, dtype=jnp.int32)  # [C*bs]
            mask = (kpos[None, None, :] <= row_pos[:, :, None]) & (kpos < p * bs)  # [NB, M, C*bs]
            if sliding_window is not None:
                mask &= row_pos[:, :, None] - kpos[None, None, :] < sliding_window
            # A page no row of the block sees (past the sequence's end, out of the window, a null
            # entry) may hold anything, even NaN, and 0 * NaN is not 0: it is read from the block's
            # own page instead, whose unused slots hold finite values (the pool starts at zero and
            # `kv_cache.scatter` stores non-finite K/V as 0). Its keys are masked all the same.
            # This costs a [NB, C] select; zeroing the masked V rows cost 15% of decode attention.
            seen = jnp.any(mask, axis=1).reshape(nb, c, bs).any(-1)  # [NB, C]
            ids = jnp.where(seen, ids, own_page)
            # Whole (bs, D) pages as rows of the flattened pool. K is gathered transposed,
            # [NB, KVH, D, C*bs], in the same fused loop as the gather: q.k then contracts over
            # a major axis with the keys along the vector lanes. Against [.., C*bs, D] (a
            # reduction across the minor axis) that made decode attention at batch 64 about
            # 1.6x faster and a 512-token prefill's about 1.1x (both layouts timed alternately in
            # one process, 2 cores).
            r = head_row[None, :, None] + ids[:, None, :]  # [NB, KVH, C]
            kt = k_rows[r].reshape(nb, kvh, c, bs, d).transpose(0, 1, 4, 2, 3)
            kt = kt.reshape(nb, kvh, d, ck).astype(jnp.float32)
            v = v_rows[r].reshape(nb, kvh, ck, d).astype(jnp.float32)  # [NB, KVH, C*bs, D]
            # Masked scores are replaced below (a where, so garbage K never matters).
            sc = jnp.einsum("bkmd,bkdn->bkmn", qb, kt)  # [NB, KVH, M, C*bs]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            sc = jnp.where(mask[:, None], sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            pr = jnp.exp(sc - m_safe[..., None])  # masked -> 0
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
            l = l * corr + pr.sum(-1)
            if small:
                pv = (pr[..., None] * v[:, :, None, :, :]).sum(3)
            else:
                pv = jnp.einsum("bkmn,bknd->bkmd", pr, v)
            acc = acc * corr[..., None] + pv
            return m_new, l, acc

        init = (
            jnp.full((nb, kvh, mr), -jnp.inf, jnp.float32),
            jnp.zeros((nb, kvh, mr), jnp.float32),
            jnp.zeros((nb, kvh, mr, d), jnp.float32),
        )
        _, l, acc = lax.fori_loop(first, last + 1, body, init)
        return l, acc

    # Query blocks go in tiles whose gathered K (or V) chunk stays within the L2 cache
    # (`_tile_blocks`), each with its own loop from its own first to its own last chunk: at
    # batch 256 the chunks of one loop over every block (6 MiB of K for SmolLM2) spilled the
    # cache and attention cost 40% more per token than in tiles.
    tile = min(nb, tile_blocks or _tile_blocks(nb, kvh * ck * d * 4))
    if tile == nb:
        l, acc = attend(qb, pos, row_pos, tables)
    else:
        nt = -(-nb // tile)

        def tiles(x, fill):  # [NB, ...] -> [nt, tile, ...], padded with blocks that see nothing
            x = jnp.concatenate([x, jnp.full((nt * tile - nb, *x.shape[1:]), fill, x.dtype)])
            return x.reshape(nt, tile, *x.shape[1:])

        xs = (tiles(qb, 0.0), tiles(pos, -1), tiles(row_pos, -1), tiles(tables, 0))
        l, acc = lax.map(lambda x: attend(*x), xs)
        l = l.reshape(nt * tile, *l.shape[2:])[:nb]
        acc = acc.reshape(nt * tile, *acc.shape[2:])[:nb]
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    # [NB, KVH, bq*G, D] -> [NB * bq, H, D] -> each token's row.
    out = out.reshape(nb, kvh, bq, g, d).transpose(0, 2, 1, 3, 4).reshape(nb * bq, h, d)
    out = out[tok_blk * bq + tok_off]
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)


def xla_paged_attention_decode(q, k_pages, v_pages, block_tables, kv_lens, **options):
    """Decode form: one query per sequence, as a ragged batch of one-row sequences
    (`layout.decode_as_ragged`, ``block_q = 1``).

    Args:
      q: ``[B, H, D]``; k_pages, v_pages: ``[L, KVH, N, bs, D]`` (or one layer's
        ``[KVH, N, bs, D]``) in ``q.dtype``; block_tables: ``i32[B, P]``; kv_lens: ``i32[B]``.
      options: the keywords of `xla_ragged_paged_attention` but ``block_q``: ``layer``,
        ``scale``, ``sliding_window``, ``soft_cap``, ``pages_per_chunk``, ``tile_blocks``.
    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    return decode_as_ragged(
        xla_ragged_paged_attention, q, k_pages, v_pages, block_tables, kv_lens, block_q=1, **options
    )
