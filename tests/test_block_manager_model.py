"""Model-based test: random operation sequences applied to the JAX block manager and to the
plain-Python reference (tests/block_manager_ref.py), compared after every step, with the
invariants checked after every step.

A shadow KV store (slot -> the token prefix whose K/V it holds) stands in for the KV cache: every
write stores the full prefix it was computed from, copy-on-write copies whole blocks, and after
every step each live sequence must read back exactly its own prefixes at every position. That
is the "no cross-sequence visibility" check: sharing by fork or prefix match passes only when
the shared K/V is the same computation.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from block_manager_ref import RefBlockManager, block_keys

from jax_paged.memory import block_manager as bm
from jax_paged.memory import eviction
from jax_paged.memory import prefix_cache as pc

M = 2  # rows per fork / match call


@functools.lru_cache(maxsize=1 << 16)
def _last_key(prefix: tuple[int, ...], bs: int) -> int:
    return block_keys(list(prefix), bs)[-1]


def _snapshot(st):
    st = jax.device_get(st)
    bt = np.asarray(st.block_tables)
    lens = np.asarray(st.seq_lens)
    nb = -(-lens // st.block_size)
    cached = np.flatnonzero(np.asarray(st.cached))
    rc = np.asarray(st.ref_counts)
    table = np.asarray(st.hash_table)
    return dict(
        tables=[bt[s, : nb[s]].tolist() for s in range(bt.shape[0])],
        lens=lens.tolist(),
        live=np.asarray(st.live).tolist(),
        rc=rc.tolist(),
        stack=np.asarray(st.free_stack)[: int(st.num_free)].tolist(),
        cache={
            int(b): (
                int(st.block_hash[b]),
                int(st.block_parent[b]),
                tuple(np.asarray(st.block_tokens[b]).tolist()),
                int(st.parent_gen[b]),
            )
            for b in cached
        },
        gen=np.asarray(st.block_gen).tolist(),
        buckets={int(i): int(table[i]) for i in np.flatnonzero(table)},
        evictable=eviction.eviction_order(st),
    )


def _ref_snapshot(ref: RefBlockManager):
    return dict(
        tables=ref.tables,
        lens=ref.lens,
        live=ref.live,
        rc=ref.rc,
        stack=ref.stack,
        cache=ref.cache,
        gen=ref.gen,
        buckets=ref.buckets,
        evictable=list(ref.evictable),
    )


class Harness:
    def __init__(self, seed, n, bs, s, p, hsize, chunk, vocab, windows=False):
        self.rng = np.random.default_rng(seed)
        self.n, self.bs, self.s, self.p, self.vocab = n, bs, s, p, vocab
        self.width = p * bs
        self.state = bm.init_state(n, bs, s, p, hash_table_size=hsize, evict_chunk=chunk)
        self.ref = RefBlockManager(n, bs, s, p, hsize)
        self.truth: list[list[int]] = [[] for _ in range(s)]  # tokens with K/V, per slot
        self.pending: list[list[int]] = [[] for _ in range(s)]  # prompt tokens still to write
        self.history: list[list[int]] = []  # past sequences, to draw shared prefixes from
        self.kv: dict[int, tuple[int, ...]] = {}  # shadow KV: slot -> prefix it was computed on
        self.max_new = 2 * bs + 1
        t = s * self.max_new
        self.reserve = jax.jit(bm.reserve)
        self.reserve_prio = jax.jit(lambda st, k, pr: bm.reserve(st, k, priority=pr))
        self.slots = jax.jit(bm.token_slots)
        self.free = jax.jit(bm.free)
        self.fork = jax.jit(bm.fork)
        self.match = jax.jit(pc.match_prefix)
        self.insert = jax.jit(pc.cache_full_blocks)
        self.drop = jax.jit(bm.drop_out_of_window, static_argnums=1)
        self.windows = windows  # op_drop runs: sliding-window drops free parents first
        self.t = t
        self.counts: dict[str, int] = {}

    # -- helpers --------------------------------------------------------------------------------
    def _row(self, toks):
        row = np.zeros(self.width, np.int32)
        row[: len(toks)] = toks[: self.width]
        return row

    def _new_prompt(self):
        r = self.rng
        if self.history and r.random() < 0.7:
            base = self.history[r.integers(len(self.history))]
            cut = int(r.integers(0, len(base) + 1))
            toks = list(base[:cut])
        else:
            toks = []
        extra = int(r.integers(0, 2 * self.bs + 2))
        toks += r.integers(0, self.vocab, extra).tolist()
        return toks[: self.width] or [int(r.integers(self.vocab))]

    # -- operations -----------------------------------------------------------------------------
    def op_reserve_write(self):
        r = self.rng
        live = [s for s in range(self.s) if self.ref.live[s]]
        num_new = np.zeros(self.s, np.int32)
        for s in range(self.s):
            u = r.random()
            if self.pending[s] and u < 0.8:
                num_new[s] = min(len(self.pending[s]), int(r.integers(1, self.max_new + 1)))
            elif s in live and u < 0.6:
                num_new[s] = 1 if r.random() < 0.7 else int(r.integers(1, self.max_new + 1))
            elif s not in live and u < 0.1:
                num_new[s] = int(r.integers(1, self.max_new + 1))
        if r.random() < 0.3:
            prio = r.permutation(self.s).astype(np.int32)
            self.state, res = self.reserve_prio(self.state, num_new, prio)
            ok, src, dst = self.ref.reserve(num_new, prio)
        else:
            self.state, res = self.reserve(self.state, num_new)
            ok, src, dst = self.ref.reserve(num_new)
        assert np.asarray(res.ok).tolist() == ok
        if not all(ok):
            self.counts["refused"] = self.counts.get("refused", 0) + 1
        if any(dst):
            self.counts["cow"] = self.counts.get("cow", 0) + 1
        assert np.asarray(res.cow_src).tolist() == src
        assert np.asarray(res.cow_dst).tolist() == dst
        bs = self.bs
        for a, b in zip(src, dst, strict=True):  # copy-on-write before any write
            if b:
                assert a and a != b
                for o in range(bs):
                    if a * bs + o in self.kv:
                        self.kv[b * bs + o] = self.kv[a * bs + o]
        seq_idx, pos = [], []
        for s in range(self.s):
            if num_new[s] and ok[s]:
                k = int(num_new[s])
                start = len(self.truth[s])
                take = self.pending[s][:k]
                self.pending[s] = self.pending[s][k:]
                take += r.integers(0, self.vocab, k - len(take)).tolist()
                self.truth[s] += take
                seq_idx += [s] * k
                pos += list(range(start, start + k))
        nt = len(seq_idx)
        seq_pad = np.full(self.t, -1, np.int32)
        pos_pad = np.full(self.t, -1, np.int32)
        seq_pad[:nt], pos_pad[:nt] = seq_idx, pos
        slots = np.asarray(self.slots(self.state, seq_pad, pos_pad))
        assert (slots[nt:] == 0).all()
        for i in range(nt):
            s, p = seq_idx[i], pos[i]
            want = self.ref.token_slot(s, p)
            assert slots[i] == want and want >= bs, (s, p, slots[i], want)
            self.kv[int(slots[i])] = tuple(self.truth[s][: p + 1])
        for s in range(self.s):
            if num_new[s] and not ok[s] and not self.ref.live[s]:
                self.pending[s] = []  # a refused new sequence is dropped

    def op_free(self):
        mask = self.rng.random(self.s) < 0.35
        if self.rng.random() < 0.3:  # one slot alone: exactly what it held alone comes back
            mask = np.arange(self.s) == self.rng.integers(self.s)
        # What each slot holds alone is what freeing it gives back; slots freed together may
        # also give back the blocks only they shared.
        sole = np.asarray(bm.sole_blocks(self.state))
        before = self.ref.num_free_blocks()
        self.state = self.free(self.state, mask)
        self.ref.free(mask)
        freed = self.ref.num_free_blocks() - before
        assert freed >= int(sole[mask].sum()), (freed, sole, mask)
        if mask.sum() == 1:
            assert freed == int(sole[mask].sum()), (freed, sole, mask)
        for s in range(self.s):
            if mask[s]:
                if self.truth[s]:
                    self.history.append(self.truth[s])
                    self.history = self.history[-32:]
                self.truth[s], self.pending[s] = [], []

    def op_fork(self):
        r = self.rng
        parent = r.integers(-1, self.s, M).astype(np.int32)
        child = r.integers(-1, self.s, M).astype(np.int32)
        self.state, ok = self.fork(self.state, parent, child)
        ref_ok = self.ref.fork(parent.tolist(), child.tolist())
        assert np.asarray(ok).tolist() == ref_ok
        for p, c, g in zip(parent, child, ref_ok, strict=True):
            if g:
                self.truth[c] = list(self.truth[p])
                self.pending[c] = []

    def op_match(self):
        r = self.rng
        slots = r.integers(-1, self.s, M).astype(np.int32)
        prompts = [self._new_prompt() for _ in range(M)]
        toks = np.stack([self._row(t) for t in prompts])
        nt = np.array([len(t) for t in prompts], np.int32)
        # The side-effect-free lookup finds what matching then takes: the same tokens, and the
        # evictable blocks it revives leave the free count.
        hit, revive = pc.lookup_prefix(self.state, toks, nt)
        free_before = int(bm.num_free_blocks(self.state))
        self.state, cached, ok = self.match(self.state, slots, toks, nt)
        okn = np.asarray(ok)
        assert np.asarray(cached)[okn].tolist() == np.asarray(hit)[okn].tolist()
        taken = free_before - int(bm.num_free_blocks(self.state))
        assert taken <= int(np.asarray(revive)[okn].sum())  # rows may revive a block twice
        if okn.sum() == 1:
            assert taken == int(np.asarray(revive)[okn].sum())
        ref_cached, ref_ok = self.ref.match_prefix(slots.tolist(), [list(t) for t in toks], nt)
        assert np.asarray(ok).tolist() == ref_ok
        assert np.asarray(cached).tolist() == ref_cached
        for s, g, c, t in zip(slots, ref_ok, ref_cached, prompts, strict=True):
            if g:
                self.truth[s] = list(t[:c])
                self.pending[s] = list(t[c:])
                if c:
                    self.counts["hit_tokens"] = self.counts.get("hit_tokens", 0) + c

    def op_insert(self):
        r = self.rng
        slots = np.where(r.random(self.s) < 0.7, np.arange(self.s), -1).astype(np.int32)
        toks = np.stack([self._row(self.truth[s]) for s in range(self.s)])
        nt = np.array([len(self.truth[s]) for s in range(self.s)], np.int32)
        nt = np.where(r.random(self.s) < 0.2, nt // 2, nt).astype(np.int32)
        self.state = self.insert(self.state, slots, toks, nt)
        self.ref.cache_full_blocks(slots.tolist(), [list(t) for t in toks], nt.tolist())

    def op_drop(self):
        window = int(self.rng.integers(1, 3 * self.bs + 1))
        before = sum(self.ref.rc)
        self.state = self.drop(self.state, window)
        self.ref.drop_out_of_window(window)
        self.counts["dropped"] = self.counts.get("dropped", 0) + before - sum(self.ref.rc)

    # -- checks ---------------------------------------------------------------------------------
    def check(self):
        host = jax.device_get(self.state)
        got, want = _snapshot(host), _ref_snapshot(self.ref)
        for key in want:
            assert got[key] == want[key], (key, got[key], want[key])
        bm.check_invariants(host, window_drops=self.windows)
        bs = self.bs
        for s in range(self.s):
            assert self.ref.lens[s] == len(self.truth[s])
            for p in range(self.ref.lens[s]):
                slot = self.ref.token_slot(s, p)
                if slot < bs:  # a block a window dropped
                    continue
                assert self.kv.get(slot) == tuple(self.truth[s][: p + 1]), (s, p, slot)
        cache, gen = self.ref.cache, self.ref.gen
        for b, (key, parent, toks, _) in cache.items():  # cached K/V is what it claims
            pre = tuple(toks)
            chain, pgen = [b], cache[b][3]
            while parent and parent in cache and gen[parent] == pgen:
                chain.append(parent)
                pre = tuple(cache[parent][2]) + pre
                parent, pgen = cache[parent][1], cache[parent][3]
            if parent:  # a parent evicted first (windows only): unreachable, not checked
                assert self.windows
                continue
            assert key == _last_key(pre, bs)
            for o in range(bs):
                assert self.kv.get(b * bs + o) == pre[: len(pre) - bs + o + 1]

    def run(self, steps):
        ops = [
            (self.op_reserve_write, 0.45),
            (self.op_free, 0.12),
            (self.op_fork, 0.10),
            (self.op_match, 0.16),
            (self.op_insert, 0.17),
        ] + ([(self.op_drop, 0.08)] if self.windows else [])
        fns, w = zip(*ops, strict=True)
        w = np.asarray(w) / sum(w)
        for _ in range(steps):
            fn = fns[self.rng.choice(len(fns), p=w)]
            fn()
            self.counts[fn.__name__] = self.counts.get(fn.__name__, 0) + 1
            self.check()
        return self.counts


CONFIGS = {
    # name: (seed, num_blocks, block_size, max_seqs, max_blocks_per_seq, hash size, chunk, vocab)
    "bs4": (0, 24, 4, 6, 6, 32, 3, 3),
    "bs2_tight": (1, 10, 2, 4, 8, 8, 1, 2),
    "bs1": (2, 20, 1, 5, 12, 16, 4, 2),
    "bs8_roomy": (3, 48, 8, 6, 5, 128, 256, 4),
    # with sliding-window drops
    "bs4_window": (4, 24, 4, 6, 8, 32, 3, 3, True),
    "bs2_window": (5, 16, 2, 4, 10, 16, 2, 2, True),
}
STEPS = {"bs4": 3500, "bs2_tight": 2500, "bs1": 2000, "bs8_roomy": 2000}  # 10,000 in all
STEPS |= {"bs4_window": 2000, "bs2_window": 2000}


FAST_TIER_SHARE = 0.2  # of the steps, when the run deselects slow tests (``-m "not slow"``)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_ops_match_reference(name, full_suite):
    share = 1.0 if full_suite else FAST_TIER_SHARE
    h = Harness(*CONFIGS[name])
    counts = h.run(int(STEPS[name] * share))
    # The run must actually exercise sharing, caching and running out.
    assert counts.get("hit_tokens", 0) > 0, counts
    assert counts.get("refused", 0) > 0, counts
    assert counts.get("cow", 0) > 0 or CONFIGS[name][2] == 1, counts  # bs 1: no partial blocks
    assert counts["op_fork"] > 50 * share and counts["op_match"] > 50 * share
    if h.windows:
        assert counts.get("dropped", 0) > 50 * share, counts
