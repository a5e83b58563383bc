"""The TPU paged-attention kernels against the plain-jnp reference, in the TPU interpreter.

The interpreter is slow (seconds per call), so each case packs many lengths into one batch:
decode batches hold lengths [0, 1, bs-1, bs, bs+1, long]; ragged batches mix a chunked-prefill
chunk, full prefills, decode tokens, an empty sequence, a slot past `num_seqs` and padding rows.
Block tables are shuffled and share blocks between sequences, and every page slot that holds no
token (the null block 0, the tails of partial pages, unused blocks) is NaN, so any read that is
not masked by length shows up in the output.

The layer tests stack `NUM_LAYERS` layers of pages (`[L, KVH, N, bs, D]`) with the case's pages at
layer 1, NaN at layer 0 and other random data at layer 2, and run the kernels at `layer=1` (an
int, and a traced `i32[]` under `jax.jit`) against the reference on the case's one-layer pages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention
from pallas_kernels.reference import (
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.tpu_paged_attention import (
    tpu_paged_attention_decode,
    tpu_ragged_paged_attention,
)

LONG = 150  # a context of many pages (several chunks at every block size below)
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # atol == rtol
NUM_LAYERS = 3
LAYER = 1


def _tables_and_pages(rng, lens, *, bs, num_kv_heads, head_dim, dtype, share=()):
    """Shuffled block tables for `lens` and pages holding a random K/V for every live token.

    `share` lists `(a, b)`: sequence b's first block is sequence a's first block (a forked
    prefix). Physical block 0 is never handed out; unused table entries are 0. Slots holding no
    token are NaN. Returns `(block_tables i32[S, P], k_pages, v_pages)`.
    """
    num_pages = [math.ceil(n / bs) for n in lens]
    pages_per_seq = max(num_pages) + 1  # one spare entry that stays 0
    num_blocks = 1 + sum(num_pages)
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lens), pages_per_seq), np.int32)
    for s, n in enumerate(num_pages):
        tables[s, :n] = [next(ids) for _ in range(n)]
    for a, b in share:
        tables[b, 0] = tables[a, 0]
    shape = (num_kv_heads, num_blocks, bs, head_dim)
    k, v = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    for s, n in enumerate(lens):
        for pos in range(n):
            block, offset = tables[s, pos // bs], pos % bs
            k[:, block, offset] = rng.standard_normal((num_kv_heads, head_dim))
            v[:, block, offset] = rng.standard_normal((num_kv_heads, head_dim))
    return jnp.asarray(tables), jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _stack_layers(rng, pages):
    """`pages` `[KVH, N, bs, D]` as layer `LAYER` of `[NUM_LAYERS, KVH, N, bs, D]`.

    Layer 0 is NaN and layer 2 other random data, so a copy from the wrong layer is seen.
    """
    other = jnp.asarray(rng.standard_normal(pages.shape), pages.dtype)
    return jnp.stack([jnp.full_like(pages, jnp.nan), pages, other])


def _with_traced_layer(fn, **kw):
    """`fn` under `jax.jit` with the layer a traced `i32[]` argument (set to `LAYER`)."""

    @jax.jit
    def run(layer, *args):
        assert isinstance(layer, jax.core.Tracer)
        return fn(*args, layer=layer, **kw)

    return lambda *args: run(jnp.int32(LAYER), *args)


def _assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# Decode.


def _decode_case(seed, *, dtype, group, bs, head_dim, num_kv_heads=2, share=((4, 3),)):
    rng = np.random.default_rng(seed)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    tables, k, v = _tables_and_pages(
        rng, lens, bs=bs, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, share=share
    )
    q = jnp.asarray(rng.standard_normal((len(lens), num_kv_heads * group, head_dim)), dtype)
    return q, k, v, tables, jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize(
    "dtype, group, bs, head_dim, knobs",
    [
        (jnp.float32, 1, 16, 128, {}),  # default chunking: one program, long chunks
        (jnp.bfloat16, 3, 8, 128, dict(pages_per_chunk=2, seqs_per_block=4)),  # B padded 6 -> 8
        # The fast tier's decode cases cover both dtypes, default and explicit chunking.
        pytest.param(
            jnp.float32,
            4,
            32,
            64,
            dict(pages_per_chunk=1, seqs_per_block=3),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_decode_matches_reference(dtype, group, bs, head_dim, knobs):
    q, k, v, tables, lens = _decode_case(0, dtype=dtype, group=group, bs=bs, head_dim=head_dim)
    scale = head_dim**-0.5
    out = tpu_paged_attention_decode(q, k, v, tables, lens, scale=scale, interpret=True, **knobs)
    ref = paged_attention_decode_reference(q, k, v, tables, lens, scale=scale)
    _assert_close(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # kv_lens == 0


# The fast tier's decode window runs in `test_decode_stacked_layers`.
@pytest.mark.parametrize(
    "sliding_window, soft_cap", [pytest.param(20, None, marks=pytest.mark.slow), (None, 1.5)]
)
def test_decode_window_and_soft_cap(sliding_window, soft_cap):
    q, k, v, tables, lens = _decode_case(1, dtype=jnp.float32, group=2, bs=16, head_dim=128)
    q = q * 4.0  # large logits, so the soft cap bites
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    out = tpu_paged_attention_decode(
        q, k, v, tables, lens, interpret=True, pages_per_chunk=2, seqs_per_block=4, **kw
    )
    ref = paged_attention_decode_reference(q, k, v, tables, lens, **kw)
    _assert_close(out, ref, jnp.float32)
    plain = paged_attention_decode_reference(q, k, v, tables, lens, scale=0.125)
    assert not np.allclose(np.asarray(ref), np.asarray(plain), atol=1e-3)  # the option matters


def test_decode_stacked_layers():
    """`[L, KVH, N, bs, D]` pages at layer 1, an int and traced, match the reference on layer 1."""
    q, k, v, tables, lens = _decode_case(2, dtype=jnp.float32, group=2, bs=16, head_dim=128)
    rng = np.random.default_rng(2)
    kw = dict(scale=0.125, sliding_window=40)
    ref = paged_attention_decode_reference(q, k, v, tables, lens, **kw)
    args = (q, _stack_layers(rng, k), _stack_layers(rng, v), tables, lens)
    kw.update(interpret=True, pages_per_chunk=2, seqs_per_block=4)
    out = tpu_paged_attention_decode(*args, layer=LAYER, **kw)
    _assert_close(out, ref, jnp.float32)
    traced = _with_traced_layer(tpu_paged_attention_decode, **kw)(*args)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(out))


# ---------------------------------------------------------------------------------------------
# Ragged.


def _ragged_case(seed, *, dtype, group, bs, head_dim, num_kv_heads=2, num_seqs_shape=()):
    """A mixed batch; returns the kernel's positional args and the number of live rows."""
    rng = np.random.default_rng(seed)
    # (q_len, kv_len): a chunk of a long prefill (positions LONG-20 .. LONG-1), decode tokens at
    # lengths 1, bs-1 and bs, full prefills of bs+1 and bs tokens, and an empty sequence.
    seqs = [(20, LONG), (1, 1), (1, bs - 1), (bs + 1, bs + 1), (1, bs), (0, 0), (bs, bs)]
    q_lens = [n for n, _ in seqs]
    kv_lens = [n for _, n in seqs] + [bs]  # the last slot is past num_seqs: ignored
    tables, k, v = _tables_and_pages(
        rng,
        kv_lens,
        bs=bs,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        share=((3, 4), (0, 6)),
    )
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    live = int(cu[-1])
    cu = np.concatenate([cu, [3]])  # garbage past num_seqs
    num_tokens = live + 7  # padding rows
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    num_seqs = jnp.full(num_seqs_shape, len(seqs), jnp.int32)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu, jnp.int32))
    return (*args, num_seqs), live


