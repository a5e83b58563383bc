"""The server's Prometheus metrics, under the names vLLM's server exports (``vllm:*``), each
with a ``model_name`` label, so dashboards built for vLLM read them unchanged.

Gauges and counters come from the engine's own counters (`LLMEngine.get_metrics`, a snapshot
taken by the engine thread after every step, so a scrape never touches the engine); the latency
histograms are observed as outputs leave the engine thread (`AsyncLLM`):

- ``vllm:time_to_first_token_seconds``: arrival to the first sampled token.
- ``vllm:inter_token_latency_seconds``: time between a request's consecutive outputs divided
  over the tokens that output brought (a multi-step decode call delivers several at once).
- ``vllm:e2e_request_latency_seconds``: arrival to finish.
- ``vllm:request_queue_time_seconds``: arrival to the first scheduled step.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; vLLM's buckets for these histograms.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

# Counters: Prometheus name (without _total) -> (engine metric, help).
_COUNTERS = {
    "vllm:prompt_tokens": ("prompt_tokens", "Prompt tokens of accepted requests."),
    "vllm:generation_tokens": ("generated_tokens", "Generated tokens."),
    "vllm:prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "vllm:num_preemptions": ("num_preemptions", "Sequences preempted (recomputed later)."),
    "jax_paged:requests_aborted": ("num_aborted", "Requests aborted (e.g. a client went away)."),
    "jax_paged:requests_rejected": ("num_rejected", "Requests rejected at admission."),
    "jax_paged:requests_failed": ("num_failed", "Requests failed by an engine step that raised."),
    "jax_paged:engine_steps": ("num_steps", "Engine steps run."),
}


class ServerMetrics:
    """One server's metrics in their own registry (``registry``; several servers may live in
    one process, e.g. in tests)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine: dict[str, Any] = {}
        labels = ["model_name"]

        def hist(name, doc, buckets):
            h = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time from arrival to first step.", _E2E_BUCKETS
        )
        self.prompt_len = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.gen_len = hist(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            _TOKEN_BUCKETS,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    def on_step(self, progressed, now: float) -> None:
        """Observes one step's outputs: ``[(RequestOutput, new tokens, previous output time or
        None), ...]`` at time ``now`` (seconds since the epoch)."""
        for out, new, prev in progressed:
            m = out.metrics
            if prev is None and new > 0 and m is not None and m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            elif prev is not None and new > 0:
                gap = (now - prev) / new
                for _ in range(new):
                    self.itl.observe(gap)
            if out.finished:
                if m is not None:
                    end = m.finished_time or now
                    self.e2e.observe(max(0.0, end - m.arrival_time))
                self.prompt_len.observe(len(out.prompt_token_ids))
                self.gen_len.observe(sum(len(c.token_ids) for c in out.outputs))
                reason = "error" if out.error else (out.outputs[0].finish_reason or "abort")
                self.success.labels(self.model_name, reason).inc()

    def on_engine(self, engine_metrics: dict[str, Any]) -> None:
        """Keeps the engine's latest `get_metrics()` for the next scrape."""
        self.engine = engine_metrics


class _EngineCollector:
    """Gauges and counters read from the engine's latest metrics at scrape time."""

    def __init__(self, owner: ServerMetrics):
        self.owner = owner

    def collect(self):
        m, name = self.owner.engine, self.owner.model_name
        gauges = (
            ("vllm:num_requests_running", "num_running", "Sequences running."),
            ("vllm:num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
            (
                "vllm:kv_cache_usage_perc",
                "kv_usage",
                "KV-cache usage: 1 = full (evictable cached blocks count as free).",
            ),
        )
        for prom, key, doc in gauges:
            g = GaugeMetricFamily(prom, doc, labels=["model_name"])
            g.add_metric([name], float(m.get(key, 0)))
            yield g
        for prom, (key, doc) in _COUNTERS.items():
            c = CounterMetricFamily(prom, doc, labels=["model_name"])
            c.add_metric([name], float(m.get(key, 0)))
            yield c
