"""Logit processing for `sampling.sample`: penalties, min_tokens, temperature, min-p, top-k /
top-p cutoffs, and the log-probabilities a sampler returns (also of prompt tokens).

All functions are jittable and work on a batch of B rows over a vocabulary of V, with the rows'
parameters in a `sampling.SamplingTensors` and their history in a `sampling.SamplingState`. The
processing order follows vLLM v1::

    raw logits --log_softmax--> returned logprobs (raw model distribution)
        |
        min_tokens mask (EOS / stop ids -> -inf) -> repetition, frequency, presence penalties
        |--> greedy rows: argmax (ties -> lowest id)
        temperature -> min_p -> top_k -> top_p -> inverse-CDF draw with the row's own key

`apply_penalties` is the first line, `process_logits` all of the second and third but the draw,
`gather_logprobs` / `compute_prompt_logprobs` the log-probabilities.

Top-k / top-p: a full-vocabulary sort costs ~0.4 s for 32 x 49,152 on a CPU, so the filter
first takes the ``max_candidates`` largest logits with ``lax.top_k`` (~10 ms) and computes each
row's cutoff from them. That is exact whenever the kept set lies inside the candidates:
``top_k <= max_candidates``, or top-k off and the top-p mass is reached within the candidates
(the usual case for a trained model). Only when some row is not resolved that way (a flat
distribution, a large top_k) does an exact sort-free fallback run under ``lax.cond``: a
bisection on the float bit patterns for the cutoff value (32 masked sums over [B, V], ~6x
cheaper than the sort); only unresolved rows take its result, so a row's tokens never depend
on its neighbours. Ties at a cutoff are all kept. Batches without a top-k/top-p row skip all of
this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from jax_paged.sampling.sampler import SamplingState, SamplingTensors


def scatter_rows(shape, ids: jax.Array, dtype, op: str) -> jax.Array:
    """[M, L] ids (-1 = padding) -> [M, V] with 1 (add) or True (set) at each id."""
    m, v = shape
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)  # padding -> out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], ids.shape)
    out = jnp.zeros(shape, dtype).at[rows, ids]
    return out.add(1, mode="drop") if op == "add" else out.set(True, mode="drop")


def gather_logprobs(raw: jax.Array, tokens: jax.Array, k: int, wanted: jax.Array | None = None):
    """Log-prob and rank of ``tokens`` i32[T] and the top-k under ``log_softmax(raw)``.

    Works on the raw logits f32[T, V] and subtracts the normaliser only from the few values
    returned: a materialised [T, V] log_softmax feeding a gather, a compare and a top-k made
    XLA (CPU) recompute it per consumer, 4x slower than the whole rest of greedy sampling.
    With ``wanted`` (bool[]) the top-k runs only when it is true (zeros otherwise).

    Returns:
      (logprobs f32[T], ranks i32[T] (1 + the number of strictly larger logits), top_ids
      i32[T, k], top_logprobs f32[T, k]), most likely first.
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
      distribution, as in `sampling.SamplerOutput`. The caller prepends None for prompt
      position 0.
    """
    return gather_logprobs(logits.astype(jnp.float32), next_tokens.astype(jnp.int32), k)


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
        stop_mask = scatter_rows((b, v), tensors.stop_token_ids, bool, "set")
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
