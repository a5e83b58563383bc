"""What differs per platform, in one place: which attention kernel runs, how K/V are written,
how the weights are laid out, and how the greedy token is picked.

- **Kernel choice** (`attention_impl`, `paged_attention`): ``impl="auto"`` resolves to the
  native C++ kernel on a CPU (through XLA's FFI; the chunked XLA path where it cannot be
  built), the Pallas Triton kernel on a CUDA GPU while jax ships that backend (on an H200 it
  is 1.4-1.7x faster than the Mosaic GPU kernel in decode and 1.5x in ragged prefill,
  docs/results/kernel_gpu_h200.json), else the Mosaic GPU kernel on compute capability >= 9.0,
  and the Pallas TPU kernel on a TPU. The rules live in `pallas_kernels.resolve_impl`; the
  engine's attention goes through `paged_attention` from here.
- **K/V write** (`native_kv_updates`): a bfloat16 pool on one CPU device is written, and copied
  on write, by two in-place FFI handlers of the native library (`write_rows`, `copy_pages`).
  XLA's CPU backend has no bfloat16 scatter and widens the whole pool to float32 around each
  one: a SmolLM2 decode step at batch 64 took 1.7 s instead of 75 ms. Float32 and float16
  scatters, and every other backend's, are in place already, so they stay with XLA.
- **Weight layout** (`prepare_params`): on one CPU device, a model that declares
  ``per_layer_weights = True`` (`models.protocol`) gets its stacked layer kernels as one array
  per layer (`models.layer_weights.split_layer_weights`). XLA's CPU dots read whole buffers,
  so a kernel sliced out of the stack inside the layer scan was copied before every dot:
  424 MB per forward for SmolLM2-135M, about 60 ms on 2 cores whatever the batch; the split
  form made decode about 1.4x faster at batch 8. Not done on a mesh, a GPU or a TPU (not
  measured there).
- **Step sizes** (`padded_size`): a step's tokens and rows are padded to a few sizes, one
  compiled variant each. On a CPU the step is compute bound even at a few rows (SmolLM2 in
  float32 on 2 cores: about 2 ms per padded token; 8 decode rows padded to 32 took 105 ms
  against 65), so sizes go up by 1.5x and 1.33x in turn (8, 12, 16, 24, 32, 48, ...: at most
  a third padding); on a GPU or TPU padding to the next power of two costs little and every
  size is one more compile.
- **Argmax** (`argmax_last`): greedy sampling takes a two-level argmax on every platform, since
  XLA:CPU lowers ``jnp.argmax`` to a (value, index) reduction about 30x slower than a plain max
  (7.5 ms against 0.25 ms at [64, 49152] logits, 6% of a decode step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.layer_weights import split_layer_weights
from pallas_kernels import cpu_paged_attention as cpu_kernels
from pallas_kernels import paged_attention, resolve_impl

__all__ = [
    "argmax_last",
    "attention_impl",
    "native_kv_updates",
    "padded_size",
    "paged_attention",
    "prepare_params",
]


# ----------------------------------------------------------------------------------------------
# Kernel choice


def attention_impl(
    impl: str, block_size: int, head_dim: int, *, dtype=jnp.bfloat16, group: int = 1
) -> str:
    """The kernel `paged_attention` runs for ``impl`` on this platform ("auto" resolved; see
    `pallas_kernels.resolve_impl`) for pages of ``dtype`` and ``group`` query heads per KV
    head."""
    return resolve_impl(impl, block_size, head_dim, dtype=dtype, group=group)


# ----------------------------------------------------------------------------------------------
# K/V write path


def native_kv_updates(pages: jax.Array) -> bool:
    """Whether the pool's updates go through the native CPU library: a bfloat16 pool on one CPU
    device (see the module docstring). A cache sharded over several devices stays with XLA (the
    custom calls have no sharding rule)."""
    return (
        pages.dtype == jnp.bfloat16
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
        and cpu_kernels.available()
    )


# ----------------------------------------------------------------------------------------------
# Weight layout


def prepare_params(model: Any, params: Any, mesh: Any = None) -> Any:
    """``params`` (``model``'s, from `nnx.split`) as the compiled programs read them fastest:
    the stacked layer kernels split per layer (`models.layer_weights.split_layer_weights`) when
    ``model`` declares ``per_layer_weights = True`` and the params live on one CPU device with
    no ``mesh``; otherwise ``params`` themselves. Either form runs the same ``forward``."""
    leaves = jax.tree.leaves(params)
    if getattr(model, "per_layer_weights", False) is not True or mesh is not None or not leaves:
        return params
    if not hasattr(leaves[0], "devices"):
        return params
    if all(d.platform == "cpu" for d in leaves[0].devices()):
        return split_layer_weights(params)
    return params


# ----------------------------------------------------------------------------------------------
# Step sizes


def padded_size(n: int, lo: int, platform: str | None = None) -> int:
    """The size a step dimension of ``n`` (tokens of a mixed step, rows of a decode loop) is
    padded to, at least ``lo``: the next power of two, or on a CPU (``platform``, default
    jax's default backend) the next of the powers of two and their 1.5x multiples (see the
    module docstring)."""
    n = max(n, lo, 1)
    p = 1 << (n - 1).bit_length()  # the next power of two
    platform = platform or jax.default_backend()
    if platform == "cpu" and p >= 4 and 3 * p // 4 >= n:
        return 3 * p // 4
    return p


# ----------------------------------------------------------------------------------------------
# Argmax

_ARGMAX_BLOCK = 256


def argmax_last(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as i32, in two levels: the block of `_ARGMAX_BLOCK` entries
    holding the maximum, then the entry inside it. Ties go to the lowest index; a NaN counts as
    +inf (XLA's CPU max does not reliably propagate NaNs, so they are made explicit).

    On the CPU XLA lowers argmax to a (value, index) reduction that runs about 30x slower than
    a plain max: at [64, 49152] logits 7.5 ms against 0.25 ms here, 6% of a decode step.
    """
    *lead, v = x.shape
    x = jnp.where(jnp.isnan(x), jnp.asarray(jnp.inf, x.dtype), x)
    nb = -(-v // _ARGMAX_BLOCK)
    pad = nb * _ARGMAX_BLOCK - v
    if pad:
        fill = jnp.asarray(-jnp.inf, x.dtype)
        x = jnp.concatenate([x, jnp.full((*lead, pad), fill, x.dtype)], axis=-1)
    xb = x.reshape(*lead, nb, _ARGMAX_BLOCK)
    blk = jnp.argmax(jnp.max(xb, axis=-1), axis=-1).astype(jnp.int32)  # [...]
    inner = jnp.take_along_axis(xb, blk[..., None, None], axis=-2)[..., 0, :]  # [..., BLOCK]
    return blk * _ARGMAX_BLOCK + jnp.argmax(inner, axis=-1).astype(jnp.int32)
