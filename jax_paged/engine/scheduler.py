"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

The scheduler is plain host Python and owns all host-side block accounting. It never touches
the device block manager: `schedule()` returns one `SchedulerOutput` holding everything the
device does in the step (slots to free, forks, admissions from the prefix cache, sampling rows
to start, the chunks to run, the waiting prompts to look up for the next step), and
`update(plan, result)` applies what the device reported. Allocation itself happens on the
device, inside the compiled step. The plan is made against the free-block count the device
last reported, which only `update` changes; blocks of sequences that finish between steps
count once the device has freed them. The plan is a bound, not a promise: blocks shared with
other sequences (n > 1, prefix hits) may free fewer blocks than a preemption counted, so the
device may refuse a chunk; a refusal is part of the contract (the step reports it per row and
`update` preempts that sequence, which recomputes later), and it never corrupts the block
manager.

Prefix hits: the device looks the prompts that may be admitted next up at the end of a step
(`SchedulerOutput.lookups`), and the next step takes the blocks it found before anything can
evict them. A prompt that could hit (its first block was cached once: ``cached_heads``) but
arrived after the last lookup waits one step for its own; an idle engine looks it up at once
(`idle_plan`).

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

import itertools
from collections import deque
from typing import Any

from jax_paged.engine.sequence import (
    ScheduledChunk,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    blocks_for,
)
from jax_paged.memory.block_manager import window_dead_blocks


