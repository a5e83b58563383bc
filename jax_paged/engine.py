"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduled step at a time.

The host loop of one `step()`::

    Scheduler.schedule()            which chunks of which sequences run (host arithmetic)
      |- all decoding, nothing to admit -> runner.decode_loop   (many tokens, one sync)
      '- otherwise                      -> runner.mixed_step    (prefill chunks + decodes)
    append sampled tokens, detokenise, stop strings, finish     (host)

The device state (KV pages, block manager, sampling history) stays on the device and is
donated to every compiled call. Slots of finished, aborted or preempted sequences are freed on
the device at the start of the next call (``free_mask``), before that call reserves blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import block_manager as bm
from jax_paged import kv_cache as kvc
from jax_paged import runner, sampling
from jax_paged.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    make_logprobs_dict,
)
from jax_paged.sampling_params import SamplingParams
from jax_paged.scheduler import Scheduler, Sequence, SequenceStatus, blocks_for

logger = logging.getLogger("jax_paged")

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
      attention_impl: "auto", "reference", "xla", "gpu" or "tpu"
        (`pallas_kernels.paged_attention`).
      attention_interpret: run the Pallas kernels in the interpreter (tests on the CPU).
      max_logprobs: the most log-probs a request may ask for per position.
      enable_prefix_caching: reuse the KV blocks of earlier prompts with the same prefix
        (full blocks keyed by their tokens and their parent's key, evicted least recently
        used first when the pool needs them).
      max_n: the most sequences one request may ask for (``SamplingParams.n``, and the beam
        width of `LLM.beam_search`); larger requests are rejected.
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
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    max_n: int = 256

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
        ):
            positive(name)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2 (block 0 is null)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.attention_impl not in ("auto", "reference", "xla", "gpu", "tpu"):
            raise ValueError(
                f"attention_impl={self.attention_impl!r} must be one of "
                "'auto', 'reference', 'xla', 'gpu', 'tpu'"
            )


# Smallest padded sizes of the compiled steps. Below them a step costs about the same (the
# weights are read once whatever the batch), so smaller buckets would only add variants.
_MIN_TOKENS = 32
_MIN_DECODE_ROWS = 8