@pytest.mark.parametrize(
    "dtype, group, bs, head_dim, knobs",
    [
        # The fast tier's ragged cases cover both dtypes, default and explicit blocking.
        pytest.param(
            jnp.float32,
            1,
            16,
            128,
            dict(pages_per_chunk=2, queries_per_block=16),
            marks=pytest.mark.slow,
        ),
        (jnp.bfloat16, 4, 8, 128, {}),  # default blocking
        (jnp.float32, 3, 32, 64, dict(pages_per_chunk=1, queries_per_block=8)),
    ],
)
def test_ragged_matches_reference(dtype, group, bs, head_dim, knobs):
    num_seqs_shape = (1,) if group == 3 else ()
    args, live = _ragged_case(
        0, dtype=dtype, group=group, bs=bs, head_dim=head_dim, num_seqs_shape=num_seqs_shape
    )
    scale = head_dim**-0.5
    out = tpu_ragged_paged_attention(*args, scale=scale, interpret=True, **knobs)
    ref = ragged_paged_attention_reference(*args[:-1], args[-1].reshape(()), scale=scale)
    _assert_close(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(out[live:], np.float32), 0.0)  # padding rows


# The fast tier's ragged soft cap runs in `test_ragged_stacked_layers`.
@pytest.mark.parametrize(
    "sliding_window, soft_cap", [(12, None), pytest.param(None, 1.5, marks=pytest.mark.slow)]
)
def test_ragged_window_and_soft_cap(sliding_window, soft_cap):
    args, _ = _ragged_case(1, dtype=jnp.float32, group=2, bs=16, head_dim=128)
    args = (args[0] * 4.0, *args[1:])  # large logits, so the soft cap bites
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    out = tpu_ragged_paged_attention(
        *args, interpret=True, pages_per_chunk=2, queries_per_block=16, **kw
    )
    ref = ragged_paged_attention_reference(*args, **kw)
    _assert_close(out, ref, jnp.float32)
    plain = ragged_paged_attention_reference(*args, scale=0.125)
    assert not np.allclose(np.asarray(ref), np.asarray(plain), atol=1e-3)  # the option matters


