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
- `sample`: logits -> next tokens (+ log-probabilities).

The processing order follows vLLM v1::

    raw logits --log_softmax--> returned logprobs (raw model distribution)
        |
        min_tokens mask (EOS / stop ids -> -inf) -> repetition, frequency, presence penalties
        |--> greedy rows: argmax (ties -> lowest id)
        temperature -> min_p -> top_k -> top_p -> inverse-CDF draw with the row's own key

Memory: with penalties tracked the state holds ``i32[B, V]`` counts and a ``bool[B, V]``
prompt mask, 5 bytes per (row, vocab entry): e.g. 256 rows x 151,936 (Qwen2) = 194 MB,
32 rows x 49,152 (SmolLM2) = 7.9 MB. Without penalties (``track_tokens=False``) only ``i32[B]``.

Top-k / top-p: a full-vocabulary sort costs ~0.4 s for 32 x 49,152 on a CPU, so the filter
first takes the `max_candidates` largest logits with ``lax.top_k`` (~10 ms) and computes each
row's cutoff from them. That is exact whenever the kept set lies inside the candidates:
``top_k <= max_candidates``, or top-k off and the top-p mass is reached within the candidates
(the usual case for a trained model). Only when some row is not resolved that way (a flat
distribution, a large top_k) does an exact sort-free fallback run under ``lax.cond``: a
bisection on the float bit patterns for the cutoff value (32 masked sums over [B, V], ~6x
cheaper than the sort); only unresolved rows take its result, so a row's tokens never depend
on its neighbours. Ties at a cutoff are all kept. Batches without a top-k/top-p row skip all of
this, and all-greedy batches draw no random numbers.

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

from jax_paged.sampling_params import SamplingParams

_KEY_IMPL = "threefry2x32"
_INT32_MAX = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch of ``B`` rows (vocabulary size ``V``).

    Build with `from_params`; all fields are device arrays.

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
      num_logprobs: i32[B]; top log-probs the row asks for (0: none). The top-N of a batch
        (N static) is computed only when some row asks, so one compiled program serves both.
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
        num_logprobs = np.zeros(b, np.int32)
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
            num_logprobs[i] = p.logprobs or 0
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

        return cls(
            temperature=jnp.asarray(temperature),
            top_k=jnp.asarray(top_k),
            top_p=jnp.asarray(top_p),
            min_p=jnp.asarray(min_p),
            presence_penalty=jnp.asarray(presence),
            frequency_penalty=jnp.asarray(frequency),
            repetition_penalty=jnp.asarray(repetition),
            min_tokens=jnp.asarray(min_tokens),
            max_tokens=jnp.asarray(max_tokens),
            stop_token_ids=jnp.asarray(stop_ids),
            seed_key=jnp.asarray(seed_key),
            has_seed=jnp.asarray(has_seed),
            request_uid=jnp.asarray(request_uid),
            num_logprobs=jnp.asarray(num_logprobs),
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


def _scatter_rows(shape, ids: jax.Array, dtype, op: str) -> jax.Array:
    """[M, L] ids (-1 = padding) -> [M, V] with 1 (add) or True (set) at each id."""
    m, v = shape
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)  # padding -> out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], ids.shape)
    out = jnp.zeros(shape, dtype).at[rows, ids]
    return out.add(1, mode="drop") if op == "add" else out.set(True, mode="drop")


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
    counts = _scatter_rows((m, v), output_token_ids, jnp.int32, "add")
    prompt = _scatter_rows((m, v), prompt_token_ids, bool, "set")
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


