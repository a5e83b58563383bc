"""Qwen2 windowing only the layers past ``max_window_layers``: the config
gives per-layer windows, the decoder runs one scan per run of layers sharing a window, and the
engine applies each layer's own window. Oracle: HF transformers (f32, eager attention)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TinySpec, build_tiny_hf_model, hf_greedy, hf_logits, oracle, right_pad
from flax import nnx

import models
from jax_paged import LLM, SamplingParams

WINDOW = 6
SPEC = TinySpec(
    "qwen2_window_layers",
    "Qwen2Config",
    (
        ("hidden_size", 128),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("intermediate_size", 256),
        ("num_hidden_layers", 4),
        ("use_sliding_window", True),
        ("sliding_window", WINDOW),
        ("max_window_layers", 2),  # layers 0, 1 full; 2, 3 windowed
        ("attn_implementation", "eager"),
    ),
)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 13, 21)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    hf = build_tiny_hf_model(SPEC)
    folder = tmp_path_factory.mktemp("qwen2_window_layers")
    hf.save_pretrained(folder)
    return hf, folder


def test_config_windows_only_the_layers_past_max_window_layers(qwen):
    _, folder = qwen
    cfg = models.load(folder).config
    assert cfg.sliding_window is None
    assert cfg.layer_windows == (None, None, WINDOW, WINDOW)


def test_logits_and_greedy_match_hf(qwen):
    hf, folder = qwen
    lm = models.load(folder, dtype=jnp.float32)
    refs = hf_logits(hf, PROMPTS)
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(lm.model, jnp.asarray(right_pad(PROMPTS))))
    for i, ref in enumerate(refs):
        assert np.abs(ours[i, : len(ref)] - ref).max() < 1e-4
    # The oracle does window those layers: without the windows the logits differ.
    torch, transformers = oracle()
    no_windows = {"layer_types": ["full_attention"] * 4, "max_window_layers": 4}
    full = transformers.Qwen2Config(**{**hf.config.to_dict(), **no_windows})
    hf_full = transformers.AutoModelForCausalLM.from_config(full).eval()
    hf_full.load_state_dict(hf.state_dict())
    assert np.abs(hf_logits(hf_full, PROMPTS[2:])[0] - refs[2]).max() > 1e-3


def test_engine_greedy_matches_hf_with_preemption_and_prefix_caching(qwen):
    hf, folder = qwen
    llm = LLM(
        str(folder), num_kv_blocks=12, block_size=4, max_num_seqs=3, enable_prefix_caching=True
    )
    prompts = PROMPTS + [PROMPTS[2] + [7, 8]]
    sp = SamplingParams(temperature=0, max_tokens=16)
    for _ in range(2):  # the second pass reads cached prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [list(o.outputs[0].token_ids) for o in outs] == [
            hf_greedy(hf, p, 16) for p in prompts
        ]
    assert llm.get_metrics()["num_preemptions"] > 0
