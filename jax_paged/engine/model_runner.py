"""`ModelRunner`: the engine's device side. It owns the device state (KV pages, block manager,
sampling history) and the compiled programs, turns the scheduler's plan into padded arrays,
makes the calls and hands back plain host results (numpy).

Every call is one compiled program with the device state donated (updated in place, never
copied). Programs are compiled on first use per bucket key and kept; shapes are bucketed so a
long run compiles a handful of variants (`get_metrics()["compiled_variants"]`):

* ``mixed``: prefill chunks and decodes in one ragged batch (`programs.mixed_step`);
* ``decode``: many decode steps on the device (`programs.decode_loop`);
* ``prepare``: bookkeeping with no forward (`programs.prepare`): an idle engine frees what
  finished and looks up prompts that just arrived.

Each starts with the plan's block ops (free, fork, take prefix hits, set sampling rows), so
a step is one call (`execute`): one `SchedulerOutput` in, one `StepResult` out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import backend
from jax_paged.engine import programs, step_inputs
from jax_paged.engine.config import kv_dtype
from jax_paged.engine.sequence import SchedulerOutput, Sequence, StepResult, blocks_for
from jax_paged.memory import block_manager as bm
from jax_paged.parallel import sharding as shard
from jax_paged.sampling import sampler as sampling

logger = logging.getLogger("jax_paged")

# Smallest padded sizes of the compiled steps (`backend.padded_size` gives the others): a
# mixed step holds a prompt chunk or several decodes, so smaller sizes would be rare variants.
_MIN_TOKENS = 16
_MIN_DECODE_ROWS = 8


def _pow2_at_least(x: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def _program_name(ckey: tuple) -> str:
    """A compiled variant's name for the metrics: its kind and bucket key, e.g. 'decode(8, 0)'."""
    return f"{ckey[0]}{ckey[1:]}" if len(ckey) > 1 else ckey[0]


