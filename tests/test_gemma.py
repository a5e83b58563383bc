"""Gemma 3 and Gemma 2 (models/gemma.py) against HF transformers' Gemma3ForCausalLM and
Gemma2ForCausalLM on tiny random models.

Three tiny models, f32, eager attention, noise on every 1-D parameter (so the (1 + w) norms, q/k
norms and biases all matter), sliding windows (5 and 7) shorter than the prompts (up to 21
tokens, and 53 positions after 32 greedy tokens):

- ``gemma3_gqa1``: MHA (4 query / 4 KV heads), HF's default pattern of 5 local + 1 global over
  8 layers (one scanned group of 6 and 2 remainder layers), linear RoPE scaling on the global
  layers, query_pre_attn_scalar 24 != head_dim 16, tied embeddings.
- ``gemma3_gqa4``: GQA 4 (4 query / 1 KV head), explicit layer_types local, local, global over
  7 layers (two groups of 3, one remainder), local RoPE base 100, q/k/v/o biases, untied LM
  head, a final-logit soft cap of 3 (the logits reach about 3, so the cap bends them).
- ``gemma2_gqa2``: Gemma 2 (same file): GQA 2, no q/k norms, one RoPE base, local and global
  layers alternating over 5 layers (window 6), attention scores soft-capped at 0.3 by the paged
  kernels and the dense forward, final-logit cap 3.

The oracle is HF transformers (torch, CPU): these tests fail, not skip, when it is missing.
The engine tests run the mixed local/global layers through the engine's attention function
with each layer's own ``sliding_window``.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from bench_support import dense
from conftest import (
    TinySpec,
    build_tiny_hf_model,
    hf_greedy,
    hf_logits,
    oracle,
    research_greedy,
    right_pad,
)
from flax import nnx

import models
from models.gemma import Gemma3, layer_pattern
from models.llama import dense_attention

PROMPT_LENGTHS = (5, 13, 21)
NEW_TOKENS = 32
TOL = 1e-4

SPECS = {
    s.name: s
    for s in [
        TinySpec(
            "gemma3_gqa1",
            "Gemma3TextConfig",
            (
                ("hidden_size", 64),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 4),
                ("head_dim", 16),
                ("intermediate_size", 128),
                ("num_hidden_layers", 8),
                ("sliding_window", 5),
                ("query_pre_attn_scalar", 24),
                ("rope_scaling", (("rope_type", "linear"), ("factor", 4.0))),
                ("tie_word_embeddings", True),
                ("attn_implementation", "eager"),
            ),
        ),
        TinySpec(
            "gemma3_gqa4",
            "Gemma3TextConfig",
            (
                ("hidden_size", 96),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 1),
                ("head_dim", 32),
                ("intermediate_size", 192),
                ("num_hidden_layers", 7),
                ("layer_types", ["sliding_attention", "sliding_attention", "full_attention"] * 2
                 + ["sliding_attention"]),
                ("sliding_window", 7),
                ("query_pre_attn_scalar", 48),
                ("rope_local_base_freq", 100.0),
                ("attention_bias", True),
                ("final_logit_softcapping", 3.0),
                ("tie_word_embeddings", False),
                ("attn_implementation", "eager"),
            ),
        ),
        # Gemma 2: no q/k norms, one RoPE, every other layer windowed (HF's default), attention
        # scores soft-capped at 0.3 (tiny random scores reach about that, so the cap bends them).
        TinySpec(
            "gemma2_gqa2",
            "Gemma2Config",
            (
                ("hidden_size", 64),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 2),
                ("head_dim", 16),
                ("intermediate_size", 128),
                ("num_hidden_layers", 5),
                ("sliding_window", 6),
                ("query_pre_attn_scalar", 16),
                ("attn_logit_softcapping", 0.3),
                ("final_logit_softcapping", 3.0),
                ("attn_implementation", "eager"),
            ),
        ),
    ]
}  # fmt: skip
NAMES = sorted(SPECS)

logits_of = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (HF model, its folder, our LoadedModel f32). Built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = build_tiny_hf_model(SPECS[name])
            assert hf.config._attn_implementation == "eager"
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            cache[name] = (hf, folder, models.load(folder))
        return cache[name]

    return get


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENGTHS]


def _max_logit_error(model, hf_model, prompts) -> float:
    ours = np.asarray(logits_of(model, jnp.asarray(right_pad(prompts))))
    refs = hf_logits(hf_model, prompts)
    return max(float(np.abs(ours[i, : len(r)] - r).max()) for i, r in enumerate(refs))


# ----------------------------------------------------------------------------------------------
# Config and structure


def test_layer_pattern_by_hand():
    w = 5
    assert layer_pattern((w, w, w, w, w, None) * 4 + (w, w)) == (w, w, w, w, w, None)
    assert layer_pattern((w, w, None, w, w, None, w)) == (w, w, None)
    assert layer_pattern((None,) * 3) == (None,)
    assert layer_pattern((None, w, w, None, w)) == (None, w, w)  # 1 group of 3, 2 remainder
    assert layer_pattern((w, None, None)) == (w, None, None)  # no repeat: one group of all


def test_config_from_hf(tiny):
    a = tiny("gemma3_gqa1")[2].config
    assert a.model_type == "gemma3_text" and a.hidden_act == "gelu_pytorch_tanh"
    assert a.sliding_window is None
    assert a.layer_windows == (5, 5, 5, 5, 5, None, 5, 5)
    assert [a.window_of(i) for i in range(8)] == list(a.layer_windows)
    assert a.scale == 24**-0.5 and a.qk_norm and a.tie_word_embeddings
    assert (a.rope_type, a.rope_factor, a.rope_theta, a.rope_local_theta) == (
        "linear", 4.0, 1e6, 1e4
    )  # fmt: skip
    assert a.num_queries_per_kv == 1 and a.final_logit_softcapping is None
    b = tiny("gemma3_gqa4")[2].config
    assert b.layer_windows == (7, 7, None, 7, 7, None, 7)
    assert b.num_queries_per_kv == 4 and b.scale == 48**-0.5
    assert b.rope_local_theta == 100.0 and b.rope_type == "default"
    assert b.qkv_bias and b.o_bias and not b.tie_word_embeddings
    assert b.final_logit_softcapping == 3.0
    assert max(PROMPT_LENGTHS) > max(w for w in a.layer_windows + b.layer_windows if w)


def test_gemma2_config_and_its_soft_cap_matters(tiny):
    hf, _, lm = tiny("gemma2_gqa2")
    c = lm.config
    assert c.model_type == "gemma2" and not c.qk_norm and c.rope_local_theta is None
    assert c.layer_windows == (6, None, 6, None, 6)
    assert c.attn_logit_softcapping == 0.3 and c.final_logit_softcapping == 3.0
    assert c.scale == 16**-0.5 and c.tie_word_embeddings
    # The oracle does cap the scores: without the cap its logits differ.
    torch, transformers = oracle()
    uncapped = transformers.Gemma2Config(**{**hf.config.to_dict(), "attn_logit_softcapping": None})
    hf_free = transformers.AutoModelForCausalLM.from_config(uncapped).eval()
    hf_free.load_state_dict(hf.state_dict())
    prompts = _prompts()[2:]
    assert np.abs(hf_logits(hf_free, prompts)[0] - hf_logits(hf, prompts)[0]).max() > 1e-3


def test_satisfies_protocol(tiny):
    lm = tiny("gemma3_gqa1")[2]
    assert isinstance(lm.model, Gemma3)
    models.check_model(lm.model)
    assert isinstance(lm.model, models.PagedModel)
    assert lm.model.layers.self_attn.q_norm.weight.shape == (8, 16)  # stacked over layers


def test_transformers4_config_spelling(tiny, tmp_path):
    """transformers 4 wrote rope_theta / rope_local_base_freq / rope_scaling at the top and
    sliding_window_pattern instead of layer_types."""
    _, folder, lm = tiny("gemma3_gqa1")
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 6
    cfg["rope_theta"] = rope["full_attention"]["rope_theta"]
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert models.load(tmp_path).config == lm.config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
        ({"layer_types": ["chunked_attention"] * 8}, "unsupported layer type"),
        ({"hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
    ],
)
def test_config_errors(tiny, change, message):
    cfg = json.loads((tiny("gemma3_gqa1")[1] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        models.ModelConfig.from_hf_dict({**cfg, **change})


# ----------------------------------------------------------------------------------------------
# Against HF transformers


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(name, tiny):
    hf, _, lm = tiny(name)
    err = _max_logit_error(lm.model, hf, _prompts())
    assert err <= TOL, f"max abs logit error {err:.2e} > {TOL}"


# gemma3_gqa4's greedy tokens meet HF's in the fast tier through the engine (below).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "gemma3_gqa4" else n for n in NAMES]
)
def test_greedy_matches_hf(name, tiny):
    hf, _, lm = tiny(name)
    prompts = _prompts(seed=2)
    ref = [hf_greedy(hf, p, NEW_TOKENS, eos=False) for p in prompts]
    assert dense.greedy_generate(lm.model, prompts, NEW_TOKENS) == ref


def test_bfloat16(tiny):
    """bf16 weights (the embedding scale rounded to bf16, as HF does) within a few percent."""
    hf, folder, _ = tiny("gemma3_gqa4")
    lm = models.load(folder, dtype=jnp.bfloat16)
    assert lm.model.layers.self_attn.q_proj.kernel.dtype == jnp.bfloat16
    prompts = _prompts()
    ours = np.asarray(logits_of(lm.model, jnp.asarray(right_pad(prompts))))
    for i, ref in enumerate(hf_logits(hf, prompts)):
        assert np.abs(ours[i, : len(ref)] - ref).max() <= 0.05 * np.abs(ref).max()


def test_orbax_checkpoint_roundtrip(tiny, tmp_path):
    lm = tiny("gemma3_gqa4")[2]
    models.save_checkpoint(lm, tmp_path / "ckpt")
    back = models.load(tmp_path / "ckpt")
    assert back.config == lm.config and isinstance(back.model, Gemma3)
    hash(back.config)  # layer_windows back as a tuple, not a JSON list
    tokens = jnp.asarray(right_pad(_prompts()))
    np.testing.assert_array_equal(logits_of(back.model, tokens), logits_of(lm.model, tokens))


def test_each_layer_gets_its_window(tiny):
    """The attention function sees every layer index once, with that layer's static window:
    traced once per position of the pattern inside the scan body and once per remainder layer.
    """
    _, _, lm = tiny("gemma3_gqa1")
    c = lm.config
    tokens = jnp.asarray(right_pad(_prompts()))
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seen = []

    def attn(layer, q, k, v, kv, sliding_window=c.sliding_window):
        seen.append(sliding_window)
        out = dense_attention(
            q, k, v, scale=c.scale, q_positions=pos, k_positions=pos,
            sliding_window=sliding_window,
        )  # fmt: skip
        return out, kv.at[layer].add(layer + 1)

    kv0 = jnp.zeros((c.num_layers,), jnp.int32)
    logits, kv = nnx.jit(lambda m, t, p: m.forward(t, p, attn, kv0))(lm.model, tokens, pos)
    np.testing.assert_array_equal(kv, np.arange(1, c.num_layers + 1))  # layer i called once
    assert seen == [5, 5, 5, 5, 5, None] + [5, 5]  # the scanned group, then the remainder
    np.testing.assert_allclose(logits, logits_of(lm.model, tokens), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The engine and the research decoder


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n != "gemma3_gqa4" else n for n in NAMES]
)
def test_engine_greedy_matches_hf(name, tiny):
    """LLM with a pool too small for every row (preemption by recompute) and prefix caching
    on; the second pass reads the cached prefixes."""
    from jax_paged import LLM, SamplingParams

    hf, _, lm = tiny(name)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, int(rng.integers(1, 30))).tolist() for _ in range(10)]
    ref = [hf_greedy(hf, p, NEW_TOKENS, eos=False) for p in prompts]
    llm = LLM(
        lm,
        num_kv_blocks=24,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["gemma3_gqa4", "gemma2_gqa2"])
def test_paged_decoder_matches_hf(name, tiny):
    from jax_paged import SamplingParams
    from jax_paged.entrypoints.research import PagedDecoder

    hf, _, lm = tiny(name)
    prompts = _prompts(seed=4)
    ref = [hf_greedy(hf, p, NEW_TOKENS, eos=False) for p in prompts]
    dec = PagedDecoder(lm.model, max_seqs=len(prompts), max_len=64, block_size=8)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    got = research_greedy(dec, greedy, prompts, NEW_TOKENS)
    assert got == ref