def _gather_logprobs(raw: jax.Array, tokens: jax.Array, k: int, wanted: jax.Array | None = None):
    """Log-prob and rank of ``tokens`` i32[T] and the top-k under ``log_softmax(raw)``.

    Works on the raw logits f32[T, V] and subtracts the normaliser only from the few values
    returned: a materialised [T, V] log_softmax feeding a gather, a compare and a top-k made
    XLA (CPU) recompute it per consumer, 4x slower than the whole rest of greedy sampling.
    With ``wanted`` (bool[]) the top-k runs only when it is true (zeros otherwise).
    """
    log_norm = jax.nn.logsumexp(raw, axis=1)
    tok = jnp.take_along_axis(raw, tokens[:, None], axis=1)[:, 0]
    lp = tok - log_norm
    ranks = 1 + jnp.sum(raw > tok[:, None], axis=1, dtype=jnp.int32)
    if k > 0:
        t = tokens.shape[0]

        def top(raw):
            return tuple(lax.top_k(raw, k))

        def none(raw):
            return jnp.zeros((t, k), raw.dtype), jnp.zeros((t, k), jnp.int32)

        top_vals, top_ids = top(raw) if wanted is None else lax.cond(wanted, top, none, raw)
        top_lp = top_vals - log_norm[:, None]
    else:
        top_lp = jnp.zeros((tokens.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((tokens.shape[0], 0), jnp.int32)
    return lp, ranks, top_ids.astype(jnp.int32), top_lp


def compute_prompt_logprobs(logits: jax.Array, next_tokens: jax.Array, k: int):
    """Prompt log-probabilities of one sequence (chunk). Jittable with ``k`` static.

    Args:
      logits: f32[T, V]; row t is the model's output at prompt position t.
      next_tokens: i32[T]; the prompt token at position t + 1 (the one row t predicts).
      k: how many top entries to return per position.

    Returns:
      (logprobs f32[T], ranks i32[T], top_ids i32[T, k], top_logprobs f32[T, k]) of the raw
      distribution, as in `SamplerOutput`. The caller prepends None for prompt position 0.
    """
    return _gather_logprobs(logits.astype(jnp.float32), next_tokens.astype(jnp.int32), k)


def apply_penalties(logits: jax.Array, tensors: SamplingTensors, state: SamplingState) -> jax.Array:
    """min_tokens mask, then repetition / frequency / presence penalties. f32[B, V] -> f32[B, V].

    vLLM's semantics: the repetition penalty applies to tokens of the prompt or the output
    (positive logits divided by it, negative ones multiplied); the frequency penalty is
    subtracted once per occurrence in the output; the presence penalty once if the token occurs
    in the output. Rows with neutral values come out bit-for-bit unchanged.
    """
    b, v = logits.shape
    # min_tokens: no stop id before the row has generated min_tokens tokens.
    early = state.num_generated < tensors.min_tokens  # [B]

    def mask_stops(x):
        stop_mask = _scatter_rows((b, v), tensors.stop_token_ids, bool, "set")
        return jnp.where(stop_mask & early[:, None], -jnp.inf, x)

    logits = lax.cond(jnp.any(early), mask_stops, lambda x: x, logits)
    if not state.tracks_tokens:
        return logits

    def penalise(x):
        counts = state.output_counts
        seen = counts > 0
        rep = tensors.repetition_penalty[:, None]
        x = jnp.where(seen | state.prompt_mask, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - tensors.frequency_penalty[:, None] * counts.astype(jnp.float32)
        return x - tensors.presence_penalty[:, None] * seen.astype(jnp.float32)

    any_penalty = (
        jnp.any(tensors.repetition_penalty != 1.0)
        | jnp.any(tensors.frequency_penalty != 0.0)
        | jnp.any(tensors.presence_penalty != 0.0)
    )
    return lax.cond(any_penalty, penalise, lambda x: x, logits)


def _cutoffs(sorted_vals, log_norm, top_k, top_p, vocab_size):
    """Per-row logit cutoffs of top-k then top-p from the M largest logits of each row.

    Args:
      sorted_vals: f32[B, M], each row's M largest (temperature-scaled) logits, descending.
      log_norm: f32[B], log of the full row's softmax normaliser (used when top-k is off).
      top_k: i32[B] (V = off); top_p: f32[B] (1 = off).

    Returns:
      (cutoff f32[B], resolved bool[B]): keep tokens with logit >= cutoff; ``resolved`` says
      whether the M values sufficed to find the cutoff exactly.
    """
    m = sorted_vals.shape[1]
    pos = jnp.arange(m)[None, :]
    in_k = pos < top_k[:, None]
    masked = jnp.where(in_k, sorted_vals, -jnp.inf)
    # top-p acts on the top-k distribution: normalise over the first top_k values (all of the
    # vocabulary when top-k is off, whose normaliser the caller computed over the full row).
    k_off = top_k >= vocab_size
    norm = jnp.where(k_off, log_norm, jax.nn.logsumexp(masked, axis=1))
    probs = jnp.exp(masked - norm[:, None])
    before = jnp.cumsum(probs, axis=1) - probs  # mass strictly before each position
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=1), 1)
    no_filter = k_off & (top_p >= 1.0)
    cutoff = jnp.take_along_axis(sorted_vals, (n_keep - 1)[:, None], axis=1)[:, 0]
    cutoff = jnp.where(no_filter, -jnp.inf, cutoff)
    resolved = no_filter | (top_k <= m) | (k_off & (n_keep < m))
    return cutoff, resolved


def _to_ordered(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (-inf smallest): the radix-sort key of a float."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _from_ordered(u: jax.Array) -> jax.Array:
    u = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return lax.bitcast_convert_type(u, jnp.float32)


def _bisect(lo: jax.Array, hi: jax.Array, pred) -> jax.Array:
    """The largest u32 ``o`` in [lo, hi] with ``pred(o)`` (monotone: true, then false), per row;
    ``lo`` when none above it passes. 32 halvings cover the whole u32 range."""

    def body(_, carry):
        lo, hi = carry
        gap = hi - lo
        mid = lo + gap // 2 + (gap & 1)  # ceil midpoint without overflow
        ok = (gap > 0) & pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok | (gap == 0), hi, mid - 1)

    return lax.fori_loop(0, 32, body, (lo, hi))[0]


def _bisect_cutoffs(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact per-row cutoffs of top-k then top-p without sorting: f32[B, V] -> f32[B].

    The top-k cutoff is the largest t with ``count(x >= t) >= k`` (the k-th largest logit);
    the top-p cutoff the largest t >= it with ``mass(x >= t) >= p * mass(x >= top-k cutoff)``
    (the smallest prefix of the sorted top-k distribution holding mass p, as in the sorted
    formulation). Each is a bisection over the bit patterns of the values: 32 passes over
    [B, V], ~6x cheaper than a [B, V] sort on a CPU.
    """
    ox = _to_ordered(x)
    lo, hi = jnp.min(ox, axis=1), jnp.max(ox, axis=1)
    ck = _bisect(lo, hi, lambda o: jnp.sum(ox >= o[:, None], axis=1) >= top_k)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))

    def mass(o):
        return jnp.sum(jnp.where(ox >= o[:, None], e, 0.0), axis=1)

    def nucleus(ck):
        target = top_p * mass(ck)
        cp = _bisect(ck, hi, lambda o: mass(o) >= target)
        return jnp.where(top_p >= 1.0, ck, cp)

    c = lax.cond(jnp.any(top_p < 1.0), nucleus, lambda ck: ck, ck)
    return _from_ordered(c)


def _top_k_top_p(x: jax.Array, top_k, top_p, max_candidates: int) -> jax.Array:
    b, v = x.shape
    log_norm = jax.nn.logsumexp(x, axis=1)
    m = min(max_candidates, v)
    cutoff, resolved = _cutoffs(lax.top_k(x, m)[0], log_norm, top_k, top_p, v)
    if m < v:

        def exact(cutoff):
            # Only unresolved rows take the bisection's result, so a row's cutoff never
            # depends on whether a neighbour forced the slow path.
            return jnp.where(resolved, cutoff, _bisect_cutoffs(x, top_k, top_p))

        cutoff = lax.cond(jnp.all(resolved), lambda c: c, exact, cutoff)
    return jnp.where(x < cutoff[:, None], -jnp.inf, x)


def process_logits(
    logits: jax.Array,
    tensors: SamplingTensors,
    state: SamplingState,
    *,
    max_candidates: int = 256,
) -> jax.Array:
    """The logits each row draws from: f32[B, V] -> f32[B, V], filtered tokens at -inf.

    Penalties and min_tokens, then (for non-greedy rows) temperature, min_p, top-k and top-p.
    Greedy rows get only the first step (temperature 1, no filters), so their argmax is the
    greedy token.
    """
    x = apply_penalties(logits.astype(jnp.float32), tensors, state)
    greedy = tensors.temperature == 0.0
    x = x / jnp.where(greedy, 1.0, tensors.temperature)[:, None]

    # min_p: drop p < min_p * p_max, i.e. exp(x - x_max) < min_p (no normaliser needed).
    def min_p(x):
        x_max = jnp.max(x, axis=1, keepdims=True)
        return jnp.where(jnp.exp(x - x_max) < tensors.min_p[:, None], -jnp.inf, x)

    x = lax.cond(jnp.any(tensors.min_p > 0.0), min_p, lambda x: x, x)
    v = x.shape[1]
    needs_filter = jnp.any((tensors.top_k < v) | (tensors.top_p < 1.0))
    return lax.cond(
        needs_filter,
        lambda x: _top_k_top_p(x, tensors.top_k, tensors.top_p, max_candidates),
        lambda x: x,
        x,
    )


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
        top-k / top-p (see the module docstring).
      greedy_only: the caller guarantees every row is greedy (temperature 0): the program
        leaves out temperature, filters and random draws, which compiles faster and gives the
        same tokens.

    Returns:
      A `SamplerOutput`. Greedy rows give the argmax of the penalised logits (lowest id on
      ties); the others a draw from the processed distribution with the row's own key.
    """
    raw = logits.astype(jnp.float32)
    wanted = jnp.any(tensors.num_logprobs > 0)  # top-N skipped when no row asks
    if greedy_only:
        tokens = jnp.argmax(apply_penalties(raw, tensors, state), axis=1).astype(jnp.int32)
        lp, ranks, top_ids, top_lp = _gather_logprobs(raw, tokens, num_top_logprobs, wanted)
        return SamplerOutput(tokens, lp, ranks, top_ids, top_lp)
    x = process_logits(raw, tensors, state, max_candidates=max_candidates)
    greedy = tensors.temperature == 0.0

    def draw(x):
        return jnp.where(greedy, argmax, _draw(x, _row_keys(tensors, state, key)))

    argmax = jnp.argmax(x, axis=1).astype(jnp.int32)
    tokens = lax.cond(jnp.all(greedy), lambda x: argmax, draw, x)
    lp, ranks, top_ids, top_lp = _gather_logprobs(raw, tokens, num_top_logprobs, wanted)
    return SamplerOutput(tokens, lp, ranks, top_ids, top_lp)
