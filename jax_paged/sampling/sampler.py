"""Batched token sampling on the device: jittable, usable inside a multi-step ``lax.scan``.

Three pieces:

- `SamplingTensors`: the per-row parameters of a batch, built on the host once per batch
  composition by `SamplingTensors.from_params` (one row per sequence slot; empty slots are
  inert greedy rows). Constant while the batch composition is.
- `SamplingState`: what changes every step: per-row counts of generated tokens, a mask of
  prompt tokens (both only when penalties are tracked) and the number of tokens generated.
  Rows are (re)initialised with `set_rows` when a sequence enters a slot, and advanced with
  `update_counts` after each sampled token, all on the device, so a ``lax.scan`` decode loop
  never returns to the host.
- `sample`: logits -> next tokens (+ log-probabilities), drawn from the logits that
  `logit_processing.process_logits` leaves (penalties, min_tokens, temperature, min-p, top-k,
  top-p, in vLLM v1's order; see that module) with an inverse-CDF draw per row.

Memory: with penalties tracked the state holds ``i32[B, V]`` counts and a ``bool[B, V]``
prompt mask, 5 bytes per (row, vocab entry): e.g. 256 rows x 151,936 (Qwen2) = 194 MB,
32 rows x 49,152 (SmolLM2) = 7.9 MB. Without penalties (``track_tokens=False``) only ``i32[B]``.
All-greedy batches draw no random numbers.

Seeds: row b draws with ``fold_in(base_b, num_generated_b)``, where ``base_b`` is
``jax.random.key(seed)`` (all 64 bits of the seed are used) for a seeded request and
``fold_in(engine_key, request_uid_b)`` otherwise. Neither depends on the row's position or on
other rows, so a seeded request gives the same tokens in any batch, and after preemption
(`set_rows` restores ``num_generated``) it continues exactly where it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_paged.backend import argmax_last
from jax_paged.entrypoints.sampling_params import SamplingParams
from jax_paged.sampling.logit_processing import (
    apply_penalties,
    gather_logprobs,
    process_logits,
    scatter_rows,
)

# Re-exported: the runner calls sampling.compute_prompt_logprobs.
from jax_paged.sampling.logit_processing import compute_prompt_logprobs as compute_prompt_logprobs

_KEY_IMPL = "threefry2x32"
_INT32_MAX = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch of ``B`` rows (vocabulary size ``V``).

    Build with `from_params`; all fields are device arrays (numpy with ``on_host=True``).

    Attributes:
      temperature: f32[B]; 0 for greedy rows.
      top_k: i32[B] in [1, V]; V means off.
      top_p: f32[B] in (0, 1]; 1 means off.
      min_p: f32[B] in [0, 1]; 0 means off.
      presence_penalty: f32[B]; 0 means off.
      frequency_penalty: f32[B]; 0 means off.
      repetition_penalty: f32[B]; 1 means off.
      min_tokens: i32[B]; stop ids are masked while ``num_generated < min_tokens``.
      max_tokens: i32[B]; ``2**31 - 1`` when the request gave None (the engine applies
        max_model_len itself).
      stop_token_ids: i32[B, K]; the row's stop ids (its stop_token_ids, plus the EOS ids unless
        ignore_eos), padded with -1.
      seed_key: u32[B, 2]; the key data of ``jax.random.key(seed)`` for seeded rows.
      has_seed: bool[B].
      request_uid: u32[B]; engine-unique id of the row's sequence, folded into the engine key
        for rows without a seed.
      num_logprobs: i32[B]; top log-probs the row asks for: -1 for none (``logprobs=None``), 0
        for the sampled token's alone. The sampled tokens' log-probs and ranks are computed only
        when some row has ``>= 0``, the top-N of a batch (N static) only when some row has
        ``> 0``, so one compiled program serves every mix.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    min_tokens: jax.Array
    max_tokens: jax.Array
    stop_token_ids: jax.Array
    seed_key: jax.Array
    has_seed: jax.Array
    request_uid: jax.Array
    num_logprobs: jax.Array

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams | None],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        request_uids: Sequence[int | None] | None = None,
        pad_to: int | None = None,
        stop_width: int | None = None,
        on_host: bool = False,
    ) -> SamplingTensors:
        """Builds the tensors on the host, one row per entry of ``params``.

        Args:
          params: one `SamplingParams` per row, or None for an empty slot (an inert greedy row).
            For ``n > 1`` pass each completion's `SamplingParams.child_params`.
          vocab_size: V, the last dimension of the logits.
          eos_token_ids: the model's EOS ids (generation_config); added to each row's stop ids
            unless its ``ignore_eos``.
          request_uids: one engine-unique int per row (e.g. the sequence id); required for
            sampled (non-greedy) rows without a seed, ignored for the others.
          pad_to: number of rows B (>= len(params)); extra rows are empty slots.
          stop_width: K, the width of ``stop_token_ids`` (a static shape: fix it to keep the
            number of compiled variants small). Default: the smallest power of two >= 4 that
            fits every row.
          on_host: keep the fields as numpy arrays (they then cross to the device with the
            call that takes them, counted with its other inputs).
        """
        if vocab_size < 1:
            raise ValueError(f"{vocab_size=} must be >= 1")
        n = len(params)
        b = n if pad_to is None else pad_to
        if b < n:
            raise ValueError(f"{pad_to=} must be >= the number of rows ({n})")
        if request_uids is not None and len(request_uids) != n:
            raise ValueError(f"request_uids has {len(request_uids)} entries for {n} rows")
        eos = [int(t) for t in eos_token_ids]
        for t in eos:
            if not 0 <= t < vocab_size:
                raise ValueError(f"eos_token_ids entry {t} must be in [0, {vocab_size=})")

        temperature = np.zeros(b, np.float32)
        top_k = np.full(b, vocab_size, np.int32)
        top_p = np.ones(b, np.float32)
        min_p = np.zeros(b, np.float32)
        presence = np.zeros(b, np.float32)
        frequency = np.zeros(b, np.float32)
        repetition = np.ones(b, np.float32)
        min_tokens = np.zeros(b, np.int32)
        max_tokens = np.full(b, _INT32_MAX, np.int32)
        seed_key = np.zeros((b, 2), np.uint32)
        has_seed = np.zeros(b, bool)
        request_uid = np.zeros(b, np.uint32)
        num_logprobs = np.full(b, -1, np.int32)
        stops: list[list[int]] = [[] for _ in range(b)]

        for i, p in enumerate(params):
            if p is None:
                continue
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] must be a SamplingParams or None, got {p!r}")
            presence[i] = p.presence_penalty
            frequency[i] = p.frequency_penalty
            repetition[i] = p.repetition_penalty
            min_tokens[i] = p.min_tokens
            num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
            if p.max_tokens is not None:
                max_tokens[i] = min(p.max_tokens, _INT32_MAX)
            row_stops = list(p.stop_token_ids) + ([] if p.ignore_eos else eos)
            for t in row_stops:
                if t >= vocab_size:
                    raise ValueError(f"stop_token_ids entry {t} must be < {vocab_size=}")
            stops[i] = sorted(set(row_stops))
            if p.is_greedy:
                # vLLM's rule: greedy ignores top_k, top_p, min_p and the seed.
                continue
            temperature[i] = p.temperature
            top_k[i] = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
            top_p[i] = p.top_p
            min_p[i] = p.min_p
            if p.seed is not None:
                s = p.seed % 2**64  # two's complement for negative seeds
                # The key data jax.random.key(seed) would give with 64-bit ints enabled.
                seed_key[i] = (s >> 32, s & 0xFFFFFFFF)
                has_seed[i] = True
            else:
                uid = None if request_uids is None else request_uids[i]
                if uid is None:
                    raise ValueError(
                        f"row {i} samples without a seed: request_uids must give it an "
                        "engine-unique id"
                    )
                request_uid[i] = int(uid) % 2**32

        widest = max((len(s) for s in stops), default=0)
        if stop_width is None:
            stop_width = 4
            while stop_width < widest:
                stop_width *= 2
        elif stop_width < widest:
            raise ValueError(f"{stop_width=} must be >= the most stop ids of a row ({widest})")
        stop_ids = np.full((b, stop_width), -1, np.int32)
        for i, s in enumerate(stops):
            stop_ids[i, : len(s)] = s

        put = (lambda a: a) if on_host else jnp.asarray
        return cls(
            temperature=put(temperature),
            top_k=put(top_k),
            top_p=put(top_p),
            min_p=put(min_p),
            presence_penalty=put(presence),
            frequency_penalty=put(frequency),
            repetition_penalty=put(repetition),
            min_tokens=put(min_tokens),
            max_tokens=put(max_tokens),
            stop_token_ids=put(stop_ids),
            seed_key=put(seed_key),
            has_seed=put(has_seed),
            request_uid=put(request_uid),
            num_logprobs=put(num_logprobs),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """The per-row history sampling needs, updated on the device every step.

    Attributes:
      output_counts: i32[B, V], how often each token was generated; None when penalties are
        not tracked.
      prompt_mask: bool[B, V], which tokens occur in the prompt (for the repetition penalty);
        None when penalties are not tracked.
      num_generated: i32[B], tokens generated so far (drives min_tokens and the seeds).
    """

    output_counts: jax.Array | None
    prompt_mask: jax.Array | None
    num_generated: jax.Array

    @property
    def tracks_tokens(self) -> bool:
        return self.output_counts is not None


def init_state(batch_size: int, vocab_size: int, *, track_tokens: bool = True) -> SamplingState:
    """An all-zero state for ``batch_size`` rows.

    With ``track_tokens=False`` the [B, V] arrays are left out (None) and `sample` ignores the
    presence, frequency and repetition penalties: use it only when no request in the batch
    sets one (`SamplingParams.uses_penalties`). The choice is static (part of the pytree
    structure), so switching it compiles a second variant.
    """
    num_generated = jnp.zeros((batch_size,), jnp.int32)
    if not track_tokens:
        return SamplingState(None, None, num_generated)
    return SamplingState(
        output_counts=jnp.zeros((batch_size, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((batch_size, vocab_size), bool),
        num_generated=num_generated,
    )


def set_rows(
    state: SamplingState,
    slots: jax.Array,
    prompt_token_ids: jax.Array,
    output_token_ids: jax.Array,
) -> SamplingState:
    """(Re)initialises the rows ``slots`` for sequences entering them. Jittable.

    Args:
      state: the state of B rows.
      slots: i32[M], the rows to set; entries outside [0, B) (e.g. -1) are padding and ignored.
        No row may appear twice.
      prompt_token_ids: i32[M, Lp], each sequence's prompt padded with -1.
      output_token_ids: i32[M, Lo], the tokens it already generated (non-empty after a
        preemption by recompute), padded with -1; Lo may be 0.

    Returns:
      The state with those rows' counts, prompt mask and ``num_generated`` replaced.
    """
    b = state.num_generated.shape[0]
    slots = jnp.where((slots >= 0) & (slots < b), slots, b)
    num_generated = state.num_generated.at[slots].set(
        jnp.sum(output_token_ids >= 0, axis=1).astype(jnp.int32), mode="drop"
    )
    if not state.tracks_tokens:
        return dataclasses.replace(state, num_generated=num_generated)
    m, v = slots.shape[0], state.output_counts.shape[1]
    counts = scatter_rows((m, v), output_token_ids, jnp.int32, "add")
    prompt = scatter_rows((m, v), prompt_token_ids, bool, "set")
    return SamplingState(
        output_counts=state.output_counts.at[slots].set(counts, mode="drop"),
        prompt_mask=state.prompt_mask.at[slots].set(prompt, mode="drop"),
        num_generated=num_generated,
    )


def update_counts(state: SamplingState, tokens: jax.Array, active: jax.Array) -> SamplingState:
    """Records one sampled token per active row. Jittable; call once after every `sample`.

    Args:
      state: the state of B rows.
      tokens: i32[B], the tokens just sampled.
      active: bool[B], rows that really sampled (not empty slots, finished rows or prefill
        chunks that stop short of the prompt's end).
    """
    num_generated = state.num_generated + active.astype(jnp.int32)
    if not state.tracks_tokens:
        return dataclasses.replace(state, num_generated=num_generated)
    b, v = state.output_counts.shape
    ids = jnp.where(active & (tokens >= 0) & (tokens < v), tokens, v)
    counts = state.output_counts.at[jnp.arange(b), ids].add(1, mode="drop")
    return dataclasses.replace(state, output_counts=counts, num_generated=num_generated)


def is_stop_token(tensors: SamplingTensors, tokens: jax.Array) -> jax.Array:
    """bool[B]: whether each row's token is one of its stop ids (EOS unless ignore_eos, and
    stop_token_ids). min_tokens needs no check here: `sample` never draws a stop id early."""
    return jnp.any(tokens[:, None] == tensors.stop_token_ids, axis=1)


def reached_max_tokens(tensors: SamplingTensors, state: SamplingState) -> jax.Array:
    """bool[B]: rows whose ``num_generated`` (after `update_counts`) reached max_tokens."""
    return state.num_generated >= tensors.max_tokens


class SamplerOutput(NamedTuple):
    """What `sample` returns for B rows and ``num_top_logprobs`` = N.

    Attributes:
      tokens: i32[B], the sampled tokens.
      logprobs: f32[B], each token's log-probability under the raw model distribution.
      ranks: i32[B], 1 + the number of tokens with a strictly larger raw log-probability.
      top_ids: i32[B, N], the N most likely tokens (raw), most likely first.
      top_logprobs: f32[B, N], their log-probabilities.
    """

    tokens: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _row_keys(tensors: SamplingTensors, state: SamplingState, key: jax.Array) -> jax.Array:
    """One typed key per row: fold_in(base, num_generated); see the module docstring."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ValueError(
            f"key must be a threefry2x32 key (data u32[2]), got {key.dtype}{key.shape}"
        )
    engine_key = jax.random.wrap_key_data(key, impl=_KEY_IMPL)
    unseeded = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(engine_key, tensors.request_uid)
    base = jnp.where(tensors.has_seed[:, None], tensors.seed_key, jax.random.key_data(unseeded))
    base = jax.random.wrap_key_data(base, impl=_KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(base, state.num_generated)


_CDF_BLOCK = 256


def _draw(x: jax.Array, keys: jax.Array) -> jax.Array:
    """One categorical draw per row from ``softmax(x)``: f32[B, V], key[B] -> i32[B].

    Two-level inverse CDF: pick a block of `_CDF_BLOCK` tokens with probability proportional to
    its mass, then a token inside it, each with one uniform. That needs 2 random numbers per
    row instead of V for a Gumbel-max draw (threefry over [B, V] costs ~10x the rest of
    sampling on a CPU) and no full-length cumsum. Tokens at -inf (probability 0) are never
    drawn: both levels pick the first entry whose running sum exceeds ``u * total`` with
    ``u < 1``, and a zero entry never raises the running sum.
    """
    b, v = x.shape
    nb = -(-v // _CDF_BLOCK)
    probs = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))  # unnormalised, max entry 1
    probs = jnp.pad(probs, ((0, 0), (0, nb * _CDF_BLOCK - v))).reshape(b, nb, _CDF_BLOCK)
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)  # [B, 2] in [0, 1)

    def pick(weights, u):  # [B, N], [B] -> i32[B]: first i with cumsum[i] > u * total
        c = jnp.cumsum(weights, axis=1)
        i = jnp.sum(c <= (u * c[:, -1])[:, None], axis=1, dtype=jnp.int32)
        return jnp.minimum(i, weights.shape[1] - 1)  # only reachable through rounding

    blk = pick(jnp.sum(probs, axis=2), u[:, 0])
    inner = jnp.take_along_axis(probs, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    return blk * _CDF_BLOCK + pick(inner, u[:, 1])


def sample(
    logits: jax.Array,
    tensors: SamplingTensors,
    state: SamplingState,
    key: jax.Array,
    *,
    num_top_logprobs: int = 0,
    max_candidates: int = 256,
    greedy_only: bool = False,
) -> SamplerOutput:
    """Samples one token per row. Jittable; ``num_top_logprobs``, ``max_candidates`` and
    ``greedy_only`` static.

    Args:
      logits: f32[B, V] (any float dtype) model output at each row's last position.
      tensors: the rows' parameters.
      state: the rows' history *before* this token (call `update_counts` afterwards).
      key: the engine key, ``jax.random.key(engine_seed)`` (or its u32[2] data); only rows
        without a seed use it, and it need not change between steps.
      num_top_logprobs: N, top entries returned per row (>= the largest ``logprobs`` in the
        batch); computed only when some row's ``tensors.num_logprobs`` is > 0, zeros otherwise.
      max_candidates: logits gathered by ``lax.top_k`` before falling back to the bisection for
        top-k / top-p (see `logit_processing`).
      greedy_only: the caller guarantees every row is greedy (temperature 0): the program
        leaves out temperature, filters and random draws, which compiles faster and gives the
        same tokens.

    Returns:
      A `SamplerOutput`. Greedy rows give the argmax of the penalised logits (lowest id on
      ties); the others a draw from the processed distribution with the row's own key.
    """
    raw = logits.astype(jnp.float32)
    if greedy_only:
        tokens = argmax_last(apply_penalties(raw, tensors, state))
        return SamplerOutput(tokens, *_logprobs(raw, tokens, tensors, num_top_logprobs))
    greedy = tensors.temperature == 0.0

    def all_greedy(raw):  # what process_logits leaves a greedy row: the penalised logits
        return argmax_last(apply_penalties(raw, tensors, state))

    def mixed(raw):
        x = process_logits(raw, tensors, state, max_candidates=max_candidates)
        return jnp.where(greedy, argmax_last(x), _draw(x, _row_keys(tensors, state, key)))

    # An all-greedy batch skips the temperature and filter passes over [B, V] altogether.
    tokens = lax.cond(jnp.all(greedy), all_greedy, mixed, raw)
    return SamplerOutput(tokens, *_logprobs(raw, tokens, tensors, num_top_logprobs))


def _logprobs(raw: jax.Array, tokens: jax.Array, tensors: SamplingTensors, n: int):
    """`gather_logprobs` when some row asks for log-probs (``num_logprobs >= 0``), zeros
    otherwise: the normaliser and the rank read all [B, V] logits (3% of a SmolLM2 decode
    step at batch 64), wasted on a batch that wants none. The top-N needs ``> 0``."""
    b = tokens.shape[0]

    def some(raw):
        return gather_logprobs(raw, tokens, n, jnp.any(tensors.num_logprobs > 0))

    def none(raw):
        zf, zi = jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32)
        return zf, zi, jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)

    return lax.cond(jnp.any(tensors.num_logprobs >= 0), some, none, raw)
