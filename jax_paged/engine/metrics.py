"""The engine's counters and the `get_metrics()` dict built from them, and its periodic log
line (vLLM's "Running: ... reqs, KV cache usage ..." shape)."""

from __future__ import annotations

import logging
import time
from typing import Any

from jax_paged.engine.sequence import blocks_for

logger = logging.getLogger("jax_paged")

COUNTERS = (
    "num_requests",  # accepted by add_request
    "num_finished",
    "num_aborted",
    "num_rejected",  # refused at admission (a bad prompt or parameter)
    "num_failed",  # failed by an engine step that raised
    "num_step_failures",
    "prompt_tokens",
    "generated_tokens",
    "num_steps",
    "decode_loop_tokens",  # generated inside multi-step decode calls
    "prefix_cache_queries",  # prompt tokens looked up (first admission of each sequence)
    "prefix_cache_hits",  # of which found in the cache
    "logical_block_steps",  # block-table entries of running sequences, summed over steps
    "physical_block_steps",  # blocks in use, summed over steps
)


class EngineMetrics:
    """Counters (`COUNTERS`), the KV usage peak and the log throttle of one engine."""

    def __init__(self):
        self.counts: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        self.peak_kv_usage = 0.0
        self.device_seconds = 0.0  # wall time of the step calls, host glue included
        self.step_seconds = 0.0  # wall time inside `LLMEngine.step`
        self.start = time.perf_counter()
        self._last_log = 0.0

    def add(self, name: str, n=1) -> None:
        self.counts[name] += n

    def on_step(self, plan, result, scheduler, caching: bool) -> None:
        """A step's accounting (`on_schedule`, `after_step`, decode-loop tokens)."""
        self.on_schedule(plan, scheduler, caching)
        self.after_step([q.num_computed for q in scheduler.running], scheduler)
        if plan.decode_steps:
            self.counts["decode_loop_tokens"] += int(result.made.sum())

    def on_schedule(self, sched, scheduler, caching: bool) -> None:
        """Stamps first scheduling times, counts a step's prefix-cache lookups (first
        admissions only) and logs preemptions."""
        now = time.time()
        for c in sched.chunks:
            if c.seq.request.metrics.first_scheduled_time is None:
                c.seq.request.metrics.first_scheduled_time = now
        for q in sched.admitted if caching else ():
            if q.num_preemptions == 0 and q.params.prompt_logprobs is None:
                self.counts["prefix_cache_queries"] += len(q.prompt_token_ids)
                self.counts["prefix_cache_hits"] += q.num_cached_tokens
        for s in sched.preempted:
            s.request.metrics.num_preemptions += 1
            logger.warning(
                "preempted request %s (recompute); KV cache is full. %d preemptions so far",
                s.request_id,
                scheduler.num_preemptions,
            )

    def after_step(self, lengths: list[int], scheduler) -> None:
        """One step's KV accounting: usage peak, and block-table entries (logical blocks: what
        the running sequences of ``lengths`` tokens would hold without sharing) against
        physical blocks in use (cached-but-free excluded), as the scheduler last heard."""
        num_blocks = scheduler.num_blocks
        used = num_blocks - scheduler.num_available_blocks
        self.peak_kv_usage = max(self.peak_kv_usage, used / max(1, num_blocks))
        bs = scheduler.block_size
        self.counts["logical_block_steps"] += sum(blocks_for(n, bs) for n in lengths)
        self.counts["physical_block_steps"] += used

    def build(self, *, scheduler, runner, output, num_kv_blocks: int) -> dict[str, Any]:
        """The `LLMEngine.get_metrics` dict."""
        c = self.counts
        elapsed = time.perf_counter() - self.start
        used = scheduler.num_blocks - scheduler.num_available_blocks
        m = dict(c)
        m.update(
            num_device_calls=runner.num_calls,
            device_calls_per_step=runner.num_calls / max(1, c["num_steps"]),
            host_to_device_bytes=runner.host_to_device_bytes,
            host_to_device_bytes_per_step=runner.host_to_device_bytes / max(1, c["num_steps"]),
            device_seconds=self.device_seconds,
            compiled_seconds=runner.call_seconds,
            step_seconds=self.step_seconds,
            # Share of the time the engine had work that no compiled call was in flight: the
            # device waiting for the host (scheduling, inputs, detokenising, the caller).
            device_idle_share=runner.idle_seconds
            / max(1e-9, runner.idle_seconds + runner.call_seconds),
            # Waits that found their call done already: the host, not the device, was late.
            host_late_share=runner.num_found_done / max(1, runner.num_calls),
            peak_kv_usage=self.peak_kv_usage,
            kv_usage=used / max(1, scheduler.num_blocks),
            num_kv_blocks=num_kv_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            compiled_variants=len(runner.compiled),
            compile_seconds=runner.compile_seconds,
            compile_seconds_by_program=dict(runner.compile_by_program),
            compiled_seconds_by_kind=dict(runner.seconds_by_kind),
            detokenized_chars=output.chars_decoded,
            elapsed_seconds=elapsed,
            generation_tokens_per_s=c["generated_tokens"] / max(elapsed, 1e-9),
            prefix_cache_hit_rate=c["prefix_cache_hits"] / max(1, c["prefix_cache_queries"]),
            # Share of KV blocks that sharing saved, averaged over steps: 1 - physical / logical
            # (evictable cached blocks do not count as used).
            kv_sharing_saving=1.0 - c["physical_block_steps"] / max(1, c["logical_block_steps"]),
            # Tensor parallelism: each device holds its KV heads' pages.
            tensor_parallel_size=1 if runner.mesh is None else runner.mesh.size,
            kv_cache_bytes_per_device=runner.kv_bytes_per_device(),
        )
        return m

    def maybe_log(self, build) -> None:
        """Logs the engine's state every 5 s; ``build()`` gives the metrics dict."""
        now = time.perf_counter()
        if now - self._last_log < 5.0:
            return
        self._last_log = now
        m = build()
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
