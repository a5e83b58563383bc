"""The Mosaic GPU kernel against the reference: in Pallas's GPU interpreter on the CPU, compiled
on a GPU of compute capability >= 9.0 when one is attached (or ``JAX_PAGED_GPU_HARDWARE=1``).

In interpret mode every kernel call runs with the interpreter's race detector on, and each test
checks that it found no race. Each decode case puts the interesting lengths (0, 1, bs-1, bs,
bs+1 and a long one) in one batch; each ragged case mixes a fresh prefill, a chunk after a long
cache, decode tokens, an idle sequence, padding rows and a dead slot (`mixed_batch`). Tables are
shuffled, share a prefix block, and the null block holds NaN. The grids cover each axis (block
size, GQA ratio, head dim, dtype, window, soft cap, splits, query block) without taking their
product; shapes are small because the interpreter runs grid points one by one.

`test_cuda_lowering` lowers every kernel variant the dispatch can pick for CUDA (an H200) with
`jax.export` on this machine, and checks that the Mosaic GPU custom call is in the module and
that both stacked page arrays reach it whole (no layer slice is copied out first).
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (
    mosaic_gpu_paged_attention_decode,
    mosaic_gpu_ragged_paged_attention,
    paged_attention,
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
    resolve_impl,
)
from pallas_kernels.mosaic_gpu_paged_attention import InterpretGPUParams
from pallas_kernels.ops import gpu_compute_capability, load_triton_kernel

try:  # pytest puts tests/ on sys.path (rootdir-relative import mode)
    from test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q
except ImportError:  # tests/ imported as a package
    from tests.test_reference_attention import TOL, make_paged_case, mixed_batch, rand_q

HARDWARE = os.environ.get("JAX_PAGED_GPU_HARDWARE") == "1" or jax.default_backend() == "gpu"
# The interpreter with its race detector on the CPU; compiled for the GPU on hardware.
INTERPRET = False if HARDWARE else InterpretGPUParams(detect_races=True)
LONG = 150  # three compute blocks of 64 keys
NUM_LAYERS = 3
LAYER = 1
TOL16 = {jnp.bfloat16: TOL[jnp.bfloat16], jnp.float16: dict(atol=1e-2, rtol=1e-2)}

needs_hopper = pytest.mark.skipif(
    HARDWARE and (gpu_compute_capability() or 0.0) < 9.0,
    reason="Mosaic GPU kernels need compute capability >= 9.0",
)


def check_no_races():
    """Fails if the interpreter's race detector saw a race in any kernel run so far."""
    if INTERPRET:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

        assert not interpret_pallas_call.get_races().races_found


def assert_matches(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out32))
    np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), **TOL16[dtype])


def stack_layers(rng, pages):
    """``pages`` as layer `LAYER` of ``[NUM_LAYERS, KVH, N, bs, D]``: layer 0 NaN, layer 2
    other random data, so a read of the wrong layer is seen."""
    other = jnp.asarray(rng.normal(scale=3.0, size=pages.shape), pages.dtype)
    return jnp.stack([jnp.full_like(pages, jnp.nan), pages, other])


def traced_layer(fn, **kw):
    """``fn`` under `jax.jit` with the layer a traced ``i32[]`` first argument."""

    @jax.jit
    def run(layer, *args):
        assert isinstance(layer, jax.core.Tracer)
        return fn(*args, layer=layer, **kw)

    return lambda *args: run(jnp.int32(LAYER), *args)


def decode_case(bs, kvh, group, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    lens = [0, 1, bs - 1, bs, bs + 1, LONG]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=head_dim, dtype=dtype, null_fill=np.nan
    )
    q, _ = rand_q(rng, (len(lens), kvh * group, head_dim), dtype)
    return rng, q, case


def ragged_case(bs, kvh, group, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
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
    return rng, q, case, jnp.asarray(cu), num_seqs


# bs, kvh, group, head_dim, dtype, window, cap, tuning. The fast tier runs two cases that
# between them cover both dtypes, both compute block sizes, window, soft cap and several splits.
slow = pytest.mark.slow
DECODE_CASES = [
    pytest.param(16, 2, 1, 64, jnp.bfloat16, None, None, dict(num_splits=1), marks=slow),
    pytest.param(32, 2, 4, 128, jnp.float16, None, None, dict(num_splits=2), marks=slow),
    (16, 1, 8, 128, jnp.bfloat16, 40, 5.0, dict(num_splits=3)),
    # default splits; 8 pages per compute block
    pytest.param(8, 2, 4, 64, jnp.bfloat16, 9, None, {}, marks=slow),
    (128, 1, 3, 64, jnp.float16, None, 2.0, dict(num_splits=2, num_stages=1)),  # bk = 128
]


@needs_hopper
@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,tuning", DECODE_CASES)
def test_decode_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, tuning):
    _, q, case = decode_case(bs, kvh, group, head_dim, dtype, seed=bs + 10 * group)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = mosaic_gpu_paged_attention_decode(*args, interpret=INTERPRET, **tuning, **kw)
    check_no_races()
    ref = paged_attention_decode_reference(*args, **kw)
    assert_matches(out, ref, dtype)
    np.testing.assert_array_equal(out[0], 0)  # kv_len 0


