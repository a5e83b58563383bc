"""The device side of the engine: jit-compiled steps over the paged KV cache.

A step is one compiled program, specialised to a few padded shapes (buckets). Each starts
with the step's block ops (`apply_ops`: free, fork, take prefix hits, set sampling rows), so
that the host's whole plan for the step goes in with one call:

- `mixed_step`: one forward over a flattened ragged batch of ``T`` tokens from ``B`` rows
  (prefill chunks and decode tokens mixed), sampling at each row's last token, then a prefix
  lookup of the prompts that may be admitted next (`lookup`).
- `decode_loop`: up to ``num_steps`` decode steps in one ``lax.while_loop`` (all on the device:
  block reservation, forward, sampling, stop checks); the host syncs once per call.
- `prepare`: the block ops and a lookup without a forward (an idle engine's bookkeeping).

Each takes and returns the whole device state as one `DeviceState` pytree, donated so the KV pages
and the block manager are updated in place::

    DeviceState(kv, blocks, sampling)   kv: KVCache [L, KVH, N, bs, D]
                                        blocks: BlockManagerState (S slots)
                                        sampling: SamplingState (S rows, indexed by slot)

A batch row ``b`` runs the sequence in block-manager slot ``row_slot[b]``. Rows past
``num_rows`` are padding: they reserve nothing, attend to nothing (``kv_lens = 0``) and write
their K/V into the null block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax

from jax_paged.backend import paged_attention
from jax_paged.engine.device_state import (
    BlockOps,
    DeviceState,
    apply_ops,
    cache_filled,
    gather_rows,
    lookup,
    row_tensors,
    scatter_rows,
)
from jax_paged.memory import block_manager as bm
from jax_paged.memory import kv_cache as kvc
from jax_paged.parallel import sharding
from jax_paged.sampling import sampler as sampling


@struct.dataclass
class MixedBatch:
    """Host-built inputs of one `mixed_step`, padded to ``T`` tokens and ``B`` rows.

    Attributes:
      tokens: i32[T] input tokens, row after row. positions: i32[T] their positions.
      token_row: i32[T] the row of each token (padding tokens: -1).
      cu_q_lens: i32[B+1] row b owns tokens ``cu_q_lens[b]:cu_q_lens[b+1]``.
      num_rows: i32[] live rows.
      row_slot: i32[B] block-manager slot of each row (padding rows: -1).
      last_idx: i32[B] index of each row's last token (where its logits are taken).
      samples: bool[B] the row's chunk ends its sequence, so a token is sampled.
      num_new: i32[S] tokens to reserve per slot.
      next_tokens: i32[T] for prompt log-probs: the token after each input token (-1 if none).
    """

    tokens: jax.Array
    positions: jax.Array
    token_row: jax.Array
    cu_q_lens: jax.Array
    num_rows: jax.Array
    row_slot: jax.Array
    last_idx: jax.Array
    samples: jax.Array
    num_new: jax.Array
    next_tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Static attention settings handed to `pallas_kernels.paged_attention`.

    ``drop_window``: when every layer attends through this one sliding window, the steps
    return the blocks that fell out of it to the pool (`block_manager.drop_out_of_window`), so
    a sequence holds about ``window / block_size + 2`` blocks however long it grows.
    ``mesh``: a tensor-parallel `jax.sharding.Mesh` (`jax_paged.parallel.sharding`): the K/V
    write and the kernel run per shard, on each device's heads and pages.
    """

    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    impl: str = "auto"
    interpret: bool = False
    drop_window: int | None = None
    mesh: Any = None


def _copy_on_write(kv, res: bm.Reservation):
    return lax.cond(
        jnp.any(res.cow_src != res.cow_dst),
        lambda kv: kvc.copy_pages(kv, res.cow_src, res.cow_dst),
        lambda kv: kv,
        kv,
    )


