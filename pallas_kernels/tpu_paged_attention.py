"""Paged attention for TPU in Pallas (Mosaic TPU): decode and ragged (mixed prefill/decode).

Contracts (shapes, `kv_lens`, positions, window, soft cap, GQA) are those of docs/DESIGN.md;
inputs are checked once, by `pallas_kernels.paged_attention`, which imports this module lazily.

Layout of the TPU kernels
-------------------------
* `tpu_common`: what both kernels share (how they work is told there): the page copier, chunk
  streaming, the online-softmax step, scratch, and the `pallas_call` around a kernel.
* `tpu_decode`: `tpu_paged_attention_decode`, one query per sequence, several sequences a
  program.
* `tpu_ragged`: `tpu_ragged_paged_attention`, blocks of query rows of a flat ragged batch; its
  row -> (sequence, position) mapping is `layout.ragged_rows`, computed outside the kernel.
* The oracle both are tested against is `reference` (tests/test_tpu_kernel.py).

Layout constraints (Mosaic TPU; the interpreter accepts anything)
-----------------------------------------------------------------
* `block_size` must be a multiple of 8 (checked by `paged_attention`): a page is `[bs, D]` tiles
  of `(8, 128)` and a chunk folds `[pages, bs, D] -> [pages * bs, D]`. For bfloat16 a multiple
  of 16 avoids packed-sublane relayouts.
* `head_dim` should be a multiple of 128 (lane width); 64 works but pads every vector to 128 lanes.
* `queries_per_block` must be a multiple of 8 (16 preferred for bfloat16).
* Block tables live in SMEM: `S * P` int32 must fit (SMEM is small, on the order of 1 MiB), as
  for jax's own TPU paged-attention kernels.
* `kv_lens` above `P * bs` are clamped to the table's capacity.

Limits worth knowing
--------------------
* Checked so far only in the TPU interpreter and by lowering to Mosaic MLIR on the CPU (see
  tests/test_tpu_kernel.py); Mosaic's layout passes and the speed are unchecked on hardware.
* The ragged kernel does bq times the decode form's matmul and exp work on a block of decode
  tokens, and neither form splits one long sequence across programs (see `tpu_decode`,
  `tpu_ragged`).
"""

from pallas_kernels.tpu_decode import tpu_paged_attention_decode
from pallas_kernels.tpu_ragged import tpu_ragged_paged_attention

__all__ = ["tpu_paged_attention_decode", "tpu_ragged_paged_attention"]