# bs, kvh, group, head_dim, dtype, window, cap, tuning
RAGGED_CASES = [
    (16, 2, 1, 64, jnp.bfloat16, None, None, dict(num_splits=2)),  # block_q = 64
    (32, 2, 4, 128, jnp.float16, 33, None, dict(num_splits=1)),  # block_q = 16
    (8, 1, 8, 64, jnp.bfloat16, 50, 4.0, dict(block_q=2, num_splits=3)),
    (16, 3, 3, 128, jnp.bfloat16, None, 3.0, dict(num_splits=2)),  # block_q = 21
]


@needs_hopper
@pytest.mark.slow
@pytest.mark.parametrize("bs,kvh,group,head_dim,dtype,window,cap,tuning", RAGGED_CASES)
def test_ragged_matches_reference(bs, kvh, group, head_dim, dtype, window, cap, tuning):
    _, q, case, cu, num_seqs = ragged_case(bs, kvh, group, head_dim, dtype, seed=100 + bs + group)
    args = (q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, cu, jnp.int32(num_seqs))
    kw = dict(scale=0.15, sliding_window=window, soft_cap=cap)
    out = mosaic_gpu_ragged_paged_attention(*args, interpret=INTERPRET, **tuning, **kw)
    check_no_races()
    ref = ragged_paged_attention_reference(*args, **kw)
    assert_matches(out, ref, dtype)
    np.testing.assert_array_equal(out[int(cu[num_seqs]) :], 0)  # padding rows


@needs_hopper
# The fast tier reads stacked decode pages at a traced layer in `test_decode_layers_in_scan`.
@pytest.mark.parametrize("form", [pytest.param("decode", marks=pytest.mark.slow), "ragged"])
def test_stacked_layers(form):
    """Stacked ``[L, KVH, N, bs, D]`` pages at layer 1, as an int and traced, vs the reference."""
    bs, kvh, group, d, dtype = 16, 2, 4, 64, jnp.bfloat16
    if form == "decode":
        rng, q, case = decode_case(bs, kvh, group, d, dtype, seed=3)
        tail = (case.block_tables, case.kv_lens)
        kernel, reference = mosaic_gpu_paged_attention_decode, paged_attention_decode_reference
    else:
        rng, q, case, cu, num_seqs = ragged_case(bs, kvh, group, d, dtype, seed=4)
        tail = (case.block_tables, case.kv_lens, cu, jnp.int32(num_seqs))
        kernel, reference = mosaic_gpu_ragged_paged_attention, ragged_paged_attention_reference
    kw = dict(scale=d**-0.5, sliding_window=60, soft_cap=None)
    ref = reference(q, case.k_pages, case.v_pages, *tail, **kw)
    args = (q, stack_layers(rng, case.k_pages), stack_layers(rng, case.v_pages), *tail)
    kw.update(interpret=INTERPRET, num_splits=2)
    out = kernel(*args, layer=LAYER, **kw)
    out_traced = traced_layer(kernel, **kw)(*args)
    check_no_races()
    for o in (out, out_traced):
        assert_matches(o, ref, dtype)
    np.testing.assert_array_equal(out_traced, out)


@needs_hopper
def test_decode_layers_in_scan():
    """A `lax.scan` over the layers (the engine's loop): its counter picks each layer's pages."""
    rng = np.random.default_rng(5)
    bs, kvh, group, d, dtype = 16, 2, 2, 64, jnp.bfloat16
    lens = [1, bs + 1, 70]
    case = make_paged_case(
        rng, lens, block_size=bs, num_kv_heads=kvh, head_dim=d, dtype=dtype, null_fill=np.nan
    )
    tables, kv_lens = case.block_tables, case.kv_lens
    shape = (NUM_LAYERS - 1, *case.k_pages.shape)  # other layers: other K/V, same tables
    k = jnp.concatenate([case.k_pages[None], jnp.asarray(rng.normal(size=shape), dtype)])
    v = jnp.concatenate([case.v_pages[None], jnp.asarray(rng.normal(size=shape), dtype)])
    q, _ = rand_q(rng, (NUM_LAYERS, len(lens), kvh * group, d), dtype)

    @jax.jit
    def all_layers(q, k, v):
        def step(_, layer):
            out = mosaic_gpu_paged_attention_decode(
                q[layer], k, v, tables, kv_lens, scale=0.1, layer=layer, interpret=INTERPRET
            )
            return None, out

        return jax.lax.scan(step, None, jnp.arange(NUM_LAYERS, dtype=jnp.int32))[1]

    out = all_layers(q, k, v)  # [L, B, H, D]
    check_no_races()
    for layer in range(NUM_LAYERS):
        ref = paged_attention_decode_reference(
            q[layer], k[layer], v[layer], tables, kv_lens, scale=0.1
        )
        assert_matches(out[layer], ref, dtype)