def paged_attn(opts: AttentionOptions, slots, block_tables, kv_lens, cu_q_lens=None, num_rows=None):
    """The model's attention function over the paged cache (the model sees ``B == 1``).

    With ``cu_q_lens`` the flattened tokens form a ragged batch (prefill chunks and decodes);
    without, there is one decode token per row.
    """

    def write_and_attend(layer, q, k, v, pages_k, pages_v, slots, *rest, sliding_window):
        # `layer` is the traced counter of the model's layer scan and the pages its carry: the
        # write scatters into the stacked pages in place and the kernel reads them through the
        # index (a `kv.k[layer]` slice would copy the layer's whole pool every step).
        kv = kvc.scatter(kvc.KVCache(k=pages_k, v=pages_v), layer, k, v, slots)
        out = paged_attention(
            q,
            kv.k,
            kv.v,
            *rest,
            layer=layer,
            scale=opts.scale,
            sliding_window=sliding_window,
            soft_cap=opts.soft_cap,
            impl=opts.impl,
            interpret=opts.interpret,
        )
        return out, kv.k, kv.v

    tables = (block_tables, kv_lens) + (() if cu_q_lens is None else (cu_q_lens, num_rows))

    def attn(layer, q, k, v, kv, sliding_window=opts.sliding_window):
        fn = functools.partial(write_and_attend, sliding_window=sliding_window)
        if opts.mesh is not None:
            fn = sharding.shard_map_attention(fn, opts.mesh, 1 + len(tables))
        out, pk, pv = fn(layer, q[0], k[0], v[0], kv.k, kv.v, slots, *tables)
        return out[None], kv.replace(k=pk, v=pv)

    return attn


