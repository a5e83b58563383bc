"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduled step at a time.

One `step()`, with its device calls (`ModelRunner`; each a compiled program, state donated)::

    prepare     if anything is queued: cache full blocks, free finished slots, fork n > 1
                siblings, look the waiting prompts up in the prefix cache     (one call)
    Scheduler.schedule()   which chunks of which sequences run (host arithmetic)
    admit       if sequences were admitted: start them from the prefix cache, set their
                sampling rows                                                  (one call)
    run         all decoding, nothing waiting -> decode loop (many tokens, one call)
                otherwise                     -> mixed step  (prefill chunks + decodes)
    OutputProcessor: append tokens, detokenise, stop strings, finish           (host)

In a steady decode phase that is one device call per step (`get_metrics()`:
``device_calls_per_step``). The device state is the one authority on blocks; the scheduler
plans against what it last reported, and a chunk the device cannot hold after all is
preempted. A step that raises fails its own requests and the state is rebuilt (`step`).
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback

import numpy as np
from flax import nnx

from jax_paged import inputs
from jax_paged.config import EngineConfig, size_kv_pool
from jax_paged.metrics import EngineMetrics
from jax_paged.model_runner import ModelRunner
from jax_paged.output_processor import OutputProcessor, RequestState
from jax_paged.outputs import RequestMetrics, RequestOutput
from jax_paged.sampling_params import SamplingParams
from jax_paged.scheduler import Scheduler, Sequence, SequenceStatus, blocks_for
from models.protocol import check_model

logger = logging.getLogger("jax_paged")


