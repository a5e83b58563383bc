"""`pallas_kernels.paged_attention`: kernel choice, routing of both forms, and input checks."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
    resolve_impl,
)

KVH, N, BS, D, H, B, P = 2, 16, 8, 16, 4, 3, 4


def _inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, H, D)), dtype)
    kp = jnp.asarray(rng.normal(size=(KVH, N, BS, D)), dtype)
    vp = jnp.asarray(rng.normal(size=(KVH, N, BS, D)), dtype)
    bt = jnp.asarray(rng.permutation(np.arange(1, N))[: B * P].reshape(B, P), jnp.int32)
    kv = jnp.array([0, 9, 30], jnp.int32)
    return q, kp, vp, bt, kv


@pytest.mark.parametrize(
    "impl,bs,d,backend,want",
    [
        ("auto", 16, 128, "cpu", "cpu"),  # the native kernel builds here (test_cpu_attention)
        ("auto", 16, 128, "gpu", "gpu"),
        ("auto", 12, 128, "gpu", "xla"),  # block size not a power of 2
        ("auto", 16, 80, "gpu", "xla"),  # head dim not a power of 2
        ("auto", 16, 128, "tpu", "tpu"),
        ("reference", 16, 128, "gpu", "reference"),
        ("gpu", 16, 128, "cpu", "gpu"),
        ("tpu", 16, 128, "cpu", "tpu"),
    ],
)
def test_resolve_impl(impl, bs, d, backend, want):
    assert resolve_impl(impl, bs, d, backend) == want


def test_auto_is_the_native_kernel_on_this_machine():
    assert jax.default_backend() != "cpu" or resolve_impl("auto", 16, 128) == "cpu"


@pytest.mark.parametrize("impl", ["auto", "reference", "xla", "cpu", "gpu"])
def test_decode_routes(impl):
    q, kp, vp, bt, kv = _inputs()
    out = paged_attention(q, kp, vp, bt, kv, scale=0.3, impl=impl, interpret=True)
    ref = paged_attention_decode_reference(q, kp, vp, bt, kv, scale=0.3)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "cpu", "gpu"])
def test_ragged_routes_and_num_seqs_defaults_to_all(impl):
    q, kp, vp, bt, kv = _inputs()
    q = jnp.concatenate([q, q])  # 6 rows: seq 0 gets 0, seq 1 gets 2, seq 2 gets 3, 1 padding
    cu = jnp.array([0, 0, 2, 5], jnp.int32)
    out = paged_attention(q, kp, vp, bt, kv, cu, scale=0.3, impl=impl, interpret=True)
    ref = ragged_paged_attention_reference(q, kp, vp, bt, kv, cu, jnp.int32(3), scale=0.3)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[5], 0)


@pytest.mark.parametrize("impl", ["reference", "xla", "cpu", "gpu"])
def test_stacked_pages_read_through_the_layer_index(impl):
    """Pages stacked over 3 layers, layer 1 picked by an int and by a traced scalar, equal the
    same call on that layer's pages alone (both forms)."""
    q, kp, vp, bt, kv = _inputs()
    rng = np.random.default_rng(1)
    ks = jnp.stack([jnp.asarray(rng.normal(size=kp.shape), kp.dtype), kp, -kp])
    vs = jnp.stack([jnp.asarray(rng.normal(size=vp.shape), vp.dtype), vp, vp * 2])
    cu = jnp.array([0, 1, 2, 3], jnp.int32)
    for extra in ((), (cu,)):
        want = paged_attention(q, kp, vp, bt, kv, *extra, scale=0.3, impl=impl, interpret=True)
        got = paged_attention(
            q, ks, vs, bt, kv, *extra, layer=1, scale=0.3, impl=impl, interpret=True
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

        @jax.jit
        def traced(layer, extra=extra):
            return paged_attention(
                q, ks, vs, bt, kv, *extra, layer=layer, scale=0.3, impl=impl, interpret=True
            )

        np.testing.assert_allclose(traced(jnp.int32(1)), want, atol=2e-5, rtol=2e-5)
        other = paged_attention(
            q, ks[2], vs[2], bt, kv, *extra, scale=0.3, impl=impl, interpret=True
        )
        np.testing.assert_allclose(traced(jnp.int32(2)), other, atol=2e-5, rtol=2e-5)


def test_layer_checks():
    q, kp, vp, bt, kv = _inputs()
    ks, vs = kp[None], vp[None]
    with pytest.raises(ValueError, match="need a layer"):
        paged_attention(q, ks, vs, bt, kv, scale=0.3)
    with pytest.raises(ValueError, match=r"layer=1 must be in \[0, 1\)"):
        paged_attention(q, ks, vs, bt, kv, layer=1, scale=0.3)
    with pytest.raises(ValueError, match="layer=2 must be None or 0"):
        paged_attention(q, kp, vp, bt, kv, layer=2, scale=0.3)
    with pytest.raises(ValueError, match="must be an int or an integer scalar"):
        paged_attention(q, ks, vs, bt, kv, layer=jnp.zeros(2, jnp.int32), scale=0.3)


def test_under_jit_with_traced_lengths_and_num_seqs():
    q, kp, vp, bt, kv = _inputs()
    cu = jnp.array([0, 1, 2, 3], jnp.int32)

    @jax.jit
    def step(kv, num_seqs):
        return paged_attention(q, kp, vp, bt, kv, cu, num_seqs, scale=0.3, soft_cap=10)

    out = step(kv, jnp.int32(2))
    ref = ragged_paged_attention_reference(q, kp, vp, bt, kv, cu, 2, scale=0.3, soft_cap=10.0)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_array_equal(out[2], 0)  # row of the sequence past num_seqs


def test_tpu_is_imported_lazily_and_gets_the_contract_arguments(monkeypatch):
    calls = []

    def fake(name):
        def fn(*args, **kw):
            calls.append((name, len(args), kw))
            return jnp.zeros_like(args[0])

        return fn

    fake_module = types.SimpleNamespace(
        tpu_paged_attention_decode=fake("decode"), tpu_ragged_paged_attention=fake("ragged")
    )
    monkeypatch.setitem(sys.modules, "pallas_kernels.tpu_paged_attention", fake_module)
    q, kp, vp, bt, kv = _inputs()
    paged_attention(q, kp, vp, bt, kv, scale=0.5, impl="tpu", sliding_window=4)
    paged_attention(
        q, kp, vp, bt, kv, jnp.arange(4, dtype=jnp.int32), impl="tpu", scale=0.5, interpret=True
    )
    common = dict(layer=0, scale=0.5, soft_cap=None)
    assert calls == [
        ("decode", 5, dict(common, sliding_window=4, interpret=False)),
        ("ragged", 7, dict(common, sliding_window=None, interpret=True)),
    ]


def _bad(**changes):
    q, kp, vp, bt, kv = _inputs()
    args = dict(
        q=q,
        k_pages=kp,
        v_pages=vp,
        block_tables=bt,
        kv_lens=kv,
        cu_q_lens=None,
        num_seqs=None,
        scale=0.3,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(q=jnp.zeros((B, H * D))), "q.shape"),
        (dict(k_pages=jnp.zeros((KVH, N, BS * D))), "k_pages.shape"),
        (dict(v_pages=jnp.zeros((KVH, N + 1, BS, D))), "v_pages.shape"),
        (dict(q=jnp.zeros((B, H, D), jnp.int32)), "q.dtype"),
        (dict(k_pages=jnp.zeros((KVH, N, BS, D), jnp.bfloat16)), "k_pages.dtype"),  # v's f32
        (dict(k_pages=jnp.zeros((KVH, N, BS, D), jnp.int8)), "k_pages.dtype"),
        (dict(q=jnp.zeros((B, H, 2 * D))), "head_dim"),
        (dict(q=jnp.zeros((B, 3, D))), "num_heads=3 must be a multiple of num_kv_heads=2"),
        (dict(block_tables=jnp.zeros((B, P), jnp.float32)), "block_tables"),
        (dict(block_tables=jnp.zeros((B + 1, P), jnp.int32)), "block_tables.shape"),
        (dict(kv_lens=jnp.zeros((B, 1), jnp.int32)), "kv_lens.shape"),
        (dict(kv_lens=jnp.zeros((B,), jnp.float32)), "kv_lens.shape"),
        (dict(cu_q_lens=jnp.zeros((B,), jnp.int32)), "cu_q_lens.shape"),
        (dict(cu_q_lens=jnp.zeros((B + 1,), jnp.int32), num_seqs=jnp.zeros(2)), "num_seqs"),
        (dict(scale=-1.0), "scale=-1.0"),
        (dict(scale=jnp.float32(0.3)), "scale="),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(soft_cap=-2.0), "soft_cap=-2.0"),
        (dict(impl="cuda"), "impl='cuda'"),
    ],
)
def test_input_checks(changes, match):
    with pytest.raises(ValueError, match=match):
        paged_attention(**_bad(**changes))


