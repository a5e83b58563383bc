"""The Pallas GPU (Triton) kernel against the reference: in the Pallas interpreter on the CPU,
compiled on a GPU when one is attached (or ``JAX_PAGED_GPU_HARDWARE=1``).

Each decode case puts every interesting length (0, 1, bs-1, bs, bs+1 and a long one) in one
batch; each ragged case mixes a fresh prefill, a prefill chunk after a long cache, decode tokens,
an idle sequence, padding rows and a dead slot. Tables are shuffled, share a prefix block, and the
null block holds NaN. The parameter grids cover every axis (block size, GQA ratio, head dim,
dtype, window, soft cap, splits, query block) without taking their product.

The layer tests stack the pages of ``NUM_LAYERS`` layers (``[L, KVH, N, bs, D]``) with the case's
pages at layer 1, NaN at layer 0 and other random data at layer 2, and check the kernels at
``layer=1`` (a Python int, and traced under `jax.jit` / as a `lax.scan` counter) against the
reference on the case's one-layer pages: reading a neighbouring layer shows up as NaN or as a
wrong value.

`test_triton_lowering` lowers the kernels through Pallas's Triton backend for CUDA without a
GPU (jax.export), which catches what the interpreter does not check: non-power-of-2 shapes,
primitives the Triton lowering lacks; with stacked pages and a traced layer it also checks that
the whole stacked array reaches the Triton call (no layer slice is copied out first).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (
    gpu_paged_attention_decode,
    gpu_ragged_paged_attention,
    paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)

try:  # pytest puts tests/ on sys.path (rootdir-relative import mode)
    from test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q
except ImportError:  # tests/ imported as a package
    from tests.test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q

# The Pallas interpreter on the CPU; compiled with Triton on a GPU (or JAX_PAGED_GPU_HARDWARE=1).
HARDWARE = os.environ.get("JAX_PAGED_GPU_HARDWARE") == "1" or jax.default_backend() == "gpu"
INTERPRET = not HARDWARE
LONG = 517  # > 500 tokens
NUM_LAYERS = 3
LAYER = 1


def stack_layers(rng, pages):
    """``pages`` ``[KVH, N, bs, D]`` as layer `LAYER` of ``[NUM_LAYERS, KVH, N, bs, D]``.

    Layer 0 is NaN and layer 2 other random data, so a read of the wrong layer is seen.
    """
    layers = [
        jnp.full_like(pages, jnp.nan),
        pages,
        jnp.asarray(rng.normal(scale=3.0, size=pages.shape), pages.dtype),
    ]
    return jnp.stack(layers)


def traced_layer(fn, **kw):
    """``fn`` under `jax.jit` with the layer a traced ``i32[]`` first argument."""

    @jax.jit
    def run(layer, *args):
        assert isinstance(layer, jax.core.Tracer)
        return fn(*args, layer=layer, **kw)

    return lambda *args: run(jnp.int32(LAYER), *args)


# bs, kvh, group, head_dim, dtype, window, cap, tuning
DECODE_CASES = [
    (8, 2, 1, 64, jnp.float32, None, None, {}),
    (16, 3, 3, 64, jnp.bfloat16, None, None, dict(num_splits=1)),
    (32, 2, 4, 128, jnp.float32, None, None, dict(num_splits=3)),
    (16, 1, 8, 128, jnp.bfloat16, 100, 5.0, {}),
    (8, 2, 4, 64, jnp.float32, 9, 2.0, dict(num_splits=4, pages_per_block=2)),
]


def _slow_where(cases, indices):
    """``cases`` with those at ``indices`` in the slow tier only: the fast tier runs those
    shapes through the stacked-layer tests below."""
    return [
        pytest.param(*c, marks=pytest.mark.slow) if i in indices else c for i, c in enumerate(cases)
    ]


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,tuning", _slow_where(DECODE_CASES, (1, 4))
)
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


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,tuning", [DECODE_CASES[1], DECODE_CASES[4]]
)
def test_decode_stacked_layers(bs, kvh, group, head_dim, dtype, window, cap, tuning):
    """Stacked ``[L, KVH, N, bs, D]`` pages at layer 1, as an int and traced, vs the reference."""
    rng = np.random.default_rng(bs + 10 * group)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype, null_fill=np.nan
    )
    q, _ = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    ref = paged_attention_decode_reference(
        q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, **kw
    )
    args = (
        q,
        stack_layers(rng, case.k_pages),
        stack_layers(rng, case.v_pages),
        case.block_tables,
        case.kv_lens,
    )
    kw.update(interpret=INTERPRET, **tuning)
    out = gpu_paged_attention_decode(*args, layer=LAYER, **kw)
    out_traced = traced_layer(gpu_paged_attention_decode, **kw)(*args)
    for o in (out, out_traced):
        assert o.shape == q.shape and o.dtype == dtype
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
        np.testing.assert_allclose(o.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])
    np.testing.assert_array_equal(out_traced, out)


def test_decode_layers_in_scan():
    """A `lax.scan` over the layers (the engine's loop): its counter picks each layer's pages."""
    rng = np.random.default_rng(5)
    bs, kvh, group, d = 16, 2, 2, 64
    lens = [1, bs + 1, 70]
    case = make_paged_case(rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=d, null_fill=np.nan)
    tables, kv_lens = case.block_tables, case.kv_lens
    shape = (NUM_LAYERS - 1, *case.k_pages.shape)  # other layers: other K/V, same tables
    k = jnp.concatenate([case.k_pages[None], jnp.asarray(rng.normal(size=shape), jnp.float32)])
    v = jnp.concatenate([case.v_pages[None], jnp.asarray(rng.normal(size=shape), jnp.float32)])
    q, _ = rand_q(rng, (NUM_LAYERS, len(lens), kvh * group, d), jnp.float32)

    @jax.jit
    def all_layers(q, k, v):
        def step(_, layer):
            out = gpu_paged_attention_decode(
                q[layer], k, v, tables, kv_lens, scale=0.1, layer=layer, interpret=INTERPRET
            )
            return None, out

        return jax.lax.scan(step, None, jnp.arange(NUM_LAYERS, dtype=jnp.int32))[1]

    out = all_layers(q, k, v)  # [L, B, H, D]
    for layer in range(NUM_LAYERS):
        ref = paged_attention_decode_reference(
            q[layer], k[layer], v[layer], tables, kv_lens, scale=0.1
        )
        np.testing.assert_allclose(out[layer], ref, **TOL[jnp.float32])


def test_rejects_bad_layer():
    """Through `paged_attention(impl="gpu")`, which checks every input once for the kernels."""
    q = jnp.zeros((2, 4, 64))
    pages = jnp.zeros((NUM_LAYERS, 2, 5, 16, 64))
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    call = functools.partial(paged_attention, scale=1.0, impl="gpu", interpret=INTERPRET)
    for layer in (-1, NUM_LAYERS, np.int64(NUM_LAYERS), True, jnp.float32(1), jnp.zeros(2, int)):
        with pytest.raises(ValueError, match="layer"):
            call(q, pages, pages, tables, lens, layer=layer)
    with pytest.raises(ValueError, match="layer"):  # one layer's pages: only layer 0
        call(q, pages[0], pages[0], tables, lens, layer=1)
    with pytest.raises(ValueError, match="k_pages"):
        call(q, pages[None], pages[None], tables, lens)
    cu, n = jnp.array([0, 1, 2], jnp.int32), jnp.int32(2)
    with pytest.raises(ValueError, match="layer"):
        call(q, pages, pages, tables, lens, cu, n, layer=3)


# bs, kvh, group, head_dim, dtype, window, cap, tuning
RAGGED_CASES = [
    (16, 2, 1, 64, jnp.float32, None, None, {}),
    (8, 3, 3, 64, jnp.bfloat16, None, 3.0, dict(block_q=4, num_splits=2)),
    (32, 1, 8, 128, jnp.float32, 33, None, {}),
    (16, 2, 4, 128, jnp.bfloat16, 50, 4.0, dict(block_q=1)),
]


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,tuning", _slow_where(RAGGED_CASES, (1, 2))
)
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


@pytest.mark.parametrize(
    "bs,kvh,group,head_dim,dtype,window,cap,tuning", [RAGGED_CASES[1], RAGGED_CASES[2]]
)
def test_ragged_stacked_layers(bs, kvh, group, head_dim, dtype, window, cap, tuning):
    """Stacked ``[L, KVH, N, bs, D]`` pages at layer 1, as an int and traced, vs the reference."""
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
    q, _ = rand_q(rng, (rows, kvh * group, head_dim), dtype)
    tail = (case.block_tables, case.kv_lens, jnp.asarray(cu), jnp.int32(num_seqs))
    kw = dict(scale=0.15, sliding_window=window, soft_cap=cap)
    ref = ragged_paged_attention_reference(q, case.k_pages, case.v_pages, *tail, **kw)
    args = (q, stack_layers(rng, case.k_pages), stack_layers(rng, case.v_pages), *tail)
    kw.update(interpret=INTERPRET, **tuning)
    out = gpu_ragged_paged_attention(*args, layer=LAYER, **kw)
    out_traced = traced_layer(gpu_ragged_paged_attention, **kw)(*args)
    for o in (out, out_traced):
        assert o.shape == q.shape and o.dtype == dtype
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
        np.testing.assert_allclose(o.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])
    np.testing.assert_array_equal(out_traced, out)


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
    "form,dtype,window,cap,stacked",
    [
        ("decode", jnp.bfloat16, None, None, True),
        ("decode", jnp.float32, 64, 30.0, False),
        ("ragged", jnp.bfloat16, 128, 50.0, True),
        ("ragged", jnp.float16, None, None, False),
    ],
)
def test_triton_lowering(form, dtype, window, cap, stacked):
    """Lowers for CUDA (an H200) through the Triton backend on this CPU-only machine.

    ``stacked``: ``[L, KVH, N, bs, D]`` pages and a traced layer (the engine's call), else one
    layer's ``[KVH, N, bs, D]``.
    """
    b, h, kvh, d, n, bs, p = 7, 36, 4, 128, 257, 16, 33  # odd sizes: only values need 2^k
    sds = jax.ShapeDtypeStruct
    pages_shape = (NUM_LAYERS, kvh, n, bs, d) if stacked else (kvh, n, bs, d)
    pages = sds(pages_shape, dtype)
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    kernel = gpu_paged_attention_decode if form == "decode" else gpu_ragged_paged_attention
    if form == "decode":
        args = (sds((b, h, d), dtype), pages, pages, sds((b, p), jnp.int32), sds((b,), jnp.int32))
    else:
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
    if stacked:

        def fn(*args):  # the last argument is the traced layer
            return kernel(*args[:-1], layer=args[-1], **kw)

        args = (*args, sds((), jnp.int32))
    else:
        fn = functools.partial(kernel, **kw)
    # jax >= 0.11 reads the target GPU from the abstract mesh when no GPU is attached.
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    text = exported.mlir_module()
    assert "xla.gpu.triton" in text
    # The Triton call's operand types: both page arrays go in whole, the stacked ones included.
    call = next(ln for ln in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in ln)
    operand_types = call.rsplit("} : (", 1)[1].split(") -> ", 1)[0]
    element = {jnp.float32: "f32", jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    stacked_shape = pages_shape if stacked else (1, *pages_shape)  # one layer: L = 1
    pages_type = "tensor<" + "x".join(map(str, stacked_shape)) + f"x{element}>"
    assert operand_types.count(pages_type) == 2, operand_types
