"""Tensor parallelism on 8 emulated CPU devices: greedy outputs at
tensor_parallel_size 2, 4 and 8 equal one device's and HF's, with KV heads that divide the
devices and ones that need replicating, Gemma 3 and Gemma 2 among them; n > 1, prefix caching
and preemption sharded; each device holds only its share of the weights and of the KV pages;
the research API under a user Mesh; head counts a mesh cannot serve refused.

Needs 8 devices, so it runs in its own process (`.ci/run`):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m pytest -q tests/test_tensor_parallel.py

Emulated devices can deadlock on collectives dispatched back to back; the engine waits for
every step's results, and the research test runs one program.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from conftest import build_tiny_hf_model, hf_greedy, make_tiny_llama, oracle, research_greedy
from jax.sharding import Mesh

import models
from jax_paged import LLM, SamplingParams
from jax_paged.entrypoints.research import PagedDecoder
from jax_paged.memory import block_manager as bm

if os.environ.get("JAX_PAGED_REQUIRE_8_DEVICES") == "1":  # .ci/run: a skip would hide it
    assert jax.device_count() >= 8, "XLA_FLAGS=--xla_force_host_platform_device_count=8 unset"
pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (.ci/run)",
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 41)), [3] * 9]


def _save(tmp_path_factory, name, **overrides):
    torch, _ = oracle()
    hf = make_tiny_llama(**overrides).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def gqa_4_2(tmp_path_factory):
    """4 query heads, 2 KV heads: tp 2 splits the KV heads, tp 4 replicates each twice."""
    return _save(tmp_path_factory, "gqa_4_2")


@pytest.fixture(scope="module")
def gqa_8_2(tmp_path_factory):
    """8 query heads, 2 KV heads, hidden 128: tp 8 replicates each KV head 4 times."""
    return _save(tmp_path_factory, "gqa_8_2", hidden_size=128, num_attention_heads=8)


def _greedy(llm, prompts, n=12):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [list(o.outputs[0].token_ids) for o in outs]


def _clean(llm):
    st = llm.engine.state.blocks
    bm.check_invariants(st)
    assert int(bm.num_free_blocks(st)) == llm.engine.num_blocks - 1


def _assert_tp_equals_one_device_and_hf(path, hf, tp: int) -> None:
    kw = dict(num_kv_blocks=64, block_size=4, max_num_seqs=4)
    one = _greedy(LLM(str(path), **kw), PROMPTS)
    llm = LLM(str(path), tensor_parallel_size=tp, **kw)
    assert _greedy(llm, PROMPTS) == one
    assert one == [hf_greedy(hf, p, 12, eos=False) for p in PROMPTS]
    _clean(llm)


@pytest.mark.parametrize(
    "model,tp",
    [("gqa_4_2", 2), ("gqa_4_2", 4), pytest.param("gqa_8_2", 8, marks=pytest.mark.slow)],
)
def test_greedy_equals_one_device_and_hf(request, model, tp):
    path, hf = request.getfixturevalue(model)
    _assert_tp_equals_one_device_and_hf(path, hf, tp)


@pytest.mark.parametrize(
    "name,tp", [("gemma3_gqa1", 4), pytest.param("gemma2_gqa2", 2, marks=pytest.mark.slow)]
)
def test_gemma_greedy_equals_one_device_and_hf(tmp_path_factory, name, tp):
    """Gemma 3 (local and global layers, two RoPE bases, q/k norms) and Gemma 2 (attention
    soft cap) sharded over their KV heads."""
    from test_gemma import SPECS  # the tiny Gemma configurations of tests/test_gemma.py

    hf = build_tiny_hf_model(SPECS[name])
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    _assert_tp_equals_one_device_and_hf(path, hf, tp)


def test_each_device_holds_its_share(gqa_8_2):
    """tp 2 with 2 KV heads: each device one KV head's pages and half the attention and MLP
    weights; embeddings, LM head and the block manager replicated."""
    path, _ = gqa_8_2
    kw = dict(num_kv_blocks=32, block_size=4, max_num_seqs=4)
    one, two = LLM(str(path), **kw), LLM(str(path), tensor_parallel_size=2, **kw)
    k = two.engine.state.kv.k  # [L, KVH, N, bs, D]
    assert len(k.sharding.device_set) == 2
    assert k.addressable_shards[0].data.shape == (2, 1, 32, 4, 16)
    m1, m2 = one.get_metrics(), two.get_metrics()
    assert m2["tensor_parallel_size"] == 2
    assert m2["kv_cache_bytes_per_device"] * 2 == m1["kv_cache_bytes_per_device"]
    params = dict(jax.tree_util.tree_flatten_with_path(two.engine.runner.params)[0])
    shapes = {}
    for path_, x in params.items():
        name = "/".join(str(getattr(p, "key", p)) for p in path_)
        shapes[name] = (x.shape, x.addressable_shards[0].data.shape)
    split = {
        "q_proj/kernel": -1,
        "k_proj/kernel": -1,
        "v_proj/kernel": -1,
        "gate_proj/kernel": -1,
        "up_proj/kernel": -1,
        "o_proj/kernel": -2,
        "down_proj/kernel": -2,
    }
    seen = set()
    for name, (full, local) in shapes.items():
        hit = [s for s in split if s in name]
        if hit:
            axis = split[hit[0]]
            assert local[axis] * 2 == full[axis], name
            seen.add(hit[0])
        else:  # embeddings, norms, LM head
            assert local == full, name
    assert seen == set(split)
    blocks = two.engine.state.blocks.block_tables
    assert blocks.sharding.is_fully_replicated


@pytest.mark.slow
def test_n_prefix_caching_and_preemption_sharded(gqa_4_2):
    """tp 2 and 4 under a pool that preempts, prefix caching hits and n = 2 forks: the same
    tokens as one device."""
    path, _ = gqa_4_2
    shared = list(range(30, 50))
    prompts = [shared + [1], shared + [2, 3], shared + [4], [7, 8, 9]]
    sp = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, n=2, seed=3),
    ]
    kw = dict(num_kv_blocks=20, block_size=4, max_num_seqs=4, enable_prefix_caching=True)

    def run(llm):
        outs = []
        for params in sp:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outs.append([[list(c.token_ids) for c in o.outputs] for o in res])
        return outs

    ref = run(LLM(str(path), **kw))
    for tp in (2, 4):
        llm = LLM(str(path), tensor_parallel_size=tp, **kw)
        assert run(llm) == ref
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0, m
        _clean(llm)


def test_research_decode_under_a_user_mesh(gqa_4_2):
    path, _ = gqa_4_2
    loaded = models.load(str(path))
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=100)
    dec = PagedDecoder(loaded.model, max_seqs=4, max_len=48, block_size=4)
    ref = research_greedy(dec, sp, PROMPTS, 10)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    sharded = PagedDecoder(loaded.model, max_seqs=4, max_len=48, block_size=4, mesh=mesh)
    assert research_greedy(sharded, sp, PROMPTS, 10) == ref
    state = sharded.init(sp)
    assert state.device.kv.k.addressable_shards[0].data.shape[1] == 1  # 2 KV heads x 2 / 4


def test_head_counts_the_mesh_cannot_serve_are_refused(gqa_4_2, tmp_path_factory):
    path, _ = gqa_4_2
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tensor_parallel_size=8"):
        LLM(str(path), tensor_parallel_size=8, num_kv_blocks=16)
    odd, _ = _save(
        tmp_path_factory, "gqa_6_3", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    with pytest.raises(ValueError, match="num_kv_heads=3 and tensor_parallel_size=2"):
        LLM(str(odd), tensor_parallel_size=2, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 must be in \[1, 8\]"):
        LLM(str(path), tensor_parallel_size=16, num_kv_blocks=16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    with pytest.raises(ValueError, match="no 'tp' axis"):
        PagedDecoder(models.load(str(path)).model, max_seqs=2, max_len=16, mesh=mesh)


@pytest.mark.parametrize("dp,tp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow), (4, 2)])
def test_data_parallel_replicas(gqa_4_2, dp, tp):
    """Requests spread over replicas on disjoint devices give the tokens one engine gives; a
    bad request is refused by its replica and the rest complete."""
    path, _ = gqa_4_2
    kw = dict(num_kv_blocks=64, block_size=4, max_num_seqs=4)
    prompts = PROMPTS * 3
    one = _greedy(LLM(str(path), **kw), prompts)
    llm = LLM(str(path), data_parallel_size=dp, tensor_parallel_size=tp, **kw)
    sets = [frozenset(e.state.kv.k.sharding.device_set) for e in llm.engine.replicas]
    assert all(len(s) == tp for s in sets) and len(frozenset().union(*sets)) == dp * tp
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": []}], sp)
    assert [list(o.outputs[0].token_ids) for o in outs[:-1]] == one
    assert "empty" in outs[-1].error
    m = llm.get_metrics()
    assert m["data_parallel_size"] == dp and m["num_finished"] == len(prompts)
    assert all(r["num_finished"] > 0 for r in m["replicas"])
    for e in llm.engine.replicas:
        bm.check_invariants(e.state.blocks)
    with pytest.raises(ValueError, match="needs 16 devices; there are 8"):
        LLM(str(path), data_parallel_size=8, tensor_parallel_size=2, **kw)


@pytest.mark.slow
def test_bench_tp_quick(capsys):
    """scripts/bench_tp.py --quick: a JSON line per tp, outputs equal to tp 1's."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_tp

    out = bench_tp.main(["--quick"])
    assert json.loads(capsys.readouterr().out)["tp"] == out["tp"]
    assert set(out["tp"]) == {"1", "2"} and out["emulated"]
    assert all(r["outputs_equal_tp1"] and r["output_tokens_per_s"] > 0 for r in out["tp"].values())
    two, one = out["tp"]["2"], out["tp"]["1"]
    assert two["kv_cache_bytes_per_device"] * 2 == one["kv_cache_bytes_per_device"]
