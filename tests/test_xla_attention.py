"""The chunked XLA paged attention (the CPU default) against the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.xla_paged_attention import (
    _TILE_BYTES,
    _l2_cache_bytes,
    _parse_cache_size,
    _tile_blocks,
    xla_paged_attention_decode,
    xla_ragged_paged_attention,
)

try:  # pytest puts tests/ on sys.path (rootdir-relative import mode)
    from test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q
except ImportError:  # tests/ imported as a package
    from tests.test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q

LONG = 517

# bs, kvh, group, head_dim, dtype, window, cap, pages_per_chunk
CASES = [
    (8, 2, 1, 64, jnp.float32, None, None, 8),
    (16, 3, 3, 64, jnp.bfloat16, None, None, 2),
    (32, 2, 4, 128, jnp.float32, None, 3.0, 1),
    (16, 1, 8, 128, jnp.bfloat16, 100, 5.0, 4),
    (8, 2, 4, 64, jnp.float32, 9, 2.0, 3),
]


def _grid(variants, fast):
    """Every case with every variant; those that ``fast(case_index, variant_index)`` rejects
    run in the slow tier only. The fast tier still runs every case and every variant."""
    return [
        pytest.param(*case, *var, marks=() if fast(c, v) else pytest.mark.slow)
        for c, case in enumerate(CASES)
        for v, var in enumerate(variants)
    ]


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,chunk,tile",
    _grid([(None,), (4,)], lambda c, v: v == 0 or c == 3),
)
def test_decode_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, chunk, tile):
    """``tile=4``: six sequences in two tiles of query blocks, the second padded."""
    rng = np.random.default_rng(bs + 10 * group)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype, null_fill=np.nan
    )
    q, _ = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = xla_paged_attention_decode(*args, pages_per_chunk=chunk, tile_blocks=tile, **kw)
    ref = paged_attention_decode_reference(*args, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[0], 0)  # kv_len 0
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,chunk,block_q,tile",
    _grid(
        [(None, None), (1, None), (3, None), (16, None), (1, 5), (3, 2)],
        lambda c, v: v % len(CASES) == c,  # each case once, each variant once
    ),
)
def test_ragged_matches_reference(
    bs, kvh, group, head_dim, dtype, window, cap, chunk, block_q, tile
):
    """Every query-block size (None: the default for the shape) gives the reference's rows:
    blocks split sequences, padding blocks and rows, empty sequences, garbage past num_seqs;
    so do the blocks cut into tiles of ``tile`` (each with its own chunk loop)."""
    rng = np.random.default_rng(100 + bs + group)
    kv_lens, q_lens, num_seqs, rows = mixed_batch(bs)
    case = make_paged_case(
        rng,
        kv_lens,
        block_size=bs,
        num_kv_heads=kvh,
        head_dim=head_dim,
        dtype=dtype,
        null_fill=np.nan,
    )
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu[num_seqs + 1 :] = 0  # garbage past num_seqs
    q, _ = rand_q(rng, (rows, kvh * group, head_dim), dtype)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, jnp.asarray(cu))
    kw = dict(scale=0.15, sliding_window=window, soft_cap=cap)
    out = xla_ragged_paged_attention(
        *args,
        jnp.int32(num_seqs),
        pages_per_chunk=chunk,
        block_q=block_q,
        tile_blocks=tile,
        **kw,
    )
    ref = ragged_paged_attention_reference(*args, jnp.int32(num_seqs), **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[cu[num_seqs] :], 0)  # padding rows
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


def test_tile_sizes():
    """All blocks in one tile while their chunk fits the budget; else the fewest equal tiles
    (SmolLM2: 3 KV heads x 32 keys x 64 dims x 4 bytes = 24 KiB per block)."""
    per_block, mib = 3 * 32 * 64 * 4, 1 << 20
    assert _tile_blocks(64, per_block, 2 * mib) == 64
    assert _tile_blocks(256, per_block, 2 * mib) == 64
    assert _tile_blocks(128, per_block, 2 * mib) == 64
    assert _tile_blocks(64, per_block, mib // 2) == 16  # 21 fit: 4 equal tiles
    assert _tile_blocks(64, per_block, mib) == 32  # 42 fit: 2 equal tiles
    assert _tile_blocks(100, 2 * mib, 2 * mib) == 8  # at least 8 blocks a tile
    assert _tile_blocks(5, 2 * mib, 2 * mib) == 5


def test_l2_cache_size(tmp_path):
    assert _parse_cache_size("512K\n") == 512 << 10
    assert _parse_cache_size("1M") == 1 << 20
    assert _parse_cache_size("65536") == 65536
    for i, (level, size) in enumerate([("1", "32K"), ("1", "64K"), ("2", "512K"), ("3", "8M")]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "level").write_text(level + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert _l2_cache_bytes(root=str(tmp_path)) == 512 << 10
    assert _l2_cache_bytes(default=123, root=str(tmp_path / "missing")) == 123
    assert _TILE_BYTES == _l2_cache_bytes() > 0


def test_dispatch_routes_xla():
    rng = np.random.default_rng(0)
    case = make_paged_case(rng, [3, 20], block_size=8, num_kv_heads=2, head_dim=64)
    q, _ = rand_q(rng, (2, 4, 64), jnp.float32)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    out = paged_attention(*args, scale=0.2, impl="xla")
    np.testing.assert_allclose(
        out, paged_attention_decode_reference(*args, scale=0.2), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("window", [None, 7])
def test_unreached_pages_may_hold_nan(window):
    """Pages a sequence's table names but no query reaches (past its end, before its window)
    are never read with weight 0: filled with NaN, the output stays the reference's. (The
    unused slots of a sequence's own last page are finite by the engine's contract:
    `kv_cache.scatter` stores non-finite K/V as 0.)"""
    bs, kvh, group, d = 4, 2, 2, 16
    rng = np.random.default_rng(7)
    lens = [3, 9, 17, 30]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=d, null_fill=np.nan, extra_pages=3
    )
    k_pages = np.asarray(case.k_pages).copy()
    v_pages = np.asarray(case.v_pages).copy()
    tables = np.asarray(case.block_tables).copy()
    n = k_pages.shape[1]
    nan_page = n  # one extra page, all NaN
    k_pages = np.concatenate([k_pages, np.full_like(k_pages[:, :1], np.nan)], axis=1)
    v_pages = np.concatenate([v_pages, np.full_like(v_pages[:, :1], np.nan)], axis=1)
    for s, length in enumerate(lens):
        tables[s, -(-length // bs) :] = nan_page  # past the end
    ref_tables = tables.copy()
    if window is not None:
        for s, length in enumerate(lens):
            dead = max(0, (length - window) // bs)  # pages wholly before the last query's window
            tables[s, :dead] = nan_page
    q, _ = rand_q(rng, (len(lens), kvh * group, d), jnp.float32)
    kw = dict(scale=0.2, sliding_window=window)
    args = (q, jnp.asarray(k_pages), jnp.asarray(v_pages))
    out = xla_paged_attention_decode(
        *args, jnp.asarray(tables), case.kv_lens, pages_per_chunk=2, **kw
    )
    ref = paged_attention_decode_reference(*args, jnp.asarray(ref_tables), case.kv_lens, **kw)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(out, ref, **TOL[jnp.float32])
    # The ragged form (a prefill chunk's last rows) reads the same pages.
    q_len = np.minimum(np.asarray(lens), 3)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_len)]), jnp.int32)
    qr, _ = rand_q(rng, (int(q_len.sum()), kvh * group, d), jnp.float32)
    ra = (qr, *args[1:])
    got = xla_ragged_paged_attention(
        *ra, jnp.asarray(tables), case.kv_lens, cu, jnp.int32(len(lens)), pages_per_chunk=2, **kw
    )
    want = ragged_paged_attention_reference(
        *ra, jnp.asarray(ref_tables), case.kv_lens, cu, jnp.int32(len(lens)), **kw
    )
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
