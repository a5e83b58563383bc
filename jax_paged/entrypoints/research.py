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

``dec.params`` is ``nnx.split(model)``'s state, except that on one CPU device the layer kernels
of a model with ``per_layer_weights`` (`models.Transformer`) are held per layer
(`jax_paged.backend.prepare_params`, about 1.4x faster decode at batch 8); ``nnx.state(model)``
works as well, at the stacked form's speed.

Blocks are allocated inside ``decode_step`` as sequences cross block boundaries, from a pool
sized by default so that every row can reach ``max_len``. A row stops (its tokens become -1)
after a stop token, at its max_tokens, at ``max_len``, or if the pool runs dry.

Every row's state is in ``state.status`` (i32[B], a `RowStatus`); ``dec.describe(state)`` turns
it into words on the host::

    UNUSED          0  prompt_len 0 (or after `release`): the row holds nothing
    RUNNING         1  still generating
    STOP            2  stopped by a stop token (EOS unless ignore_eos, or its stop_token_ids)
    MAX_TOKENS      3  stopped at its max_tokens
    MAX_LEN         4  stopped when its sequence reached ``max_len`` tokens
    NO_BLOCKS       5  no KV blocks: its prefill reservation was refused (it produced no token
                       and wrote no K/V), or the pool ran dry in `decode_step` (it keeps the
                       tokens it had and its blocks until `release`)
    INVALID_PROMPT  6  its prompt length, traced under jit, was < 0, > Lmax or > max_len - 1
                       (no token, no K/V, no blocks)

When a row's token meets several stop conditions at once the status is the first of STOP,
MAX_TOKENS, MAX_LEN. Prefill reserves in row order, first come first served: once a prompt
does not fit in the free blocks no later prompt is given any.

What `prefill` refuses with a ValueError at the call (before any work): prompts wider than
``max_len`` (``Lmax > max_len``), and, when ``prompt_lens`` is concrete (not traced), any
``prompt_lens[b] > max_len - 1`` (one token must be generatable), ``> Lmax`` or ``< 0``. Under
``jit`` with traced lengths those rows get INVALID_PROMPT instead.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jax_paged import backend
from jax_paged.engine import programs
from jax_paged.engine.config import KV_CACHE_DTYPES
from jax_paged.engine.sequence import blocks_for
from jax_paged.entrypoints.sampling_params import SamplingParams
from jax_paged.memory import block_manager as bm
from jax_paged.parallel import sharding as shard
from jax_paged.sampling import sampler as sampling
from models.protocol import check_model


class RowStatus(enum.IntEnum):
    """Why a row is (not) generating: the values of ``DecodeState.status`` (see the module
    docstring for their meaning and precedence)."""

    UNUSED = 0
    RUNNING = 1
    STOP = 2
    MAX_TOKENS = 3
    MAX_LEN = 4
    NO_BLOCKS = 5
    INVALID_PROMPT = 6

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    RowStatus.UNUSED: "unused (prompt_len 0)",
    RowStatus.RUNNING: "running",
    RowStatus.STOP: "stopped: stop token (EOS or stop_token_ids)",
    RowStatus.MAX_TOKENS: "stopped: max_tokens reached",
    RowStatus.MAX_LEN: "stopped: max_len reached",
    RowStatus.NO_BLOCKS: "stopped: no KV blocks (the pool ran out)",
    RowStatus.INVALID_PROMPT: "invalid prompt length (< 0, > Lmax or > max_len - 1)",
}


def _finish(status, ran, stop_token, max_tokens, max_len):
    """Status after a row that ``ran`` sampled a token: the first stop reason that applies
    (STOP, MAX_TOKENS, MAX_LEN), else RUNNING; rows that did not run keep ``status``."""
    new = jnp.where(max_len, int(RowStatus.MAX_LEN), int(RowStatus.RUNNING))
    new = jnp.where(max_tokens, int(RowStatus.MAX_TOKENS), new)
    new = jnp.where(stop_token, int(RowStatus.STOP), new)
    return jnp.where(ran, new, status).astype(jnp.int32)