@needs_hopper
def test_dispatch_casts_q_to_the_pages_dtype():
    """`paged_attention(impl="mosaic_gpu")`: a float32 model over a bfloat16 cache."""
    bs, kvh, group, d = 32, 1, 4, 64
    rng, q, case = decode_case(bs, kvh, group, d, jnp.bfloat16, seed=6)
    q32 = q.astype(jnp.float32) + jnp.asarray(rng.normal(size=q.shape) * 1e-3, jnp.float32)
    args = (q32, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    out = paged_attention(*args, scale=0.2, impl="mosaic_gpu", interpret=INTERPRET)
    check_no_races()
    ref = paged_attention(*args, scale=0.2, impl="reference")
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, **TOL[jnp.bfloat16])


def test_dispatch_rejects_what_the_kernel_cannot_take():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    call = functools.partial(paged_attention, scale=1.0, impl="mosaic_gpu", interpret=INTERPRET)
    for pages, field in [
        (jnp.zeros((2, 5, 16, 64), jnp.float32), "k_pages.dtype"),
        (jnp.zeros((2, 5, 16, 80), jnp.bfloat16), "head_dim"),
        (jnp.zeros((2, 5, 4, 64), jnp.bfloat16), "block_size"),
    ]:
        q_ = jnp.zeros((2, 4, pages.shape[-1]), jnp.bfloat16)
        with pytest.raises(ValueError, match=field):
            call(q_, pages, pages, tables, lens)
    with pytest.raises(ValueError, match="query heads per KV head"):
        call(
            jnp.zeros((2, 65, 64), jnp.bfloat16),
            *[jnp.zeros((1, 5, 16, 64), q.dtype)] * 2,
            tables,
            lens,
        )


@pytest.mark.parametrize(
    "bs,d,dtype,group,cc,triton,want",
    [
        # While jax ships the Triton backend, its kernel is the default (faster on an H200).
        (16, 128, jnp.bfloat16, 4, 9.0, True, "gpu"),
        (16, 128, jnp.bfloat16, 4, 8.0, True, "gpu"),
        (12, 128, jnp.bfloat16, 1, 9.0, True, "xla"),  # block size not a power of 2
        # Without it, Mosaic GPU on Hopper and newer where it takes the shapes.
        (16, 128, jnp.bfloat16, 4, 9.0, False, "mosaic_gpu"),  # H100 / H200
        (32, 64, jnp.float16, 1, 10.0, False, "mosaic_gpu"),  # Blackwell
        (16, 128, jnp.bfloat16, 4, 8.0, False, "xla"),  # A100
        (16, 128, jnp.float32, 4, 9.0, False, "xla"),  # float32 pages
        (16, 256, jnp.bfloat16, 1, 9.0, False, "xla"),  # head dim outside the kernel's
        (4, 128, jnp.bfloat16, 1, 9.0, False, "xla"),  # block size below 8
        (16, 128, jnp.bfloat16, 96, 9.0, False, "xla"),  # more than 64 heads per KV head
    ],
)
def test_auto_on_cuda(bs, d, dtype, group, cc, triton, want):
    got = resolve_impl(
        "auto", bs, d, "gpu", dtype=dtype, group=group, compute_capability=cc, triton=triton
    )
    assert got == want


# form, bs, head_dim, dtype, group, window, cap, splits: every static variant of the kernel
# (compute block 64 or 128 keys, head dim 64 or 128, bf16 or f16, one split (output in the page
# dtype) or several (float32 partials), window, soft cap, decode and ragged blocks).
LOWERING_CASES = [
    ("decode", 16, 128, jnp.bfloat16, 8, None, None, None),
    ("decode", 8, 64, jnp.float16, 1, 64, 30.0, 1),
    ("decode", 128, 128, jnp.bfloat16, 4, None, 50.0, 4),
    ("ragged", 32, 128, jnp.bfloat16, 4, 128, None, 1),
    ("ragged", 16, 64, jnp.float16, 7, None, 20.0, None),
    ("ragged", 64, 64, jnp.bfloat16, 1, 100, None, 2),
]


