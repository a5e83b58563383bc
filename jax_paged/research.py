"""Pure, jittable paged decoding for research code: no engine, no host loop.

`PagedDecoder` holds only static things (the model's graph, sizes, attention options). Its
methods are pure functions of ``(params, state)``, so they go inside your own ``jit``,
``lax.scan`` or ``while_loop``::

    dec = PagedDecoder(model, max_seqs=8, max_len=256)
    params = dec.params                                   # nnx.State of the weights
    state = dec.init(SamplingParams(temperature=0.0))     # cache + block manager + sampling
    state, first = dec.prefill(params, state, prompts, prompt_lens)   # i32[B, Lmax], i32[B]

    @jax.jit
    def run(params, state):
        return jax.lax.scan(lambda s, _: dec.decode_step(params, s), state, None, length=64)

    state, tokens = run(params, state)                    # tokens: i32[64, B]

Blocks are allocated inside ``decode_step`` as sequences cross block boundaries, from a pool
sized by default so that every row can reach ``max_len``. A row stops (its tokens become -1)
after a stop token, at its max_tokens, at ``max_len``, or if the pool runs dry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jax_paged import block_manager as bm
from jax_paged import kv_cache as kvc
from jax_paged import runner, sampling
from jax_paged.sampling_params import SamplingParams
from jax_paged.scheduler import blocks_for


@struct.dataclass
class DecodeState:
    """The whole decoding state of ``B`` rows, a pytree of arrays.

    Attributes:
      device: KV pages ``[L, KVH, N, bs, D]``, block manager (``B`` slots), sampling history.
      last_tokens: i32[B] each row's newest token (not yet in the cache).
      active: bool[B] rows still generating.
      tensors: per-row sampling parameters.
      key: u32[2] base key for rows without a seed.
    """

    device: runner.DeviceState
    last_tokens: jax.Array
    active: jax.Array
    tensors: sampling.SamplingTensors
    key: jax.Array


class PagedDecoder:
    """Static description of a paged decoder over an NNX model.

    Args:
      model: a `models.Transformer` (or any model with the same ``forward``).
      max_seqs: B, rows decoded together.
      max_len: longest sequence (prompt + generated).
      block_size: tokens per KV block.
      num_blocks: KV pool size (null block included); default enough for every row to
        reach ``max_len``.
      eos_token_ids: stop ids added to every row (unless its ignore_eos).
      attention_impl: `pallas_kernels.paged_attention` implementation.
    """

    def __init__(
        self,
        model,
        *,
        max_seqs: int,
        max_len: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        eos_token_ids: Sequence[int] = (),
        attention_impl: str = "auto",
    ):
        self.graphdef, self.params = nnx.split(model)
        self.config = c = model.config
        self.dtype = model.dtype
        self.max_seqs, self.max_len, self.block_size = max_seqs, max_len, block_size
        self.max_blocks_per_seq = blocks_for(max_len, block_size)
        self.num_blocks = num_blocks or max_seqs * self.max_blocks_per_seq + 1
        self.eos_token_ids = list(eos_token_ids)
        self.greedy_only = False  # set by `init`: every row greedy -> a smaller program
        self.opts = runner.AttentionOptions(
            scale=c.scale, sliding_window=c.sliding_window, impl=attention_impl
        )

    def init(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, seed=0
    ) -> DecodeState:
        """An empty state. ``sampling_params``: one for all rows or one per row."""
        b = self.max_seqs
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams(temperature=0.0)] * b
        if len(sampling_params) != b:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {b} rows")
        track = any(p.uses_penalties for p in sampling_params)
        self.greedy_only = all(p.is_greedy for p in sampling_params)
        c = self.config
        device = runner.DeviceState(
            kv=kvc.KVCache.create(
                c.num_layers,
                c.num_kv_heads,
                c.head_dim,
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                dtype=self.dtype,
            ),
            blocks=bm.init_state(self.num_blocks, self.block_size, b, self.max_blocks_per_seq),
            sampling=sampling.init_state(b, c.vocab_size, track_tokens=track),
        )
        tensors = sampling.SamplingTensors.from_params(
            list(sampling_params),
            vocab_size=c.vocab_size,
            eos_token_ids=self.eos_token_ids,
            request_uids=list(range(b)),
        )
        return DecodeState(
            device=device,
            last_tokens=jnp.zeros(b, jnp.int32),
            active=jnp.zeros(b, bool),
            tensors=tensors,
            key=jax.random.key_data(jax.random.key(seed)),
        )

    def prefill(self, params, state: DecodeState, prompts, prompt_lens):
        """Prefills row b with ``prompts[b, :prompt_lens[b]]`` and samples its first token.

        Args:
          prompts: i32[B, Lmax] (padding ignored); prompt_lens: i32[B] (0 = row unused).

        Returns:
          (state, first tokens i32[B], -1 for unused rows). Pure and jittable.
        """
        model = nnx.merge(self.graphdef, params)
        b, lmax = prompts.shape
        prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(prompt_lens)])
        t = b * lmax
        j = jnp.arange(lmax)[None, :]
        valid = j < prompt_lens[:, None]  # [B, Lmax]
        dest = jnp.where(valid, cu[:-1, None] + j, t)  # flat index of each valid token
        tokens = jnp.zeros(t, jnp.int32).at[dest].set(prompts, mode="drop")
        positions = (
            jnp.zeros(t, jnp.int32).at[dest].set(jnp.broadcast_to(j, (b, lmax)), mode="drop")
        )
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, lmax))
        token_row = jnp.full(t, -1, jnp.int32).at[dest].set(rows, mode="drop")

        blocks, _ = bm.reserve(state.device.blocks, prompt_lens)
        slots = bm.token_slots(blocks, token_row, positions)
        attn = runner._paged_attn(
            self.opts, slots, blocks.block_tables, blocks.seq_lens, cu, jnp.int32(b)
        )
        last_idx = jnp.maximum(cu[1:] - 1, 0)
        logits, kv = model.forward(
            tokens[None], positions[None], attn, state.device.kv, logits_indices=last_idx
        )
        used = prompt_lens > 0
        out = sampling.sample(
            logits[0],
            state.tensors,
            state.device.sampling,
            state.key,
            greedy_only=self.greedy_only,
        )
        samp = sampling.update_counts(state.device.sampling, out.tokens, used)
        if samp.tracks_tokens:
            prompt_mask = jnp.zeros_like(samp.prompt_mask)
            prompt_mask = prompt_mask.at[rows, jnp.where(valid, prompts, samp.prompt_mask.shape[1])]
            samp = dataclasses.replace(samp, prompt_mask=prompt_mask.set(True, mode="drop"))
        first = jnp.where(used, out.tokens, -1)
        stop = sampling.is_stop_token(state.tensors, out.tokens)
        stop |= sampling.reached_max_tokens(state.tensors, samp) | (prompt_lens + 1 >= self.max_len)
        device = runner.DeviceState(kv=kv, blocks=blocks, sampling=samp)
        new = state.replace(device=device, last_tokens=jnp.maximum(first, 0), active=used & ~stop)
        return new, first

    def decode_step(self, params, state: DecodeState):
        """One token for every active row: ``(params, state) -> (state, tokens i32[B])``,
        -1 for rows that are not active. Pure; use it as a ``lax.scan`` body."""
        model = nnx.merge(self.graphdef, params)
        b = self.max_seqs
        rows = jnp.arange(b, dtype=jnp.int32)
        device, out, ok = runner.decode_step(
            model,
            state.device,
            state.last_tokens,
            rows,
            state.active,
            state.tensors,
            state.key,
            opts=self.opts,
            greedy_only=self.greedy_only,
        )
        seq_len = device.blocks.seq_lens
        stop = sampling.is_stop_token(state.tensors, out.tokens)
        stop |= sampling.reached_max_tokens(state.tensors, device.sampling)
        stop |= seq_len + 1 >= self.max_len
        tokens = jnp.where(ok, out.tokens, -1)
        new = state.replace(
            device=device,
            last_tokens=jnp.where(ok, out.tokens, state.last_tokens),
            active=ok & ~stop,
        )
        return new, tokens

    def release(self, state: DecodeState) -> DecodeState:
        """Frees every row's blocks (pure)."""
        blocks = bm.free(state.device.blocks, jnp.ones(self.max_seqs, bool))
        return state.replace(
            device=state.device.replace(blocks=blocks), active=state.active & False
        )