def _concrete(x):
    """``x`` as a numpy array, or None when it is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


@struct.dataclass
class DecodeState:
    """The whole decoding state of ``B`` rows, a pytree of arrays.

    Attributes:
      device: KV pages ``[L, KVH, N, bs, D]``, block manager (``B`` slots), sampling history.
      last_tokens: i32[B] each row's newest token (not yet in the cache).
      active: bool[B] rows still generating.
      tensors: per-row sampling parameters.
      key: u32[2] base key for rows without a seed.
      status: i32[B] a `RowStatus` per row (RUNNING exactly where ``active``).
    """

    device: programs.DeviceState
    last_tokens: jax.Array
    active: jax.Array
    tensors: sampling.SamplingTensors
    key: jax.Array
    status: jax.Array


class PagedDecoder:
    """Static description of a paged decoder over an NNX model.

    Args:
      model: a `models.Transformer`, or any NNX module satisfying `models.PagedModel`.
      max_seqs: B, rows decoded together.
      max_len: longest sequence (prompt + generated).
      block_size: tokens per KV block.
      num_blocks: KV pool size (null block included); default enough for every row to
        reach ``max_len``.
      eos_token_ids: stop ids added to every row (unless its ignore_eos).
      attention_impl: `pallas_kernels.paged_attention` implementation.
      kv_cache_dtype: "auto" (the model's), "float32", "bfloat16" or "float16": the KV pages'
        dtype (`jax_paged.EngineConfig.kv_cache_dtype`).
      mesh: a `jax.sharding.Mesh` with a ``"tp"`` axis (`jax_paged.parallel.sharding.TP_AXIS`; other
        axes replicate): ``params`` and the KV pages of `init` are split over it, heads and
        KV heads (replicated when fewer than the devices), and the steps run sharded.
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
        kv_cache_dtype: str = "auto",
        mesh=None,
    ):
        check_model(model)  # names what a model lacks (models.PagedModel)
        if mesh is not None:
            if shard.TP_AXIS not in mesh.axis_names:
                raise ValueError(
                    f"mesh axes {mesh.axis_names} have no {shard.TP_AXIS!r} axis to split the "
                    "model over"
                )
            r = shard.kv_replication(model.config, mesh.shape[shard.TP_AXIS])
            model = shard.replicate_kv_heads(model, r)
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(model)
        if mesh is not None:
            self.params = shard.shard_params(self.params, mesh)
        self.params = backend.prepare_params(model, self.params, mesh)  # CPU: per-layer kernels
        self.config = c = model.config
        self.dtype = model.dtype
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{kv_cache_dtype=} must be one of {KV_CACHE_DTYPES}")
        self.kv_dtype = model.dtype if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
        self.max_seqs, self.max_len, self.block_size = max_seqs, max_len, block_size
        self.max_blocks_per_seq = blocks_for(max_len, block_size)
        self.num_blocks = num_blocks or max_seqs * self.max_blocks_per_seq + 1
        self.eos_token_ids = list(eos_token_ids)
        self.greedy_only = False  # set by `init`: every row greedy -> a smaller program
        self.opts = programs.AttentionOptions(
            scale=c.scale,
            sliding_window=c.sliding_window,
            soft_cap=getattr(c, "attn_logit_softcapping", None),
            impl=attention_impl,
            mesh=mesh,
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
        kv = shard.create_kv_cache(
            self.mesh,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.kv_dtype,
        )
        device = programs.DeviceState(
            kv=kv,
            blocks=bm.init_state(self.num_blocks, self.block_size, b, self.max_blocks_per_seq),
            sampling=sampling.init_state(b, c.vocab_size, track_tokens=track),
        )
        tensors = sampling.SamplingTensors.from_params(
            list(sampling_params),
            vocab_size=c.vocab_size,
            eos_token_ids=self.eos_token_ids,
            request_uids=list(range(b)),
        )
        state = DecodeState(
            device=device,
            last_tokens=jnp.zeros(b, jnp.int32),
            active=jnp.zeros(b, bool),
            tensors=tensors,
            key=jax.random.key_data(jax.random.key(seed)),
            status=jnp.full(b, int(RowStatus.UNUSED), jnp.int32),
        )
        if self.mesh is None:
            return state
        # Everything but the KV pages replicated on the mesh.
        rest = jax.device_put(
            state.replace(device=device.replace(kv=None)), shard.replicated(self.mesh)
        )
        return rest.replace(device=rest.device.replace(kv=kv))

    def _check_prompts(self, prompts, prompt_lens):
        """The call-time refusals of `prefill` (ValueError); see the module docstring."""
        b, lmax = prompts.shape
        m = self.max_len
        if b != self.max_seqs:
            raise ValueError(f"prompts has {b} rows; this decoder has max_seqs={self.max_seqs}")
        if tuple(prompt_lens.shape) != (b,):
            raise ValueError(f"prompt_lens has shape {tuple(prompt_lens.shape)}, expected ({b},)")
        if lmax > m:
            raise ValueError(
                f"prompts are {lmax} tokens wide; with max_len={m} a prompt must be at most "
                f"{m - 1} tokens so that one token can be generated (pad to at most {m})"
            )
        lens = _concrete(prompt_lens)
        if lens is None:
            return
        bad = []
        for r, n in enumerate(lens.tolist()):
            if n < 0:
                bad.append(f"row {r}: prompt_lens[{r}]={n} is negative")
            elif n > m - 1:
                bad.append(
                    f"row {r}: prompt is {n} tokens; with max_len={m} it must be at most {m - 1} "
                    "so that one token can be generated"
                )
            elif n > lmax:
                bad.append(f"row {r}: prompt_lens[{r}]={n} is more than the prompts' width {lmax}")
        if bad:
            raise ValueError("; ".join(bad))

    def prefill(self, params, state: DecodeState, prompts, prompt_lens):
        """Prefills row b with ``prompts[b, :prompt_lens[b]]`` and samples its first token.

        Args:
          prompts: i32[B, Lmax] (padding ignored; ``Lmax <= max_len``); prompt_lens: i32[B]
            (0 = row unused, at most ``min(Lmax, max_len - 1)``).

        Returns:
          (state, first tokens i32[B]). Pure and jittable. A row gives -1 and no K/V when it
          is unused, its prompt length is invalid (traced lengths only: INVALID_PROMPT) or its
          blocks could not be reserved (NO_BLOCKS); ``state.status`` says which.

        Raises:
          ValueError: ``Lmax > max_len``, or concrete ``prompt_lens`` out of range (see the
            module docstring).
        """
        prompts = jnp.asarray(prompts, jnp.int32)
        prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
        self._check_prompts(prompts, prompt_lens)
        model = nnx.merge(self.graphdef, params)
        b, lmax = prompts.shape
        invalid = (prompt_lens < 0) | (prompt_lens > min(lmax, self.max_len - 1))
        want = jnp.where(invalid, 0, prompt_lens)
        blocks, res = bm.reserve(state.device.blocks, want)
        refused = (want > 0) & ~res.ok
        lens = jnp.where(refused, 0, want)  # the tokens that run: refused rows are padding

        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens)])
        t = b * lmax
        j = jnp.arange(lmax)[None, :]
        valid = j < lens[:, None]  # [B, Lmax]
        dest = jnp.where(valid, cu[:-1, None] + j, t)  # flat index of each valid token
        tokens = jnp.zeros(t, jnp.int32).at[dest].set(prompts, mode="drop")
        positions = (
            jnp.zeros(t, jnp.int32).at[dest].set(jnp.broadcast_to(j, (b, lmax)), mode="drop")
        )
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, lmax))
        token_row = jnp.full(t, -1, jnp.int32).at[dest].set(rows, mode="drop")

        slots = bm.token_slots(blocks, token_row, positions)
        attn = programs.paged_attn(
            self.opts, slots, blocks.block_tables, blocks.seq_lens, cu, jnp.int32(b)
        )
        last_idx = jnp.maximum(cu[1:] - 1, 0)
        logits, kv = model.forward(
            tokens[None], positions[None], attn, state.device.kv, logits_indices=last_idx
        )
        used = lens > 0
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
        status = jnp.where(invalid, int(RowStatus.INVALID_PROMPT), int(RowStatus.UNUSED))
        status = jnp.where(refused, int(RowStatus.NO_BLOCKS), status)
        status = _finish(
            status,
            used,
            sampling.is_stop_token(state.tensors, out.tokens),
            sampling.reached_max_tokens(state.tensors, samp),
            lens + 1 >= self.max_len,
        )
        device = programs.DeviceState(kv=kv, blocks=blocks, sampling=samp)
        new = state.replace(
            device=device,
            last_tokens=jnp.maximum(first, 0),
            active=status == int(RowStatus.RUNNING),
            status=status,
        )
        return new, first

    def decode_step(self, params, state: DecodeState):
        """One token for every active row: ``(params, state) -> (state, tokens i32[B])``,
        -1 for rows that are not active. Pure; use it as a ``lax.scan`` body.

        A row that stops gets its reason in ``state.status``: STOP, MAX_TOKENS or MAX_LEN after
        its last token (which is returned), NO_BLOCKS when its next block could not be
        reserved (its token this step is -1)."""
        model = nnx.merge(self.graphdef, params)
        b = self.max_seqs
        rows = jnp.arange(b, dtype=jnp.int32)
        device, out, ok = programs.decode_step(
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
        status = jnp.where(state.active & ~ok, int(RowStatus.NO_BLOCKS), state.status)
        status = _finish(
            status,
            ok,
            sampling.is_stop_token(state.tensors, out.tokens),
            sampling.reached_max_tokens(state.tensors, device.sampling),
            device.blocks.seq_lens + 1 >= self.max_len,
        )
        tokens = jnp.where(ok, out.tokens, -1)
        new = state.replace(
            device=device,
            last_tokens=jnp.where(ok, out.tokens, state.last_tokens),
            active=ok & (status == int(RowStatus.RUNNING)),
            status=status,
        )
        return new, tokens

    def release(self, state: DecodeState) -> DecodeState:
        """Frees every row's blocks and clears its sampling history (pure): every row becomes
        inactive and UNUSED, as after `init`, ready for another `prefill`; so read the statuses
        (`describe`) before releasing."""
        blocks = bm.free(state.device.blocks, jnp.ones(self.max_seqs, bool))
        samp = jax.tree.map(jnp.zeros_like, state.device.sampling)
        return state.replace(
            device=state.device.replace(blocks=blocks, sampling=samp),
            active=jnp.zeros_like(state.active),
            status=jnp.full_like(state.status, int(RowStatus.UNUSED)),
        )

    @staticmethod
    def statuses(state: DecodeState) -> list[RowStatus]:
        """Host-side: each row's `RowStatus`."""
        return [RowStatus(int(s)) for s in np.asarray(jax.device_get(state.status))]

    @staticmethod
    def describe(state: DecodeState) -> list[str]:
        """Host-side: each row's status in words, e.g. ``"stopped: max_tokens reached"``."""
        return [s.description for s in PagedDecoder.statuses(state)]
