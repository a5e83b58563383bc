"""The Pallas GPU kernel against the reference, in the Pallas interpreter (no GPU needed).

Each decode case puts every interesting length (0, 1, bs-1, bs, bs+1 and a long one) in one
batch; each ragged case mixes a fresh prefill, a prefill chunk after a long cache, decode tokens,
an idle sequence, padding rows and a dead slot. Tables are shuffled, share a prefix block, and the
null block holds NaN. The parameter grids cover every axis (block size, GQA ratio, head dim,
dtype, window, soft cap, splits, query block) without taking their product.

`test_triton_lowering` lowers the kernels through Pallas's Triton backend for CUDA without a
GPU (jax.export), which catches what the interpreter does not check: non-power-of-2 shapes,
primitives the Triton lowering lacks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (
    gpu_paged_attention_decode,
    gpu_ragged_paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)

try:  # pytest puts tests/ on sys.path (rootdir-relative import mode)
    from test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q
except ImportError:  # tests/ imported as a package
    from tests.test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q

INTERPRET = True
LONG = 517  # > 500 tokens

# bs, kvh, group, head_dim, dtype, window, cap, tuning
DECODE_CASES = [
    (8, 2, 1, 64, jnp.float32, None, None, {}),
    (16, 3, 3, 64, jnp.bfloat16, None, None, dict(num_splits=1)),
    (32, 2, 4, 128, jnp.float32, None, None, dict(num_splits=3)),
    (16, 1, 8, 128, jnp.bfloat16, 100, 5.0, {}),
    (8, 2, 4, 64, jnp.float32, 9, 2.0, dict(num_splits=4, pages_per_block=2)),
]


@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,tuning", DECODE_CASES)
def test_decode_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, tuning):
    rng = np.random.default_rng(bs + 10 * group)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype, null_fill=np.nan
    )
    q, _ = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = gpu_paged_attention_decode(*args, interpret=INTERPRET, **tuning, **kw)
    ref = paged_attention_decode_reference(*args, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[0], 0)  # kv_len 0
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


# bs, kvh, group, head_dim, dtype, window, cap, tuning
RAGGED_CASES = [
    (16, 2, 1, 64, jnp.float32, None, None, {}),
    (8, 3, 3, 64, jnp.bfloat16, None, 3.0, dict(block_q=4, num_splits=2)),
    (32, 1, 8, 128, jnp.float32, 33, None, {}),
    (16, 2, 4, 128, jnp.bfloat16, 50, 4.0, dict(block_q=1)),
]


@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,tuning", RAGGED_CASES)
def test_ragged_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, tuning):
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
    out = gpu_ragged_paged_attention(
        *args, jnp.int32(num_seqs), interpret=INTERPRET, **tuning, **kw
    )
    ref = ragged_paged_attention_reference(*args, jnp.int32(num_seqs), **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(out[cu[num_seqs] :], 0)  # padding rows
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])


def test_ragged_decode_step_and_long_prefill_chunk():
    """T <= S (a pure decode step, block_q defaults to 1), then one long prefill in chunks."""
    rng = np.random.default_rng(11)
    bs, kvh, group, d = 16, 2, 4, 64
    lens = [1, bs - 1, bs, bs + 1, LONG, 0]
    case = make_paged_case(rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=d, null_fill=np.nan)
    tables, kv = case.block_tables, case.kv_lens
    q, _ = rand_q(rng, (5, kvh * group, d), jnp.float32)
    cu = jnp.array([0, 1, 2, 3, 4, 5, 5], jnp.int32)
    args = (q, case.k_pages, case.v_pages, tables, kv, cu, jnp.int32(6))
    out = gpu_ragged_paged_attention(*args, scale=0.1, interpret=INTERPRET)
    ref = ragged_paged_attention_reference(*args, scale=0.1)
    np.testing.assert_allclose(out, ref, **TOL[jnp.float32])
    # Sequence 4 (517 tokens) as the last 200-token chunk of its prefill, alone in the batch.
    q, _ = rand_q(rng, (208, kvh * group, d), jnp.float32)
    cu = jnp.array([0, 200], jnp.int32)
    args = (q, case.k_pages, case.v_pages, tables[4:5], kv[4:5], cu, jnp.int32(1))
    out = gpu_ragged_paged_attention(*args, scale=0.1, interpret=INTERPRET, num_splits=2)
    ref = ragged_paged_attention_reference(*args, scale=0.1)
    np.testing.assert_allclose(out, ref, **TOL[jnp.float32])
    np.testing.assert_array_equal(out[200:], 0)


@pytest.mark.parametrize(
    "form,dtype,window,cap",
    [
        ("decode", jnp.bfloat16, None, None),
        ("decode", jnp.float32, 64, 30.0),
        ("ragged", jnp.bfloat16, 128, 50.0),
        ("ragged", jnp.float16, None, None),
    ],
)
def test_triton_lowering(form, dtype, window, cap):
    """Lowers for CUDA (an H200) through the Triton backend on this CPU-only machine."""
    b, h, kvh, d, n, bs, p = 7, 36, 4, 128, 257, 16, 33  # odd sizes: only values need 2^k
    sds = jax.ShapeDtypeStruct
    pages = sds((kvh, n, bs, d), dtype)
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    if form == "decode":
        fn = functools.partial(gpu_paged_attention_decode, **kw)
        args = (sds((b, h, d), dtype), pages, pages, sds((b, p), jnp.int32), sds((b,), jnp.int32))
    else:
        fn = functools.partial(gpu_ragged_paged_attention, **kw)
        t = 300
        args = (
            sds((t, h, d), dtype),
            pages,
            pages,
            sds((b, p), jnp.int32),
            sds((b,), jnp.int32),
            sds((b + 1,), jnp.int32),
            sds((), jnp.int32),
        )
    # jax >= 0.11 reads the target GPU from the abstract mesh when no GPU is attached.
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    assert "xla.gpu.triton" in exported.mlir_module()
