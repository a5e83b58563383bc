"""`paged_attention`: the one entry point the model calls, picking a kernel by platform.

::

    impl="auto"       CUDA GPU -> gpu_paged_attention (Pallas, Triton lowering) while jax ships
                                  that backend; without it, on compute capability >= 9.0
                                  (Hopper, Blackwell) with 16-bit pages,
                                  mosaic_gpu_paged_attention (Pallas, Mosaic GPU: TMA, WGMMA).
                                  On an H200 the Triton kernel is 1.4-1.7x faster in decode and
                                  1.5x in ragged prefill (scripts/bench_kernel.py,
                                  docs/results/kernel_gpu_h200.json), so it stays the default.
                      TPU      -> tpu_paged_attention (Pallas, Mosaic TPU)
                      CPU      -> cpu_paged_attention (a native C++ kernel through XLA's FFI,
                                  built on first use, reading the pages in place), or, where
                                  it cannot be built (no C++ compiler), xla_paged_attention
                      else     -> xla_paged_attention (plain jnp, keys walked in chunks up to
                                  the longest live context: cost follows the real lengths)
    impl="reference" | "xla" | "cpu" | "gpu" | "mosaic_gpu" | "tpu"   force one; interpret=True
                      runs a Pallas kernel in its interpreter (how the CPU tests run them)

"reference" is the oracle every implementation is tested against: it gathers each query's whole
block table, so its cost grows with the table width (max_model_len), not the live context.

Pages come either as one layer, ``[KVH, N, bs, D]``, or stacked over layers, ``[L, KVH, N, bs,
D]`` with ``layer`` (a Python int or a traced ``i32[]``, e.g. the counter of a scan over layers)
picking one. Every implementation reads the stacked array in place through the layer index: a
slice ``k_pages[layer]`` taken outside the kernel would be a copy of the layer's whole pool on
every call, so the cost would follow the pool size instead of the live tokens.

"auto" falls back to the XLA path on a GPU when the shapes are outside what the GPU kernels
take (block size or head dim not a power of two), rather than failing; an explicit
``impl="gpu"`` or ``impl="mosaic_gpu"`` raises instead; ``impl="tpu"`` needs a block size that is
a multiple of 8.

The GPU kernel modules are imported only when used: jax has deprecated its Pallas Triton backend
(it warns at every Triton lowering from jax 0.11 on and will remove it), so the package must not
break when it goes, and the warning, which concerns jax's internals and not the user's code, is
filtered (by its message) when the Triton kernel is loaded. Every
input is checked here, once, at trace time, with errors that name the offending argument (the
layer, the pages, q, the tables and lengths, the options, the forced kernel's shape limits); the
implementations behind this call assume valid inputs and check only their own tuning knobs.
"""

from __future__ import annotations

import functools
import importlib
import numbers
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_paged_attention as _cpu
from pallas_kernels import reference as _ref
from pallas_kernels import xla_paged_attention as _xla

__all__ = ["gpu_compute_capability", "load_triton_kernel", "paged_attention", "resolve_impl"]

Impl = Literal["auto", "reference", "xla", "cpu", "gpu", "mosaic_gpu", "tpu"]
IMPLS = ("auto", "reference", "xla", "cpu", "gpu", "mosaic_gpu", "tpu")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# jax's warning at every Pallas Triton lowering (jax >= 0.11); see the module docstring.
_TRITON_DEPRECATION = r".*Pallas Triton backend is deprecated"


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _gpu_supports(page_size: int, head_dim: int) -> bool:
    return _is_pow2(page_size) and _is_pow2(head_dim) and head_dim >= 16


def _mosaic_gpu_supports(page_size: int, head_dim: int, dtype, group: int) -> bool:
    """`mosaic_gpu_paged_attention.supports`, without importing the kernel module."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim in (64, 128)
        and 8 <= page_size <= 128
        and _is_pow2(page_size)
        and 1 <= group <= 64
    )


@functools.cache
def triton_available() -> bool:
    """Whether this jax still ships Pallas's (deprecated) Triton backend."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


