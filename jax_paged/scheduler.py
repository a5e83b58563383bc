"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

The scheduler is plain host Python. It never touches the device block manager; it plans
against the free-block count the device last reported (after every device call), less what it
grants, and a per-sequence block count. Allocation itself happens on the device, inside the
compiled step. The plan is a bound, not a promise: blocks shared with other sequences (n > 1,
prefix hits) may free fewer blocks than the host counted, so the device may refuse a chunk;
a refusal is part of the contract (the step reports it per row and the engine preempts that
sequence, which recomputes later), and it never corrupts the block manager.

Every sequence computes the tokens ``all_tokens[num_computed:]`` (its prompt, then each
sampled token). A step gives it a chunk of them::

    all_tokens:  p0 p1 p2 p3 p4 p5 p6 | o0 o1
                 |<- num_computed ->|<-chunk->|
                 (KV in the cache)   (this step)

When a chunk reaches the end of ``all_tokens`` the step samples the next token from the last
position's logits; a chunk that stops short (chunked prefill) samples nothing. A decode is
just a chunk of one token. Preemption by recompute sets ``num_computed`` back to 0 and frees
the blocks; the sequence re-enters the waiting queue first in line and later re-prefills
its prompt plus everything it has generated, so its output is unchanged.

Policy (first come, first served):
1. Running sequences, oldest first, each get their next chunk (1 token when decoding). When
   the pool cannot hold a chunk, the youngest running sequence is preempted (possibly the one
   asking) until it can.
2. Then waiting sequences, oldest first, are admitted while the token budget, the sequence
   cap and the pool allow. No waiting sequence jumps ahead of an older one that does not fit,
   and none is admitted in a step that had to preempt.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Any

