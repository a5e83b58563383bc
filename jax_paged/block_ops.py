"""`BlockOpQueue`: the block-manager work the engine queues between steps, sent to the device
in one ``prepare`` call (`ModelRunner.prepare`).

Between two steps the engine learns that slots must be freed (finished, aborted or preempted
sequences) and that n > 1 siblings can be forked from their leader. Neither needs a device call
of its own: the queue holds them until the next ``prepare``, which also looks the prompts of
the waiting sequences that could be admitted next up in the prefix cache, so the scheduler
knows how many of their tokens are cached. Order on the device: free -> fork -> lookup.
(Full blocks need no host work: each step adds the blocks it fills to the prefix cache.)

The device's block manager stays the one authority: after ``prepare`` the scheduler's free
count is the device's, and nothing here re-implements what the device does. The one host-side
shortcut is a filter, ``cached_heads``: the first blocks ever filled with caching on. A prompt
whose first block is not in it cannot hit, so it is not looked up (a superset; evictions are
not tracked, which only costs a lookup that finds nothing). Past ``max_cached_heads`` entries
the filter is dropped (None) and every admissible waiting prompt is looked up.
"""

from __future__ import annotations

import itertools

from jax_paged.scheduler import Scheduler, Sequence, SequenceStatus


class BlockOpQueue:
    """Frees, caching requests and forks waiting for the next ``prepare`` call.

    Attributes:
      free: slots to free.
      forks: (parent slot, child slot) pairs: the child shares all the parent's blocks.
      fork_waiting: request id -> request whose n > 1 leader has not yet prefilled all but the
        last prompt token (its siblings are forked from it then).
    """

    def __init__(self, block_size: int, caching: bool, max_cached_heads: int):
        self.block_size = block_size
        self.caching = caching
        self.max_cached_heads = max_cached_heads
        self.reset()

    def reset(self) -> None:
        """Forgets everything queued (the device state was rebuilt empty)."""
        self.free: list[int] = []
        self.forks: list[tuple[int, int]] = []
        self.fork_waiting: dict = {}
        self.cached_heads: set[tuple[int, ...]] | None = set()

    def add_request(self, req, scheduler: Scheduler) -> None:
        """Queues a new request's sequences. With n > 1 the first one prefills the prompt but
        its last token; the others are then forked from it (`fork_ready`), sharing its blocks
        (copy-on-write of the partial last block)."""
        seqs = req.seqs
        if len(seqs) > 1 and len(req.prompt_token_ids) > 1:
            seqs[0].prefill_cap = len(req.prompt_token_ids) - 1
            req.pending_forks = seqs[1:]
            self.fork_waiting[req.request_id] = req
            seqs = seqs[:1]
        for s in seqs:
            scheduler.add(s)

    def release(self, seq: Sequence) -> None:
        """Queues the slot of a sequence that stops running."""
        if seq.slot is not None:
            self.free.append(seq.slot)

    def filled(self, seq: Sequence, start: int) -> None:
        """Notes that ``seq`` computed from ``start`` to ``num_computed``: the device cached
        its first block if that step filled it."""
        bs, heads = self.block_size, self.cached_heads
        if self.caching and heads is not None and start < bs <= seq.num_computed:
            heads.add(tuple(seq.all_token_ids[:bs]))
            if len(heads) > self.max_cached_heads:
                self.cached_heads = None

    def fork_ready(self, scheduler: Scheduler) -> None:
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
                if scheduler.fork(leader, child):
                    self.forks.append((leader.slot, child.slot))
                else:
                    scheduler.add(child)
            req.pending_forks = []
            leader.prefill_cap = None
            del self.fork_waiting[rid]

    def _lookup_candidates(self, scheduler: Scheduler, room: int) -> list[Sequence]:
        bs, heads = self.block_size, self.cached_heads
        cand = []
        for q in itertools.islice(scheduler.waiting, room):
            # A prompt whose first block was never cached cannot hit; cached positions have no
            # logits, so prompt_logprobs requests compute their whole prompt.
            head = tuple(q.all_token_ids[:bs])
            if (
                q.num_computed == 0
                and q.params.prompt_logprobs is None
                and q.num_tokens > bs
                and (heads is None or head in heads)
            ):
                cand.append(q)
        return cand

    def prepare(self, runner, scheduler: Scheduler, lookup: bool = False) -> list[Sequence]:
        """Makes the ``prepare`` call for the queued work, if any; with ``lookup`` the prompts
        of the waiting sequences that may be admitted next are looked up in the prefix cache
        (their ``prefix_hit`` / ``prefix_revive`` are set), which alone is reason for a call
        only when one of them could hit. Afterwards the scheduler's free-block count is the
        device's. Returns the sequences given hints."""
        cand = []
        if lookup:
            room = min(len(scheduler.free_slots), scheduler.max_num_seqs)
            cand = self._lookup_candidates(scheduler, room)
        if not (self.free or self.forks or cand):
            return []
        free, forks, self.free, self.forks = self.free, self.forks, [], []
        num_free, found = runner.prepare(free, forks, [q.all_token_ids for q in cand])
        scheduler.num_free_blocks = num_free
        for i, (q, (hit, revive)) in enumerate(zip(cand, found, strict=True)):
            q.prefix_hit, q.prefix_revive, q.prefix_row = hit, revive, i
        return cand
