"""Cost of one compiled block-manager decode step (reserve + token_slots), printed as JSON.

Workload: every live sequence asks for 1 token per step (a decode step), starting from random
lengths in [0, 64) with block_size 16, so about 1 in 16 sequences crosses into a new block per
step. The state is donated (updated in place, as in the engine). Two timings per point:

  dispatched_us: one jitted call per step (what an engine pays per step if it calls it alone);
  in_scan_us:    per step inside one `lax.scan` over `steps` steps (the compiled cost alone).

Series: the headline (256 sequences, 100,000 blocks), batch scaling at 100,000 blocks, pool
scaling at 256 sequences (should stay flat), and the eviction path (every free block cached, so
each step first pops least recently freed cached blocks off the eviction queue).

  python scripts/bench_block_manager.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_support import run_metadata

from jax_paged.memory import block_manager as bm

BS = 16
P = 64


def _state(num_seqs, num_blocks, *, all_cached=False, seed=0):
    st = bm.init_state(num_blocks, BS, num_seqs, P)
    if all_cached:  # every usable block cached and evictable, in a random LRU order
        n = num_blocks
        rng = np.random.default_rng(seed)
        cached = np.ones(n, bool)
        cached[0] = False
        ids = np.arange(n, dtype=np.uint32)
        hsize = st.hash_table.shape[0]
        table = np.zeros(hsize, np.int32)
        table[ids[1:] & (hsize - 1)] = ids[1:]
        order = rng.permutation(np.arange(1, n, dtype=np.int32))
        queue = np.zeros(2 * n, np.int32)
        queue[: n - 1] = order
        pos = np.zeros(n, np.int32)
        pos[order] = np.arange(n - 1)
        st = st.replace(
            cached=jnp.asarray(cached),
            block_hash=jnp.asarray(ids),
            hash_table=jnp.asarray(table),
            evict_queue=jnp.asarray(queue),
            queue_pos=jnp.asarray(pos),
            queue_len=jnp.int32(n - 1),
            num_free=jnp.int32(0),
            num_evictable=jnp.int32(n - 1),
        )
    lens = np.random.default_rng(seed).integers(1, 64, num_seqs).astype(np.int32)
    st, res = jax.jit(bm.reserve)(st, jnp.asarray(lens))
    assert bool(res.ok.all())
    return st


def _step(st, num_new):
    st, res = bm.reserve(st, num_new)
    slots = bm.token_slots(st, jnp.arange(num_new.shape[0]), st.seq_lens - 1)
    return st, (res.ok, slots)


_step_jit = jax.jit(_step, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _scan(st, xs):
    return jax.lax.scan(_step, st, xs)


def measure(num_seqs, num_blocks, *, steps, repeats, all_cached=False):
    ones = jnp.ones(num_seqs, jnp.int32)
    xs = jnp.ones((steps, num_seqs), jnp.int32)
    # Dispatched: fresh state per repeat (so sequences never outgrow their tables).
    per_call = []
    for r in range(repeats + 1):
        st = _state(num_seqs, num_blocks, all_cached=all_cached, seed=r)
        st, out = _step_jit(st, ones)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(steps):
            st, out = _step_jit(st, ones)
        jax.block_until_ready((st, out))
        if r:  # the first round compiles
            per_call.append((time.perf_counter() - t0) / steps)
        assert bool(out[0].all()), "benchmark ran out of blocks"
    in_scan = []
    for r in range(repeats + 1):
        st = _state(num_seqs, num_blocks, all_cached=all_cached, seed=r)
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        st, out = _scan(st, xs)
        jax.block_until_ready((st, out))
        if r:
            in_scan.append((time.perf_counter() - t0) / steps)
    return {
        "num_seqs": num_seqs,
        "num_blocks": num_blocks,
        "dispatched_us": round(float(np.median(per_call)) * 1e6, 1),
        "in_scan_us": round(float(np.median(in_scan)) * 1e6, 1),
        "dispatched_us_min": round(float(np.min(per_call)) * 1e6, 1),
        "in_scan_us_min": round(float(np.min(in_scan)) * 1e6, 1),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer points and repeats")
    args = ap.parse_args()
    steps, repeats = (20, 2) if args.quick else (100, 4)
    kw = dict(steps=steps, repeats=repeats)
    batches = [64, 256] if args.quick else [32, 64, 128, 256, 512, 1024]
    pools = [4096, 100_000] if args.quick else [4096, 16_384, 100_000, 1_000_000]
    evict_pools = [16_384, 100_000] if args.quick else [4096, 16_384, 100_000, 1_000_000]
    out = {
        "benchmark": "block_manager",
        "run": run_metadata(),
        "what": "block manager decode step: reserve 1 token/seq + token_slots, compiled, CPU",
        "block_size": BS,
        "max_blocks_per_seq": P,
        "steps": steps,
        "backend": jax.default_backend(),
        "cpu": platform.processor() or platform.machine(),
        "headline": measure(256, 100_000, **kw),
        "batch_scaling": [measure(s, 100_000, **kw) for s in batches],
        "pool_scaling": [measure(256, n, **kw) for n in pools],
        "eviction_path": [measure(256, n, all_cached=True, **kw) for n in evict_pools],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
