"""A contiguous-KV-cache engine with static batching: the baseline that paging is measured against.

What the vLLM paper's Orca / FasterTransformer comparison isolates, built from the same model
and the same attention kernel as `LLMEngine`, so that only the KV management differs:

- every running sequence reserves ``max_model_len`` contiguous KV slots up front, whatever its
  real length: a KV budget of ``num_kv_slots`` tokens holds ``num_kv_slots // max_model_len``
  sequences at once (``max_num_seqs`` caps it further);
- static batches: up to that many waiting requests (first come, first served) are prefilled
  together, then decoded together until the longest member is done; a finished member keeps its
  reservation (and its row keeps computing) until the whole batch ends, and only then does the
  next batch start;
- no paging, no sharing, no prefix cache, no preemption.

Greedy decoding only (``temperature=0``, ``n=1``, no ``min_tokens``); ``max_tokens``,
``ignore_eos`` and ``stop_token_ids`` are honoured. Attention is the paged engine's own
(`jax_paged.engine.programs.paged_attn`, the same kernel for the platform) over a cache laid
out contiguously: row ``r`` owns the fixed run of blocks ``tables[r]`` covering
``max_model_len`` slots, so the kernel reads each row's live tokens only and the comparison
with `LLMEngine` isolates the KV management. Decode runs up to ``max_decode_steps`` tokens per
device call inside a `lax.scan`, as `LLMEngine` does. Shapes are bucketed to powers of two
(active rows, prompt width, steps per call), so a handful of programs serve any workload.

    eng = ContiguousEngine(loaded, max_model_len=512, num_kv_slots=4096)   # 8 rows
    outs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=16))

`add_request` / `step` / `has_unfinished_requests` serve online use (a batch forms from what
has arrived when the previous one ends); `kv_stats()` gives the slots reserved and the tokens
held right now, for utilisation accounting.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged.backend import argmax_last, prepare_params
from jax_paged.engine.programs import AttentionOptions, paged_attn
from jax_paged.entrypoints.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jax_paged.entrypoints.sampling_params import SamplingParams
from jax_paged.memory.kv_cache import KVCache

__all__ = ["ContiguousEngine", "kv_bytes_per_token"]


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes of K and V for one token over all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def _pow2_at_least(x: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def _row_slots(tables, rows, positions, block_size: int):
    """KV slots of ``positions`` in ``rows``: each row owns its blocks ``tables[row]``."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


@functools.partial(jax.jit, static_argnames=("graphdef", "nb", "t", "opts"), donate_argnames="kv")
def _prefill(graphdef, state, kv, tokens, lens, tables, *, nb, t, opts):
    """tokens i32[nb, t] (right-padded), lens i32[nb] -> (greedy next token i32[nb], kv).

    The rows run as a ragged batch of ``nb`` chunks of ``t`` tokens: each attends causally
    within itself; pad positions hold K/V that no real query reads and decode overwrites."""
    model = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (nb, t)).reshape(nb * t)
    rows = jnp.repeat(jnp.arange(nb, dtype=jnp.int32), t)
    tables = tables[:nb]
    slots = _row_slots(tables, rows, pos, kv.block_size)
    cu = jnp.arange(nb + 1, dtype=jnp.int32) * t
    attn = paged_attn(opts, slots, tables, jnp.full((nb,), t, jnp.int32), cu, jnp.int32(nb))
    last = jnp.arange(nb, dtype=jnp.int32) * t + jnp.maximum(lens, 1) - 1
    logits, kv = model.forward(tokens.reshape(1, nb * t), pos[None], attn, kv, logits_indices=last)
    return argmax_last(logits[0]), kv