def test_ragged_stacked_layers():
    """`[L, KVH, N, bs, D]` pages at layer 1, an int and traced, match the reference on layer 1."""
    args, live = _ragged_case(2, dtype=jnp.bfloat16, group=2, bs=8, head_dim=128)
    q, k, v, *tail = args
    rng = np.random.default_rng(2)
    kw = dict(scale=0.125, soft_cap=20.0)
    ref = ragged_paged_attention_reference(*args, **kw)
    args = (q, _stack_layers(rng, k), _stack_layers(rng, v), *tail)
    kw.update(interpret=True, pages_per_chunk=2, queries_per_block=16)
    out = tpu_ragged_paged_attention(*args, layer=LAYER, **kw)
    _assert_close(out, ref, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out[live:], np.float32), 0.0)  # padding rows
    traced = _with_traced_layer(tpu_ragged_paged_attention, **kw)(*args)
    np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(out, np.float32))


# ---------------------------------------------------------------------------------------------
# Lowering to Mosaic TPU (no TPU needed).


@pytest.mark.parametrize(
    "dtype, stacked", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True)]
)
def test_kernels_lower_for_tpu(dtype, stacked):
    """The Pallas -> Mosaic lowering, which the interpreter skips, accepts both kernels.

    This catches ops without a Mosaic lowering rule (a traced `//` once needed the TPU
    generation); Mosaic's own layout passes still need a real TPU. `stacked`: the pages of
    `NUM_LAYERS` layers and a traced layer (the engine's call), else one layer's pages.
    """
    q, k, v, tables, lens = _decode_case(0, dtype=dtype, group=4, bs=16, head_dim=128)
    ragged_args, _ = _ragged_case(0, dtype=dtype, group=4, bs=16, head_dim=128)
    kw = dict(scale=0.1, sliding_window=32, soft_cap=30.0)
    for fn, args in [
        (tpu_paged_attention_decode, (q, k, v, tables, lens)),
        (tpu_ragged_paged_attention, ragged_args),
    ]:
        if stacked:
            k_pages = jnp.broadcast_to(args[1], (NUM_LAYERS, *args[1].shape))
            args = (args[0], k_pages, k_pages, *args[3:], jnp.int32(LAYER))

            def call(*args, fn=fn):  # the last argument is the traced layer
                return fn(*args[:-1], layer=args[-1], **kw)

        else:
            call = functools.partial(fn, **kw)
        lowered = jax.jit(call).trace(*args)
        text = lowered.lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text
        # Both page arrays reach the kernel whole (`[L, ...]`; one layer is `[1, ...]`): no layer
        # slice is copied out before the call.
        line = next(ln for ln in text.splitlines() if "custom_call @tpu_custom_call" in ln)
        operand_types = line.rsplit("} : (", 1)[1].split(") -> ", 1)[0]
        shape = args[1].shape if stacked else (1, *args[1].shape)
        element = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
        pages_type = "tensor<" + "x".join(map(str, shape)) + f"x{element}>"
        assert operand_types.count(pages_type) == 2, operand_types