def test_forced_gpu_rejects_a_block_size_it_cannot_take():
    q, _, _, bt, kv = _inputs()
    pages = jnp.zeros((KVH, N, 12, D))
    with pytest.raises(ValueError, match="block_size=12"):
        paged_attention(q, pages, pages, bt, kv, scale=0.3, impl="gpu", interpret=True)
    # ...while the reference takes it.
    out = paged_attention(q, pages, pages, bt, kv, scale=0.3)
    assert out.shape == q.shape


@pytest.mark.parametrize("impl", ["reference", "xla", "cpu", "gpu"])
@pytest.mark.parametrize("pages_dtype", [jnp.bfloat16, jnp.float16])
def test_float32_queries_over_16bit_pages(impl, pages_dtype):
    """A 16-bit KV cache under a float32 model (`EngineConfig.kv_cache_dtype`): the output is
    float32 and equals attention over the same pages widened to float32 (exactly: widening is
    exact), but for the GPU kernel, which takes q rounded to the pages' dtype."""
    q, kp, vp, bt, kv = _inputs()
    kp, vp = kp.astype(pages_dtype), vp.astype(pages_dtype)
    cu = jnp.array([0, 1, 2, 3], jnp.int32)
    for extra in ((), (cu,)):
        out = paged_attention(q, kp, vp, bt, kv, *extra, scale=0.3, impl=impl, interpret=True)
        want = paged_attention(
            q,
            kp.astype(jnp.float32),
            vp.astype(jnp.float32),
            bt,
            kv,
            *extra,
            scale=0.3,
            impl="reference",
        )
        assert out.dtype == jnp.float32
        tol = 2e-2 if impl == "gpu" else 2e-5
        np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
