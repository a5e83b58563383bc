"""`ModelRunner`: the engine's device side. It owns the device state (KV pages, block manager,
sampling history) and the compiled programs, turns the scheduler's plan into padded arrays,
makes the calls and hands back plain host results (numpy).

Every call is one compiled program with the device state donated (updated in place, never
copied). Programs are compiled on first use per bucket key and kept; shapes are bucketed so a
long run compiles a handful of variants (`get_metrics()["compiled_variants"]`):

* ``prepare``: cache full blocks, free slots, fork, look prompts up in the prefix cache;
* ``admit``: start admitted sequences from the prefix cache, set their sampling rows;
* ``mixed``: prefill chunks and decodes in one ragged batch (`runner.mixed_step`);
* ``decode``: many decode steps on the device (`runner.decode_loop`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import block_manager as bm
from jax_paged import prefix_cache as pc
from jax_paged import runner, sampling
from jax_paged import sharding as shard
from jax_paged.config import kv_dtype
from jax_paged.scheduler import ScheduledChunk, Sequence, blocks_for
from models.llama import prepare_layer_weights

logger = logging.getLogger("jax_paged")

# Smallest padded sizes of the compiled steps. Below them a step costs about the same (the
# weights are read once whatever the batch), so smaller buckets would only add variants.
_MIN_TOKENS = 32
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
        self.mesh = mesh  # tensor parallelism (`jax_paged.sharding`), or None: one device
        self.graphdef, self.params = nnx.split(model)
        if mesh is not None:
            self.params = shard.shard_params(self.params, mesh)
        # On a CPU, each layer's kernels as separate arrays: no copy of them per step.
        self.params = prepare_layer_weights(model, self.params, mesh)
        self.dtype = model.dtype
        self.kv_dtype = kv_dtype(config, model.dtype)
        self.vocab_size = mc.vocab_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = blocks_for(max_model_len, config.block_size)
        self.eos_token_ids = list(eos_token_ids)
        self.opts = runner.AttentionOptions(
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
        self.state: runner.DeviceState | None = self.fresh_state(track_tokens=False)
        self.compiled: dict[tuple, Any] = {}
        self.compile_seconds = 0.0
        self.compile_by_program: dict[str, float] = {}
        self.seconds_by_kind: dict[str, float] = {}  # time inside compiled calls, per kind
        self.num_calls = 0
        self.call_seconds = 0.0

    # -- state -----------------------------------------------------------------------------
    def fresh_state(self, track_tokens: bool) -> runner.DeviceState:
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
        if not self.config.enable_prefix_caching:
            return self._place(runner.DeviceState(kv=kv, blocks=blocks, sampling=samp))
        s, p = self.max_num_seqs, self.max_blocks_per_seq
        return self._place(
            runner.DeviceState(
                kv=kv,
                blocks=blocks,
                sampling=samp,
                tokens=jnp.zeros((s, p * bs), jnp.int32),
                found_blocks=jnp.zeros((s, p), jnp.int32),
                found_len=jnp.zeros(s, jnp.int32),
            )
        )

    def _place(self, state: runner.DeviceState) -> runner.DeviceState:
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
            state, *rest = self._run(kind, fn, key, (args[0].replace(kv=None), *args[1:]), static)
            return (state.replace(kv=pages), *rest)
        return self._run(kind, fn, key, args, static)

    def _run(self, kind: str, fn, key: tuple, args: tuple, static: dict):
        ckey = (kind,) + key
        if self.mesh is not None:  # host inputs as global arrays (several hosts: the same)
            args = shard.put_replicated(args, self.mesh)
        compiled = self.compiled.get(ckey)
        if compiled is None:
            t0 = time.perf_counter()
            lowered = fn.lower(*args, **static)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            dt = time.perf_counter() - t0
            logger.debug("%s: traced in %.1fs, compiled in %.1fs", kind, t1 - t0, dt - (t1 - t0))
            self.compile_seconds += dt
            self.compiled[ckey] = compiled
            self.compile_by_program[_program_name(ckey)] = dt
            logger.info("compiled %s %s in %.1fs", kind, key, dt)
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        dt = time.perf_counter() - t0
        self.num_calls += 1
        self.call_seconds += dt
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + dt
        return out

    def token_rows(self, items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots i32[S], tokens i32[S, K], lengths i32[S]) for (slot, tokens) pairs, -1 and 0
        padded: the block manager's batched form of per-sequence token lists."""
        s, k = self.max_num_seqs, self.max_blocks_per_seq * self.config.block_size
        slots = np.full(s, -1, np.int32)
        tokens = np.zeros((s, k), np.int32)
        lens = np.zeros(s, np.int32)
        for i, (slot, toks) in enumerate(items):
            slots[i], lens[i] = slot, len(toks)
            tokens[i, : len(toks)] = toks
        return slots, tokens, lens

    def _free_mask(self, free_slots: list[int]) -> np.ndarray:
        mask = np.zeros(self.max_num_seqs, bool)
        mask[free_slots] = True
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

    # -- the programs ----------------------------------------------------------------------
    def prepare(self, free: list[int], forks, lookup):
        """Frees the ``free`` slots, applies the ``forks`` (parent slot, child slot) and looks
        up the ``lookup`` token lists in the prefix cache. Returns (free blocks, [(cached
        tokens, evictable blocks among them)] per lookup)."""
        parent = np.full(self.max_num_seqs, -1, np.int32)
        child = np.full(self.max_num_seqs, -1, np.int32)
        for i, (p, c) in enumerate(forks):
            parent[i], child[i] = p, c
        _, q_tokens, q_len = self.token_rows((-1, t) for t in lookup)
        args = (self.state, self._free_mask(free), parent, child, q_tokens, q_len)
        # The state's structure differs once penalties track tokens: one variant for each.
        key = (self.tracks_tokens,)
        self.state, num_free, hit, revive = self.call(
            "prepare", runner.prepare, key, args, {}, kv=False
        )
        found = [(int(hit[i]), int(revive[i])) for i in range(len(lookup))]
        return int(num_free), found

    def admit(self, seqs: list[Sequence], fresh: list[ScheduledChunk], running=()) -> int:
        """Starts the ``fresh`` chunks' sequences from the prefix cache in their slots (the
        blocks this step's `prepare` found for them, row ``seq.prefix_row``) and sets
        the sampling rows of the admitted ``seqs`` (their ``needs_row_init`` is cleared).
        The first sequence with penalties switches the sampling history to per-slot token
        counts, filled in for the other ``running`` sequences. Returns the free blocks. Raises
        RuntimeError if a fresh chunk's sequence matched other than the ``c.start`` cached
        tokens its lookup found."""
        if not self.tracks_tokens and any(s.params.uses_penalties for s in seqs):
            self.start_tracking_tokens([q for q in running if not q.needs_row_init])
        m = _pow2_at_least(max(len(seqs), self.max_num_seqs))  # one shape: one compiled variant
        slots = np.full(m, -1, np.int32)
        for i, s in enumerate(seqs):
            slots[i] = s.slot
        mslots = np.full(self.max_num_seqs, -1, np.int32)
        mrows = np.zeros(self.max_num_seqs, np.int32)
        for i, c in enumerate(fresh):
            mslots[i], mrows[i] = c.seq.slot, c.seq.prefix_row
        match = (mslots, mrows)
        if self.tracks_tokens:
            lp = _pow2_at_least(max(len(s.prompt_token_ids) for s in seqs), 16)
            lo = _pow2_at_least(max(len(s.output_token_ids) for s in seqs), 16)
            prompt = np.full((m, lp), -1, np.int32)
            out = np.full((m, lo), -1, np.int32)
            for i, s in enumerate(seqs):
                prompt[i, : len(s.prompt_token_ids)] = s.prompt_token_ids
                out[i, : len(s.output_token_ids)] = s.output_token_ids
            args = (self.state, *match, slots, prompt, out)
            key, fn = (m, lp, lo), _admit_tracked
        else:
            n_out = np.zeros(m, np.int32)
            for i, s in enumerate(seqs):
                n_out[i] = len(s.output_token_ids)
            args = (self.state, *match, slots, n_out)
            key, fn = (m,), _admit_untracked
        self.state, cached, num_free = self.call("admit", fn, key, args, {}, kv=False)
        for i, c in enumerate(fresh):
            if int(cached[i]) != c.start:
                raise RuntimeError(
                    f"prefix cache: the lookup found {c.start} tokens for request "
                    f"{c.seq.request_id} but matching found {int(cached[i])}"
                )
        for s in seqs:
            s.needs_row_init = False
        return int(num_free)

    def start_tracking_tokens(self, running: list[Sequence]) -> None:
        """Switches the sampling history to per-slot token counts (penalties need them),
        filled in for the ``running`` sequences."""
        s = self.state
        counts = sampling.init_state(self.max_num_seqs, self.vocab_size, track_tokens=True)
        counts = dataclasses.replace(counts, num_generated=s.sampling.num_generated)
        self.state = self._place(s.replace(sampling=counts))
        if running:
            self.admit(running, [])

    def mixed(self, chunks: list[ScheduledChunk], free: list[int]):
        """One ragged batch of the ``chunks`` (prefill chunks and decodes), after freeing the
        ``free`` slots. Returns (`runner.MixedOutput` as numpy, whether prompt log-probs were
        computed)."""
        num_tokens = sum(c.length for c in chunks)
        t = _pow2_at_least(num_tokens, _MIN_TOKENS)
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
            free_mask=self._free_mask(free),
            next_tokens=next_tokens,
        )
        seqs = [c.seq for c in chunks] + [None] * (b - len(chunks))
        tensors = self._tensors(seqs, b)
        ntop = self.num_top
        plp_k = self.config.max_logprobs if want_plp else -1  # one variant, sliced on the host
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            num_top_logprobs=ntop,
            prompt_logprobs_k=plp_k,
        )
        key = (t, b, ntop, plp_k, self.tracks_tokens, tensors.stop_token_ids.shape[1])
        args = (self.params, self.state, batch, tensors, self.key)
        self.state, out = self.call("mixed", runner.mixed_step, key, args, static)
        return jax.device_get(out), want_plp

    def decode(self, seqs: list[Sequence], k: int):
        """Up to ``k`` decode steps of ``seqs`` on the device (each row stops at its stop
        token, max_tokens or the model length). Returns `runner.DecodeOutput` as numpy."""
        b = min(_pow2_at_least(len(seqs), _MIN_DECODE_ROWS), _pow2_at_least(self.max_num_seqs))
        last = np.zeros(b, np.int32)
        row_slot = np.full(b, -1, np.int32)
        active = np.zeros(b, bool)
        max_len = np.zeros(b, np.int32)
        for r, s in enumerate(seqs):
            last[r] = s.output_token_ids[-1]
            row_slot[r] = s.slot
            active[r] = True
            max_len[r] = self.max_model_len
        tensors = self._tensors(seqs + [None] * (b - len(seqs)), b)
        ntop = self.num_top
        static = dict(
            graphdef=self.graphdef,
            opts=self.opts,
            max_steps=self.config.max_decode_steps,
            num_top_logprobs=ntop,
        )
        key = (b, ntop, self.tracks_tokens, tensors.stop_token_ids.shape[1])
        args = (self.params, self.state, last, row_slot, active, max_len, tensors, self.key)
        self.state, out = self.call("decode", runner.decode_loop, key, (*args, np.int32(k)), static)
        return jax.device_get(out)


