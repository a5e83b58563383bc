"""Host-side scheduler: budgets, FCFS admission, chunked prefill and preemption."""

import random
from types import SimpleNamespace

import numpy as np

from jax_paged.engine.scheduler import Scheduler
from jax_paged.engine.sequence import Sequence, SequenceStatus, blocks_for
from jax_paged.entrypoints.sampling_params import SamplingParams


def _seq(i, prompt_len, max_tokens=4):
    return Sequence(
        seq_id=i,
        request_id=str(i),
        prompt_token_ids=[1] * prompt_len,
        max_tokens=max_tokens,
        params=SamplingParams(),
    )


def _run_step(sched, out, sample_token=7):
    """Applies a step as the engine would: the device's report (every chunk ran; the free
    count is what the running sequences leave), then the sampled tokens and the finishes."""
    held = sum(sched.held_blocks(s) for s in sched.running)
    n = len(out.chunks)
    made = [int(c.samples) for c in out.chunks]
    sole = np.zeros(sched.max_num_seqs, np.int32)  # nothing is shared in these tests
    for s in sched.running:
        sole[s.slot] = sched.held_blocks(s)
    free = sched.num_blocks - held
    report = SimpleNamespace(ok=[True] * n, made=made, num_free=free, sole=sole, hits=None)
    sched.update(out, report)
    assert (
        sum(sched.held_blocks(s) for s in sched.running) + sched.num_free_blocks == sched.num_blocks
    )
    finished = []
    for c in out.chunks:
        if c.samples:
            c.seq.output_token_ids.append(sample_token)
            if len(c.seq.output_token_ids) >= c.seq.max_tokens:
                finished.append(c.seq)
    for s in finished:
        sched.finish(s)
    return finished


def _idle(sched):
    """The idle engine's call: frees what finished; the device reports a whole free pool."""
    plan = sched.idle_plan()
    assert plan is not None and plan.free_slots
    report = SimpleNamespace(ok=[], made=[], num_free=sched.num_blocks, sole=None, hits=None)
    sched.update(plan, report)


def test_budget_and_chunked_prefill():
    sched = Scheduler(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _seq(0, 6), _seq(1, 10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes 6 tokens, b gets the 2 left of the budget (a chunk).
    assert [(c.seq.seq_id, c.start, c.length) for c in out.chunks] == [(0, 0, 6), (1, 0, 2)]
    assert out.chunks[0].samples and not out.chunks[1].samples
    assert sched.num_free_blocks == 100  # changed only by what the device reports
    _run_step(sched, out)
    assert sched.num_free_blocks == 100 - 2 - 1
    out = sched.schedule()
    # a decodes one token; b continues its prefill with the rest of the budget.
    assert [(c.seq.seq_id, c.start, c.length) for c in out.chunks] == [(0, 6, 1), (1, 2, 7)]


def test_fcfs_admission_waits_for_blocks():
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big, small = _seq(0, 20), _seq(1, 2)  # big needs 5 blocks > 4: stays first in line
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.chunks == [] and list(sched.waiting) == [big, small]


def test_next_plan_spends_the_blocks_of_what_finished():
    """The step after a sequence finishes frees its slot first, so its plan may already give
    those blocks to a waiting sequence (counting only the device's free count would make the
    newcomer wait one more step)."""
    sched = Scheduler(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 8, max_tokens=1), _seq(1, 8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [a]  # b needs 2 blocks, 1 is left
    assert _run_step(sched, out) == [a] and sched.num_free_blocks == 1
    assert sched.num_available_blocks == 3
    out = sched.schedule()
    assert out.free_slots == [0] and [c.seq for c in out.chunks] == [b]
    assert sched.num_available_blocks == sched.num_free_blocks  # the frees are in this plan


def test_preempts_youngest_and_requeues_first():
    sched = Scheduler(num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 4, max_tokens=8), _seq(1, 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())  # both prefilled: one block each, pool empty
    assert sched.num_free_blocks == 0
    out = sched.schedule()  # a's decode needs a second block: b is preempted
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING
    assert b.num_computed == 0 and b.slot is None and sched.num_free_blocks == 0
    assert [c.seq for c in out.chunks] == [a]


def test_random_workload_loses_nothing():
    rng = random.Random(0)
    for trial in range(20):
        bs = rng.choice([2, 4, 16])
        nb = rng.randint(8, 40)
        sched = Scheduler(
            num_blocks=nb,
            block_size=bs,
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(8, 40),
        )
        seqs = []
        for i in range(rng.randint(1, 25)):
            s = _seq(i, rng.randint(1, 12), max_tokens=rng.randint(1, 10))
            if blocks_for(s.num_tokens + s.max_tokens, bs) <= nb:
                seqs.append(s)
                sched.add(s)
        done = []
        for _ in range(10_000):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            ids = [c.seq.seq_id for c in out.chunks]
            assert len(ids) == len(set(ids)), "a sequence scheduled twice in a step"
            assert out.num_tokens <= sched.max_num_batched_tokens
            assert len(sched.running) <= sched.max_num_seqs
            assert sched.num_free_blocks >= 0
            done += _run_step(sched, out)
        assert not sched.has_unfinished(), f"trial {trial} did not finish"
        assert sorted(s.seq_id for s in done) == [s.seq_id for s in seqs]
        assert all(len(s.output_token_ids) == s.max_tokens for s in done)
        _idle(sched)
        assert sched.num_free_blocks == nb and sorted(sched.free_slots) == list(
            range(sched.max_num_seqs)
        )


def test_decode_horizon_counts_each_row_for_what_it_has_left():
    """Two rows in a pool that holds both at full length and no more: the one with 2 tokens
    left is counted for 2, so the call may run the other's 8 (counting 8 for both would not
    fit and cut the call to 4); with one block fewer, the most that fits (7)."""
    for free, want in ((4, 8), (3, 7)):
        sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
        a, b = _seq(0, 4, max_tokens=10), _seq(1, 4, max_tokens=10)
        for s, made in ((a, 8), (b, 2)):
            s.num_computed, s.num_blocks = 4 + made - 1, 2
            s.output_token_ids = [7] * made
        # a needs blocks_for(11 + 2) - 2 = 2, b blocks_for(5 + 8) - 2 = 2 at full length.
        sched.num_free_blocks = free
        assert sched.decode_horizon([a, b], 32, 1000) == want
        assert sched.decode_horizon([a, b], 2, 1000) == 2  # max_steps caps it
