"""The native CPU kernel (`pallas_kernels.cpu_paged_attention`, ``impl="cpu"``) against the
plain-jnp reference: both forms, every dtype, head dims with and without a compiled-in size,
GQA, windows, soft caps, stacked pages read through a traced layer, padding rows, and garbage
(NaN) in every page slot a row does not see. Also its build: cached, and a missing compiler
leaves ``impl="auto"`` on the XLA path with the reason at hand."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_paged_attention as cpu
from pallas_kernels import (
    paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernel")


def test_builds_here():
    assert cpu.available(), cpu.build_error()
    assert cpu._build() == cpu._build()  # cached: the second call finds the library


def _pages(rng, layers, kvh, n, bs, d, dtype, written):
    """Stacked pages full of NaN but where ``written`` (a bool [N, bs] mask) says a sequence
    wrote a key: a kernel may only ever read written slots."""
    k = rng.normal(size=(layers, kvh, n, bs, d))
    v = rng.normal(size=(layers, kvh, n, bs, d))
    k[:, :, ~written] = np.nan
    v[:, :, ~written] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _batch(rng, q_lens, kv_lens, p, bs, n):
    """Block tables over distinct pages (row 0 of the pool never used) and the written mask."""
    s = len(q_lens)
    tables = rng.permutation(np.arange(1, n))[: s * p].reshape(s, p).astype(np.int32)
    written = np.zeros((n, bs), bool)
    for seq, kv_len in enumerate(kv_lens):
        for key in range(kv_len):
            written[tables[seq, key // bs], key % bs] = True
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return jnp.asarray(tables), jnp.asarray(np.asarray(kv_lens, np.int32)), jnp.asarray(cu), written


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _grid(*axes):
    """The product of ``axes`` (lists of argument tuples), the first axis varying slowest. The
    fast tier runs the points whose indices sum to 0 modulo the last axis's length (a Latin
    square: every value of every axis, every pair of the first axes' values); the slow tier
    runs them all."""
    points = [()]
    for axis in axes:
        points = [(*p, (i, a)) for p in points for i, a in enumerate(axis)]
    n = len(axes[-1])
    return [
        pytest.param(
            *(x for _, a in p for x in a),
            marks=() if sum(i for i, _ in p) % n == 0 else pytest.mark.slow,
        )
        for p in points
    ]


@pytest.mark.parametrize(
    "window,cap,d,h,kvh,dtype",
    _grid(
        [(None, None), (7, None), (None, 5.0)],
        [(64, 9, 3), (128, 4, 4), (24, 8, 2)],
        [(jnp.float32,), (jnp.bfloat16,), (jnp.float16,)],
    ),
)
def test_ragged_matches_reference(dtype, d, h, kvh, window, cap):
    rng = np.random.default_rng(d + h + (window or 0))
    layers, n, bs, p = 3, 64, 4, 12
    # Sequences: a prefill chunk mid-prompt, a decode, an empty one, a long prefill, one not live.
    q_lens, kv_lens = [3, 1, 0, 9, 2], [10, 30, 0, 9, 5]
    tables, kv, cu, written = _batch(rng, q_lens, kv_lens, p, bs, n)
    k, v = _pages(rng, layers, kvh, n, bs, d, dtype, written)
    q = jnp.asarray(rng.normal(size=(18, h, d)), dtype)  # 13 live rows for 4 live seqs, padding
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    got = jax.jit(
        lambda q, layer: paged_attention(
            q, k, v, tables, kv, cu, jnp.int32(4), layer=layer, impl="cpu", **kw
        )
    )(q, jnp.int32(1))
    want = ragged_paged_attention_reference(
        q, k, v, tables, kv, cu, jnp.int32(4), layer=jnp.int32(1), **kw
    )
    assert got.dtype == dtype and got.shape == q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(got[13:], 0)  # padding rows (and the fifth, non-live seq)


def test_decode_matches_reference_and_spreads_over_threads():
    """A decode batch big enough that the work goes out in many grains."""
    rng = np.random.default_rng(3)
    b, h, kvh, d, n, bs, p = 96, 8, 2, 64, 600, 16, 6
    kv_lens = rng.integers(0, p * bs + 1, size=b)
    tables, kv, _, written = _batch(rng, [1] * b, kv_lens, p, bs, n)
    k, v = _pages(rng, 2, kvh, n, bs, d, jnp.float32, written)
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32)
    got = paged_attention(q, k, v, tables, kv, layer=1, scale=0.125, impl="cpu")
    want = paged_attention_decode_reference(q, k, v, tables, kv, layer=1, scale=0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[kv_lens == 0], 0)


@pytest.mark.parametrize(
    "window,cap,d,h,kvh,dtype",
    _grid(
        [(None, None), (11, 3.0)],
        [
            (64, 4, 2),  # G = 2: 8 keys per folded block of 16 dot products
            (64, 12, 2),  # G = 6: no compiled-in head count, the head count read at run time
            (128, 16, 2),  # G = 8
            (64, 20, 1),  # G = 20 > 16: the heads go in groups of 16 and 4, one key per block
            (256, 6, 3),  # D = 256, G = 2
        ],
        [(jnp.float32,), (jnp.bfloat16,)],
    ),
)
def test_head_groups_match_reference(dtype, d, h, kvh, window, cap):
    """Every way the kernel groups a KV head's query heads over a key block, and the softmax's
    lanes of 16 G floats, against the reference (ragged rows, NaN where no row looks)."""
    rng = np.random.default_rng(d * h + kvh)
    n, bs, p = 48, 16, 5
    q_lens, kv_lens = [1, 4, 1, 2], [77, 40, 1, 16]
    tables, kv, cu, written = _batch(rng, q_lens, kv_lens, p, bs, n)
    k, v = _pages(rng, 2, kvh, n, bs, d, dtype, written)
    q = jnp.asarray(rng.normal(size=(9, h, d)), dtype)
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    got = paged_attention(q, k, v, tables, kv, cu, jnp.int32(4), layer=1, impl="cpu", **kw)
    want = ragged_paged_attention_reference(
        q, k, v, tables, kv, cu, jnp.int32(4), layer=jnp.int32(1), **kw
    )
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(got[8:], 0)  # the padding row


def test_layers_scanned_with_one_layers_pages_too():
    """Under a scan over stacked layers the kernel reads each layer through the counter; one
    layer's pages [KVH, N, bs, D] work as well."""
    rng = np.random.default_rng(4)
    tables, kv, _, written = _batch(rng, [1] * 4, [5, 17, 1, 32], 8, 4, 40)
    k, v = _pages(rng, 3, 2, 40, 4, 32, jnp.float32, written)
    q = jnp.asarray(rng.normal(size=(4, 4, 32)), jnp.float32)

    def step(_, layer):
        return None, paged_attention(q, k, v, tables, kv, layer=layer, scale=0.2, impl="cpu")

    _, outs = jax.jit(lambda: jax.lax.scan(step, None, jnp.arange(3)))()
    for layer in range(3):
        want = paged_attention_decode_reference(q, k[layer], v[layer], tables, kv, scale=0.2)
        np.testing.assert_allclose(outs[layer], want, atol=2e-5, rtol=2e-5)
        one = paged_attention(q, k[layer], v[layer], tables, kv, scale=0.2, impl="cpu")
        np.testing.assert_allclose(one, want, atol=2e-5, rtol=2e-5)


