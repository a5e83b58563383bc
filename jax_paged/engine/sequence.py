"""What the scheduler plans with: a `Sequence` (one generated sequence and its progress), a
`ScheduledChunk` (the tokens of one sequence a step computes), the `SchedulerOutput` (one
step's whole plan) and the `StepResult` (what the device reports back), plus the block
arithmetic they share."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated sequence (a request with ``n > 1`` has several).

    Attributes:
      seq_id: engine-unique id, also the arrival order (smaller = older = higher priority).
      prompt_token_ids: the prompt.
      output_token_ids: tokens sampled so far.
      num_computed: leading tokens of ``all_tokens`` whose K/V is in the cache.
      num_blocks: physical blocks the block manager holds for this sequence (host mirror).
      slot: row of the device block table while running, else ``None``.
      num_cached_tokens: prompt tokens found in the prefix cache at admission.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    num_blocks: int = 0
    slot: int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Engine-side links: the sequence's own SamplingParams, its request, its index in it.
    params: Any = None
    request: Any = None
    index: int = 0
    # Sharing. prefill_cap: compute no further than this many tokens (an n > 1 leader stops
    # one token short of its prompt until its siblings are forked from it). cow_pending: the
    # last block is partial and shared, so the next write first copies it (one more block).
    prefill_cap: int | None = None
    cow_pending: bool = False
    needs_row_init: bool = False
    # Prefix cache, as the device's last lookup found it for this waiting sequence (valid for
    # the next step only: ``looked_up``): tokens it would start from, how many of those blocks
    # are evictable (taken from the free pool), and its row in that lookup (admission takes the
    # blocks found there).
    prefix_hit: int = 0
    prefix_revive: int = 0
    prefix_row: int = 0
    looked_up: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_decoding(self) -> bool:
        """True when only the newest sampled token is left to compute."""
        return self.num_tokens - self.num_computed == 1 and len(self.output_token_ids) > 0


@dataclasses.dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed before the step)
    length: int  # tokens computed this step
    need: int = 0  # free blocks granted for it (copy-on-write included)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: everything the device does in the step, in the order it does it.

    Attributes:
      free_slots: slots to free first (sequences finished, aborted or preempted since the
        last step).
      forks: (parent slot, child slot): the child starts sharing all the parent's blocks.
      preempted_slots: the slots of ``preempted``, freed after the forks.
      fresh: chunks of sequences admitted from the prefix cache (the device takes the blocks
        the last lookup found for them, row ``seq.prefix_row``).
      row_inits: sequences whose sampling rows (re)start (admitted or forked).
      chunks: the tokens to compute, one chunk per sequence; ``preempted``: sequences
        preempted to make room.
      decode_steps: > 0 when every chunk is a decode and nothing waits: a multi-step decode
        loop of up to this many tokens per sequence runs them.
      lookups: waiting sequences to look up in the prefix cache after the step.
      admitted: the sequences taken from the waiting queue. running: every running sequence.
    """

    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    free_slots: list[int] = dataclasses.field(default_factory=list)
    forks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted_slots: list[int] = dataclasses.field(default_factory=list)
    fresh: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    row_inits: list[Sequence] = dataclasses.field(default_factory=list)
    decode_steps: int = 0
    lookups: list[Sequence] = dataclasses.field(default_factory=list)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    running: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing for the device to do."""
        ops = self.free_slots or self.forks or self.preempted_slots or self.row_inits
        return not (self.chunks or ops or self.lookups)

    @property
    def all_decode(self) -> bool:
        return bool(self.chunks) and all(c.seq.is_decoding for c in self.chunks)

    @property
    def loopable(self) -> bool:
        """All decodes and none wants prompt log-probs: a multi-step decode loop may run it."""
        return self.all_decode and all(c.seq.params.prompt_logprobs is None for c in self.chunks)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_blocks_held(num_tokens: int, block_size: int, window: int | None, chunk: int) -> int:
    """The most blocks a sequence growing to ``num_tokens`` in steps of at most ``chunk``
    tokens holds at once (copy-on-write aside): all of them without a window; with one, the
    blocks that can still be seen (`window_dead_blocks`) plus the step's new ones, at most
    ``ceil((window + chunk) / bs) + 3``."""
    whole = blocks_for(num_tokens, block_size)
    if window is None:
        return whole
    return min(whole, blocks_for(window + min(chunk, num_tokens), block_size) + 3)


@dataclasses.dataclass
class StepResult:
    """What one step's program reports, on the host (numpy). ``K`` steps (1 for a mixed step),
    ``B`` padded rows, row ``r`` < len(plan.chunks) being chunk ``r``'s sequence.

    Attributes:
      tokens: i32[K, B] sampled tokens (-1 where the row made none); logprobs f32[K, B];
        ranks i32[K, B]; top_ids i32[K, B, N]; top_logprobs f32[K, B, N].
      made: i32[R] tokens each chunk's sequence sampled (decode loop: its tokens made).
      ok: bool[R] the chunk ran (False: the device refused its reservation; nothing ran).
      num_free: free blocks after the step (evictable cached blocks included).
      sole: i32[S] blocks each block-manager slot holds alone after the step (what freeing it
        gives back); None when the program did not report it.
      cached: i32[S] tokens each take started from. hits: per looked-up prompt of the plan,
        (cached tokens, evictable blocks among them); None when nothing was looked up.
      prompt_lp: the prompt log-probs arrays when the step computed them, else None.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    made: np.ndarray
    ok: np.ndarray
    num_free: int
    sole: Any = None
    cached: Any = None
    hits: Any = None
    prompt_lp: Any = None

    @classmethod
    def of_mixed(cls, out, samples: np.ndarray, want_plp: bool) -> StepResult:
        """The host's `StepResult` of a mixed step (``samples``: bool[R] of its chunks)."""
        n = len(samples)
        ok = np.asarray(out.ok[:n])
        return cls(
            tokens=out.tokens[None],
            logprobs=out.logprobs[None],
            ranks=out.ranks[None],
            top_ids=out.top_ids[None],
            top_logprobs=out.top_logprobs[None],
            made=(ok & samples[:n]).astype(np.int32),
            ok=ok,
            num_free=int(out.num_free),
            sole=np.asarray(out.sole),
            cached=out.cached,
            hits=out.hits,
            prompt_lp=out.prompt_lp if want_plp else None,
        )

    @classmethod
    def of_decode(cls, out, n: int) -> StepResult:
        """The host's `StepResult` of a decode loop over ``n`` rows."""
        steps = int(out.num_steps)
        made = np.sum(out.tokens[:steps, :n] >= 0, axis=0).astype(np.int32)
        return cls(
            tokens=out.tokens,
            logprobs=out.logprobs,
            ranks=out.ranks,
            top_ids=out.top_ids,
            top_logprobs=out.top_logprobs,
            made=made,
            ok=np.ones(n, bool),
            num_free=int(out.num_free),
            sole=np.asarray(out.sole),
            cached=out.cached,
        )
