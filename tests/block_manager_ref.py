"""A plain-Python block manager (lists, dicts, loops): the oracle for
`jax_paged.memory.block_manager`.

It follows the documented policy one request and one block at a time, the way a host-side
manager would, with none of the vectorised tricks (cumsums, scatters, first-occurrence
designation, top_k eviction rounds) of the JAX version.
"""

from __future__ import annotations

M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def block_keys(tokens: list[int], bs: int) -> list[int]:
    """Chained keys of the full blocks: H_j = H_{j-1} * C + d_j, key = mix(H_j)."""
    tokens = [int(t) for t in tokens]
    keys, h = [], 0
    for j in range(len(tokens) // bs):
        d = 0
        for t in range(bs):
            d = (d + mix32((tokens[j * bs + t] + t * 0x9E3779B9) & M32)) & M32
        h = (h * 0x01000193 + mix32(d)) & M32
        keys.append(mix32(h))
    return keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefBlockManager:
    def __init__(self, num_blocks, block_size, max_seqs, max_blocks_per_seq, hash_table_size):
        self.n, self.bs, self.s, self.p, self.hsize = (
            num_blocks,
            block_size,
            max_seqs,
            max_blocks_per_seq,
            hash_table_size,
        )
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]
        self.lens = [0] * max_seqs
        self.live = [False] * max_seqs
        self.rc = [0] * num_blocks
        self.stack = list(range(num_blocks - 1, 0, -1))  # last element = top
        # block -> key, parent, toks, the parent's incarnation (gen) when it was cached
        self.cache: dict[int, tuple[int, int, tuple[int, ...], int]] = {}
        self.gen = [0] * num_blocks  # times each block was cached
        self.buckets: dict[int, int] = {}  # bucket -> block
        self.evictable: dict[int, None] = {}  # cached blocks with refcount 0, oldest first

    def num_free_blocks(self) -> int:
        return len(self.stack) + len(self.evictable)

    # -- reserve ----------------------------------------------------------------------------
    def reserve(self, num_new, priority=None):
        bs, s_count = self.bs, self.s
        plan = []
        for s in range(s_count):
            k = max(int(num_new[s]), 0)
            old_nb = cdiv(self.lens[s], bs)
            new_nb = cdiv(self.lens[s] + k, bs)
            valid = k > 0 and new_nb <= self.p
            last = self.tables[s][old_nb - 1] if old_nb > 0 else 0
            cow = valid and self.lens[s] % bs != 0 and self.rc[last] > 1
            need = (new_nb - old_nb + cow) if valid else 0
            plan.append((k, old_nb, new_nb, valid, last, cow, need))
        if priority is None:
            order = list(range(s_count))
        else:
            order = sorted(range(s_count), key=lambda s: (int(priority[s]), s))
        avail, cum = self.num_free_blocks(), 0
        granted = [False] * s_count
        for s in order:
            cum += plan[s][6]
            granted[s] = plan[s][3] and (plan[s][6] == 0 or cum <= avail)
        # Copy-on-write: the lowest slot keeps a block when all its sharers write now.
        writers: dict[int, list[int]] = {}
        for s in range(s_count):
            if granted[s] and plan[s][5]:
                writers.setdefault(plan[s][4], []).append(s)
        do_cow = [False] * s_count
        for blk, ss in writers.items():
            keep = min(ss) if len(ss) == self.rc[blk] else None
            for s in ss:
                if s != keep:
                    do_cow[s] = True
                    self.rc[blk] -= 1
        total = sum(plan[s][2] - plan[s][1] + do_cow[s] for s in range(s_count) if granted[s])
        self._evict(max(0, total - len(self.stack)))
        src, dst = [0] * s_count, [0] * s_count
        for s in order:
            if not granted[s]:
                continue
            k, old_nb, new_nb, _, last, _, _ = plan[s]
            if do_cow[s]:
                b = self.stack.pop()
                self.rc[b] = 1
                self.tables[s][old_nb - 1] = b
                src[s], dst[s] = last, b
            for _ in range(old_nb, new_nb):
                b = self.stack.pop()
                self.rc[b] = 1
                self.tables[s].append(b)
            self.lens[s] += k
            self.live[s] = True
        ok = [granted[s] or plan[s][0] == 0 for s in range(s_count)]
        return ok, src, dst

    def _evict(self, count):
        victims = list(self.evictable)[:count]  # oldest first
        for b in victims:
            del self.evictable[b]
            key = self.cache.pop(b)[0]
            del self.buckets[key & (self.hsize - 1)]
        self.stack.extend(reversed(victims))  # oldest on top

    def token_slot(self, s, pos):
        if not (0 <= s < self.s) or pos < 0 or pos >= self.lens[s]:
            return 0
        return self.tables[s][pos // self.bs] * self.bs + pos % self.bs

    # -- free / fork ----------------------------------------------------------------------------
    def free(self, mask):
        freed = [s for s in range(self.s) if mask[s] and self.live[s]]
        released = []  # logical block descending, then slot ascending
        for j in range(self.p - 1, -1, -1):
            for s in freed:
                if j < len(self.tables[s]) and self.tables[s][j]:  # 0: dropped by a window
                    self.rc[self.tables[s][j]] -= 1
                    released.append(self.tables[s][j])
        for s in freed:
            self.tables[s], self.lens[s], self.live[s] = [], 0, False
        self._put_back(released)

    def drop_out_of_window(self, window):
        released = []  # slot ascending, then logical block descending
        for s in range(self.s):
            if not self.live[s]:
                continue
            nb = cdiv(self.lens[s], self.bs)
            hi = max(0, min(nb - 2, (self.lens[s] - window + 1) // self.bs))
            for j in range(hi - 1, -1, -1):
                b = self.tables[s][j]
                if b:
                    self.rc[b] -= 1
                    released.append(b)
                    self.tables[s][j] = 0
        self._put_back(released)

    def _put_back(self, released):
        seen = set()
        for b in released:
            if self.rc[b] == 0 and b not in seen:
                seen.add(b)
                if b in self.cache:
                    self.evictable[b] = None
                else:
                    self.stack.append(b)

    def fork(self, parent, child):
        ok, used = [], set()
        pre_live = list(self.live)
        for p, c in zip(parent, child, strict=True):
            good = 0 <= p < self.s and 0 <= c < self.s and pre_live[p] and not pre_live[c]
            good = good and c not in used
            if good:
                used.add(c)
            ok.append(good)
        snap = [
            (list(self.tables[p]), self.lens[p]) if g else None
            for p, g in zip(parent, ok, strict=True)
        ]
        for c, g, sn in zip(child, ok, snap, strict=True):
            if g:
                self.tables[c], self.lens[c], self.live[c] = list(sn[0]), sn[1], True
                for b in sn[0]:
                    if b:
                        self.rc[b] += 1
        return ok

    # -- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, slots, tokens, num_tokens):
        bs, used = self.bs, set()
        results, ok = [], []
        for slot, toks, nt in zip(slots, tokens, num_tokens, strict=True):
            good = 0 <= slot < self.s and not self.live[slot] and slot not in used
            if good:
                used.add(slot)
            ok.append(good)
            k = min(self.p, len(toks) // bs)
            keys = block_keys(list(toks[: k * bs]), bs)
            limit = min(max((nt - 1) // bs, 0), k)
            matched, prev = [], 0
            for j in range(limit if good else 0):
                b = self.buckets.get(keys[j] & (self.hsize - 1), 0)
                entry = self.cache.get(b)
                blk_toks = tuple(toks[j * bs : (j + 1) * bs])
                if entry is None or entry != (keys[j], prev, blk_toks, self.gen[prev]):
                    break
                matched.append(b)
                prev = b
            results.append(matched)
        for slot, g, matched in zip(slots, ok, results, strict=True):
            if g:
                self.tables[slot] = list(matched)
                self.lens[slot] = len(matched) * bs
                self.live[slot] = True
                for b in matched:
                    self.rc[b] += 1
                    self.evictable.pop(b, None)  # revived
        return [len(m) * bs for m in results], ok

    def cache_full_blocks(self, slots, tokens, num_tokens):
        bs = self.bs
        rows = []
        claims: dict[int, int] = {}  # bucket -> highest claiming block
        for slot, toks, nt in zip(slots, tokens, num_tokens, strict=True):
            if not (0 <= slot < self.s and self.live[slot]):
                continue
            k = min(self.p, len(toks) // bs)
            nfull = min(min(nt, self.lens[slot]) // bs, k)
            keys = block_keys(list(toks[: k * bs]), bs)
            entries = []
            for j in range(nfull):
                b = self.tables[slot][j]
                if b == 0:  # dropped by a sliding window: the chain stops
                    break
                bucket = keys[j] & (self.hsize - 1)
                already = b in self.cache
                claim = not already and bucket not in self.buckets
                if claim:
                    claims[bucket] = max(claims.get(bucket, 0), b)
                parent = self.tables[slot][j - 1] if j else 0
                entries.append((b, bucket, already, claim, keys[j], parent, toks, j))
            rows.append(entries)
        commits, winners = {}, set()
        for entries in rows:
            chain = True
            for b, bucket, already, claim, key, parent, toks, j in entries:
                won = claim and claims[bucket] == b
                if won:
                    winners.add((bucket, b))
                chain = chain and (already or won)
                if won and chain:
                    commits[b] = (key, parent, tuple(toks[j * bs : (j + 1) * bs]), bucket)
        committed = [(bucket, b) for bucket, b in winners if b in commits]
        for _, b in committed:
            self.gen[b] += 1
        for bucket, b in committed:
            key, parent, blk_toks, _ = commits[b]
            self.cache[b] = (key, parent, blk_toks, self.gen[parent])
            self.buckets[bucket] = b