def gpu_compute_capability() -> float | None:
    """The first CUDA GPU's compute capability (e.g. 9.0 for an H100/H200), None without one."""
    try:
        device = jax.devices("gpu")[0]
        return float(device.compute_capability)
    except (RuntimeError, AttributeError, TypeError, ValueError):  # no GPU, or not CUDA
        return None


def resolve_impl(
    impl: Impl,
    page_size: int,
    head_dim: int,
    backend: str | None = None,
    *,
    dtype=jnp.bfloat16,
    group: int = 1,
    compute_capability: float | None = None,
    triton: bool | None = None,
) -> str:
    """The implementation `paged_attention` runs for ``impl`` on ``backend`` (default: jax's).

    On a CUDA GPU "auto" picks the Triton kernel when jax ships Pallas's Triton backend
    (``triton``; default: whether it imports) and the kernel takes the shapes; else the Mosaic
    GPU kernel on compute capability >= 9.0 (default: the attached GPU's; none attached counts
    as older) when it takes the pages' ``dtype`` and the ``group`` query heads per KV head;
    else the XLA path.
    """
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda"):
        triton = triton_available() if triton is None else triton
        if triton and _gpu_supports(page_size, head_dim):
            return "gpu"
        cc = gpu_compute_capability() if compute_capability is None else compute_capability
        if cc is not None and cc >= 9.0 and _mosaic_gpu_supports(page_size, head_dim, dtype, group):
            return "mosaic_gpu"
        return "xla"
    if backend == "tpu":
        return "tpu"
    if backend == "cpu" and _cpu.available():
        return "cpu"
    return "xla"


def _check_int(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if x.shape != shape or x.dtype != jnp.int32:
        raise ValueError(
            f"{name} must be int32 of shape {shape}; got {name}.shape={x.shape}, {x.dtype}"
        )


def _check_layer(layer, num_layers: int) -> jax.Array | int:
    """``layer`` of stacked pages: an int (or concrete integer scalar) must lie in [0, L) and is
    returned as an int; a traced one must be an integer scalar (its range is unknown: the
    kernels clamp it) and is returned as ``i32[]``."""
    try:
        value = np.asarray(layer)  # an int, a NumPy integer or a concrete array
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        # Traced (e.g. a scan counter): only its type can be checked.
        if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(
                f"layer must be an integer scalar; got {jnp.result_type(layer)}"
                f"{list(jnp.shape(layer))}"
            ) from None
        return jnp.asarray(layer, jnp.int32)
    if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{layer=} must be an int or an integer scalar")
    if not 0 <= value < num_layers:
        raise ValueError(f"{layer=} must be in [0, {num_layers}) (the pages' layers)")
    return int(value)


def _stack_pages(k_pages, v_pages, layer):
    """The pages as ``[L, KVH, N, bs, D]`` (one layer's as a stack of one: a bitcast, no copy)
    and the checked layer."""
    if k_pages.ndim not in (4, 5):
        raise ValueError(f"{k_pages.shape=} must be [KVH, N, bs, D] or [L, KVH, N, bs, D]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError(f"stacked pages {k_pages.shape=} [L, KVH, N, bs, D] need a layer")
        return k_pages, v_pages, _check_layer(layer, k_pages.shape[0])
    if layer is not None and not (isinstance(layer, numbers.Integral) and layer == 0):
        raise ValueError(f"{layer=} must be None or 0 for one layer's pages [KVH, N, bs, D]")
    return k_pages[None], v_pages[None], 0


def _check_arrays(q, k_pages, v_pages) -> None:  # pages [L, KVH, N, bs, D]
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [B, H, D] (decode) or [T, H, D] (ragged)")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{q.dtype=} must be a floating dtype: float32, bfloat16 or float16")
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{k_pages.dtype=} and {v_pages.dtype=} must be one floating dtype: float32, "
            "bfloat16 or float16"
        )
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, head_dim_k = k_pages.shape
    if head_dim_k != head_dim:
        raise ValueError(f"{head_dim_k=} (k_pages.shape[-1]) must equal {head_dim=} (q.shape[2])")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"{block_size=} and {num_blocks=} must be >= 1")


