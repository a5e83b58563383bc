"""The host arrays of a step's inputs, built from the scheduler's plan: the block ops every
step starts with (`block_ops`), the ragged batch of a mixed step (`mixed_batch`) and the
prompts a step looks up in the prefix cache (`lookup_rows`). Plain numpy; `ModelRunner` ships
them with the step's call."""

from __future__ import annotations

import numpy as np

from jax_paged.engine.programs import BlockOps, MixedBatch
from jax_paged.engine.sequence import ScheduledChunk, SchedulerOutput, Sequence


def _pow2_at_least(x: int, lo: int) -> int:
    return max(lo, 1 << max(0, (max(x, 1) - 1).bit_length()))


def block_ops(
    plan: SchedulerOutput, num_slots: int, stop_width: int, tracks_tokens: bool, tensors
) -> tuple[BlockOps, tuple]:
    """The plan's `BlockOps` as padded host arrays, and their shape key.

    Every list has ``num_slots`` entries (-1: none): a shorter bucket for quiet steps doubled
    the compiled variants, and an online run met the second one mid-run (a 5 s compile).
    ``tensors(seqs, pad_to)`` gives the sampling tensors of the rows to (re)start; with
    ``tracks_tokens`` (penalties) their prompts and outputs so far go too, padded to powers of
    two (at least 16), which the key then names.
    """
    seqs, m = plan.row_inits, num_slots

    def slots(values) -> np.ndarray:
        a = np.full(m, -1, np.int32)
        a[: len(values)] = values
        return a

    take_row = np.zeros(m, np.int32)
    take_row[: len(plan.fresh)] = [c.seq.prefix_row for c in plan.fresh]
    if tracks_tokens:
        lp = _pow2_at_least(max((len(q.prompt_token_ids) for q in seqs), default=0), 16)
        lo = _pow2_at_least(max((len(q.output_token_ids) for q in seqs), default=0), 16)
        init_prompt = np.full((m, lp), -1, np.int32)
        init_out = np.full((m, lo), -1, np.int32)
        for i, q in enumerate(seqs):
            init_prompt[i, : len(q.prompt_token_ids)] = q.prompt_token_ids
            init_out[i, : len(q.output_token_ids)] = q.output_token_ids
        key = (m, stop_width, lp, lo)
    else:
        init_prompt, key = None, (m, stop_width)
        init_out = np.zeros(m, np.int32)
        init_out[: len(seqs)] = [len(q.output_token_ids) for q in seqs]
    ops = BlockOps(
        free_slots=slots(plan.free_slots),
        fork_parent=slots([p for p, _ in plan.forks]),
        fork_child=slots([c for _, c in plan.forks]),
        preempt_slots=slots(plan.preempted_slots),
        take_slot=slots([c.seq.slot for c in plan.fresh]),
        take_row=take_row,
        init_slot=slots([q.slot for q in seqs]),
        init_out=init_out,
        init_prompt=init_prompt,
        init_tensors=tensors(seqs + [None] * (m - len(seqs)), m),
    )
    return ops, key


def mixed_batch(
    chunks: list[ScheduledChunk], t: int, b: int, num_slots: int
) -> tuple[MixedBatch, bool]:
    """The `MixedBatch` of ``chunks`` padded to ``t`` tokens and ``b`` rows (``num_slots``
    block-manager slots), and whether a chunk wants prompt log-probs (then ``next_tokens``
    holds the token after each of its inputs)."""
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    token_row = np.full(t, -1, np.int32)
    next_tokens = np.full(t, -1, np.int32)
    cu = np.zeros(b + 1, np.int32)
    row_slot = np.full(b, -1, np.int32)
    last_idx = np.zeros(b, np.int32)
    samples = np.zeros(b, bool)
    num_new = np.zeros(num_slots, np.int32)
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
    batch = MixedBatch(
        tokens=tokens,
        positions=positions,
        token_row=token_row,
        cu_q_lens=cu,
        num_rows=np.int32(len(chunks)),
        row_slot=row_slot,
        last_idx=last_idx,
        samples=samples,
        num_new=num_new,
        next_tokens=next_tokens,
    )
    return batch, want_plp


def lookup_rows(seqs: list[Sequence], num_rows: int, width: int):
    """(tokens i32[num_rows, width], lengths i32[num_rows]) of the prompts to look up (each
    sequence's tokens so far); rows past ``seqs`` are padding (length 0)."""
    tokens = np.zeros((num_rows, width), np.int32)
    lens = np.zeros(num_rows, np.int32)
    for i, q in enumerate(seqs):
        toks = q.all_token_ids
        lens[i] = len(toks)
        tokens[i, : len(toks)] = toks
    return tokens, lens
