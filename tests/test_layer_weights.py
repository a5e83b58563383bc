"""Per-layer kernels (`models.llama.split_layer_weights`): the same forward, no weight copies.

Inside the layer scan a stacked kernel ``[L, in, out]`` is a dynamic slice, which XLA's CPU
backend copies into a fresh buffer before each dot. Split into L arrays, each dot reads its own
layer's buffer through a ``lax.switch``. These tests check that both forms give the same logits
for every way the models index their layers (one scan, a scan per window run, Gemma's groups
with a remainder), that the engine holds the split form on a CPU, and, from the optimised HLO,
that the copies are gone.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from jax_paged import LLM, SamplingParams
from models.config import ModelConfig
from models.llama import PerLayer, prepare_layer_weights, split_layer_weights
from models.loading import GenerationConfig, LoadedModel

# Odd sizes, so that the MLP kernels' shapes ([48, 80], [80, 48]) name nothing else.
BASE = dict(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=80,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    max_position_embeddings=256,
)


def _model(kind: str):
    if kind == "llama":
        return models.Transformer(
            ModelConfig(model_type="llama", num_layers=3, **BASE), rngs=nnx.Rngs(0)
        )
    if kind == "qwen_windows":  # two runs of layers: full, then windowed
        cfg = ModelConfig(
            model_type="qwen2", num_layers=4, layer_windows=(None, None, 5, 5), **BASE
        )
        return models.Transformer(cfg, rngs=nnx.Rngs(0))
    # Gemma 3: pattern (4, 4, None), one scanned group of 3 and an unrolled remainder of 2.
    cfg = ModelConfig(
        model_type="gemma3_text",
        num_layers=5,
        layer_windows=(4, 4, None, 4, 4),
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        rope_local_theta=10000.0,
        query_pre_attn_scalar=12.0,
        **BASE,
    )
    return models.Gemma3(cfg, rngs=nnx.Rngs(0))


def _per_layer_leaves(state) -> list[PerLayer]:
    leaves = jax.tree.leaves(state, is_leaf=lambda a: isinstance(a, PerLayer))
    return [a for a in leaves if isinstance(a, PerLayer)]


@pytest.mark.parametrize("kind", ["llama", "qwen_windows", "gemma3"])
def test_split_kernels_give_the_same_logits(kind):
    model = _model(kind)
    graphdef, state = nnx.split(model)
    split = split_layer_weights(state)
    kernels = _per_layer_leaves(split)
    assert len(kernels) == 7  # q, k, v, o, gate, up, down
    assert all(len(k.arrays) == model.config.num_layers for k in kernels)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)), jnp.int32)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    np.testing.assert_allclose(fwd(split, tokens), fwd(state, tokens), rtol=1e-6, atol=1e-6)


def test_prepare_splits_only_a_transformer_on_one_cpu_device():
    model = _model("llama")
    _, state = nnx.split(model)
    assert len(_per_layer_leaves(prepare_layer_weights(model, state))) == 7
    # On a mesh, and for a model that is not ours (its forward knows nothing of PerLayer),
    # the state is handed back as it is.
    assert prepare_layer_weights(model, state, mesh=object()) is state
    assert prepare_layer_weights(object(), state) is state


def _dynamic_slices_of_mlp_kernels(hlo: str) -> list[str]:
    """Instructions that produce a [48, 80] or [80, 48] f32 buffer by a dynamic slice, alone or
    as a fusion named after one: a copy of an MLP kernel out of the stacked parameters."""
    pat = re.compile(r"%([\w.\-]+) = f32\[(?:48,80|80,48)\]\S* ([\w\-]+)\(")
    bad = []
    for line in hlo.splitlines():
        m = pat.search(line)
        if m and re.search(
            r"dynamic[-_]slice", m.group(1) if m.group(2) == "fusion" else m.group(2)
        ):
            bad.append(line.strip()[:160])
    return bad


def test_dense_forward_copies_stacked_kernels_but_not_split_ones():
    """The check can fail: the stacked form's HLO has the copies, the split form's has none."""
    model = _model("llama")
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = jnp.zeros((4, 1), jnp.int32)
    assert _dynamic_slices_of_mlp_kernels(fwd.lower(state, tokens).compile().as_text())
    split = split_layer_weights(state)
    assert not _dynamic_slices_of_mlp_kernels(fwd.lower(split, tokens).compile().as_text())


def test_engine_holds_split_kernels_and_its_programs_copy_none():
    model = _model("llama")
    cfg = model.config
    lm = LoadedModel(model, None, cfg, GenerationConfig(eos_token_ids=[1]), "tiny")
    llm = LLM(lm, num_kv_blocks=64, max_num_seqs=4, max_model_len=128)
    assert len(_per_layer_leaves(llm.engine.runner.params)) == 7
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 256, size=n).tolist()} for n in (5, 9, 3)]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    kinds = {key[0] for key in llm.engine.runner.compiled}
    assert {"decode", "mixed"} <= kinds
    for key, compiled in llm.engine.runner.compiled.items():
        bad = _dynamic_slices_of_mlp_kernels(compiled.as_text())
        assert not bad, f"{key[0]} copies layer kernels:\n" + "\n".join(bad)