# ---------------------------------------------------------------------------------------------
# Input checks (no kernel runs): `paged_attention` checks the inputs once for both kernels, the
# kernels only their own tuning knobs.


def _small(dtype=jnp.float32, *, bs=16, heads=4, kv_heads=2, head_dim=128):
    q = jnp.zeros((3, heads, head_dim), dtype)
    pages = jnp.zeros((kv_heads, 5, bs, head_dim), dtype)
    tables = jnp.zeros((3, 2), jnp.int32)
    lens = jnp.ones((3,), jnp.int32)
    return q, pages, tables, lens


def _via_ops(*args, **kw):
    """`paged_attention(impl="tpu")`: it checks every input once, for both TPU kernels."""
    return paged_attention(*args, impl="tpu", interpret=True, **kw)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bs=12), "block_size"),
        (dict(heads=3), "num_heads"),
        (dict(dtype=jnp.int32), "floating"),
    ],
)
def test_decode_rejects_bad_shapes(change, message):
    q, pages, tables, lens = _small(**change)
    with pytest.raises(ValueError, match=message):
        _via_ops(q, pages, pages, tables, lens, scale=1.0)


def test_decode_rejects_bad_arguments():
    q, pages, tables, lens = _small()
    call = _via_ops
    with pytest.raises(ValueError, match="dtype"):  # K and V pages in two dtypes
        call(q, pages.astype(jnp.bfloat16), pages, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        call(q, pages, pages, tables, lens.astype(jnp.float32), scale=1.0)
    with pytest.raises(ValueError, match="kv_lens.shape"):
        call(q, pages, pages, tables, lens[:2], scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        call(q, pages, pages, tables, lens, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        call(q, pages, pages, tables, lens, scale=1.0, soft_cap=-1.0)
    with pytest.raises(ValueError, match="pages_per_chunk"):  # the kernel's own knob
        tpu_paged_attention_decode(q, pages, pages, tables, lens, scale=1.0, pages_per_chunk=3)


def test_rejects_bad_layer():
    q, pages, tables, lens = _small()
    stacked = jnp.stack([pages] * NUM_LAYERS)
    call = functools.partial(_via_ops, scale=1.0)
    for layer in (-1, NUM_LAYERS, np.int64(NUM_LAYERS), True, jnp.float32(1), jnp.zeros(2, int)):
        with pytest.raises(ValueError, match="layer"):
            call(q, stacked, stacked, tables, lens, layer=layer)
    with pytest.raises(ValueError, match="layer"):  # one layer's pages: only layer 0
        call(q, pages, pages, tables, lens, layer=1)
    with pytest.raises(ValueError, match="k_pages"):
        call(q, stacked[None], stacked[None], tables, lens)
    cu, n = jnp.array([0, 1, 2, 3], jnp.int32), jnp.int32(3)
    with pytest.raises(ValueError, match="layer"):
        call(q, stacked, stacked, tables, lens, cu, n, layer=3)


def test_ragged_rejects_bad_arguments():
    q, pages, tables, lens = _small()
    cu, n = jnp.array([0, 1, 2, 3], jnp.int32), jnp.int32(3)
    call = _via_ops
    with pytest.raises(ValueError, match="cu_q_lens.shape"):
        call(q, pages, pages, tables, lens, cu[:3], n, scale=1.0)
    with pytest.raises(ValueError, match="num_seqs.shape"):
        call(q, pages, pages, tables, lens, cu, jnp.array([3, 3], jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="queries_per_block"):  # the kernel's own knob
        tpu_ragged_paged_attention(
            q, pages, pages, tables, lens, cu, n, scale=1.0, queries_per_block=12
        )
    with pytest.raises(ValueError, match="v_pages.shape"):
        call(q, pages, pages[:1], tables, lens, cu, n, scale=1.0)