def _fresh_process(env_extra: dict[str, str], code: str) -> str:
    env = {**os.environ, **env_extra}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


CHOICE = (
    "from pallas_kernels import resolve_impl, cpu_paged_attention as c; "
    "print(resolve_impl('auto', 16, 64), '|', c.build_error())"
)


def test_without_a_compiler_auto_stays_on_xla(tmp_path):
    out = _fresh_process(
        {"CXX": "/bin/false", "JAX_PAGED_KERNEL_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"},
        CHOICE,
    )
    impl, why = out.split(" | ")
    assert impl == "xla" and "failed" in why
    code = (
        "import jax.numpy as jnp\nfrom pallas_kernels import paged_attention\n"
        "z = jnp.zeros((1, 2, 2, 4))\n"
        "try:\n    paged_attention(jnp.zeros((1, 2, 4)), z, z, jnp.zeros((1, 2), jnp.int32),"
        " jnp.ones(1, jnp.int32), scale=1.0, impl='cpu')\n"
        "except ValueError as e:\n    print(e)\n"
    )
    msg = _fresh_process({"CXX": "/bin/false", "JAX_PAGED_KERNEL_DIR": str(tmp_path)}, code)
    assert "impl='cpu' is unavailable here" in msg


def test_turned_off_by_env():
    out = _fresh_process({"JAX_PAGED_NATIVE": "0", "JAX_PLATFORMS": "cpu"}, CHOICE)
    assert out == "xla | turned off by JAX_PAGED_NATIVE=0"


_PARTS_SOURCE = """
#if JAX_PAGED_PART == 0
extern "C" int part0() { return 10; }
#elif JAX_PAGED_PART == 1
extern "C" int part1() { return 11; }
#else
extern "C" int part2() { return 12; }
#endif
"""


def test_build_links_the_parts_where_library_path_says(tmp_path, monkeypatch):
    """The build machinery on a small stand-in source: the three parts compile and link into one
    library at library_path(), whose key follows the flags, and no object file stays behind."""
    src = tmp_path / "parts.cc"
    src.write_text(_PARTS_SOURCE)
    cache = tmp_path / "cache"
    monkeypatch.setattr(cpu, "_SOURCE", src)
    monkeypatch.setenv("JAX_PAGED_KERNEL_DIR", str(cache))
    path = cpu.library_path()
    assert path.parent == cache and not path.exists()
    monkeypatch.setattr(cpu, "_FLAGS", (*cpu._FLAGS, "-DJAX_PAGED_UNUSED=1"))
    built = cpu.library_path()
    assert built != path
    assert cpu._build() == built and built.exists()
    assert [p.name for p in cache.iterdir()] == [built.name]
    lib = ctypes.cdll.LoadLibrary(str(built))
    assert (lib.part0(), lib.part1(), lib.part2()) == (10, 11, 12)


def test_a_failing_part_says_which_and_why(tmp_path, monkeypatch):
    src = tmp_path / "parts.cc"
    src.write_text(_PARTS_SOURCE + "\n#if JAX_PAGED_PART == 2\n#error part two is broken\n#endif\n")
    cache = tmp_path / "cache"
    monkeypatch.setattr(cpu, "_SOURCE", src)
    monkeypatch.setenv("JAX_PAGED_KERNEL_DIR", str(cache))
    with pytest.raises(RuntimeError) as e:
        cpu._build()
    msg = str(e.value)
    assert "-DJAX_PAGED_PART=2" in msg and "exit status 1" in msg
    assert "part two is broken" in msg
    assert list(cache.iterdir()) == []  # no library, no leftover objects
