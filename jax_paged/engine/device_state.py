"""The engine's device state (`DeviceState`) and what a step does to it before its forward
(`apply_ops`: free, fork, take prefix hits, start sampling rows, from one `BlockOps`), plus the
prefix lookup a step ends with (`lookup`). All pure and jittable; the compiled programs that
use them are in `jax_paged.engine.programs`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jax_paged.memory import block_manager as bm
from jax_paged.memory import kv_cache as kvc
from jax_paged.memory import prefix_cache as pc
from jax_paged.sampling import sampler as sampling


@struct.dataclass
class DeviceState:
    """Everything that lives on the device between steps.

    Attributes:
      kv: the K/V pages, ``[L, KVH, N, bs, D]`` each.
      blocks: block tables, refcounts and free pool (``S`` sequence slots).
      sampling: per-slot sampling history (``num_generated``, optional penalty counts).
      tokens: with prefix caching, i32[S, P * bs] each slot's input tokens by position, written
        by the steps as they compute them, so that every block is added to the prefix cache in
        the step that fills it (`prefix_cache.cache_new_blocks`); None without caching.
      found_blocks, found_len: with prefix caching, i32[M, P] and i32[M]: what the last
        `prepare` found for each prompt it looked up (`prefix_cache.lookup_blocks`), so that
        admitting them takes those blocks without their tokens crossing again.
      rows: the engine's persistent batch: each slot's sampling parameters
        (`SamplingTensors` of ``S`` rows), set once when its sequence (re)starts
        (`BlockOps.init_tensors`) and read by every step through the slot, so a step ships
        no per-row parameters. None for callers that pass tensors per call (`decode_step`).
    """

    kv: kvc.KVCache
    blocks: bm.BlockManagerState
    sampling: sampling.SamplingState
    tokens: jax.Array | None = None
    found_blocks: jax.Array | None = None
    found_len: jax.Array | None = None
    rows: sampling.SamplingTensors | None = None


def cache_filled(tokens, blocks, old_blocks, slot, positions, values, write, max_new):
    """With caching (``tokens`` not None): records ``values`` at (``slot``, ``positions``) where
    ``write`` and adds the blocks they filled since ``old_blocks`` (the block manager before
    this step's reservation) to the prefix cache. Returns (tokens, blocks)."""
    if tokens is None:
        return None, blocks
    s = tokens.shape[0]
    tokens = tokens.at[jnp.where(write, slot, s), positions].set(values, mode="drop")
    return tokens, pc.cache_new_blocks(blocks, tokens, old_blocks.seq_lens, max_new)


@struct.dataclass
class BlockOps:
    """What a step does to the state before its forward (`apply_ops`), in this order: free
    slots, fork, free the slots the plan preempted, start admitted sequences from the prefix
    cache, (re)start sampling rows. Host-built lists of ``M`` entries (a small bucket, or
    ``S``), padded with -1.

    Attributes:
      free_slots: i32[M] slots to free first (finished, aborted, refused, preempted before).
      fork_parent, fork_child: i32[M] slot pairs: the child shares all the parent's blocks
        (and, with caching, its token row). A child's slot may be one freed just before.
      preempt_slots: i32[M] slots of the sequences this plan preempted, freed after the forks
        (a parent forked in this step may be one of them: its child keeps the blocks).
      take_slot, take_row: i32[M]: slot ``take_slot[i]`` starts from the blocks the last
        lookup found for its row ``take_row[i]`` (`prefix_cache.take_prefix`).
      init_slot: i32[M] slots whose sampling row (re)starts.
      init_out: i32[M] tokens each of them has generated or, when the sampling state tracks
        tokens (penalties), i32[M, Lo] those tokens, -1 padded.
      init_prompt: with tracked tokens, i32[M, Lp] each prompt, -1 padded; else None.
      init_tensors: the sampling parameters of those rows (`SamplingTensors` of ``M`` rows),
        written into `DeviceState.rows`; None when the state holds no rows.
    """

    free_slots: jax.Array
    fork_parent: jax.Array
    fork_child: jax.Array
    preempt_slots: jax.Array
    take_slot: jax.Array
    take_row: jax.Array
    init_slot: jax.Array
    init_out: jax.Array
    init_prompt: jax.Array | None = None
    init_tensors: sampling.SamplingTensors | None = None


def _slot_mask(slots: jax.Array, s: int) -> jax.Array:
    """bool[S]: True at the slots of ``slots`` (i32[M], -1 = padding)."""
    return jnp.zeros(s, bool).at[jnp.where(slots >= 0, slots, s)].set(True, mode="drop")


def apply_ops(state: DeviceState, ops: BlockOps) -> tuple[DeviceState, jax.Array]:
    """Applies ``ops`` (see `BlockOps`). Returns (state, cached tokens i32[M] per take)."""
    s = state.blocks.max_seqs
    blocks = bm.free(state.blocks, _slot_mask(ops.free_slots, s))
    blocks, _ = bm.fork(blocks, ops.fork_parent, ops.fork_child)
    tokens = state.tokens
    if tokens is not None:
        pair = (ops.fork_parent >= 0) & (ops.fork_child >= 0)
        src = tokens[jnp.clip(ops.fork_parent, 0, s - 1)]
        tokens = tokens.at[jnp.where(pair, ops.fork_child, s)].set(src, mode="drop")
    blocks = bm.free(blocks, _slot_mask(ops.preempt_slots, s))
    if state.found_blocks is None:  # no prefix caching: nothing can have been found
        cached = jnp.zeros(ops.take_slot.shape, jnp.int32)
    else:
        cand, matched = state.found_blocks[ops.take_row], state.found_len[ops.take_row]
        blocks, cached, _ = pc.take_prefix(blocks, ops.take_slot, cand, matched)
    samp = state.sampling
    if ops.init_prompt is not None:
        samp = sampling.set_rows(samp, ops.init_slot, ops.init_prompt, ops.init_out)
    else:
        b = samp.num_generated.shape[0]
        idx = jnp.where((ops.init_slot >= 0) & (ops.init_slot < b), ops.init_slot, b)
        gen = samp.num_generated.at[idx].set(ops.init_out, mode="drop")
        samp = dataclasses.replace(samp, num_generated=gen)
    rows = state.rows
    if rows is not None and ops.init_tensors is not None:
        rows = scatter_rows(rows, ops.init_tensors, ops.init_slot, ops.init_slot >= 0)
    new = state.replace(blocks=blocks, tokens=tokens, sampling=samp, rows=rows)
    return new, cached


def row_tensors(state: DeviceState, row_slot: jax.Array) -> sampling.SamplingTensors:
    """The sampling parameters of batch rows ``row_slot`` (i32[B], -1 = padding) out of the
    persistent batch; padding rows are greedy and ask for no log-probs."""
    t = gather_rows(state.rows, row_slot)
    valid = row_slot >= 0
    return dataclasses.replace(
        t,
        temperature=jnp.where(valid, t.temperature, 0.0),
        num_logprobs=jnp.where(valid, t.num_logprobs, -1),
    )


def lookup(state: DeviceState, prompts) -> tuple[DeviceState, Any]:
    """Looks the ``prompts`` (i32[M, K] tokens, i32[M] lengths; 0 = padding) up in the prefix
    cache without taking anything, and keeps what it found (``found_blocks``, ``found_len``)
    for the next step's takes (nothing evicts before them: only a reservation does). Returns
    (state, (cached tokens i32[M], evictable blocks among them i32[M])), or (state, None)
    when ``prompts`` is None. All-padding ``prompts`` (no row with a length) skip the lookup
    at run time and keep what the last one found: every step can pass the same shapes (one
    compiled variant) and pay for a lookup only when prompts are waiting."""
    if prompts is None:
        return state, None
    tokens, lens = prompts

    def run(blocks):
        cand, matched = pc.lookup_blocks(blocks, tokens, lens)
        return cand, matched, pc.prefix_hits(blocks, cand, matched)

    def skip(blocks):
        zero = jnp.zeros_like(state.found_len)
        return state.found_blocks, state.found_len, (zero, zero)

    cand, matched, hits = jax.lax.cond(jnp.any(lens > 0), run, skip, state.blocks)
    return state.replace(found_blocks=cand, found_len=matched), hits


def gather_rows(tree, idx):
    """Rows ``idx`` of every [S, ...] leaf (idx clipped; padding rows read slot 0)."""
    return jax.tree.map(lambda a: a[jnp.clip(idx, 0, a.shape[0] - 1)], tree)


def scatter_rows(tree, rows, idx, valid):
    """Writes ``rows`` back at ``idx`` where ``valid`` (others dropped)."""

    def put(a, r):
        i = jnp.where(valid, idx, a.shape[0])
        return a.at[i].set(r, mode="drop")

    return jax.tree.map(put, tree, rows)