def _check_tables(block_tables, kv_lens, cu_q_lens, num_seqs, num_q: int) -> None:
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"{block_tables.shape=}, {block_tables.dtype=} must be [S, P], int32")
    num_seq_slots = block_tables.shape[0]
    if cu_q_lens is None:
        if num_seq_slots != num_q:
            raise ValueError(f"{block_tables.shape=} must have one row per query ({num_q=})")
    else:
        _check_int("cu_q_lens", cu_q_lens, (num_seq_slots + 1,))
        if num_seqs is not None and jnp.shape(num_seqs) != ():
            raise ValueError(f"num_seqs.shape={jnp.shape(num_seqs)} must be () (a scalar)")
    _check_int("kv_lens", kv_lens, (num_seq_slots,))


def _check_options(scale, sliding_window, soft_cap) -> None:
    if not isinstance(scale, numbers.Real) or scale <= 0:
        raise ValueError(f"{scale=} must be a positive Python number (static)")
    if sliding_window is not None and (
        not isinstance(sliding_window, numbers.Integral) or sliding_window < 1
    ):
        raise ValueError(f"{sliding_window=} must be None or a positive int")
    if soft_cap is not None and (not isinstance(soft_cap, numbers.Real) or soft_cap <= 0):
        raise ValueError(f"{soft_cap=} must be None or a positive number")


def _check_kernel_shapes(which: str, block_size: int, head_dim: int, dtype, group: int) -> None:
    if which == "gpu" and not _gpu_supports(block_size, head_dim):
        raise ValueError(
            f"{block_size=} and {head_dim=} must be powers of 2 (head_dim >= 16) for impl='gpu'"
        )
    if which == "mosaic_gpu" and not _mosaic_gpu_supports(block_size, head_dim, dtype, group):
        raise ValueError(
            f"impl='mosaic_gpu' takes k_pages.dtype bfloat16 or float16 (got {jnp.dtype(dtype)}), "
            f"{head_dim=} 64 or 128, {block_size=} a power of 2 in [8, 128], and at most 64 "
            f"query heads per KV head (got {group})"
        )
    if which == "cpu" and jax.default_backend() != "cpu":
        backend = jax.default_backend()
        raise ValueError(f"impl='cpu' runs on the CPU backend only; jax's is {backend!r}")
    if which == "cpu" and not _cpu.available():
        raise ValueError(f"impl='cpu' is unavailable here: {_cpu.build_error()}")
    if which == "tpu" and block_size % 8:
        raise ValueError(f"{block_size=} must be a multiple of 8 for impl='tpu' (sublane tiling)")


def _kernels(which: str):
    """The ``(decode, ragged)`` functions of implementation ``which``."""
    # The Pallas kernels are imported lazily, so that a missing or broken backend (jax's
    # deprecated Triton lowering, Mosaic GPU, Mosaic TPU) never breaks the rest.
    if which == "tpu":
        tpu = importlib.import_module("pallas_kernels.tpu_paged_attention")
        return tpu.tpu_paged_attention_decode, tpu.tpu_ragged_paged_attention
    if which == "gpu":
        triton = load_triton_kernel()
        return triton.gpu_paged_attention_decode, triton.gpu_ragged_paged_attention
    if which == "mosaic_gpu":
        mosaic = importlib.import_module("pallas_kernels.mosaic_gpu_paged_attention")
        return mosaic.mosaic_gpu_paged_attention_decode, mosaic.mosaic_gpu_ragged_paged_attention
    return {
        "reference": (_ref.paged_attention_decode_reference, _ref.ragged_paged_attention_reference),
        "xla": (_xla.xla_paged_attention_decode, _xla.xla_ragged_paged_attention),
        "cpu": (_cpu.cpu_paged_attention_decode, _cpu.cpu_ragged_paged_attention),
    }[which]


def load_triton_kernel():
    """The Triton kernel module, imported on first use, with jax's deprecation warning for the
    Pallas Triton backend filtered: it fires at every lowering, also under a caller's own
    `jax.jit`, so a `catch_warnings` around our call would not cover it."""
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
    return importlib.import_module("pallas_kernels.gpu_paged_attention")