@pytest.mark.parametrize("form,bs,d,dtype,group,window,cap,splits", LOWERING_CASES)
def test_cuda_lowering(form, bs, d, dtype, group, window, cap, splits):
    """Lowers for CUDA (an H200) through Mosaic GPU on this machine (no GPU needed): layouts,
    tilings and WGMMA shapes are checked here; the PTX only on a GPU."""
    b, kvh, n, p = 7, 4, 257, 33  # odd sizes
    h = kvh * group
    sds = jax.ShapeDtypeStruct
    pages_shape = (NUM_LAYERS, kvh, n, bs, d)
    pages = sds(pages_shape, dtype)
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap, num_splits=splits)
    if form == "decode":
        kernel = mosaic_gpu_paged_attention_decode
        args = (sds((b, h, d), dtype), pages, pages, sds((b, p), jnp.int32), sds((b,), jnp.int32))
    else:
        kernel = mosaic_gpu_ragged_paged_attention
        args = (
            sds((300, h, d), dtype),
            pages,
            pages,
            sds((b, p), jnp.int32),
            sds((b,), jnp.int32),
            sds((b + 1,), jnp.int32),
            sds((), jnp.int32),
        )

    def fn(*args):  # the last argument is the traced layer
        return kernel(*args[:-1], layer=args[-1], **kw)

    with h200_mesh():
        exported = export.export(jax.jit(fn), platforms=["cuda"])(*args, sds((), jnp.int32))
    text = exported.mlir_module()
    calls = [ln for ln in text.splitlines() if re.search(r"custom_call @mosaic_gpu", ln)]
    assert len(calls) == 1, text[:2000]
    # The call's operands: both stacked page arrays go in whole.
    operand_types = calls[0].rsplit("} : (", 1)[1].split(") -> ", 1)[0]
    element = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    pages_type = "tensor<" + "x".join(map(str, pages_shape)) + f"x{element}>"
    assert operand_types.count(pages_type) == 2, operand_types


def h200_mesh():
    """An abstract mesh on an H200: jax >= 0.11 reads the target GPU from it with no GPU."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.skipif(
    jax.__version_info__ < (0, 11), reason="jax < 0.11 does not deprecate Pallas's Triton backend"
)
def test_triton_deprecation_warning_does_not_reach_users():
    """jax >= 0.11 warns at every Pallas Triton lowering; `paged_attention(impl="gpu")` (through
    `load_triton_kernel`) filters it, even when the caller's own jit does the lowering."""
    sds = jax.ShapeDtypeStruct
    pages = sds((2, 11, 16, 64), jnp.bfloat16)  # shapes no other test lowers (no cache hit)
    args = (sds((3, 6, 64), jnp.bfloat16), pages, pages, sds((3, 5), jnp.int32))
    args += (sds((3,), jnp.int32),)
    fn = jax.jit(functools.partial(paged_attention, scale=0.1, impl="gpu"))
    with warnings.catch_warnings(record=True) as caught, h200_mesh():
        warnings.simplefilter("always")
        load_triton_kernel()  # what paged_attention does; it adds its filter in this context
        triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        exported = export.export(fn, platforms=["cuda"], disabled_checks=[triton])(*args)
    assert "xla.gpu.triton" in exported.mlir_module()
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]


@pytest.mark.slow
def test_engine_runs_on_the_mosaic_gpu_kernel():
    """`LLM(attention_impl="mosaic_gpu")`: the engine's prefill, decode loop and cache writes
    through the Mosaic GPU kernel (interpreted on a CPU). A bfloat16 model: its greedy tokens
    equal those through the Triton kernel (both round q and p to bfloat16) and, up to the
    rounding's first near-tie, those through the float32 reference."""
    from flax import nnx

    import models
    from jax_paged import LLM, SamplingParams

    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )
    model = models.Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    loaded = models.LoadedModel(
        model=model,
        tokenizer=None,
        config=cfg,
        generation_config=models.GenerationConfig(),
        source="tiny bf16 llama",
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1, 256, size=n).tolist()} for n in (5, 17, 33)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    tokens = {}
    for impl in ("reference", "gpu", "mosaic_gpu"):
        llm = LLM(
            loaded,
            dtype="bfloat16",
            num_kv_blocks=64,
            max_num_seqs=4,
            attention_impl=impl,
            attention_interpret=impl != "reference" and not HARDWARE,
        )
        outs = llm.generate(prompts, params)
        assert not any(o.error for o in outs)
        tokens[impl] = [o.outputs[0].token_ids for o in outs]
    assert tokens["mosaic_gpu"] == tokens["gpu"]
    assert [t[:4] for t in tokens["mosaic_gpu"]] == [t[:4] for t in tokens["reference"]]