@functools.partial(
    jax.jit, static_argnames=("graphdef", "nb", "steps", "opts"), donate_argnames="kv"
)
def _decode(graphdef, state, kv, last, n_cached, remaining, stop_ids, tables, *, nb, steps, opts):
    """``steps`` greedy decode steps for ``nb`` rows.

    last i32[nb]: the latest token (its K/V not yet cached); n_cached i32[nb]: tokens cached,
    = last's position; remaining i32[nb]: tokens still allowed (0 = row done); stop_ids
    i32[nb, E] (-1 = none): ids that end a row. A done row keeps computing (static batching)
    but neither advances nor emits. Returns tokens i32[steps, nb] (-1 from a row once it is
    done), the new (last, n_cached, remaining) and kv.
    """
    model = nnx.merge(graphdef, state)
    tables = tables[:nb]
    max_pos = tables.shape[1] * kv.block_size - 1
    rows = jnp.arange(nb, dtype=jnp.int32)

    def one(carry, _):
        kv, last, n, rem = carry
        live = rem > 0
        pos = jnp.minimum(n, max_pos)
        attn = paged_attn(opts, _row_slots(tables, rows, pos, kv.block_size), tables, pos + 1)
        logits, kv = model.forward(last[None], pos[None], attn, kv)  # rows as one ragged batch
        nxt = argmax_last(logits[0])
        hit = jnp.any(stop_ids == nxt[:, None], axis=-1)
        out = jnp.where(live, nxt, -1)
        rem = jnp.where(live & ~hit, rem - 1, 0)
        n = jnp.where(live, n + 1, n)
        last = jnp.where(live, nxt, last)
        return (kv, last, n, rem), out

    (kv, last, n, rem), toks = jax.lax.scan(
        one, (kv, last, n_cached, remaining), None, length=steps
    )
    return toks, last, n, rem, kv


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    metrics: RequestMetrics
    out: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None


