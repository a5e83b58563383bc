"""Data-parallel replicas: M independent engines, each on its own devices, one request queue.

    LLM(model, data_parallel_size=2, tensor_parallel_size=2)   # 4 devices: 2 replicas x tp 2

Replica i runs on ``jax.devices()[i * tp:(i + 1) * tp]`` with its own KV cache, block manager,
prefix cache and scheduler. A new request goes to the replica with the fewest unfinished
requests; `step` steps every busy replica at once, each in its own thread (a compiled call
releases the GIL, so the replicas' devices work in parallel), and returns all their outputs.

Why replicas rather than one engine whose batch is sharded over a ``data`` mesh axis: the block
manager, prefix cache and scheduler stay local to a replica, so nothing crosses between
replicas (no collective per step, no global block table), a replica's failure is contained by
its own engine, and each replica is exactly the tested single engine. The cost: prefix-cache
hits and n > 1 / beam sharing only within a replica.

`DataParallelEngine` has `LLMEngine`'s interface (add_request, step, abort,
has_unfinished_requests, get_metrics, ...), so `LLM`, beam search and `scripts/generate.py`
use it unchanged.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax

from jax_paged.engine.config import EngineConfig
from jax_paged.engine.llm_engine import LLMEngine
from jax_paged.entrypoints.outputs import RequestOutput

# Gauges averaged over the replicas; other numbers are summed (counts, tokens, seconds).
_MEAN_KEYS = ("usage", "rate", "saving", "share", "per_step")


class DataParallelEngine:
    """``config.data_parallel_size`` `LLMEngine` replicas (see the module docstring)."""

    def __init__(self, loaded, config: EngineConfig, devices=None):
        m, tp = config.data_parallel_size, config.tensor_parallel_size
        devices = list(jax.devices() if devices is None else devices)
        if m * tp > len(devices):
            raise ValueError(
                f"data_parallel_size={m} x tensor_parallel_size={tp} needs {m * tp} devices; "
                f"there are {len(devices)}"
            )
        one = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [
            LLMEngine(loaded, one, devices=devices[i * tp : (i + 1) * tp]) for i in range(m)
        ]
        self.config = config
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len = first.max_model_len
        self.num_blocks = first.num_blocks
        self._owner: dict[str, LLMEngine] = {}
        self._pool = ThreadPoolExecutor(max_workers=m, thread_name_prefix="jax-paged-replica")

    def add_request(self, request_id: str, prompt, params=None) -> None:
        """Queues a request on the least busy replica (ValueError as `LLMEngine` raises it)."""
        rid = str(request_id)
        if rid in self._owner:
            raise ValueError(f"request_id {rid!r} is already in use")
        engine = min(self.replicas, key=lambda e: len(e.requests))
        engine.add_request(rid, prompt, params)
        self._owner[rid] = engine

    def count_rejected(self) -> None:
        self.replicas[0].count_rejected()

    def abort(self, request_id: str) -> bool:
        engine = self._owner.pop(str(request_id), None)
        return engine is not None and engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def has_request(self, request_id: str) -> bool:
        engine = self._owner.get(str(request_id))
        return engine is not None and engine.has_request(request_id)

    def step(self, *, max_decode_steps: int | None = None) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their outputs together
        (``max_decode_steps`` as in `LLMEngine.step`)."""
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        outs: list[RequestOutput] = []
        for res in self._pool.map(lambda e: e.step(max_decode_steps=max_decode_steps), busy):
            outs.extend(res)
        for o in outs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outs

    def get_metrics(self) -> dict:
        """The replicas' metrics combined (counts and tokens summed, gauges averaged), and each
        replica's own under ``replicas``."""
        each = [e.get_metrics() for e in self.replicas]
        out = dict(each[0])
        for key, v in each[0].items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            vals = [m[key] for m in each]
            mean = any(k in key for k in _MEAN_KEYS)
            out[key] = sum(vals) / len(vals) if mean else sum(vals)
        out["elapsed_seconds"] = max(m["elapsed_seconds"] for m in each)
        out["tensor_parallel_size"] = each[0]["tensor_parallel_size"]
        out["kv_cache_bytes_per_device"] = each[0]["kv_cache_bytes_per_device"]
        out["data_parallel_size"] = len(each)
        out["replicas"] = each
        return out
