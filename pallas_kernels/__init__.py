"""Paged-attention kernels: a plain-jnp reference, Pallas GPU/TPU kernels and the KV write.

`paged_attention` is the entry point (it picks the kernel by platform); `write_kv` scatters new
K/V into the pages. The TPU kernel is imported only when used.
"""

from pallas_kernels.gpu_paged_attention import (
    gpu_paged_attention_decode,
    gpu_ragged_paged_attention,
)
from pallas_kernels.kv_write import write_kv
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
    "write_kv",
    "xla_paged_attention_decode",
    "xla_ragged_paged_attention",
]