class Scheduler:
    """FCFS continuous batching with chunked prefill, preemption by recompute, n > 1 forks and
    prefix-cache admissions; the host side of all block accounting.

    Args:
      num_blocks: usable blocks in the pool (the null block excluded).
      block_size: tokens per block.
      max_num_seqs: cap on running sequences (the device block table has this many rows).
      max_num_batched_tokens: token budget of one step.
      window: the sliding window through which every layer attends, if any: the device drops
        the blocks that fall out of it after each step, so a sequence holds fewer blocks than
        its table has entries (`held_blocks`).
      caching: prefix caching is on (waiting prompts are looked up).
      max_cached_heads: bound on ``cached_heads``, the first blocks ever filled with caching
        on. A prompt whose first block is not in it cannot hit, so it is not looked up (a
        superset: evictions are not tracked, which only costs a lookup that finds nothing).
        Past the bound the filter is dropped (None) and every candidate is looked up.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        window: int | None = None,
        caching: bool = False,
        max_cached_heads: int = 4096,
    ):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"{max_num_batched_tokens=} must be >= {max_num_seqs=} so that every running "
                "sequence can decode in one step"
            )
        self.block_size = block_size
        self.window = window
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.caching = caching
        self.max_cached_heads = max_cached_heads
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fork_waiting: dict[str, Any] = {}  # request id -> request whose leader prefills
        self.reset()

    def reset(self) -> None:
        """The device state was rebuilt empty: every running sequence goes back to the waiting
        queue (it re-prefills later) and nothing queued for the device is kept."""
        for s in list(self.running):
            self._preempt(s)
        self.num_free_blocks = self.num_blocks  # as the device last reported
        # Blocks the slots queued in `_to_free` hold alone (the device's last `sole` count):
        # the next step frees them before it reserves, so its plan may spend them.
        self._sole = None
        self._pending_free = 0
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first
        self._to_free: list[int] = []
        self._forks: list[tuple[int, int]] = []
        self._hinted: list[Sequence] = []
        self.cached_heads: set[tuple[int, ...]] | None = set()
        for q in self.waiting:
            q.looked_up, q.prefix_hit, q.prefix_revive = False, 0, 0

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_request(self, req) -> None:
        """Queues a request's sequences. With n > 1 the first one prefills the prompt but its
        last token; the others are then forked from it, sharing its blocks (copy-on-write of
        the partial last block)."""
        seqs = req.seqs
        if len(seqs) > 1 and len(req.prompt_token_ids) > 1:
            seqs[0].prefill_cap = len(req.prompt_token_ids) - 1
            req.pending_forks = seqs[1:]
            self.fork_waiting[req.request_id] = req
            seqs = seqs[:1]
        for s in seqs:
            self.add(s)

    def drop_forks(self, req) -> None:
        """Forgets a request's planned forks (its siblings waiting for one finish as aborted)."""
        self.fork_waiting.pop(req.request_id, None)
        for s in req.pending_forks:
            s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
        req.pending_forks = []

    @property
    def num_available_blocks(self) -> int:
        """Blocks the next step can reserve: the device's last free count plus the blocks that
        the slots it frees first (finished, aborted, preempted since) held alone."""
        return self.num_free_blocks + self._pending_free

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes a running or waiting sequence; its slot is freed by the next step."""
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

    def _release(self, seq: Sequence) -> int:
        """Gives ``seq``'s slot back (the device frees it first thing in the next step);
        returns the blocks it held."""
        held = self.held_blocks(seq)
        seq.num_blocks = 0
        if self._sole is not None:
            self._pending_free += int(self._sole[seq.slot])
        self.free_slots.append(seq.slot)
        self._to_free.append(seq.slot)
        seq.slot = None
        return held

    def preempt(self, seq: Sequence) -> None:
        """Preempts a running sequence by recompute (its slot is freed by the next step)."""
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> int:
        self.running.remove(seq)
        held = self._release(seq)
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
        return held

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

    def schedule(self, max_decode_steps: int = 1, max_model_len: int | None = None):
        """The next step's plan (host arithmetic only, no device call): a `SchedulerOutput`.

        A waiting sequence the last lookup found ``prefix_hit`` cached tokens for is admitted
        from there: its chunk starts after them and its block need counts the evictable
        cached blocks it revives. A waiting sequence that could hit but was not looked up
        yet stops admission for this step (it is looked up at the end of it). With
        ``max_decode_steps`` > 1, all chunks decodes and nothing waiting, the plan is a
        multi-step decode loop (`decode_horizon`; ``max_model_len`` bounds it).
        """
        self._fork_ready()
        free_slots, self._to_free = self._to_free, []
        budget, avail = self.max_num_batched_tokens, self.num_available_blocks
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
            while need > avail and self.running[-1] is not seq:
                victim = self.running[-1]
                avail += self._preempt(victim)
                preempted.append(victim)
            if need > avail:  # even alone it does not fit: preempt itself
                avail += self._preempt(seq)
                preempted.append(seq)
                break
            avail -= self._grant(seq, length, need, chunks)
            budget -= length
            i += 1

        bs = self.block_size
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if self._could_hit(seq) and not seq.looked_up:
                break
            hit = seq.prefix_hit if seq.looked_up and seq.num_computed == 0 else 0
            length = max(0, min(self._limit(seq) - hit, budget))
            need = blocks_for(hit + length, bs) - hit // bs
            revive = seq.prefix_revive if hit else 0
            if need + revive > avail:
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
                avail -= revive
            avail -= self._grant(seq, length, need, chunks)
            if hit:
                fresh.append(chunks[-1])
            budget -= length

        plan = SchedulerOutput(
            chunks=chunks,
            preempted=preempted,
            free_slots=free_slots,
            forks=self._forks,
            preempted_slots=self._to_free,
            fresh=fresh,
            row_inits=[s for s in self.running if s.needs_row_init],
            admitted=admitted,
            running=list(self.running),
        )
        self._to_free, self._forks, self._pending_free = [], [], 0
        if plan.loopable and not self.waiting and max_decode_steps > 1:
            seqs = [c.seq for c in chunks]
            plan.decode_steps = self.decode_horizon(seqs, max_decode_steps, max_model_len, avail)
        plan.lookups = self._lookup_candidates()
        return plan

    def idle_plan(self) -> SchedulerOutput | None:
        """With nothing running, what the device must do before a step can be planned: look
        up the waiting prompts that could hit the prefix cache (arrivals since the last
        lookup) and, once nothing is left at all, free the slots of what finished (an idle
        engine holds no blocks). None when there is nothing to do."""
        if self.running:
            return None
        lookups = self._lookup_candidates()
        if all(q.looked_up for q in lookups):
            lookups = []
        if not lookups and (self.waiting or not self._to_free):
            return None
        plan = SchedulerOutput(chunks=[], preempted=[], free_slots=self._to_free, lookups=lookups)
        self._to_free, self._pending_free = [], 0
        return plan

    def _could_hit(self, q: Sequence) -> bool:
        """Whether a lookup could find cached blocks for ``q``'s prompt. Cached positions have
        no logits, so prompt_logprobs requests compute their whole prompt."""
        heads, bs = self.cached_heads, self.block_size
        return (
            self.caching
            and q.num_computed == 0
            and q.params.prompt_logprobs is None
            and q.num_tokens > bs
            and (heads is None or tuple(q.all_token_ids[:bs]) in heads)
        )

    def _lookup_candidates(self) -> list[Sequence]:
        """The waiting sequences that may be admitted next and could hit the prefix cache."""
        room = min(len(self.free_slots), self.max_num_seqs - len(self.running))
        return [q for q in itertools.islice(self.waiting, max(0, room)) if self._could_hit(q)]

    def _grant(self, seq: Sequence, length: int, need: int, chunks: list) -> int:
        chunks.append(ScheduledChunk(seq=seq, start=seq.num_computed, length=length, need=need))
        seq.num_blocks += need - int(seq.cow_pending and seq.num_computed % self.block_size != 0)
        seq.cow_pending = False
        return need

    def _fork_ready(self) -> None:
        """Forks the siblings of n > 1 leaders that have prefilled all but the last prompt
        token. Siblings that find no free slot prefill on their own later (their prompt's full
        blocks are then found in the prefix cache)."""
        for rid, req in list(self.fork_waiting.items()):
            leader = req.seqs[0]
            if leader.status is not SequenceStatus.RUNNING:
                continue
            if leader.num_computed < leader.prefill_cap:
                continue
            for child in req.pending_forks:
                if self.fork(leader, child):
                    self._forks.append((leader.slot, child.slot))
                else:
                    self.add(child)
            req.pending_forks = []
            leader.prefill_cap = None
            del self.fork_waiting[rid]

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

    def update(self, plan: SchedulerOutput, result) -> None:
        """Applies what the device reported for ``plan`` (a `ModelRunner.execute` result): the
        free-block count, the tokens each chunk computed (a refused chunk ran nothing: its
        sequence is preempted and recomputes later; a decode loop made ``result.made[r]``
        tokens of row ``r``, reserving exactly those), the first blocks now cached, and the
        lookup's hints for the next step."""
        self.num_free_blocks = result.num_free
        self._sole = result.sole
        for s in plan.row_inits:
            s.needs_row_init = False
        for r, c in enumerate(plan.chunks):
            s = c.seq
            if not result.ok[r]:
                self.preempt(s)
                continue
            s.num_computed += int(result.made[r]) if plan.decode_steps else c.length
            if plan.decode_steps:
                s.num_blocks = blocks_for(s.num_computed, self.block_size)
            self._filled(s, c.start)
        for q in self._hinted:  # a lookup holds for the next step only
            q.looked_up, q.prefix_hit, q.prefix_revive = False, 0, 0
        self._hinted = []
        if result.hits is not None:
            for i, (q, (hit, revive)) in enumerate(zip(plan.lookups, result.hits, strict=True)):
                q.looked_up, q.prefix_hit, q.prefix_revive, q.prefix_row = True, hit, revive, i
            self._hinted = list(plan.lookups)

    def _filled(self, seq: Sequence, start: int) -> None:
        """Notes that ``seq`` computed from ``start`` to ``num_computed``: the device cached
        its first block if that step filled it."""
        bs, heads = self.block_size, self.cached_heads
        if self.caching and heads is not None and start < bs <= seq.num_computed:
            heads.add(tuple(seq.all_token_ids[:bs]))
            if len(heads) > self.max_cached_heads:
                self.cached_heads = None

    def decode_horizon(
        self, seqs: list[Sequence], max_steps: int, max_model_len: int | None, free=None
    ) -> int:
        """Largest k <= max_steps such that every sequence can decode its next min(k, what it
        has left) tokens with the ``free`` blocks (default: the last reported count), and no
        more than the most any of them has left to make (max_tokens, max_model_len).

        A sequence stops inside the call once it has made what it has left, so it is counted
        for no more: counting k tokens for every row would make a pool that holds the whole
        batch at full length (and no more) cut the calls short near its end."""
        free = self.num_free_blocks if free is None else free
        limit = max_model_len or 1 << 62
        left = [min(s.max_tokens - len(s.output_token_ids), limit - s.num_tokens) for s in seqs]

        def fits(k: int) -> bool:
            need = sum(self._need(s, max(0, min(k, r))) for s, r in zip(seqs, left, strict=True))
            return need <= free

        lo, hi = 1, max(1, min(max_steps, max(left)))
        while lo < hi:  # the need grows with k: the largest k that fits, by bisection
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