# Admission: start sequences from the prefix cache, set their slots' sampling history. The
# whole device state is donated (the KV pool is passed through untouched, never copied).
def _take_found(state: runner.DeviceState, mslots, mrows):
    """Starts slots ``mslots`` (i32[M], -1 = padding) from what the last `prepare` found for
    its lookup rows ``mrows`` (i32[M])."""
    if state.found_blocks is None:  # no prefix caching: nothing can have been found
        return state.blocks, jnp.zeros(mslots.shape, jnp.int32)
    cand, matched = state.found_blocks[mrows], state.found_len[mrows]
    blocks, cached, _ = pc.take_prefix(state.blocks, mslots, cand, matched)
    return blocks, cached


@functools.partial(jax.jit, donate_argnums=0)
def _admit_untracked(state: runner.DeviceState, mslots, mrows, slots, n_out):
    blocks, cached = _take_found(state, mslots, mrows)
    s = state.sampling
    b = s.num_generated.shape[0]
    idx = jnp.where((slots >= 0) & (slots < b), slots, b)
    samp = dataclasses.replace(s, num_generated=s.num_generated.at[idx].set(n_out, mode="drop"))
    return state.replace(blocks=blocks, sampling=samp), cached, bm.num_free_blocks(blocks)


@functools.partial(jax.jit, donate_argnums=0)
def _admit_tracked(state: runner.DeviceState, mslots, mrows, slots, prompt, out):
    blocks, cached = _take_found(state, mslots, mrows)
    samp = sampling.set_rows(state.sampling, slots, prompt, out)
    return state.replace(blocks=blocks, sampling=samp), cached, bm.num_free_blocks(blocks)