def _pow2_at_least(x: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def _program_name(ckey: tuple) -> str:
    """A compiled variant's name for the metrics: its kind and bucket key, e.g. 'decode(8, 0)'."""
    return f"{ckey[0]}{ckey[1:]}" if len(ckey) > 1 else ckey[0]


def _param_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    texts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[list | None] = dataclasses.field(default_factory=list)
    cum_logprob: list[float] = dataclasses.field(default_factory=list)
    emitted_len: list[int] = dataclasses.field(default_factory=list)
    pending_forks: list[Sequence] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class LLMEngine:
    """Continuous-batching engine over a loaded model (`models.load`).

    Args:
      loaded: a `models.LoadedModel` (model, tokenizer or None, config, generation_config).
      config: `EngineConfig`.
    """

    def __init__(self, loaded, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = list(loaded.generation_config.eos_token_ids or [])
        if not self.eos_token_ids and self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.graphdef, self.params = nnx.split(loaded.model)
        self.dtype = loaded.model.dtype
        self.vocab_size = mc.vocab_size

        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(512, self.max_num_seqs)
        bs = config.block_size
        self.num_blocks = self._size_kv_pool()
        self.max_blocks_per_seq = blocks_for(self.max_model_len, bs)
        self.opts = runner.AttentionOptions(
            scale=mc.scale,
            sliding_window=mc.sliding_window,
            impl=config.attention_impl,
            interpret=config.attention_interpret,
        )
        self.state = self._fresh_state(track_tokens=False)
        self.scheduler = Scheduler(
            num_blocks=self.num_blocks - 1,
            block_size=bs,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        self.key = jax.random.key_data(jax.random.key(config.seed))
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._pending_free: list[int] = []
        self._cache_reqs: dict[int, list[int]] = {}  # slot -> tokens whose full blocks to cache
        # First blocks ever offered to the prefix cache: a prompt whose first block is not here
        # cannot hit, so its admission skips the device lookup (a superset: evictions are not
        # tracked, which only costs a lookup that finds nothing).
        self._cached_heads: set[tuple[int, ...]] = set()
        self._fork_pairs: list[tuple[int, int]] = []
        self._fork_waiting: dict[str, _Request] = {}
        self.caching = config.enable_prefix_caching
        self._compiled: dict[tuple, Any] = {}
        self._compile_seconds = 0.0
        self._compile_by_program: dict[str, float] = {}
        self._seconds_by_kind: dict[str, float] = {}  # time inside compiled calls, per kind
        self._start = time.perf_counter()
        self._stats = dict(
            num_requests=0,
            num_finished=0,
            num_aborted=0,
            num_rejected=0,
            num_failed=0,
            num_step_failures=0,
            prompt_tokens=0,
            generated_tokens=0,
            num_steps=0,
            num_device_calls=0,
            peak_kv_usage=0.0,
            device_seconds=0.0,
            compiled_seconds=0.0,
            decode_loop_tokens=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            logical_block_steps=0,
            physical_block_steps=0,
        )
        self._last_log = 0.0
        self._step_seqs: list[Sequence] | None = None  # the sequences of the step in flight

    def _fresh_state(self, track_tokens: bool) -> runner.DeviceState:
        """An empty device state: a zeroed KV pool, every block free, no prefix cache."""
        mc, bs = self.model_config, self.config.block_size
        kv = kvc.KVCache.create(
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            block_size=bs,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
        )
        # A direct-mapped prefix-cache table: a bucket collision costs a miss (and stops that
        # prompt's chain), so give it 16 buckets per block (4 bytes each) to keep that rare.
        blocks = bm.init_state(
            self.num_blocks,
            bs,
            self.max_num_seqs,
            self.max_blocks_per_seq,
            hash_table_size=16 * _pow2_at_least(self.num_blocks),
        )
        samp = sampling.init_state(self.max_num_seqs, self.vocab_size, track_tokens=track_tokens)
        return runner.DeviceState(kv=kv, blocks=blocks, sampling=samp)

    # -- sizing ----------------------------------------------------------------------------
    def _size_kv_pool(self) -> int:
        c, mc = self.config, self.model_config
        per_block = kvc.bytes_per_block(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, c.block_size, self.dtype
        )
        weights = _param_bytes(self.params)
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

    # -- requests --------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this model has no tokenizer; pass token ids as "
                    '{"prompt_token_ids": [...]}'
                )
            try:
                return prompt, self.tokenizer.encode(prompt)
            except Exception as e:  # e.g. a lone surrogate: TypeError from `tokenizers`
                raise ValueError(
                    f"prompt: the tokenizer cannot encode it ({type(e).__name__}: {e})"
                ) from e
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(
                    f"prompt: unknown keys {sorted(unknown)}; allowed: 'prompt', 'prompt_token_ids'"
                )
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list | tuple) or not all(
                    isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        raise ValueError(
            f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
    ) -> None:
        """Queues a request. Raises ValueError (naming the field) if it cannot be served; the
        engine and the other requests are unaffected (nothing of a rejected request is kept;
        ``num_rejected`` counts it)."""
        try:
            self._add_request(request_id, prompt, params)
        except Exception:
            self._stats["num_rejected"] += 1
            raise

    def count_rejected(self) -> None:
        """Counts a request rejected before it reached `add_request` (e.g. by its chat
        template) in ``num_rejected``."""
        self._stats["num_rejected"] += 1

    def _add_request(self, request_id, prompt, params) -> None:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.n > self.config.max_n:
            raise ValueError(
                f"n={params.n} is more than max_n={self.config.max_n} (an EngineConfig / LLM "
                "argument): ask for fewer sequences per request or raise max_n"
            )
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: {bad[:5]} out of range; ids must be in [0, {self.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; with max_model_len={self.max_model_len} it must be "
                f"at most {self.max_model_len - 1} so that one token can be generated"
            )
        if (params.stop or params.logprobs) and self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ValueError(f"{name}={v} must be <= max_logprobs={self.config.max_logprobs}")
        for t in params.stop_token_ids or []:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} must be in [0, {self.vocab_size})")
        # max_tokens=None: until max_model_len (vLLM's meaning).
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        longest = min(len(ids) + max_tokens, self.max_model_len)
        need = blocks_for(longest, self.config.block_size)
        if need > self.num_blocks - 1:
            raise ValueError(
                f"request needs up to {need} KV blocks ({longest} tokens) but the cache holds "
                f"{self.num_blocks - 1}: lower max_tokens or raise num_kv_blocks"
            )
        if params.uses_penalties and not self.state.sampling.tracks_tokens:
            try:
                self._start_tracking_tokens()
            except Exception as e:  # a device call: contain it as a failed step would be
                self._step_seqs = None
                self._recover(e)
                raise

        now = time.time()
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                prompt_token_ids=list(ids),
                max_tokens=max_tokens,
            )
            for _ in range(params.n)
        ]
        req = _Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(ids),
            params=params,
            seqs=seqs,
            metrics=RequestMetrics(arrival_time=now),
            prompt_logprobs=None,
            texts=[""] * params.n,
            logprobs=[[] if params.logprobs is not None else None for _ in seqs],
            cum_logprob=[0.0] * params.n,
            emitted_len=[0] * params.n,
        )
        for i, s in enumerate(seqs):
            s.params = params.child_params(i)
            s.request = req
            s.index = i
        # n > 1: the first sequence prefills the prompt but its last token; the others are then
        # forked from it, sharing its blocks (copy-on-write of the partial last block).
        if len(seqs) > 1 and len(ids) > 1:
            seqs[0].prefill_cap = len(ids) - 1
            req.pending_forks = seqs[1:]
            self._fork_waiting[request_id] = req
            self.scheduler.add(seqs[0])
        else:
            for s in seqs:
                self.scheduler.add(s)
        self.requests[request_id] = req
        self._stats["num_requests"] += 1
        self._stats["prompt_tokens"] += len(ids)

    def abort(self, request_id: str) -> bool:
        """Stops a request; its blocks return to the pool. False if it is unknown or done."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        self._fork_waiting.pop(req.request_id, None)
        for s in req.pending_forks:
            s.status = SequenceStatus.FINISHED
            s.finish_reason = "abort"
        req.pending_forks = []
        for s in req.seqs:
            if s.status is not SequenceStatus.FINISHED:
                self._finish_seq(s, "abort", None)
        self._stats["num_aborted"] += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason) -> None:
        if seq.slot is not None:
            self._pending_free.append(seq.slot)
            if self.caching and seq.num_computed >= self.config.block_size:
                self._cache_reqs[seq.slot] = seq.all_token_ids[: seq.num_computed]
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _start_tracking_tokens(self) -> None:
        """Switches the sampling history to per-slot token counts (penalties need them)."""
        s = self.state
        counts = sampling.init_state(self.max_num_seqs, self.vocab_size, track_tokens=True)
        counts = dataclasses.replace(counts, num_generated=s.sampling.num_generated)
        running = [q for q in self.scheduler.running if q.slot is not None]
        self.state = s.replace(sampling=counts)
        if running:
            self._init_rows(running, counts_only=True)

    # -- compiled calls --------------------------------------------------------------------
    def _call(self, kind: str, fn, key: tuple, args: tuple, static: dict):
        ckey = (kind,) + key
        compiled = self._compiled.get(ckey)
        if compiled is None:
            t0 = time.perf_counter()
            lowered = fn.lower(*args, **static)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            dt = time.perf_counter() - t0
            logger.debug("%s: traced in %.1fs, compiled in %.1fs", kind, t1 - t0, dt - (t1 - t0))
            self._compile_seconds += dt
            self._compiled[ckey] = compiled
            self._compile_by_program[_program_name(ckey)] = dt
            logger.info("compiled %s %s in %.1fs", kind, key, dt)
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        dt = time.perf_counter() - t0
        self._stats["compiled_seconds"] += dt
        self._seconds_by_kind[kind] = self._seconds_by_kind.get(kind, 0.0) + dt
        return out

    def _init_rows(self, seqs: list[Sequence], counts_only: bool = False) -> None:
        """Sets the sampling history of newly admitted sequences' slots."""
        m = _pow2_at_least(max(len(seqs), self.max_num_seqs))  # one shape: one compiled variant
        slots = np.full(m, -1, np.int32)
        for i, s in enumerate(seqs):
            slots[i] = s.slot
        if self.state.sampling.tracks_tokens:
            lp = _pow2_at_least(max(len(s.prompt_token_ids) for s in seqs), 16)
            lo = _pow2_at_least(max(len(s.output_token_ids) for s in seqs), 16)
            prompt = np.full((m, lp), -1, np.int32)
            out = np.full((m, lo), -1, np.int32)
            for i, s in enumerate(seqs):
                prompt[i, : len(s.prompt_token_ids)] = s.prompt_token_ids
                out[i, : len(s.output_token_ids)] = s.output_token_ids
            args = (self.state.sampling, slots, prompt, out)
            samp = self._call("set_rows", _set_rows_tracked, (m, lp, lo), args, {})
            self.state = self.state.replace(sampling=samp)
        else:
            n_out = np.zeros(m, np.int32)
            for i, s in enumerate(seqs):
                n_out[i] = len(s.output_token_ids)
            args = (self.state.sampling, slots, n_out)
            samp = self._call("set_rows", _set_rows_untracked, (m,), args, {})
            self.state = self.state.replace(sampling=samp)

    def _free_mask(self) -> np.ndarray:
        mask = np.zeros(self.max_num_seqs, bool)
        mask[self._pending_free] = True
        self._pending_free = []
        return mask

    def _tensors(self, seqs: list[Sequence | None], pad_to: int):
        params = [None if s is None else s.params for s in seqs]
        uids = [None if s is None else s.seq_id for s in seqs]
        return sampling.SamplingTensors.from_params(
            params,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            request_uids=uids,
            pad_to=pad_to,
            stop_width=_pow2_at_least(
                max((len(s.params.stop_token_ids or []) for s in seqs if s), default=0)
                + len(self.eos_token_ids),
                8,  # one bucket for every request with up to 8 stop ids (EOS included)
            ),
        )

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of the requests that progressed
        (``finished`` set on those that are done).

        If the step raises (an error inside a compiled call: out of memory, a runtime fault),
        the requests of that step finish with ``error`` set and come back in the returned
        outputs, the device state is rebuilt empty, and every other running sequence is
        preempted (it re-prefills later, its output unchanged): the engine keeps serving.
        """
        self._stats["num_steps"] += 1
        self._step_seqs = None
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - contained: see the docstring
            return self._recover(e)

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """Fails the requests of the step that raised, rebuilds the device state and puts every
        other running sequence back in the waiting queue (nothing of the old state is read)."""
        import traceback

        seqs = self._step_seqs or []
        failed = list({id(s.request): s.request for s in seqs}.values())
        logger.error(
            "engine step failed (%s: %s); failing %d requests, rebuilding the KV cache and "
            "re-prefilling %d running sequences",
            type(exc).__name__,
            exc,
            len(failed),
            sum(s.request not in failed for s in self.scheduler.running),
            exc_info=exc,
        )
        # The traceback's frames hold the old state's arrays: let them go before re-allocating.
        traceback.clear_frames(exc.__traceback__)
        self._stats["num_step_failures"] += 1
        msg = f"engine step failed: {type(exc).__name__}: {exc}"
        outs = []
        for req in failed:
            self._fork_waiting.pop(req.request_id, None)
            for s in req.seqs:
                if s.status is not SequenceStatus.FINISHED:
                    if s not in req.pending_forks:  # pending forks are not queued anywhere
                        self.scheduler.finish(s)
                    s.status = SequenceStatus.FINISHED
                    s.finish_reason = "abort"
            req.pending_forks = []
            req.error = msg
            req.metrics.finished_time = time.time()
            self.requests.pop(req.request_id, None)
            self._stats["num_failed"] += 1
            outs.append(self._make_output(req))
        for s in list(self.scheduler.running):
            self.scheduler.preempt(s)
        self.scheduler.drain_preempted_slots()
        self.scheduler.num_free_blocks = self.scheduler.num_blocks
        self._pending_free, self._cache_reqs, self._fork_pairs = [], {}, []
        self._cached_heads = set()
        track = bool(self.state is not None and self.state.sampling.tracks_tokens)
        self.state = None
        self.state = self._fresh_state(track_tokens=track)
        return outs

    def _step(self) -> list[RequestOutput]:
        self._fork_ready()
        self._maintain()
        sched = self.scheduler.schedule(match=self._match if self.caching else None)
        self._step_seqs = [c.seq for c in sched.chunks]
        self._pending_free += self.scheduler.drain_preempted_slots()
        for s in sched.preempted:
            s.request.metrics.num_preemptions += 1
            logger.warning(
                "preempted request %s (recompute); KV cache is full. %d preemptions so far",
                s.request_id,
                self.scheduler.num_preemptions,
            )
        if not sched.chunks:
            self._maintain()
            return []
        admitted = [s for s in self.scheduler.running if s.needs_row_init]
        now = time.time()
        for c in sched.chunks:
            if c.seq.request.metrics.first_scheduled_time is None:
                c.seq.request.metrics.first_scheduled_time = now
        if admitted:
            self._init_rows(admitted)
            for s in admitted:
                s.needs_row_init = False

        t0 = time.perf_counter()
        progressed: dict[str, _Request] = {}
        if (
            sched.all_decode
            and self.config.max_decode_steps > 1
            and not self.scheduler.waiting
            and not any(c.seq.params.prompt_logprobs is not None for c in sched.chunks)
        ):
            self._run_decode_loop(sched, progressed)
        else:
            self._run_mixed(sched, progressed)
        self._stats["device_seconds"] += time.perf_counter() - t0
        self._stats["num_device_calls"] += 1
        used = 1.0 - self.scheduler.num_free_blocks / max(1, self.scheduler.num_blocks)
        self._stats["peak_kv_usage"] = max(self._stats["peak_kv_usage"], used)

        self._maybe_log()
        outs = []
        for req in progressed.values():
            outs.append(self._make_output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
                self._stats["num_finished"] += 1
        if not self.scheduler.has_unfinished():
            self._maintain()
        return outs

    # -- sharing -----------------------------------------------------------------------------
    def _fork_ready(self) -> None:
        """Forks the siblings of n > 1 leaders that have prefilled all but the last prompt
        token. Siblings that find no free slot prefill on their own later (their prompt's full
        blocks are then found in the prefix cache)."""
        for rid, req in list(self._fork_waiting.items()):
            leader = req.seqs[0]
            if leader.status is not SequenceStatus.RUNNING:
                continue
            if leader.num_computed < leader.prefill_cap:
                continue
            for child in req.pending_forks:
                if self.scheduler.fork(leader, child):
                    self._fork_pairs.append((leader.slot, child.slot))
                else:
                    self.scheduler.add(child)
            req.pending_forks = []
            leader.prefill_cap = None
            del self._fork_waiting[rid]

    def _maintain(self) -> None:
        """One device call for the work queued between steps: cache full blocks, free slots,
        fork; then the host's free-block count is the device's."""
        if not (self._cache_reqs or self._pending_free or self._fork_pairs):
            return
        s = self.max_num_seqs
        k = self.max_blocks_per_seq * self.config.block_size
        cache_slots = np.full(s, -1, np.int32)
        cache_tokens = np.zeros((s, k), np.int32)
        cache_len = np.zeros(s, np.int32)
        bs = self.config.block_size
        for i, (slot, toks) in enumerate(self._cache_reqs.items()):
            self._cached_heads.add(tuple(toks[:bs]))
            cache_slots[i] = slot
            cache_tokens[i, : len(toks)] = toks
            cache_len[i] = len(toks)
        parent = np.full(s, -1, np.int32)
        child = np.full(s, -1, np.int32)
        for i, (p, c) in enumerate(self._fork_pairs):
            parent[i], child[i] = p, c
        self._cache_reqs, self._fork_pairs = {}, []
        args = (self.state, cache_slots, cache_tokens, cache_len, self._free_mask(), parent, child)
        self.state, num_free = self._call("maintain", runner.maintain, (), args, {})
        self.scheduler.num_free_blocks = int(num_free)

    def _match(self, seq: Sequence) -> tuple[int, int]:
        """Prefix-cache lookup for a sequence being admitted into ``seq.slot``."""
        if seq.params.prompt_logprobs is not None:
            # Cached positions have no logits: compute the whole prompt (vLLM does the same).
            return 0, self.scheduler.num_free_blocks
        toks = seq.all_token_ids
        bs = self.config.block_size
        if len(toks) <= bs or tuple(toks[:bs]) not in self._cached_heads:
            if seq.num_preemptions == 0:
                self._stats["prefix_cache_queries"] += len(seq.prompt_token_ids)
            return 0, self.scheduler.num_free_blocks
        k = self.max_blocks_per_seq * self.config.block_size
        tokens = np.zeros((1, k), np.int32)
        tokens[0, : len(toks)] = toks
        args = (
            self.state,
            np.array([seq.slot], np.int32),
            tokens,
            np.array([len(toks)], np.int32),
        )
        self.state, cached, num_free = self._call("match", runner.match_prefix, (), args, {})
        cached = int(cached[0])
        if seq.num_preemptions == 0:
            self._stats["prefix_cache_queries"] += len(seq.prompt_token_ids)
            self._stats["prefix_cache_hits"] += cached
        return cached, int(num_free)

    def _run_mixed(self, sched, progressed) -> None:
        chunks = sched.chunks
        t = _pow2_at_least(sched.num_tokens, _MIN_TOKENS)
        t = min(t, _pow2_at_least(self.max_num_batched_tokens, _MIN_TOKENS))
        # Rows follow tokens (each row has >= 1 token), so one bucket axis: t in 32, 64, ...,
        # max_num_batched_tokens, b = min(t, max_num_seqs) rows (the LM head runs on b rows).
        b = min(t, _pow2_at_least(self.max_num_seqs, 4))
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        token_row = np.full(t, -1, np.int32)
        next_tokens = np.full(t, -1, np.int32)
        cu = np.zeros(b + 1, np.int32)
        row_slot = np.full(b, -1, np.int32)
        last_idx = np.zeros(b, np.int32)
        samples = np.zeros(b, bool)
        num_new = np.zeros(self.max_num_seqs, np.int32)
        want_plp = False
        off = 0
        for r, c in enumerate(chunks):
            s = c.seq
            all_ids = s.all_token_ids
            tokens[off : off + c.length] = all_ids[c.start : c.start + c.length]
            positions[off : off + c.length] = np.arange(c.start, c.start + c.length)
            token_row[off : off + c.length] = r
            if s.params.prompt_logprobs is not None and s.request.prompt_logprobs is None:
                want_plp = True
                nxt = all_ids[c.start + 1 : c.start + c.length + 1]
                next_tokens[off : off + len(nxt)] = nxt
            off += c.length
            cu[r + 1] = off
            row_slot[r] = s.slot
            last_idx[r] = off - 1
            samples[r] = c.samples
            num_new[s.slot] = c.length
        cu[len(chunks) + 1 :] = off
        batch = runner.MixedBatch(
            tokens=tokens,
            positions=positions,
            token_row=token_row,
            cu_q_lens=cu,
            num_rows=np.int32(len(chunks)),
            row_slot=row_slot,
            last_idx=last_idx,
            samples=samples,
            num_new=num_new,
            free_mask=self._free_mask(),
            next_tokens=next_tokens,
        )
        seqs = [c.seq for c in chunks] + [None] * (b - len(chunks))
        tensors = self._tensors(seqs, b)
        ntop = self._num_top
        plp_k = self.config.max_logprobs if want_plp else -1  # one variant, sliced on the host
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            num_top_logprobs=ntop,
            prompt_logprobs_k=plp_k,
        )
        key = (t, b, ntop, plp_k, self._track_key(), tensors.stop_token_ids.shape[1])
        args = (self.params, self.state, batch, tensors, self.key)
        self.state, out = self._call("mixed", runner.mixed_step, key, args, static)
        out = jax.device_get(out)
        self.scheduler.num_free_blocks = int(out.num_free)
        bs = self.config.block_size
        done = {id(c.seq): c.start + c.length for r, c in enumerate(chunks) if out.ok[r]}
        self._account_sharing([done.get(id(q), q.num_computed) for q in self.scheduler.running])
        off = 0
        for r, c in enumerate(chunks):
            s = c.seq
            if not out.ok[r]:
                # The pool could not hold it after all (blocks shared with others freed fewer
                # than estimated): nothing ran for it; recompute it later.
                self.scheduler.preempt(s)
                self._pending_free += self.scheduler.drain_preempted_slots()
                off += c.length
                continue
            if want_plp and s.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(s, c, out.prompt_lp, off)
            off += c.length
            s.num_computed += c.length
            if self.caching and s.num_computed // bs > c.start // bs:
                self._cache_reqs[s.slot] = s.all_token_ids[: s.num_computed]
            if c.samples:
                self._append(
                    s,
                    [int(out.tokens[r])],
                    [float(out.logprobs[r])],
                    [int(out.ranks[r])],
                    [out.top_ids[r]],
                    [out.top_logprobs[r]],
                )
                progressed[s.request_id] = s.request

    def _run_decode_loop(self, sched, progressed) -> None:
        seqs = [c.seq for c in sched.chunks]
        b = min(_pow2_at_least(len(seqs), _MIN_DECODE_ROWS), _pow2_at_least(self.max_num_seqs))
        remaining = max(
            min(s.max_tokens - len(s.output_token_ids), self.max_model_len - s.num_tokens)
            for s in seqs
        )
        k = self.scheduler.decode_horizon(seqs, min(self.config.max_decode_steps, remaining))
        last = np.zeros(b, np.int32)
        row_slot = np.full(b, -1, np.int32)
        active = np.zeros(b, bool)
        max_len = np.zeros(b, np.int32)
        for r, s in enumerate(seqs):
            last[r] = s.output_token_ids[-1]
            row_slot[r] = s.slot
            active[r] = True
            max_len[r] = self.max_model_len
        if self._pending_free:
            self._maintain()
        tensors = self._tensors(seqs + [None] * (b - len(seqs)), b)
        ntop = self._num_top
        max_steps = self.config.max_decode_steps
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            max_steps=max_steps,
            num_top_logprobs=ntop,
        )
        key = (b, ntop, self._track_key(), tensors.stop_token_ids.shape[1])
        args = (
            self.params,
            self.state,
            last,
            row_slot,
            active,
            max_len,
            tensors,
            self.key,
            np.int32(k),
        )
        self.state, out = self._call("decode", runner.decode_loop, key, args, static)
        out = jax.device_get(out)
        self.scheduler.num_free_blocks = int(out.num_free)
        n = int(out.num_steps)
        self._stats["decode_loop_tokens"] += int(np.sum(out.tokens[:n] >= 0))
        self._account_sharing(
            [q.num_computed + int(np.sum(out.tokens[:n, r] >= 0)) for r, q in enumerate(seqs)]
        )
        for r, s in enumerate(seqs):
            toks = out.tokens[:n, r]
            m = int(np.sum(toks >= 0))
            # The device reserved exactly the m tokens it computed: bring the host mirror in line
            # (the scheduler had granted one step) before finishing can release the blocks.
            s.num_computed += m
            # The device count above already includes these blocks: only the table size moves.
            s.num_blocks = blocks_for(s.num_computed, self.config.block_size)
            self._append(
                s,
                [int(x) for x in toks[:m]],
                out.logprobs[:m, r].tolist(),
                out.ranks[:m, r].tolist(),
                list(out.top_ids[:m, r]),
                list(out.top_logprobs[:m, r]),
            )
            progressed[s.request_id] = s.request

    def _account_sharing(self, lengths: list[int]) -> None:
        """Adds one step's block-table entries (logical blocks: what the running sequences
        would hold without sharing) and physical blocks in use (cached-but-free excluded)."""
        bs = self.config.block_size
        self._stats["logical_block_steps"] += sum(blocks_for(n, bs) for n in lengths)
        self._stats["physical_block_steps"] += (
            self.scheduler.num_blocks - self.scheduler.num_free_blocks
        )

    def _track_key(self) -> bool:
        return self.state.sampling.tracks_tokens

    @property
    def _num_top(self) -> int:
        """Top log-probs every program returns per row: always max_logprobs, so requests with
        and without logprobs share one compiled variant. The device computes them only when a
        row asks (a runtime `lax.cond` on ``SamplingTensors.num_logprobs``); the host keeps
        each request's own count."""
        return self.config.max_logprobs

    # -- host bookkeeping ------------------------------------------------------------------
    def _decode_token(self, t: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([t])

    def _record_prompt_logprobs(self, s: Sequence, c, plp, off: int) -> None:
        req = s.request
        if s.index != 0:
            return
        acc = getattr(s, "_plp", None)
        if acc is None or c.start == 0:
            acc = [None]
        lps, ranks, top_ids, top_lps = plp
        k = s.params.prompt_logprobs
        n_prompt = len(s.prompt_token_ids)
        for j in range(c.length):
            pos = c.start + j
            if pos + 1 >= n_prompt:
                break
            nxt = s.prompt_token_ids[pos + 1]
            i = off + j
            acc.append(
                make_logprobs_dict(
                    nxt, lps[i], ranks[i], top_ids[i], top_lps[i], k, self._decode_token
                )
            )
        s._plp = acc
        if len(acc) == n_prompt:
            req.prompt_logprobs = acc

    def _append(self, s, tokens, lps, ranks, top_ids, top_lps) -> None:
        req: _Request = s.request
        p = s.params
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        stop_ids = set(p.stop_token_ids or [])
        eos = set() if p.ignore_eos else set(self.eos_token_ids)
        for j, t in enumerate(tokens):
            s.output_token_ids.append(t)
            self._stats["generated_tokens"] += 1
            req.cum_logprob[s.index] += lps[j]
            if p.logprobs is not None:
                req.logprobs[s.index].append(
                    make_logprobs_dict(
                        t,
                        lps[j],
                        ranks[j],
                        top_ids[j],
                        top_lps[j],
                        p.logprobs,
                        self._decode_token,
                    )
                )
            n_out = len(s.output_token_ids)
            reason = None
            if n_out >= p.min_tokens and t in stop_ids:
                reason = ("stop", t)
            elif n_out >= p.min_tokens and t in eos:
                reason = ("stop", None)
            elif n_out >= s.max_tokens or s.num_tokens >= self.max_model_len:
                reason = ("length", None)
            if p.stop and self.tokenizer is not None:
                hit = self._check_stop_strings(s)
                if hit is not None:
                    reason = ("stop", hit)
            if reason is not None:
                # Drop anything the device generated past the stop.
                del s.output_token_ids[n_out:]
                if s.num_computed > s.num_tokens:
                    s.num_computed = s.num_tokens
                self._finish_seq(s, *reason)
                req.metrics.finished_time = now
                break
        self._update_text(s)

    def _check_stop_strings(self, s) -> str | None:
        text = self.tokenizer.decode(
            s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
        )
        best = None
        for st in s.params.stop:
            i = text.find(st)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, st)
        if best is None:
            return None
        s._stop_at = best[0] + (len(best[1]) if s.params.include_stop_str_in_output else 0)
        return best[1]

    def _update_text(self, s) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(
            s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
        )
        stop_at = getattr(s, "_stop_at", None)
        if stop_at is not None:
            text = text[:stop_at]
        s.request.texts[s.index] = text

    def _make_output(self, req: _Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            lp = req.logprobs[s.index]
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=req.texts[s.index],
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=req.cum_logprob[s.index],
                    logprobs=None if lp is None else list(lp),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            metrics=req.metrics,
            error=req.error,
        )

    # -- metrics ---------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """Counters and gauges of the engine (a plain dict)."""
        elapsed = time.perf_counter() - self._start
        used = self.scheduler.num_blocks - self.scheduler.num_free_blocks
        m = dict(self._stats)
        m.update(
            kv_usage=used / max(1, self.scheduler.num_blocks),
            num_kv_blocks=self.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            compiled_variants=len(self._compiled),
            compile_seconds=self._compile_seconds,
            compile_seconds_by_program=dict(self._compile_by_program),
            compiled_seconds_by_kind=dict(self._seconds_by_kind),
            elapsed_seconds=elapsed,
            generation_tokens_per_s=self._stats["generated_tokens"] / max(elapsed, 1e-9),
            prefix_cache_hit_rate=self._stats["prefix_cache_hits"]
            / max(1, self._stats["prefix_cache_queries"]),
            # Share of KV blocks that sharing saved, averaged over steps: 1 - physical / logical
            # (evictable cached blocks do not count as used).
            kv_sharing_saving=1.0
            - self._stats["physical_block_steps"] / max(1, self._stats["logical_block_steps"]),
        )
        return m

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < 5.0:
            return
        self._last_log = now
        m = self.get_metrics()
        logger.info(
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, generation "
            "throughput: %.1f tokens/s, prefix cache hit rate: %.1f%%, preemptions: %d, "
            "compiled variants: %d",
            m["num_running"],
            m["num_waiting"],
            100 * m["kv_usage"],
            m["generation_tokens_per_s"],
            100 * m["prefix_cache_hit_rate"],
            m["num_preemptions"],
            m["compiled_variants"],
        )


# These take the sampling state alone, donated: handing them the whole device state would copy
# the KV pool on every admission (a jitted function's outputs cannot alias undonated inputs).
@functools.partial(jax.jit, donate_argnums=0)
def _set_rows_untracked(s: sampling.SamplingState, slots, n_out):
    b = s.num_generated.shape[0]
    idx = jnp.where((slots >= 0) & (slots < b), slots, b)
    ng = s.num_generated.at[idx].set(n_out, mode="drop")
    return dataclasses.replace(s, num_generated=ng)


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows_tracked(s: sampling.SamplingState, slots, prompt, out):
    return sampling.set_rows(s, slots, prompt, out)


__all__ = ["EngineConfig", "LLMEngine", "Seq"]