class StepOutput(struct.PyTreeNode):
    """Per-row results of a `mixed_step` (``N`` top log-probs, ``T`` tokens)."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]
    ranks: jax.Array  # i32[B]
    top_ids: jax.Array  # i32[B, N]
    top_logprobs: jax.Array  # f32[B, N]
    num_free: jax.Array  # i32[] free blocks after the step
    sole: jax.Array  # i32[S] blocks freeing each slot would give back (`bm.sole_blocks`)
    ok: jax.Array  # bool[B] the row's reservation succeeded (False: nothing ran for it)
    cached: jax.Array  # i32[M] tokens each take started from (`apply_ops`)
    hits: Any = None  # (i32[M], i32[M]) what the lookup after the step found, or None
    prompt_lp: Any = None  # (f32[T], i32[T], i32[T, K], f32[T, K]) or None


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "opts", "num_top_logprobs", "prompt_logprobs_k", "greedy_only"),
    donate_argnames=("state",),
)
def mixed_step(
    params,
    state: DeviceState,
    ops: BlockOps,
    batch: MixedBatch,
    key: jax.Array,
    prompts=None,
    *,
    graphdef,
    opts: AttentionOptions,
    num_top_logprobs: int = 0,
    prompt_logprobs_k: int = -1,
    greedy_only: bool = False,
) -> tuple[DeviceState, StepOutput]:
    """One step over a ragged batch, each row sampled with its slot's parameters
    (`DeviceState.rows`).

    Order on the device: the block ops (`apply_ops`: free, fork, take prefix hits, set
    sampling rows); reserve ``num_new`` tokens per slot (copy-on-write applied to the pages);
    write each token's K/V at its slot and attend through the block tables; sample at each
    row's last token where ``samples``; add the blocks the step filled to the prefix cache;
    look the ``prompts`` (`lookup`) up for the next step.
    """
    model = nnx.merge(graphdef, params)
    state, cached = apply_ops(state, ops)
    before = state.blocks
    blocks, res = bm.reserve(before, batch.num_new)
    kv = _copy_on_write(state.kv, res)

    b = batch.row_slot.shape[0]
    row_valid = jnp.arange(b) < batch.num_rows
    row_slot = jnp.where(row_valid, batch.row_slot, -1)
    tok_slot = jnp.where(batch.token_row >= 0, row_slot[jnp.clip(batch.token_row, 0)], -1)
    slots = bm.token_slots(blocks, tok_slot, batch.positions)
    safe_slot = jnp.clip(row_slot, 0)
    block_tables = blocks.block_tables[safe_slot]
    kv_lens = jnp.where(row_valid, blocks.seq_lens[safe_slot], 0)

    attn = paged_attn(opts, slots, block_tables, kv_lens, batch.cu_q_lens, batch.num_rows)
    hidden_idx = batch.last_idx if prompt_logprobs_k < 0 else None
    logits, kv = model.forward(
        batch.tokens[None], batch.positions[None], attn, kv, logits_indices=hidden_idx
    )
    logits = logits[0]
    prompt_lp = None
    if prompt_logprobs_k >= 0:
        safe_next = jnp.clip(batch.next_tokens, 0)
        prompt_lp = sampling.compute_prompt_logprobs(logits, safe_next, prompt_logprobs_k)
        logits = logits[batch.last_idx]

    rows = gather_rows(state.sampling, safe_slot)
    tensors = row_tensors(state, row_slot)
    out = sampling.sample(
        logits, tensors, rows, key, num_top_logprobs=num_top_logprobs, greedy_only=greedy_only
    )
    active = row_valid & batch.samples & res.ok[safe_slot]
    rows = sampling.update_counts(rows, out.tokens, active)
    samp = scatter_rows(state.sampling, rows, row_slot, active)
    written = (tok_slot >= 0) & res.ok[jnp.clip(tok_slot, 0)]
    t, bs = batch.tokens.shape[0], blocks.block_size
    tokens, blocks = cache_filled(
        state.tokens, blocks, before, tok_slot, batch.positions, batch.tokens, written, t // bs + 1
    )
    if opts.drop_window is not None:  # all of them: a prefix-cache hit may bring many
        blocks = bm.drop_out_of_window(blocks, opts.drop_window)
    new_state = state.replace(kv=kv, blocks=blocks, sampling=samp, tokens=tokens)
    new_state, hits = lookup(new_state, prompts)
    return new_state, StepOutput(
        tokens=out.tokens,
        logprobs=out.logprobs,
        ranks=out.ranks,
        top_ids=out.top_ids,
        top_logprobs=out.top_logprobs,
        num_free=bm.num_free_blocks(blocks),
        sole=bm.sole_blocks(blocks),
        ok=res.ok[safe_slot] | ~row_valid,
        cached=cached,
        hits=hits,
        prompt_lp=prompt_lp,
    )


class DecodeOutput(struct.PyTreeNode):
    """Results of a `decode_loop` over ``K`` steps of ``B`` rows."""

    tokens: jax.Array  # i32[K, B], -1 where the row did not run
    logprobs: jax.Array  # f32[K, B]
    ranks: jax.Array  # i32[K, B]
    top_ids: jax.Array  # i32[K, B, N]
    top_logprobs: jax.Array  # f32[K, B, N]
    num_steps: jax.Array  # i32[] steps run
    num_free: jax.Array  # i32[]
    sole: jax.Array  # i32[S] as `StepOutput.sole`
    cached: jax.Array  # i32[M] tokens each take started from (`apply_ops`)


def decode_step(
    model,
    state: DeviceState,
    last_tokens: jax.Array,
    row_slot: jax.Array,
    active: jax.Array,
    tensors: sampling.SamplingTensors,
    key: jax.Array,
    *,
    opts: AttentionOptions,
    num_top_logprobs: int = 0,
    greedy_only: bool = False,
):
    """One decode token for every active row: reserve, forward, sample. Pure and jittable.

    Args:
      model: the NNX model (merged inside the caller's trace).
      state: the device state.
      last_tokens: i32[B] each row's newest token (its K/V is not yet in the cache).
      row_slot: i32[B] the block-manager slot of each row.
      active: bool[B] rows that decode (others are untouched).
      tensors: sampling parameters, one row per batch row.
      key: the engine's base key.

    Returns:
      (state, sampler output, ok bool[B]): rows whose reservation failed (pool exhausted) are
      not ``ok`` and sample nothing.
    """
    s = state.blocks.max_seqs
    safe_slot = jnp.clip(row_slot, 0, s - 1)
    num_new = jnp.zeros((s,), jnp.int32).at[jnp.where(active, row_slot, s)].add(1, mode="drop")
    blocks, res = bm.reserve(state.blocks, num_new)
    kv = _copy_on_write(state.kv, res)
    ok = active & res.ok[safe_slot]
    positions = blocks.seq_lens[safe_slot] - 1
    slots = bm.token_slots(blocks, jnp.where(ok, row_slot, -1), positions)
    block_tables = blocks.block_tables[safe_slot]
    kv_lens = jnp.where(ok, blocks.seq_lens[safe_slot], 0)
    attn = paged_attn(opts, slots, block_tables, kv_lens)
    logits, kv = model.forward(last_tokens[None], jnp.maximum(positions, 0)[None], attn, kv)
    rows = gather_rows(state.sampling, safe_slot)
    out = sampling.sample(
        logits[0], tensors, rows, key, num_top_logprobs=num_top_logprobs, greedy_only=greedy_only
    )
    rows = sampling.update_counts(rows, out.tokens, ok)
    samp = scatter_rows(state.sampling, rows, row_slot, ok)
    tokens, blocks = cache_filled(
        state.tokens, blocks, state.blocks, row_slot, positions, last_tokens, ok, 1
    )
    if opts.drop_window is not None:  # one token more: at most one more block out of it
        blocks = bm.drop_out_of_window(blocks, opts.drop_window, band=1)
    return state.replace(kv=kv, blocks=blocks, sampling=samp, tokens=tokens), out, ok


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "opts", "max_steps", "num_top_logprobs", "greedy_only"),
    donate_argnames=("state",),
)
def decode_loop(
    params,
    state: DeviceState,
    ops: BlockOps,
    last_tokens: jax.Array,
    row_slot: jax.Array,
    active: jax.Array,
    max_len: jax.Array,
    key: jax.Array,
    num_steps: jax.Array,
    *,
    graphdef,
    opts: AttentionOptions,
    max_steps: int,
    num_top_logprobs: int = 0,
    greedy_only: bool = False,
) -> tuple[DeviceState, DecodeOutput]:
    """The block ops (`apply_ops`), then up to ``num_steps`` (<= ``max_steps``) decode steps
    on the device, no host round trip, each row sampled with its slot's parameters
    (`DeviceState.rows`).

    A row stops after sampling a stop token (EOS unless ignore_eos, its stop_token_ids), on
    reaching its max_tokens, or when its sequence reaches ``max_len`` tokens (i32[]). The
    loop ends early when no row is active. Stop strings are the host's business.
    """
    model = nnx.merge(graphdef, params)
    state, cached = apply_ops(state, ops)
    tensors = row_tensors(state, jnp.where(active, row_slot, -1))
    b = last_tokens.shape[0]
    n = num_top_logprobs
    out0 = DecodeOutput(
        tokens=jnp.full((max_steps, b), -1, jnp.int32),
        logprobs=jnp.zeros((max_steps, b), jnp.float32),
        ranks=jnp.zeros((max_steps, b), jnp.int32),
        top_ids=jnp.zeros((max_steps, b, n), jnp.int32),
        top_logprobs=jnp.zeros((max_steps, b, n), jnp.float32),
        num_steps=jnp.int32(0),
        num_free=jnp.int32(0),
        sole=jnp.zeros((state.blocks.max_seqs,), jnp.int32),
        cached=cached,
    )

    def cond(carry):
        _, _, active, out = carry
        return (out.num_steps < num_steps) & jnp.any(active)

    def body(carry):
        state, last, active, out = carry
        state, smp, ok = decode_step(
            model,
            state,
            last,
            row_slot,
            active,
            tensors,
            key,
            opts=opts,
            num_top_logprobs=n,
            greedy_only=greedy_only,
        )
        i = out.num_steps
        seq_len = state.blocks.seq_lens[jnp.clip(row_slot, 0, state.blocks.max_seqs - 1)]
        rows = gather_rows(state.sampling, row_slot)
        stop = (
            sampling.is_stop_token(tensors, smp.tokens)
            | sampling.reached_max_tokens(tensors, rows)
            | (seq_len + 1 >= max_len)
        )
        out = out.replace(
            tokens=out.tokens.at[i].set(jnp.where(ok, smp.tokens, -1)),
            logprobs=out.logprobs.at[i].set(smp.logprobs),
            ranks=out.ranks.at[i].set(smp.ranks),
            top_ids=out.top_ids.at[i].set(smp.top_ids),
            top_logprobs=out.top_logprobs.at[i].set(smp.top_logprobs),
            num_steps=i + 1,
        )
        last = jnp.where(ok, smp.tokens, last)
        return state, last, ok & ~stop, out

    state, _, _, out = lax.while_loop(cond, body, (state, last_tokens, active, out0))
    blocks = state.blocks
    return state, out.replace(num_free=bm.num_free_blocks(blocks), sole=bm.sole_blocks(blocks))


@functools.partial(jax.jit, donate_argnames=("state",))
def prepare(state: DeviceState, ops: BlockOps, prompts=None):
    """The block ops (`apply_ops`) and a lookup (`lookup`) with no forward: what an idle
    engine does (free what finished, look up the prompts that just arrived) and what starts
    token tracking for running rows. Neither reads nor writes the K/V pages.

    Returns:
      (state, free blocks i32[], cached tokens i32[M] per take, the lookup's hits or None).
    """
    state, cached = apply_ops(state, ops)
    state, hits = lookup(state, prompts)
    return state, bm.num_free_blocks(state.blocks), cached, hits
