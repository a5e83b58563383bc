"""The host arrays of a step's inputs, built from the scheduler's plan: the ragged batch of a
mixed step (`mixed_batch`) and the prompts a step looks up in the prefix cache
(`lookup_rows`). Plain numpy; `ModelRunner` ships them with the step's call."""

from __future__ import annotations

import numpy as np

from jax_paged.engine.programs import MixedBatch
from jax_paged.engine.sequence import ScheduledChunk, Sequence


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
