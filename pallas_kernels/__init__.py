"""Paged-attention kernels: a plain-jnp reference, Pallas GPU/TPU kernels and the KV write."""

from pallas_kernels.kv_write import write_kv
from pallas_kernels.reference import (
    paged_attention_decode_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "paged_attention_decode_reference",
    "ragged_paged_attention_reference",
    "write_kv",
]
