"""Paged-attention kernels: a plain-jnp reference, an XLA path and Pallas GPU/TPU kernels.

`paged_attention` is the entry point (it picks the kernel by platform). The K/V write is
`jax_paged.memory.kv_cache.write`. The Pallas kernel modules are imported only when used: the GPU
kernels' names below resolve on first access (the Triton one through
`pallas_kernels.ops.load_triton_kernel`, which filters jax's deprecation warning for that
backend), the TPU kernel through `paged_attention`.
"""

import importlib

from pallas_kernels.ops import IMPLS, paged_attention, resolve_impl
from pallas_kernels.reference import (
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.xla_paged_attention import (
    xla_paged_attention_decode,
    xla_ragged_paged_attention,
)

_LAZY = {
    "gpu_paged_attention_decode": "pallas_kernels.gpu_paged_attention",
    "gpu_ragged_paged_attention": "pallas_kernels.gpu_paged_attention",
    "mosaic_gpu_paged_attention_decode": "pallas_kernels.mosaic_gpu_paged_attention",
    "mosaic_gpu_ragged_paged_attention": "pallas_kernels.mosaic_gpu_paged_attention",
}

__all__ = [
    "gpu_paged_attention_decode",
    "gpu_ragged_paged_attention",
    "mosaic_gpu_paged_attention_decode",
    "mosaic_gpu_ragged_paged_attention",
    "paged_attention",
    "paged_attention_decode_reference",
    "ragged_paged_attention_reference",
    "resolve_impl",
    "IMPLS",
    "xla_paged_attention_decode",
    "xla_ragged_paged_attention",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    if _LAZY[name] == "pallas_kernels.gpu_paged_attention":
        module = importlib.import_module("pallas_kernels.ops").load_triton_kernel()
    else:
        module = importlib.import_module(_LAZY[name])
    return getattr(module, name)
