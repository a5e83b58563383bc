"""Sliding-window layers free their blocks: when every layer attends through
one window (Mistral), the steps return the blocks that fell out of it to the pool, so a
sequence's KV stays bounded by the window however long it grows. Oracle: HF transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_greedy

from jax_paged import LLM, SamplingParams
from jax_paged.engine.sequence import max_blocks_held
from jax_paged.memory import block_manager as bm

WINDOW, BS, NEW = 8, 4, 200
PROMPTS = [[5, 9, 14, 3, 7], list(range(20, 33)), list(range(40, 61))]  # 5, 13 and 21 tokens


@pytest.fixture(scope="module")
def mistral(tiny_hf):
    hf, folder = tiny_hf("mistral_window")
    assert hf.config.sliding_window == WINDOW
    refs = [hf_greedy(hf, p, NEW, eos=False) for p in PROMPTS]
    return folder, refs


def _held(llm) -> int:
    """Blocks held by sequences now (cached blocks no sequence holds are not counted)."""
    st = jax.device_get(llm.engine.state.blocks)
    return int((np.asarray(st.ref_counts) > 0).sum())


def _run(llm, prompts, params):
    """Steps the engine to the end; returns (token ids per request, most blocks held after a
    step)."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outs, peak = {}, 0
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o
        peak = max(peak, _held(llm))
        bm.check_invariants(llm.engine.state.blocks, window_drops=True)
    return [outs[str(i)] for i in range(len(prompts))], peak


def _assert_pool_clean(llm):
    engine = llm.engine
    st = engine.state.blocks
    bm.check_invariants(st, window_drops=True)
    assert int(bm.num_free_blocks(st)) == engine.num_blocks - 1
    assert engine.scheduler.num_free_blocks == engine.num_blocks - 1


def test_window_dead_blocks_rule():
    # Block j is dead once (j + 1) * bs <= len - window + 1, and the last two stay.
    lens = np.array([0, 4, 8, 12, 13, 20, 100])
    want = [0, 0, 0, 1, 1, 3, 23]
    assert bm.window_dead_blocks(lens, BS, WINDOW).tolist() == want
    assert bm.window_dead_blocks(jnp.asarray(lens), BS, WINDOW).tolist() == want
    # The next query at position len sees keys len - window + 1 .. len: none in a dead block.
    for n, dead in zip(lens, want, strict=True):
        assert dead * BS <= max(n - WINDOW + 1, 0)


def test_mistral_long_outputs_hold_blocks_bounded_by_the_window(mistral):
    """200 new tokens per sequence (a table of 56 blocks each) through a pool of 24 blocks:
    greedy equals HF, and the blocks held never exceed the per-sequence bound."""
    folder, refs = mistral
    llm = LLM(
        str(folder),
        num_kv_blocks=24,
        block_size=BS,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert llm.engine.runner.opts.drop_window == WINDOW
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs, peak = _run(llm, PROMPTS, sp)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    # Without drops the three sequences would need 56 + 54 + 52 blocks.
    per_seq = -(-WINDOW // BS) + 3  # in-window blocks, the partial last one, the step's new one
    assert peak <= len(PROMPTS) * per_seq, peak
    assert peak <= 23 < sum(-(-(len(p) + NEW) // BS) for p in PROMPTS)
    assert llm.get_metrics()["num_preemptions"] == 0
    _assert_pool_clean(llm)


def test_mistral_window_drops_with_prefix_caching_and_forks(mistral):
    """Drops under the prefix cache (the dropped blocks stay cached, evictable: a rerun finds
    them) and n = 2 forks sharing tables with dropped entries: outputs equal HF."""
    folder, refs = mistral
    hf_refs = dict(zip(map(tuple, PROMPTS), refs, strict=True))
    llm = LLM(
        str(folder),
        num_kv_blocks=64,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for _ in range(2):  # the second pass finds the first pass's blocks in the cache
        outs, _ = _run(llm, PROMPTS, sp)
        assert [list(o.outputs[0].token_ids) for o in outs] == [
            hf_refs[tuple(p)][:60] for p in PROMPTS
        ]
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    two = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    outs, _ = _run(llm, PROMPTS[1:], two)
    for o, p in zip(outs, PROMPTS[1:], strict=True):
        assert [list(c.token_ids) for c in o.outputs] == [hf_refs[tuple(p)][:40]] * 2
    _assert_pool_clean(llm)


def test_mistral_window_drops_under_preemption(mistral):
    """A pool of 9 usable blocks for three sequences of about 4 held blocks each preempts;
    recomputed sequences drop their blocks again and the outputs equal HF."""
    folder, refs = mistral
    llm = LLM(
        str(folder),
        num_kv_blocks=10,
        block_size=BS,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs, peak = _run(llm, PROMPTS, sp)
    assert [list(o.outputs[0].token_ids) for o in outs] == [r[:60] for r in refs]
    assert llm.get_metrics()["num_preemptions"] > 0 and peak <= 9
    _assert_pool_clean(llm)


def test_pool_fit_check_counts_the_window():
    # A sequence of 221 tokens grown 16 at a time holds at most ceil((8 + 16) / 4) + 3 blocks.
    assert max_blocks_held(221, BS, WINDOW, 16) == 9
    assert max_blocks_held(221, BS, None, 16) == 56
    assert max_blocks_held(10, BS, WINDOW, 16) == 3  # never more than its whole table


def test_decode_band_equals_full_drop():
    """A decode step's one-entry band finds what the full O(S * P) pass finds."""
    st = bm.init_state(40, BS, 3, 12)
    st, _ = bm.reserve(st, jnp.array([13, 5, 0]))
    st = bm.drop_out_of_window(st, WINDOW)
    for _ in range(20):
        st, _ = bm.reserve(st, jnp.array([1, 1, 0]))
        band = bm.drop_out_of_window(st, WINDOW, band=1)
        full = bm.drop_out_of_window(st, WINDOW)
        # queue_pos of blocks not evictable is scratch, unspecified.
        for a, b in zip(
            jax.tree.leaves(band.replace(queue_pos=0)),
            jax.tree.leaves(full.replace(queue_pos=0)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        st = band
        bm.check_invariants(st, window_drops=True)
    lens = np.asarray(st.seq_lens)
    held = (np.asarray(st.block_tables) != 0).sum(1)
    nb = -(-lens // BS)
    assert (held == nb - bm.window_dead_blocks(lens, BS, WINDOW)).all()


@pytest.mark.slow
def test_window_memory_script_quick(capsys):
    """scripts/bench_window_memory.py --quick: drops hold what per-group tables would; the
    mixed layout (no drops) holds more; no window holds every block."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_window_memory

    out = bench_window_memory.main(["--quick"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    m = out["measured"]
    assert m["window_all"]["drops_blocks"] and not m["mixed"]["drops_blocks"]
    assert m["window_all"]["held_over_needed"] == 1.0 == m["none"]["held_over_needed"]
    assert m["mixed"]["held_over_needed"] > 1.0
    assert m["window_all"]["held_layer_blocks_peak"] < m["none"]["held_layer_blocks_peak"]
    assert m["mixed"]["held_layer_blocks_peak"] == m["none"]["held_layer_blocks_peak"]
    gemma = out["real_models"]["Gemma-3-270M"]["contexts"]
    assert gemma["1024"]["extra"] < gemma["8192"]["extra"] < gemma["32768"]["extra"]
