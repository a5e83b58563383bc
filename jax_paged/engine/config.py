"""Engine settings (`EngineConfig`) and the KV pool's size on each kind of device."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jax_paged.memory import kv_cache as kvc
from pallas_kernels import IMPLS

_DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine settings (vLLM's names where vLLM has one).

    Attributes:
      block_size: tokens per KV block.
      num_kv_blocks: KV pool size in blocks (null block included). Or give
        ``kv_cache_memory_bytes``, or on GPU/TPU ``gpu_memory_utilization`` (the fraction of
        device memory that weights plus cache may use). Default on the CPU: 1 GiB of KV.
      max_model_len: longest sequence (prompt + output); default the model's context length.
      max_num_seqs: most sequences running at once.
      max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
      max_decode_steps: decode steps run on the device per call when the batch is all decode
        (1 = a host round trip per token).
      seed: engine seed for requests without their own.
      attention_impl: "auto", "reference", "xla", "cpu", "gpu" (Pallas Triton), "mosaic_gpu"
        (Pallas Mosaic GPU, Hopper and newer) or "tpu" (`pallas_kernels.paged_attention`).
      attention_interpret: run the Pallas kernels in the interpreter (tests on the CPU).
      kv_cache_dtype: "auto" (the model's dtype), "float32", "bfloat16" or "float16": the
        dtype of the KV pages (vLLM's option). A 16-bit cache holds twice the tokens in the
        same bytes and halves what attention reads; K/V are rounded to it when written and
        attention computes in float32 either way.
      max_logprobs: the most log-probs a request may ask for per position.
      enable_prefix_caching: reuse the KV blocks of earlier prompts with the same prefix
        (full blocks keyed by their tokens and their parent's key, evicted least recently
        used first when the pool needs them).
      max_n: the most sequences one request may ask for (``SamplingParams.n``, and the beam
        width of `LLM.beam_search`); larger requests are rejected.
      tensor_parallel_size: devices the model and its KV cache are split over
        (`jax_paged.parallel.sharding`: attention heads, MLP width and KV heads); the pool sizes
        (``kv_cache_memory_bytes``, ``gpu_memory_utilization``) are then per device.
      data_parallel_size: independent engine replicas, each on its own
        ``tensor_parallel_size`` devices, requests spread over them
        (`jax_paged.parallel.data_parallel.DataParallelEngine`); ``LLM`` builds them.
      async_scheduling: overlap the host with the device (vLLM's option): a step waits for
        the call in flight, applies its tokens, schedules and launches the next call, and
        only then detokenises and builds the outputs of the step that ended, while the device
        runs; `LLMEngine.step` returns while that call is in flight. Off: each step waits for
        its own call (outputs of a step come back from that step).
      precompile: compile every program variant a step can pick when the engine starts
        (`ModelRunner.compile_all`; SmolLM2 on a CPU: about 20 s on two cores) instead of on
        first use, so no request waits for a compile (`jax-paged serve` sets it).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_decode_steps: int = 32
    seed: int = 0
    attention_impl: str = "auto"
    attention_interpret: bool = False
    kv_cache_dtype: str = "auto"
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    max_n: int = 256
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    async_scheduling: bool = False
    precompile: bool = False

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive integer")

        for name in (
            "block_size",
            "num_kv_blocks",
            "kv_cache_memory_bytes",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_decode_steps",
            "max_n",
            "tensor_parallel_size",
            "data_parallel_size",
        ):
            positive(name)
        for name in ("async_scheduling", "precompile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2 (block 0 is null)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                + ", ".join(repr(d) for d in KV_CACHE_DTYPES)
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl={self.attention_impl!r} must be one of "
                + ", ".join(repr(i) for i in ATTENTION_IMPLS)
            )


def _param_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_IMPLS = IMPLS  # `pallas_kernels.paged_attention`'s impl names


def kv_dtype(c: EngineConfig, model_dtype):
    """The KV pages' dtype: ``c.kv_cache_dtype``, or the model's for "auto"."""
    return model_dtype if c.kv_cache_dtype == "auto" else jnp.dtype(c.kv_cache_dtype)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def size_kv_pool(c: EngineConfig, mc, dtype, params) -> int:
    """KV pool size in blocks (null block included) from the config, or the device's memory;
    MemoryError when the weights and that pool do not fit. With tensor parallelism every
    figure is one device's: its KV heads' share of a block, about its share of the weights."""
    tp = c.tensor_parallel_size
    per_block = kvc.bytes_per_block(
        mc.num_layers, mc.num_kv_heads // tp, mc.head_dim, c.block_size, dtype
    )
    weights = _param_bytes(params) // tp
    device = jax.devices()[0]
    if c.num_kv_blocks is not None:
        n = c.num_kv_blocks
    elif c.kv_cache_memory_bytes is not None:
        n = c.kv_cache_memory_bytes // per_block
    elif device.platform in ("gpu", "cuda", "tpu"):
        stats = device.memory_stats() or {}
        total = stats.get("bytes_limit", 0)
        n = int(total * c.gpu_memory_utilization - weights - (1 << 30)) // per_block
    else:
        n = _DEFAULT_CPU_KV_BYTES // per_block
    kv_bytes = n * per_block
    if device.platform == "cpu":
        available = _host_memory_bytes()
    else:
        available = (device.memory_stats() or {}).get("bytes_limit", 0)
    if n < 2 or (available and weights + kv_bytes > available):
        raise MemoryError(
            f"the model's weights need {weights / 2**30:.2f} GiB and a KV cache of {n} "
            f"blocks ({per_block} bytes each, block_size={c.block_size}) needs "
            f"{kv_bytes / 2**30:.2f} GiB, but the device has {available / 2**30:.2f} GiB; "
            "lower num_kv_blocks / kv_cache_memory_bytes / gpu_memory_utilization, or "
            "use a smaller dtype"
        )
    return n