def paged_attention(
    q: jax.Array,  # [B, H, D] decode, or [T, H, D] ragged
    k_pages: jax.Array,  # [KVH, N, bs, D] or [L, KVH, N, bs, D]
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[B, P] decode, i32[S, P] ragged
    kv_lens: jax.Array,  # i32[B] or i32[S]
    cu_q_lens: jax.Array | None = None,  # i32[S+1]; given -> ragged form
    num_seqs: jax.Array | int | None = None,  # i32[]; default S
    *,
    layer: jax.Array | int | None = None,  # i32[] or int; required with stacked pages
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:  # same shape and dtype as q
    """Paged attention over one layer's pages, decode or ragged (docs/DESIGN.md, "Kernels").

    The pages are one layer's, or all layers' with ``layer`` choosing one (read in place).

    Decode (``cu_q_lens is None``): query b sits at position ``kv_lens[b] - 1`` and sees keys
    ``0..kv_lens[b]-1``; ``kv_lens[b] == 0`` gives zeros.

    Ragged: sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its row j sits at position
    ``kv_lens[s] - q_len_s + j`` and sees keys at or before it. Rows at or past
    ``cu_q_lens[num_seqs]`` are padding and give zeros.

    Args:
      q: ``[B, H, D]`` or ``[T, H, D]``; float32, bfloat16 or float16.
      k_pages, v_pages: ``[KVH, N, bs, D]`` or ``[L, KVH, N, bs, D]``, float32, bfloat16 or
        float16, not necessarily ``q.dtype`` (a 16-bit cache under a float32 model); block 0
        is the null block.
      block_tables: ``i32[B or S, P]``; kv_lens: ``i32[B or S]`` (current tokens included).
      cu_q_lens: ``i32[S+1]`` query start offsets (ragged form only).
      num_seqs: live sequences (ragged form; default all S).
      scale: softmax scale (static), e.g. ``D ** -0.5``.
      sliding_window: key k visible from position p when ``p - k < sliding_window``.
      soft_cap: ``logits = soft_cap * tanh(scale * q.k / soft_cap)``.
      layer: which layer of stacked pages (int in [0, L) or a traced integer scalar); must be
        None or 0 for one layer's pages.
      impl: "auto", "reference", "xla", "cpu", "gpu", "mosaic_gpu" or "tpu" (see module
        docstring).
      interpret: run a Pallas kernel in the interpreter.
    Returns:
      Attention output, same shape and dtype as ``q``.
    Raises:
      ValueError: on inconsistent shapes or dtypes, a head count not divisible by the KV heads,
        a bad scale/window/cap, an unknown impl, or shapes the forced kernel cannot take.
    """
    k_pages, v_pages, layer = _stack_pages(k_pages, v_pages, layer)
    _check_arrays(q, k_pages, v_pages)
    _check_tables(block_tables, kv_lens, cu_q_lens, num_seqs, q.shape[0])
    _check_options(scale, sliding_window, soft_cap)
    block_size, head_dim = k_pages.shape[3:]
    group = q.shape[1] // k_pages.shape[1]
    which = resolve_impl(impl, block_size, head_dim, dtype=k_pages.dtype, group=group)
    _check_kernel_shapes(which, block_size, head_dim, k_pages.dtype, group)

    args = (q, k_pages, v_pages, block_tables, kv_lens)
    if cu_q_lens is not None:
        num_seqs = block_tables.shape[0] if num_seqs is None else num_seqs
        args += (cu_q_lens, jnp.asarray(num_seqs, jnp.int32))
    soft_cap = None if soft_cap is None else float(soft_cap)
    sliding_window = None if sliding_window is None else int(sliding_window)
    kw = dict(layer=layer, scale=float(scale), sliding_window=sliding_window, soft_cap=soft_cap)
    if which in ("gpu", "mosaic_gpu", "tpu"):
        kw["interpret"] = interpret
    kernel = _kernels(which)[0 if cu_q_lens is None else 1]
    if which in ("gpu", "mosaic_gpu", "tpu") and q.dtype != k_pages.dtype:
        # A cache in another dtype than the model (`EngineConfig.kv_cache_dtype`): the Pallas
        # kernels take q in the pages' dtype (they accumulate in float32 either way).
        return kernel(q.astype(k_pages.dtype), *args[1:], **kw).astype(q.dtype)
    return kernel(*args, **kw)