class ContiguousEngine:
    """Static batches over a contiguous KV cache; see the module docstring.

    Args:
      loaded: a `models.LoadedModel` (its model, generation config and tokenizer are used).
      max_model_len: slots each sequence reserves (prompt + output must fit); default the
        model's context length.
      num_kv_slots: KV budget in tokens; or ``kv_cache_memory_bytes`` (one of the two).
        Rows = min(budget // max_model_len, max_num_seqs); at least one row must fit.
      max_num_seqs: cap on the rows (sequences decoded together).
      max_decode_steps: decode steps per device call.
      block_size: slots per block of the cache layout (rows are whole runs of blocks).
      attention_impl: the kernel, as `EngineConfig.attention_impl`.
    """

    def __init__(
        self,
        loaded,
        *,
        max_model_len: int | None = None,
        num_kv_slots: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_decode_steps: int = 32,
        block_size: int = 16,
        attention_impl: str = "auto",
    ):
        cfg = loaded.config
        self.loaded = loaded
        self.model_config = cfg
        self.dtype = loaded.model.dtype
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        per_tok = kv_bytes_per_token(cfg, self.dtype)
        if (num_kv_slots is None) == (kv_cache_memory_bytes is None):
            raise ValueError("give exactly one of num_kv_slots and kv_cache_memory_bytes")
        if num_kv_slots is None:
            num_kv_slots = int(kv_cache_memory_bytes) // per_tok
        self.num_kv_slots = int(num_kv_slots)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if max_num_seqs < 1 or max_decode_steps < 1:
            raise ValueError("max_num_seqs and max_decode_steps must be >= 1")
        self.num_rows = min(self.num_kv_slots // self.max_model_len, int(max_num_seqs))
        if self.num_rows < 1:
            raise ValueError(
                f"a KV budget of {self.num_kv_slots} slots ({self.num_kv_slots * per_tok} bytes) "
                f"holds no sequence of max_model_len={self.max_model_len}"
            )
        self.max_decode_steps = int(max_decode_steps)
        self.kv_bytes = self.num_rows * self.max_model_len * per_tok
        self.eos_token_ids = [int(e) for e in loaded.generation_config.eos_token_ids or []]
        tok = loaded.tokenizer
        if not self.eos_token_ids and getattr(tok, "eos_token_id", None) is not None:
            self.eos_token_ids = [int(tok.eos_token_id)]
        self.graphdef, self.state = nnx.split(loaded.model)
        # The weights as the paged engine holds them (on a CPU: per-layer kernels).
        self.state = prepare_params(loaded.model, self.state)
        # Row r owns the contiguous run of blocks tables[r] (block 0 is the kernels' null
        # block): the layout of a contiguous cache, read by the paged engine's kernel.
        per_row = -(-self.max_model_len // block_size)
        self.tables = jnp.arange(self.num_rows * per_row, dtype=jnp.int32).reshape(-1, per_row) + 1
        self.kv = KVCache.create(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            block_size=block_size,
            num_blocks=1 + self.num_rows * per_row,
            dtype=self.dtype,
        )
        self.opts = AttentionOptions(
            scale=cfg.scale,
            sliding_window=cfg.sliding_window,
            soft_cap=getattr(cfg, "attn_logit_softcapping", None),
            impl=attention_impl,
        )
        self.waiting: list[_Req] = []
        self.batch: list[_Req] = []
        self._row_state = None  # device arrays of the running batch
        self._programs: dict[tuple, Any] = {}
        self._compile_seconds = 0.0
        self._stats = dict(
            num_requests=0,
            num_finished=0,
            num_batches=0,
            num_device_calls=0,
            prompt_tokens=0,
            generated_tokens=0,
            wasted_row_steps=0,
            peak_running=0,
        )

    # ------------------------------------------------------------------------------------------
    # Requests

    def add_request(self, request_id: str, prompt: dict | list[int], params=None) -> None:
        """Queues a request: ``{"prompt_token_ids": [...]}`` or a list of ids; greedy params."""
        params = params if params is not None else SamplingParams(temperature=0.0)
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
            raise ValueError("prompt_token_ids: an id is out of the vocabulary's range")
        if params.temperature != 0:
            raise ValueError("temperature: the contiguous engine decodes greedily (use 0)")
        if params.n != 1:
            raise ValueError("n: the contiguous engine runs one completion per request")
        if params.min_tokens:
            raise ValueError("min_tokens: not supported by the contiguous engine")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt_token_ids: {len(ids)} tokens leave no room in max_model_len="
                f"{self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.waiting.append(
            _Req(request_id, ids, params, max_tokens, RequestMetrics(arrival_time=time.time()))
        )
        self._stats["num_requests"] += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.batch)

    # ------------------------------------------------------------------------------------------
    # Steps

    def _call(self, key: tuple, fn, *args, **static):
        """Runs jitted ``fn``; a new shape is compiled ahead of time and its compile seconds
        counted apart from the run."""
        prog = self._programs.get(key)
        if prog is None:
            t0 = time.perf_counter()
            prog = fn.lower(self.graphdef, *args, **static).compile()
            self._compile_seconds += time.perf_counter() - t0
            self._programs[key] = prog
        self._stats["num_device_calls"] += 1
        return jax.block_until_ready(prog(*args))

    def _start_batch(self) -> list[RequestOutput]:
        reqs, self.waiting = self.waiting[: self.num_rows], self.waiting[self.num_rows :]
        n = len(reqs)
        nb = min(_pow2_at_least(n), self.num_rows)
        t = _pow2_at_least(max(len(r.prompt) for r in reqs), lo=16)
        t = min(t, self.max_model_len)
        tokens = np.zeros((nb, t), np.int32)
        lens = np.ones(nb, np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : len(r.prompt)] = r.prompt
            lens[i] = len(r.prompt)
        now = time.time()
        for r in reqs:
            r.metrics.first_scheduled_time = now
        first, self.kv = self._call(
            ("prefill", nb, t),
            _prefill,
            self.state,
            self.kv,
            jnp.asarray(tokens),
            jnp.asarray(lens),
            self.tables,
            nb=nb,
            t=t,
            opts=self.opts,
        )
        first = np.asarray(first)
        e = max(1, max(len(self._stops(r)) for r in reqs))
        stop_ids = np.full((nb, e), -1, np.int32)
        remaining = np.zeros(nb, np.int32)
        self.batch = reqs
        self._stats["num_batches"] += 1
        self._stats["prompt_tokens"] += int(sum(len(r.prompt) for r in reqs))
        self._stats["peak_running"] = max(self._stats["peak_running"], n)
        for i, r in enumerate(reqs):
            stops = self._stops(r)
            stop_ids[i, : len(stops)] = stops
            self._append(r, int(first[i]), now, stops, first=True)
            remaining[i] = 0 if r.finish_reason else r.max_tokens - len(r.out)
        self._row_state = dict(
            last=jnp.asarray(first),
            n=jnp.asarray(lens),
            rem=jnp.asarray(remaining),
            stop_ids=jnp.asarray(stop_ids),
            nb=nb,
        )
        self._host_rem = remaining.copy()
        return self._finish_step(reqs)

    def _stops(self, r: _Req) -> list[int]:
        stops = list(r.params.stop_token_ids or [])
        if not r.params.ignore_eos:
            stops += [e for e in self.eos_token_ids if e not in stops]
        return stops

    def _append(self, r: _Req, tok: int, now: float, stops, first=False) -> None:
        r.out.append(tok)
        self._stats["generated_tokens"] += 1
        if first:
            r.metrics.first_token_time = now
        r.metrics.last_token_time = now
        if tok in stops:
            r.finish_reason = "stop"
            if tok in (r.params.stop_token_ids or []):
                r.stop_reason = tok
        elif len(r.out) >= r.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason:
            r.metrics.finished_time = now
            self._stats["num_finished"] += 1

    def _decode_batch(self) -> list[RequestOutput]:
        rs = self._row_state
        nb = rs["nb"]
        left = int(self._host_rem.max())
        steps = min(self.max_decode_steps, _pow2_at_least(left))
        toks, last, n, rem, self.kv = self._call(
            ("decode", nb, steps),
            _decode,
            self.state,
            self.kv,
            rs["last"],
            rs["n"],
            rs["rem"],
            rs["stop_ids"],
            self.tables,
            nb=nb,
            steps=steps,
            opts=self.opts,
        )
        rs.update(last=last, n=n, rem=rem)
        toks = np.asarray(toks)
        now = time.time()
        progressed = []
        for i, r in enumerate(self.batch):
            col = toks[:, i]
            col = col[col >= 0]
            if not len(col):
                continue
            stops = self._stops(r)
            for tok in col.tolist():
                self._append(r, tok, now, stops)
            progressed.append(r)
        self._stats["wasted_row_steps"] += int(nb * steps - (toks >= 0).sum())
        self._host_rem = np.asarray(rem).copy()
        return self._finish_step(progressed)

    def _finish_step(self, progressed: list[_Req]) -> list[RequestOutput]:
        outs = [self._output(r) for r in progressed]
        if all(r.finish_reason for r in self.batch):
            self.batch, self._row_state = [], None  # the batch ends with its longest member
        return outs

    def step(self) -> list[RequestOutput]:
        """Starts a batch (prefill, first tokens) if none is running, else decodes up to
        ``max_decode_steps`` tokens of the running batch. Returns the requests that progressed."""
        if self.batch:
            return self._decode_batch()
        if self.waiting:
            return self._start_batch()
        return []

    def _output(self, r: _Req) -> RequestOutput:
        text = ""
        tok = self.loaded.tokenizer
        if tok is not None and r.finish_reason:
            text = tok.decode(r.out)
        comp = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(r.out),
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
        )
        return RequestOutput(
            request_id=r.request_id,
            prompt=None,
            prompt_token_ids=list(r.prompt),
            prompt_logprobs=None,
            outputs=[comp],
            finished=r.finish_reason is not None,
            metrics=r.metrics,
        )

    def generate(self, prompts, params=None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order."""
        if not isinstance(prompts, list | tuple):
            prompts = [prompts]
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        base = self._stats["num_requests"]
        ids = [f"c{base + i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params, strict=True):
            self.add_request(rid, p, sp)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
        return [done[rid] for rid in ids]

    # ------------------------------------------------------------------------------------------
    # Accounting

    def kv_stats(self) -> dict[str, int]:
        """KV slots right now: ``reserved`` (rows of the running batch x max_model_len),
        ``tokens`` (K/V positions of its unfinished members that hold real tokens; a finished
        member's slots stay reserved but hold nothing that will be read again), ``budget``
        (the whole cache) and ``running`` (unfinished members)."""
        live = [r for r in self.batch if not r.finish_reason]
        tokens = sum(len(r.prompt) + len(r.out) - 1 for r in live)
        return dict(
            reserved=len(self.batch) * self.max_model_len,
            tokens=int(tokens),
            budget=self.num_rows * self.max_model_len,
            running=len(live),
        )

    def get_metrics(self) -> dict[str, Any]:
        m = dict(self._stats)
        m.update(
            num_rows=self.num_rows,
            max_model_len=self.max_model_len,
            num_kv_slots=self.num_kv_slots,
            kv_cache_bytes=self.kv_bytes,
            num_waiting=len(self.waiting),
            num_running=sum(1 for r in self.batch if not r.finish_reason),
            compiled_variants=len(self._programs),
            compile_seconds=self._compile_seconds,
        )
        return m