from jax_paged.block_manager import window_dead_blocks


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
    # Prefix cache, as the device's last lookup found it for this waiting sequence: tokens it
    # would start from, how many of those blocks are evictable (taken from the free pool), and
    # its row in that lookup (admission takes the blocks found there).
    prefix_hit: int = 0
    prefix_revive: int = 0
    prefix_row: int = 0

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
    """One step's plan. ``fresh``: chunks of sequences admitted from the prefix cache;
    ``admitted``: the sequences taken from the waiting queue."""

    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    fresh: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)  # from the waiting queue

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

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


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Args:
      num_blocks: usable blocks in the pool (the null block excluded).
      block_size: tokens per block.
      max_num_seqs: cap on running sequences (the device block table has this many rows).
      max_num_batched_tokens: token budget of one step.
      window: the sliding window through which every layer attends, if any: the device drops
        the blocks that fall out of it after each step, so a sequence holds fewer blocks than
        its table has entries (`held_blocks`).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        window: int | None = None,
    ):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"{max_num_batched_tokens=} must be >= {max_num_seqs=} so that every running "
                "sequence can decode in one step"
            )
        self.block_size = block_size
        self.window = window
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first
        self.num_preemptions = 0
        self._preempted_slots: list[int] = []

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes a running or waiting sequence. The caller frees its device blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks the device holds for ``seq``: its table entries, less those a sliding window
        dropped (`block_manager.window_dead_blocks`)."""
        if self.window is None:
            return seq.num_blocks
        dead = int(window_dead_blocks(seq.num_computed, self.block_size, self.window))
        return seq.num_blocks - min(dead, seq.num_blocks)

    def _release(self, seq: Sequence) -> None:
        self.num_free_blocks += self.held_blocks(seq)
        seq.num_blocks = 0
        self.free_slots.append(seq.slot)
        seq.slot = None

    def preempt(self, seq: Sequence) -> None:
        """Preempts a running sequence by recompute (its slot is drained for freeing)."""
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._preempted_slots.append(seq.slot)
        self._release(seq)
        seq.num_computed = 0
        seq.cow_pending = False
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        # Oldest first: put it back at the position its age gives it.
        i = 0
        while i < len(self.waiting) and self.waiting[i].seq_id < seq.seq_id:
            i += 1
        self.waiting.insert(i, seq)

    # -- one step --------------------------------------------------------------------------
    def _limit(self, seq: Sequence) -> int:
        end = seq.num_tokens if seq.prefill_cap is None else min(seq.prefill_cap, seq.num_tokens)
        return end - seq.num_computed

    def _need(self, seq: Sequence, length: int) -> int:
        """Blocks a chunk of ``length`` tokens takes (copy-on-write of a shared tail included)."""
        bs = self.block_size
        need = blocks_for(seq.num_computed + length, bs) - seq.num_blocks
        cow = seq.cow_pending and length > 0 and seq.num_computed % bs != 0
        return need + int(cow)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's chunks (host arithmetic only, no device call).

        A waiting sequence with ``prefix_hit`` tokens found in the prefix cache (by the
        device's lookup just before; the caller clears the hints after this call, as any
        later step can evict) is admitted from there: its chunk starts after them and
        its block need counts the evictable cached blocks it revives. Those admissions are in
        ``fresh``; the device must start them from the cache before the step
        (`prefix_cache.match_prefix`, which finds the same blocks: nothing changes the cache
        in between).
        """
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        fresh: list[ScheduledChunk] = []
        admitted: list[Sequence] = []
        self.running.sort(key=lambda s: s.seq_id)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            length = min(self._limit(seq), budget)
            if length == 0:
                i += 1
                continue
            need = self._need(seq, length)
            while need > self.num_free_blocks and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
            if need > self.num_free_blocks:  # even alone it does not fit: preempt itself
                self._preempt(seq)
                preempted.append(seq)
                break
            self._grant(seq, length, need, chunks)
            budget -= length
            i += 1

        bs = self.block_size
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            hit = seq.prefix_hit if seq.num_computed == 0 else 0
            length = max(0, min(self._limit(seq) - hit, budget))
            need = blocks_for(hit + length, bs) - hit // bs
            revive = seq.prefix_revive if hit else 0
            if need + revive > self.num_free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.free_slots.pop()
            seq.needs_row_init = True
            self.running.append(seq)
            admitted.append(seq)
            if hit:
                seq.num_computed = seq.num_cached_tokens = hit
                seq.num_blocks = hit // bs
                self.num_free_blocks -= revive
            self._grant(seq, length, need, chunks)
            if hit:
                fresh.append(chunks[-1])
            budget -= length
        return SchedulerOutput(chunks=chunks, preempted=preempted, fresh=fresh, admitted=admitted)

    def started_from_cache(self, chunks: list[ScheduledChunk], num_free: int) -> None:
        """The device has started the ``fresh`` sequences from the prefix cache and reports
        ``num_free`` free blocks: the free count becomes that, less the step's grants."""
        self.num_free_blocks = num_free - sum(c.need for c in chunks)

    def _grant(self, seq: Sequence, length: int, need: int, chunks: list) -> None:
        chunks.append(ScheduledChunk(seq=seq, start=seq.num_computed, length=length, need=need))
        seq.num_blocks += need - int(seq.cow_pending and seq.num_computed % self.block_size != 0)
        seq.cow_pending = False
        self.num_free_blocks -= need

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Starts ``child`` as a running copy of ``parent`` sharing all its blocks, if a slot is
        free. Both then copy the shared partial last block on their next write."""
        if len(self.running) >= self.max_num_seqs or not self.free_slots:
            return False
        child.slot = self.free_slots.pop()
        child.status = SequenceStatus.RUNNING
        child.num_computed = parent.num_computed
        child.num_blocks = parent.num_blocks
        child.needs_row_init = True
        shared_tail = parent.num_computed % self.block_size != 0
        child.cow_pending = parent.cow_pending = shared_tail
        self.running.append(child)
        return True

    def update_from_mixed(self, chunks: list[ScheduledChunk], ok, num_free: int) -> list[int]:
        """The device ran the ``chunks`` whose ``ok`` is set and reports ``num_free`` free
        blocks. A refused chunk (blocks shared with others freed fewer than estimated) ran
        nothing: its sequence is preempted and recomputes later. Returns the slots to free."""
        self.num_free_blocks = num_free
        for r, c in enumerate(chunks):
            if ok[r]:
                c.seq.num_computed += c.length
            else:
                self.preempt(c.seq)
        return self.drain_preempted_slots()

    def update_from_decode(self, seqs: list[Sequence], made, num_free: int) -> None:
        """A decode loop computed ``made[r]`` tokens of ``seqs[r]`` (the device reserved exactly
        those; the plan had granted one step) and reports ``num_free`` free blocks, which
        already count the blocks they took: only the table sizes move."""
        self.num_free_blocks = num_free
        for s, m in zip(seqs, made, strict=True):
            s.num_computed += int(m)
            s.num_blocks = blocks_for(s.num_computed, self.block_size)

    def decode_horizon(self, seqs: list[Sequence], max_steps: int, max_model_len: int) -> int:
        """Largest k <= max_steps such that every sequence can decode its next min(k, what it
        has left) tokens with the free blocks (used to size a multi-step decode call), and no
        more than the most any of them has left to make (max_tokens, max_model_len).

        A sequence stops inside the call once it has made what it has left, so it is counted
        for no more: counting k tokens for every row would make a pool that holds the whole
        batch at full length (and no more) cut the calls short near the end (32, 15, 8, 4
        steps instead of 32 throughout)."""
        left = [
            min(s.max_tokens - len(s.output_token_ids), max_model_len - s.num_tokens) for s in seqs
        ]

        def fits(k: int) -> bool:
            need = sum(self._need(s, max(0, min(k, r))) for s, r in zip(seqs, left, strict=True))
            return need <= self.num_free_blocks

        lo, hi = 1, max(1, min(max_steps, max(left)))
        while lo < hi:  # the need grows with k: the largest k that fits, by bisection
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def drain_preempted_slots(self) -> list[int]:
        """Slots of sequences preempted since the last call: the device must free them."""
        out, self._preempted_slots = self._preempted_slots, []
        return out
