"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduled step at a time.

One step is one plan in, one compiled program, one result out (`EngineCore.step`)::

    plan = scheduler.schedule()      what the device does (`SchedulerOutput`): free, fork,
                                     take prefix hits, start sampling rows, the chunks to
                                     run, the prompts to look up next
    result = runner.execute(plan)    one call: a mixed step (prefill chunks + decodes) or,
                                     all decoding and nothing waiting, a decode loop
    scheduler.update(plan, result)   the device's free count, tokens computed, lookup hints
    output.commit, output.render     the new tokens to their sequences; detokenise, outputs

The engine builds the parts and owns the request API; `EngineCore` runs the steps. The device
state is the one authority on blocks: the scheduler plans against what it last reported, and
a chunk the device cannot hold after all is preempted.
"""

from __future__ import annotations

import time

from flax import nnx

from jax_paged.engine import inputs
from jax_paged.engine.config import EngineConfig, kv_dtype, size_kv_pool
from jax_paged.engine.core import EngineCore
from jax_paged.engine.metrics import EngineMetrics
from jax_paged.engine.model_runner import ModelRunner
from jax_paged.engine.output_processor import OutputProcessor, RequestState
from jax_paged.engine.scheduler import Scheduler
from jax_paged.entrypoints.outputs import RequestOutput
from jax_paged.entrypoints.sampling_params import SamplingParams
from jax_paged.parallel import sharding as shard
from models.protocol import check_model


class LLMEngine:
    """Continuous-batching engine over a loaded model (`models.load`).

    Args:
      loaded: a `models.LoadedModel` (model, tokenizer or None, config, generation_config).
      config: `EngineConfig`.
    """

    def __init__(self, loaded, config: EngineConfig | None = None, devices=None):
        self.config = config = config or EngineConfig()
        check_model(loaded.model)  # names what a user-written model lacks (models.PagedModel)
        self.loaded = loaded
        model, mesh = loaded.model, None
        if config.tensor_parallel_size > 1 or devices is not None:
            # The device count, then the head counts, named. ``devices``: this engine's own
            # (a data-parallel replica's, `DataParallelEngine`).
            mesh = shard.make_mesh(config.tensor_parallel_size, devices)
            r = shard.kv_replication(loaded.config, config.tensor_parallel_size)
            model = shard.replicate_kv_heads(model, r)
        mc = model.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = inputs.eos_token_ids(loaded)
        self.vocab_size = mc.vocab_size
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(512, self.max_num_seqs)
        bs = config.block_size
        self.num_blocks = size_kv_pool(config, mc, kv_dtype(config, model.dtype), nnx.state(model))
        self.runner = ModelRunner(
            model,
            config,
            mesh=mesh,
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
            window=self.runner.opts.drop_window,
            caching=config.enable_prefix_caching,
            max_cached_heads=max(4096, 4 * self.num_blocks),
        )
        self.limits = inputs.RequestLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=config.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
            max_n=config.max_n,
            block_size=bs,
            usable_blocks=self.num_blocks - 1,
            window=self.scheduler.window,
            chunk=self.max_num_batched_tokens,
        )
        self.metrics = EngineMetrics()
        self.core = EngineCore(
            config,
            self.scheduler,
            self.runner,
            self.output,
            self.metrics,
            self.max_model_len,
            log=lambda: self.metrics.maybe_log(self.get_metrics),
        )
        if config.precompile:
            self.runner.compile_all()

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests by id (`OutputProcessor.requests`)."""
        return self.output.requests

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
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = inputs.parse_prompt(prompt, self.tokenizer)
        max_tokens = self.limits.check(ids, params)
        self.scheduler.add_request(
            self.output.new_request(request_id, text, ids, params, max_tokens)
        )
        self.metrics.add("num_requests")
        self.metrics.add("prompt_tokens", len(ids))

    def abort(self, request_id: str) -> bool:
        """Stops a request; its blocks return to the pool. False if it is unknown or done."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        self.core.abort_seqs(req)
        self.metrics.add("num_aborted")
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running, or a step is still in flight."""
        return self.core.busy

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` was added and has not finished, failed or been aborted."""
        return str(request_id) in self.requests

    # -- one step --------------------------------------------------------------------------
    def step(self, *, max_decode_steps: int | None = None) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of the requests that progressed
        (``finished`` set on those that are done).

        ``max_decode_steps`` caps the tokens per sequence of a multi-step decode call below
        ``config.max_decode_steps`` for this step only (an online server shortens the call so
        that a request arriving meanwhile waits for less; `jax_paged.serve.AsyncLLM`).

        If the step raises (an error inside a compiled call: out of memory, a runtime fault),
        the requests of that step finish with ``error`` set and come back in the returned
        outputs, the device state is rebuilt empty, and every other running sequence is
        preempted (it re-prefills later, its output unchanged): the engine keeps serving.
        """
        t0 = time.perf_counter()
        self.metrics.add("num_steps")
        if max_decode_steps is not None and (
            not isinstance(max_decode_steps, int) or max_decode_steps < 1
        ):
            raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
        cap = self.config.max_decode_steps
        try:
            return self.core.step(min(max_decode_steps or cap, cap))
        finally:
            self.metrics.step_seconds += time.perf_counter() - t0

    def get_metrics(self) -> dict:
        """Counters and gauges of the engine (a plain dict; the README lists them)."""
        return self.metrics.build(
            scheduler=self.scheduler,
            runner=self.runner,
            output=self.output,
            num_kv_blocks=self.num_blocks,
        )


__all__ = ["EngineConfig", "LLMEngine"]
