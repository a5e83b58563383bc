"""Paged-attention kernels: a plain-jnp reference, an XLA path and Pallas GPU/TPU kernels.

`paged_attention` is the entry point (it picks the kernel by platform). The K/V write is
`jax_paged.kv_cache.write`. The TPU kernel is imported only when used.
"""

from pallas_kernels.gpu_paged_attention import (
    gpu_paged_attention_decode,
    gpu_ragged_paged_attention,
)
from pallas_kernels.ops import paged_attention, resolve_impl
from pallas_kernels.reference import (
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.xla_paged_attention import (
    xla_paged_attention_decode,
    xla_ragged_paged_attention,
)

__all__ = [
    "gpu_paged_attention_decode",
    "gpu_ragged_paged_attention",
    "paged_attention",
    "paged_attention_decode_reference",
    "ragged_paged_attention_reference",
    "resolve_impl",
    "xla_paged_attention_decode",
    "xla_ragged_paged_attention",
]
