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


@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,chunk", CASES)
def test_decode_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, chunk):
    rng = np.random.default_rng(bs + 10 * group)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype, null_fill=np.nan
    )
    q, _ = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = xla_paged_attention_decode(*args, pages_per_chunk=chunk, **kw)
    ref = paged_attention_decode_reference(*args, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[0], 0)  # kv_len 0
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


@pytest.mark.parametrize("block_q", [None, 1, 3, 16])
@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,chunk", CASES)
def test_ragged_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, chunk, block_q):
    """Every query-block size (None: the default for the shape) gives the reference's rows:
    blocks split sequences, padding blocks and rows, empty sequences, garbage past num_seqs."""
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
        *args, jnp.int32(num_seqs), pages_per_chunk=chunk, block_q=block_q, **kw
    )
    ref = ragged_paged_attention_reference(*args, jnp.int32(num_seqs), **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[cu[num_seqs] :], 0)  # padding rows
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


def test_dispatch_routes_xla():
    rng = np.random.default_rng(0)
    case = make_paged_case(rng, [3, 20], block_size=8, num_kv_heads=2, head_dim=64)
    q, _ = rand_q(rng, (2, 4, 64), jnp.float32)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    out = paged_attention(*args, scale=0.2, impl="xla")
    np.testing.assert_allclose(
        out, paged_attention_decode_reference(*args, scale=0.2), atol=2e-5, rtol=2e-5
    )