class ModelRunner:
    """Device state, compiled programs and batch building for one engine.

    Args:
      model: the NNX model (split into graph and parameters here).
      config: the `EngineConfig`.
      num_blocks: KV pool size in blocks (null block included).
      max_model_len, max_num_seqs, max_num_batched_tokens: the engine's limits.
      eos_token_ids: stop ids added to every row (unless its ignore_eos).
    """

    def __init__(
        self,
        model,
        config,
        *,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: list[int],
        mesh=None,
    ):
        self.config = config
        self.model_config = mc = model.config
        self.mesh = mesh  # tensor parallelism (`jax_paged.parallel.sharding`), or None: one device
        self.platform = (jax.devices() if mesh is None else mesh.devices.flat)[0].platform
        self.graphdef, self.params = nnx.split(model)
        if mesh is not None:
            self.params = shard.shard_params(self.params, mesh)
        # On a CPU, each layer's kernels as separate arrays: no copy of them per step.
        self.params = backend.prepare_params(model, self.params, mesh)
        self.dtype = model.dtype
        self.kv_dtype = kv_dtype(config, model.dtype)
        self.vocab_size = mc.vocab_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = blocks_for(max_model_len, config.block_size)
        self.eos_token_ids = list(eos_token_ids)
        # Width of every row's stop-id list in the persistent batch (`DeviceState.rows`): one
        # bucket for every request with up to 8 stop ids (EOS included); grows when one has more.
        self.stop_width = _pow2_at_least(len(self.eos_token_ids), 8)
        self.opts = programs.AttentionOptions(
            scale=mc.scale,
            sliding_window=mc.sliding_window,
            soft_cap=getattr(mc, "attn_logit_softcapping", None),  # Gemma 2
            # One window in every layer (Mistral): blocks out of it go back to the pool. Models
            # mixing windowed and full layers keep every block (docs/DESIGN.md).
            drop_window=mc.sliding_window,
            impl=config.attention_impl,
            interpret=config.attention_interpret,
            mesh=mesh,
        )
        self.key = jax.random.key_data(jax.random.key(config.seed))
        self.state: programs.DeviceState | None = self.fresh_state(track_tokens=False)
        self.compiled: dict[tuple, Any] = {}
        self.compile_seconds = 0.0
        self.compile_by_program: dict[str, float] = {}
        self._no_prompts = None  # device-resident empty lookup input (`_lookup_input`)
        self.seconds_by_kind: dict[str, float] = {}  # time inside compiled calls, per kind
        self.num_calls = 0
        self.call_seconds = 0.0  # calls in flight: dispatch to the host seeing them done
        self.idle_seconds = 0.0  # no call in flight while the engine had work
        self.num_found_done = 0  # waits that found the call done already (the host was late)
        self._done_at: float | None = None
        self.host_to_device_bytes = 0

    # -- state -----------------------------------------------------------------------------
    def fresh_state(self, track_tokens: bool) -> programs.DeviceState:
        """An empty device state: a zeroed KV pool, every block free, no prefix cache."""
        mc, bs = self.model_config, self.config.block_size
        kv = shard.create_kv_cache(
            self.mesh,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            block_size=bs,
            num_blocks=self.num_blocks,
            dtype=self.kv_dtype,
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
        rows = self._tensors([None] * self.max_num_seqs, self.max_num_seqs, on_host=False)
        state = programs.DeviceState(kv=kv, blocks=blocks, sampling=samp, rows=rows)
        if not self.config.enable_prefix_caching:
            return self._place(state)
        s, p = self.max_num_seqs, self.max_blocks_per_seq
        return self._place(
            state.replace(
                tokens=jnp.zeros((s, p * bs), jnp.int32),
                found_blocks=jnp.zeros((s, p), jnp.int32),
                found_len=jnp.zeros(s, jnp.int32),
            )
        )

    def _place(self, state: programs.DeviceState) -> programs.DeviceState:
        """With a mesh: everything but the KV pages replicated on it."""
        if self.mesh is None:
            return state
        rep = shard.replicated(self.mesh)
        rest = jax.device_put(state.replace(kv=None), rep)
        return rest.replace(kv=state.kv)

    def kv_bytes_per_device(self) -> int:
        """Bytes of KV pages one device holds (all of them without a mesh)."""
        return shard.per_device_bytes(self.state.kv.k) * 2

    def reset(self) -> None:
        """Drops the device state (first, so its memory is free) and starts an empty one."""
        track = bool(self.state is not None and self.tracks_tokens)
        self.state = None
        self.state = self.fresh_state(track_tokens=track)

    @property
    def tracks_tokens(self) -> bool:
        return self.state.sampling.tracks_tokens

    @property
    def num_top(self) -> int:
        """Top log-probs every program returns per row: always max_logprobs, so requests with
        and without logprobs share one compiled variant. The device computes them only when a
        row asks (a runtime `lax.cond` on ``SamplingTensors.num_logprobs``); the host keeps
        each request's own count."""
        return self.config.max_logprobs

    # -- compiled calls --------------------------------------------------------------------
    def call(self, kind: str, fn, key: tuple, args: tuple, static: dict, *, kv: bool = True):
        """Runs ``fn`` (jitted, donating the state) compiled for bucket ``key``; blocks until
        done and returns its outputs.

        ``kv=False``: ``fn`` neither reads nor writes the K/V pages, so the state goes in
        without them and they are put back into the returned state. A program that returns a
        donated input unchanged is not guaranteed to alias it: on an H200 this program, with the
        pages passed through, asked for a 39 GiB buffer (one K or V pool of a Llama-3-8B-sized
        cache) and ran out of memory, where on the CPU its memory analysis shows them aliased.
        """
        if not kv:
            pages = args[0].kv
            args = (args[0].replace(kv=None), *args[1:])
            state, *rest = self.wait(self._launch(kind, fn, key, args, static))
            return (state.replace(kv=pages), *rest)
        return self.wait(self._launch(kind, fn, key, args, static))

    def launch(self, kind: str, fn, key: tuple, args: tuple, static: dict) -> _Launched:
        """Starts ``fn`` (jitted; ``fn(*args) -> (state, out)``, the state donated) without
        waiting: the runner's state becomes the program's output state at once (jax computes
        it asynchronously) and `wait` on the returned handle gives ``out``."""
        launched = self._launch(kind, fn, key, args, static)
        self.state, launched.out = launched.out
        return launched

    def wait(self, launched: _Launched):
        """Blocks until a launched call is done; returns its outputs. Counts the call's time in
        flight (dispatch to the host seeing it done) and whether it was done already."""
        leaves = jax.tree.leaves(launched.out)
        self.num_found_done += all(getattr(a, "is_ready", lambda: True)() for a in leaves)
        out = jax.block_until_ready(launched.out)
        now = time.perf_counter()
        dt = now - launched.start
        self.num_calls += 1
        self.call_seconds += dt
        self.seconds_by_kind[launched.kind] = self.seconds_by_kind.get(launched.kind, 0.0) + dt
        self._done_at = now
        return out

    def mark_idle(self) -> None:
        """The engine has nothing left to run: the time until its next call is not the
        device waiting for the host (`idle_seconds`)."""
        self._done_at = None

    def _launch(self, kind: str, fn, key: tuple, args: tuple, static: dict) -> _Launched:
        ckey = (kind,) + key
        # What crosses from the host: the numpy inputs (params and state stay on the device).
        host = [a for a in jax.tree.leaves(args) if isinstance(a, np.ndarray | np.generic)]
        self.host_to_device_bytes += sum(a.nbytes for a in host)
        if self.mesh is not None:  # host inputs as global arrays (several hosts: the same)
            args = shard.put_replicated(args, self.mesh)
        compiled = self.compiled.get(ckey)
        if compiled is None:
            t0 = time.perf_counter()
            compiled = fn.lower(*args, **static).compile()
            self._keep(ckey, compiled, time.perf_counter() - t0)
        t0 = time.perf_counter()
        if self._done_at is not None:  # the device sat idle since the last call ended
            self.idle_seconds += t0 - self._done_at
            self._done_at = None
        return _Launched(kind, t0, compiled(*args))

    def _keep(self, ckey: tuple, compiled, seconds: float) -> None:
        self.compiled[ckey] = compiled
        self.compile_seconds += seconds
        self.compile_by_program[_program_name(ckey)] = seconds
        logger.info("compiled %s in %.1fs", _program_name(ckey), seconds)

    def compile_all(self) -> dict[str, float]:
        """Compiles, up front, every variant a step can pick under this engine's limits
        (`variant_names`): the mixed step at each token size, the decode loop at each row size
        and the idle prepare, as vLLM captures its graphs at start-up. A server that calls it
        never stalls a request on a compile (SmolLM2 on a CPU: about 4 s per variant). Only the
        variants for penalties (a per-slot token history) and prompt log-probs still compile
        on first use. Lowering runs here, compiling on one thread per core. Returns
        {variant name: compile seconds} of the variants compiled now."""
        todo = []
        for kind, fn, key, args, static in self._variant_calls():
            if (kind,) + key not in self.compiled:
                if self.mesh is not None:
                    args = shard.put_replicated(args, self.mesh)
                todo.append(((kind,) + key, fn.lower(*args, **static)))

        def build(item):
            t0 = time.perf_counter()
            return item[0], item[1].compile(), time.perf_counter() - t0

        with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            for ckey, compiled, seconds in pool.map(build, todo):
                self._keep(ckey, compiled, seconds)
        names = [_program_name(ckey) for ckey, _ in todo]
        return {name: self.compile_by_program[name] for name in names}

    def variant_names(self) -> list[str]:
        """The variants (names as in ``compile_seconds_by_program``) a step can pick under
        this engine's limits, without penalties or prompt log-probs: what `compile_all`
        compiles."""
        return [_program_name((kind,) + key) for kind, _, key, _, _ in self._variant_calls()]

    def _variant_calls(self) -> list[tuple]:
        ops, ops_key = self._block_ops(SchedulerOutput(chunks=[], preempted=[]))
        prompts = self._lookup_input([])
        calls = [self._prepare_call(ops, ops_key, prompts)]
        # Each size a step of 1 .. the limit can be padded to, once.
        tokens = {self._mixed_rows(n)[0]: n for n in range(1, self.max_num_batched_tokens + 1)}
        calls += [self._mixed_call([], n, ops, prompts, ops_key)[:5] for n in tokens.values()]
        rows = {self._decode_rows(n): n for n in range(1, self.max_num_seqs + 1)}
        calls += [self._decode_call([], n, ops, ops_key, 1) for n in rows.values()]
        return calls

    def _tensors(self, seqs: list[Sequence | None], pad_to: int, on_host: bool = True):
        """The sampling parameters of ``seqs`` (None: an empty row), ``pad_to`` rows."""
        params = [None if s is None else s.params for s in seqs]
        uids = [None if s is None else s.seq_id for s in seqs]
        return sampling.SamplingTensors.from_params(
            params,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            request_uids=uids,
            pad_to=pad_to,
            stop_width=self.stop_width,
            on_host=on_host,
        )

    def _fit_stop_width(self, seqs: list[Sequence]) -> None:
        """Widens the persistent batch's stop-id lists (a new compiled variant) when one of
        ``seqs`` has more stop ids than they hold."""
        need = max((len(s.params.stop_token_ids or []) for s in seqs), default=0)
        need = _pow2_at_least(need + len(self.eos_token_ids), 8)
        if need <= self.stop_width:
            return
        rows = self.state.rows
        pad = ((0, 0), (0, need - self.stop_width))
        rows = dataclasses.replace(
            rows, stop_token_ids=jnp.pad(rows.stop_token_ids, pad, constant_values=-1)
        )
        self.stop_width = need
        self.state = self._place(self.state.replace(rows=rows))

    # -- one step ------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Runs the step ``plan`` describes and returns its results (`dispatch`, then waits)."""
        return self.dispatch(plan)()

    def dispatch(self, plan: SchedulerOutput) -> Callable[[], StepResult]:
        """Starts the step ``plan`` describes as one compiled program (`programs.mixed_step`,
        `programs.decode_loop` when ``plan.decode_steps``, `programs.prepare`, run at once,
        when it has no chunks); returns a function that waits for it and gives its results.
        That function raises RuntimeError if a take started from other than the ``c.start``
        cached tokens its lookup found (the step's requests then fail)."""
        if not self.tracks_tokens and any(s.params.uses_penalties for s in plan.row_inits):
            self.start_tracking_tokens([q for q in plan.running if not q.needs_row_init])
        ops, ops_key = self._block_ops(plan)
        prompts = self._lookup_input(plan.lookups)
        if not plan.chunks:
            kind, fn, key, _, static = self._prepare_call(ops, ops_key, prompts)
            args = (self.state, ops, prompts)  # `call` takes the pages out (kv=False)
            self.state, num_free, cached, hits = self.call(kind, fn, key, args, static, kv=False)
            none = np.zeros((1, 0), np.int32)
            done = StepResult(none, none, none, none, none, none[0], none[0] > 0, int(num_free))
            done.cached, done.hits = cached, hits
            finish = lambda: done  # noqa: E731
        elif plan.decode_steps:
            finish = self._decode(plan, ops, ops_key)
        else:
            finish = self._mixed(plan, ops, prompts, ops_key)
        return lambda: self._checked(plan, finish())

    def _lookup_input(self, seqs: list[Sequence]):
        """The prompts a step looks up (`step_inputs.lookup_rows`), in one shape whether or
        not any wait (one compiled variant; the program skips an all-padding lookup). The
        all-padding input stays on the device: no bytes cross. None without prefix caching."""
        if self.state.found_blocks is None:
            return None
        if seqs or self._no_prompts is None:
            width = self.max_blocks_per_seq * self.config.block_size
            rows = step_inputs.lookup_rows(seqs, self.max_num_seqs, width)
            if seqs:
                return rows
            mesh = self.mesh
            self._no_prompts = (
                jax.device_put(rows) if mesh is None else shard.put_replicated(rows, mesh)
            )
        return self._no_prompts

    @staticmethod
    def _checked(plan: SchedulerOutput, result: StepResult) -> StepResult:
        cached, hits = result.cached, result.hits
        for i, c in enumerate(plan.fresh):
            if int(cached[i]) != c.start:
                raise RuntimeError(
                    f"prefix cache: the lookup found {c.start} tokens for request "
                    f"{c.seq.request_id} but taking found {int(cached[i])}"
                )
        if hits is not None:
            n = len(plan.lookups)
            result.hits = [(int(h), int(r)) for h, r in zip(hits[0][:n], hits[1][:n], strict=True)]
        return result

    def _block_ops(self, plan: SchedulerOutput) -> tuple[programs.BlockOps, tuple]:
        """The plan's block ops as padded host arrays and their shape key
        (`step_inputs.block_ops`), the stop-id width grown first if a new row needs it."""
        self._fit_stop_width(plan.row_inits)
        return step_inputs.block_ops(
            plan, self.max_num_seqs, self.stop_width, self.tracks_tokens, self._tensors
        )

    def start_tracking_tokens(self, running: list[Sequence]) -> None:
        """Switches the sampling history to per-slot token counts (penalties need them),
        filled in for the ``running`` sequences (one `programs.prepare` call, once per engine)."""
        s = self.state
        counts = sampling.init_state(self.max_num_seqs, self.vocab_size, track_tokens=True)
        counts = dataclasses.replace(counts, num_generated=s.sampling.num_generated)
        self.state = self._place(s.replace(sampling=counts))
        if running:
            self.execute(SchedulerOutput(chunks=[], preempted=[], row_inits=running))

    def _prepare_call(self, ops, ops_key, prompts) -> tuple:
        """(kind, fn, key, args, static) of the idle prepare (args without the K/V pages)."""
        args = (self.state.replace(kv=None), ops, prompts)
        return "prepare", programs.prepare, (self.tracks_tokens, ops_key), args, {}

    def _mixed_rows(self, num_tokens: int) -> tuple[int, int]:
        """The (tokens, rows) bucket of a mixed step of ``num_tokens`` tokens."""
        size = functools.partial(backend.padded_size, platform=self.platform)
        t = min(size(num_tokens, _MIN_TOKENS), size(self.max_num_batched_tokens, _MIN_TOKENS))
        # Rows follow tokens (each row has >= 1 token), so one bucket axis: t in 32, 64, ...,
        # max_num_batched_tokens, b = min(t, max_num_seqs) rows (the LM head runs on b rows).
        return t, min(t, size(self.max_num_seqs, 4))

    def _mixed_call(self, chunks, num_tokens: int, ops, prompts, ops_key) -> tuple:
        """(kind, fn, key, args, static, batch, want_plp) of a mixed step over ``chunks``."""
        t, b = self._mixed_rows(num_tokens)
        batch, want_plp = step_inputs.mixed_batch(chunks, t, b, self.max_num_seqs)
        plp_k = self.config.max_logprobs if want_plp else -1  # one variant, sliced on the host
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            num_top_logprobs=self.num_top,
            prompt_logprobs_k=plp_k,
        )
        key = (t, b, self.num_top, plp_k) + ops_key
        args = (self.params, self.state, ops, batch, self.key, prompts)
        return "mixed", programs.mixed_step, key, args, static, batch, want_plp

    def _mixed(self, plan: SchedulerOutput, ops: programs.BlockOps, prompts, ops_key):
        """One ragged batch of the plan's chunks (prefill chunks and decodes)."""
        chunks = plan.chunks
        *call, batch, want_plp = self._mixed_call(chunks, plan.num_tokens, ops, prompts, ops_key)
        launched = self.launch(*call)
        samples = np.asarray(batch.samples[: len(chunks)])
        return lambda: StepResult.of_mixed(jax.device_get(self.wait(launched)), samples, want_plp)

    def _decode_rows(self, n: int) -> int:
        """The rows bucket of a decode loop over ``n`` sequences."""
        size = functools.partial(backend.padded_size, platform=self.platform)
        return min(size(n, _MIN_DECODE_ROWS), size(self.max_num_seqs, 1))

    def _decode_call(self, seqs: list[Sequence], n: int, ops, ops_key, steps: int) -> tuple:
        """(kind, fn, key, args, static) of up to ``steps`` decode steps of ``seqs`` in the
        rows bucket of ``n`` sequences."""
        b = self._decode_rows(n)
        last = np.zeros(b, np.int32)
        row_slot = np.full(b, -1, np.int32)
        active = np.zeros(b, bool)
        for r, s in enumerate(seqs):
            last[r] = s.output_token_ids[-1]
            row_slot[r] = s.slot
            active[r] = True
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            max_steps=self.config.max_decode_steps,
            num_top_logprobs=self.num_top,
        )
        max_len, k = np.int32(self.max_model_len), np.int32(steps)
        args = (self.params, self.state, ops, last, row_slot, active, max_len, self.key, k)
        return "decode", programs.decode_loop, (b, self.num_top) + ops_key, args, static

    def _decode(self, plan: SchedulerOutput, ops: programs.BlockOps, ops_key):
        """Up to ``plan.decode_steps`` decode steps of the plan's sequences on the device (each
        row stops at its stop token, max_tokens or the model length)."""
        seqs = [c.seq for c in plan.chunks]
        call = self._decode_call(seqs, len(seqs), ops, ops_key, plan.decode_steps)
        launched = self.launch(*call)
        return lambda: StepResult.of_decode(jax.device_get(self.wait(launched)), len(seqs))


@dataclasses.dataclass
class _Launched:
    """A compiled call in flight: its kind, when it was dispatched, its (future) outputs."""

    kind: str
    start: float
    out: Any