class LLMEngine:
    """Continuous-batching engine over a loaded model (`models.load`).

    Args:
      loaded: a `models.LoadedModel` (model, tokenizer or None, config, generation_config).
      config: `EngineConfig`.
    """

    def __init__(self, loaded, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        check_model(loaded.model)  # names what a user-written model lacks (models.PagedModel)
        self.loaded = loaded
        mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = list(loaded.generation_config.eos_token_ids or [])
        if not self.eos_token_ids and self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.vocab_size = mc.vocab_size
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(512, self.max_num_seqs)
        bs = config.block_size
        self.num_blocks = size_kv_pool(config, mc, loaded.model.dtype, nnx.state(loaded.model))
        self.runner = ModelRunner(
            loaded.model,
            config,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            eos_token_ids=self.eos_token_ids,
        )
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(
            num_blocks=self.num_blocks - 1,
            block_size=bs,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        self.metrics = EngineMetrics()
        self.caching = config.enable_prefix_caching
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        # Work for the next `prepare` call: slots to free, slot -> tokens whose full blocks to
        # cache, (parent, child) slots to fork; n > 1 requests waiting to fork.
        self._pending_free: list[int] = []
        self._cache_reqs: dict[int, list[int]] = {}
        self._fork_pairs: list[tuple[int, int]] = []
        self._fork_waiting: dict[str, RequestState] = {}
        # First blocks ever offered to the prefix cache: a prompt whose first block is not here
        # cannot hit, so it is not looked up (a superset: evictions are not tracked, which only
        # costs a lookup that finds nothing). Bounded: past a few times the pool's blocks it is
        # dropped (None) and every waiting prompt is looked up.
        self._cached_heads: set[tuple[int, ...]] | None = set()
        self._max_cached_heads = max(4096, 4 * self.num_blocks)
        self._step_seqs: list[Sequence] | None = None  # the sequences of the step in flight

    @property
    def state(self):
        """The device state (`runner.DeviceState`: KV pages, block manager, sampling)."""
        return self.runner.state

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict, params=None) -> None:
        """Queues a request. Raises ValueError (naming the field) if it cannot be served; the
        engine and the other requests are unaffected (nothing of a rejected request is kept;
        ``num_rejected`` counts it)."""
        try:
            self._add_request(str(request_id), prompt, params)
        except Exception:
            self.metrics.add("num_rejected")
            raise

    def count_rejected(self) -> None:
        """Counts a request rejected before it reached `add_request` (e.g. by its chat
        template) in ``num_rejected``."""
        self.metrics.add("num_rejected")

    def _add_request(self, request_id: str, prompt, params) -> None:
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
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = inputs.parse_prompt(prompt, self.tokenizer)
        inputs.check_request(
            ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=self.config.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )
        # max_tokens=None: until max_model_len (vLLM's meaning).
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        longest = min(len(ids) + max_tokens, self.max_model_len)
        need = blocks_for(longest, self.config.block_size)
        if need > self.num_blocks - 1:
            raise ValueError(
                f"request needs up to {need} KV blocks ({longest} tokens) but the cache holds "
                f"{self.num_blocks - 1}: lower max_tokens or raise num_kv_blocks"
            )
        if params.uses_penalties and not self.runner.tracks_tokens:
            try:
                self.runner.start_tracking_tokens(
                    [q for q in self.scheduler.running if q.slot is not None]
                )
            except Exception as e:  # a device call: contained as a failed step would be
                self._step_seqs = None
                self._recover(e)
                raise

        seqs = [
            Sequence(next(self._seq_ids), request_id, list(ids), max_tokens)
            for _ in range(params.n)
        ]
        req = RequestState(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(ids),
            params=params,
            seqs=seqs,
            metrics=RequestMetrics(arrival_time=time.time()),
            outputs=self.output.new_outputs(params),
        )
        for i, s in enumerate(seqs):
            s.params, s.request, s.index = params.child_params(i), req, i
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
        self.metrics.add("num_requests")
        self.metrics.add("prompt_tokens", len(ids))

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
        self.metrics.add("num_aborted")
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

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of the requests that progressed
        (``finished`` set on those that are done).

        If the step raises (an error inside a compiled call: out of memory, a runtime fault),
        the requests of that step finish with ``error`` set and come back in the returned
        outputs, the device state is rebuilt empty, and every other running sequence is
        preempted (it re-prefills later, its output unchanged): the engine keeps serving.
        """
        self.metrics.add("num_steps")
        self._step_seqs = None
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - contained: see the docstring
            return self._recover(e)

    def _step(self) -> list[RequestOutput]:
        self._fork_ready()
        hinted = self._prepare(lookup=self.caching, flush=False)
        sched = self.scheduler.schedule()
        for q in hinted:  # the lookup holds for this step only
            q.prefix_hit = q.prefix_revive = 0
        self._step_seqs = [c.seq for c in sched.chunks]
        self._pending_free += self.scheduler.drain_preempted_slots()
        for q in sched.admitted if self.caching else ():
            if q.num_preemptions == 0 and q.params.prompt_logprobs is None:
                self.metrics.add("prefix_cache_queries", len(q.prompt_token_ids))
                self.metrics.add("prefix_cache_hits", q.num_cached_tokens)
        for s in sched.preempted:
            s.request.metrics.num_preemptions += 1
            logger.warning(
                "preempted request %s (recompute); KV cache is full. %d preemptions so far",
                s.request_id,
                self.scheduler.num_preemptions,
            )
        if not sched.chunks:
            return []
        now = time.time()
        for c in sched.chunks:
            if c.seq.request.metrics.first_scheduled_time is None:
                c.seq.request.metrics.first_scheduled_time = now
        admitted = [s for s in self.scheduler.running if s.needs_row_init]
        if admitted:
            cached, num_free = self.runner.admit(admitted, sched.fresh)
            for c, n in zip(sched.fresh, cached, strict=True):
                if n != c.start:
                    raise RuntimeError(
                        f"prefix cache: the lookup found {c.start} tokens for request "
                        f"{c.seq.request_id} but matching found {n}"
                    )
            if sched.fresh:
                self.scheduler.started_from_cache(sched.chunks, num_free)
            for s in admitted:
                s.needs_row_init = False

        t0 = time.perf_counter()
        progressed: dict[str, RequestState] = {}
        if (
            sched.all_decode
            and self.config.max_decode_steps > 1
            and not self.scheduler.waiting
            and not any(c.seq.params.prompt_logprobs is not None for c in sched.chunks)
        ):
            self._run_decode_loop(sched, progressed)
        else:
            self._run_mixed(sched, progressed)
        self.metrics.device_seconds += time.perf_counter() - t0
        self.metrics.maybe_log(self.get_metrics)
        outs = []
        for req in progressed.values():
            outs.append(self.output.make_output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
                self.metrics.add("num_finished")
        if not self.scheduler.has_unfinished():
            self._prepare()  # free the last slots: an idle engine holds no blocks
        return outs

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """Fails the requests of the step that raised, rebuilds the device state and puts every
        other running sequence back in the waiting queue (nothing of the old state is read)."""
        step_reqs = {id(q.request): q.request for q in self._step_seqs or []}.values()
        # Requests of the step still in flight (one that finished in it has been reported).
        failed = [r for r in step_reqs if r.request_id in self.requests and not r.finished]
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
        self.metrics.add("num_step_failures")
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
            self.metrics.add("num_failed")
            outs.append(self.output.make_output(req))
        for s in list(self.scheduler.running):
            self.scheduler.preempt(s)
        self.scheduler.drain_preempted_slots()
        self.scheduler.num_free_blocks = self.scheduler.num_blocks
        self._pending_free, self._cache_reqs, self._fork_pairs = [], {}, []
        self._cached_heads = set()
        self.runner.reset()
        return outs

    # -- sharing ---------------------------------------------------------------------------
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

    def _prepare(self, lookup: bool = False, flush: bool = True) -> list[Sequence]:
        """The ``prepare`` call for the work queued between steps, if any; with ``lookup``
        the prompts of the waiting sequences that may be admitted next are looked up in the
        prefix cache (their ``prefix_hit`` / ``prefix_revive`` are set). Afterwards the
        scheduler's free-block count is the device's. Returns the sequences given hints.

        Without ``flush``, blocks queued for caching alone do not make a call: they wait for
        the next one (a free, a fork, or a waiting prompt that could use them), so a workload
        without prefix hits pays no extra call for caching."""
        bs = self.config.block_size
        heads = self._cached_heads
        cand = []
        if lookup:
            pending = {tuple(t[:bs]) for t in self._cache_reqs.values()}
            room = min(len(self.scheduler.free_slots), self.max_num_seqs)
            for q in itertools.islice(self.scheduler.waiting, room):
                # A prompt whose first block was never cached cannot hit; cached positions
                # have no logits, so prompt_logprobs requests compute their whole prompt.
                head = tuple(q.all_token_ids[:bs])
                if (
                    q.num_computed == 0
                    and q.params.prompt_logprobs is None
                    and q.num_tokens > bs
                    and (heads is None or head in heads or head in pending)
                ):
                    cand.append(q)
        if not (self._pending_free or self._fork_pairs or cand or (flush and self._cache_reqs)):
            return []
        if heads is not None:
            heads.update(tuple(toks[:bs]) for toks in self._cache_reqs.values())
            if len(heads) > self._max_cached_heads:
                self._cached_heads = None
        cache, free, forks = self._cache_reqs, self._pending_free, self._fork_pairs
        self._cache_reqs, self._pending_free, self._fork_pairs = {}, [], []
        num_free, found = self.runner.prepare(cache, free, forks, [q.all_token_ids for q in cand])
        self.scheduler.num_free_blocks = num_free
        for q, (hit, revive) in zip(cand, found, strict=True):
            q.prefix_hit, q.prefix_revive = hit, revive
        return cand

    # -- running a step --------------------------------------------------------------------
    def _run_mixed(self, sched, progressed) -> None:
        chunks = sched.chunks
        free, self._pending_free = self._pending_free, []
        out, want_plp = self.runner.mixed(chunks, free)
        self.scheduler.num_free_blocks = int(out.num_free)
        bs = self.config.block_size
        done = {id(c.seq): c.start + c.length for r, c in enumerate(chunks) if out.ok[r]}
        self._after_step([done.get(id(q), q.num_computed) for q in self.scheduler.running])
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
                self.output.record_prompt_logprobs(s, c.start, c.length, out.prompt_lp, off)
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
        remaining = max(
            min(s.max_tokens - len(s.output_token_ids), self.max_model_len - s.num_tokens)
            for s in seqs
        )
        k = self.scheduler.decode_horizon(seqs, min(self.config.max_decode_steps, remaining))
        if self._pending_free:  # slots preempted while scheduling: the loop must not reuse them
            self._prepare()
        out = self.runner.decode(seqs, k)
        self.scheduler.num_free_blocks = int(out.num_free)
        n = int(out.num_steps)
        self.metrics.add("decode_loop_tokens", int(np.sum(out.tokens[:n] >= 0)))
        self._after_step(
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

    def _after_step(self, lengths: list[int]) -> None:
        sch = self.scheduler
        self.metrics.after_step(
            lengths, self.config.block_size, sch.num_blocks, sch.num_free_blocks
        )

    def _append(self, s, tokens, lps, ranks, top_ids, top_lps) -> None:
        kept, reason = self.output.append(s, tokens, lps, ranks, top_ids, top_lps)
        self.metrics.add("generated_tokens", kept)
        if reason is not None:
            self._finish_seq(s, *reason)
            s.request.metrics.finished_time = time.time()

    # -- metrics ---------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        """Counters and gauges of the engine (a plain dict; the README lists them)."""
        return self.metrics.build(
            scheduler=self.scheduler,
            runner=self.runner,
            output=self.output,
            num_kv_blocks=self.num_blocks,
        )


__all__ = ["EngineConfig", "LLMEngine"]
