"""Per-layer kernels (`models.layer_weights.split_layer_weights`, applied by
`jax_paged.backend.prepare_params`): the same forward, no weight copies.

Inside the layer scan a stacked kernel ``[L, in, out]`` is a dynamic slice, which XLA's CPU
backend copies into a fresh buffer before each dot. Split into L arrays, each dot reads its own
layer's buffer through a ``lax.switch``. These tests check that both forms give the same logits
for every way the models index their layers (one scan, a scan per window run, Gemma's groups
with a remainder), that the engine holds the split form on a CPU, and, from the optimised HLO,
that the copies are gone. A user-written model (not ours) that reads its layers through
`models.layer_weights` and declares ``per_layer_weights = True`` gets the same layout; one that
does not declare it is left alone.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from jax_paged import LLM, SamplingParams
from jax_paged.backend import prepare_params
from models.config import ModelConfig
from models.layer_weights import Linear, PerLayer, layer_at, split_layer_weights
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


def test_prepare_splits_a_declaring_model_on_one_cpu_device():
    model = _model("llama")
    assert model.per_layer_weights is True
    _, state = nnx.split(model)
    assert len(_per_layer_leaves(prepare_params(model, state))) == 7
    # On a mesh, and for a model that does not declare per_layer_weights (its forward may
    # know nothing of PerLayer), the state is handed back as it is.
    assert prepare_params(model, state, mesh=object()) is state
    assert prepare_params(object(), state) is state


# ----------------------------------------------------------------------------------------------
# A user-written model: its layers stacked under `layers`, read through models.layer_weights.


@dataclasses.dataclass(frozen=True)
class StackedConfig:
    vocab_size: int = 64
    hidden_size: int = 24
    num_layers: int = 3
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 12
    max_position_embeddings: int = 64
    sliding_window: int | None = None

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class StackedBlock(nnx.Module):
    def __init__(self, c: StackedConfig, rngs: nnx.Rngs):
        self.c = c
        self.qkv = Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, rngs=rngs)
        self.out = Linear(c.num_heads * c.head_dim, c.hidden_size, use_bias=False, rngs=rngs)
        self.up = Linear(c.hidden_size, 40, rngs=rngs)
        self.down = Linear(40, c.hidden_size, rngs=rngs)

    def __call__(self, x, layer, attn, kv):
        c, (b, t, _) = self.c, x.shape
        h, g = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.qkv(x)
        q = qkv[..., :h].reshape(b, t, c.num_heads, c.head_dim)
        k = qkv[..., h : h + g].reshape(b, t, c.num_kv_heads, c.head_dim)
        v = qkv[..., h + g :].reshape(b, t, c.num_kv_heads, c.head_dim)
        a, kv = attn(layer, q, k, v, kv)
        x = x + self.out(a.reshape(b, t, h))
        return x + self.down(jax.nn.relu(self.up(x))), kv


class StackedGPT(nnx.Module):
    """Learned positions, one scan over stacked layers, an untied (unstacked) head."""

    per_layer_weights = True

    def __init__(self, config: StackedConfig, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.config, self.dtype = config, jnp.dtype(jnp.float32)
        self.wte = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.wpe = nnx.Embed(config.max_position_embeddings, config.hidden_size, rngs=rngs)
        blocks = [StackedBlock(config, rngs) for _ in range(config.num_layers)]
        graphdef, first = nnx.split(blocks[0])
        states = [first] + [nnx.state(b) for b in blocks[1:]]
        self.layers = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
        self.head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def forward(self, tokens, positions, attn, kv, *, logits_indices=None):
        x = self.wte(tokens) + self.wpe(positions)
        layer_def, layer_params = nnx.split(self.layers)

        def body(carry, i):
            x, kv = carry
            return nnx.merge(layer_def, layer_at(layer_params, i))(x, i, attn, kv), None

        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(body, (x, kv), layers)
        if logits_indices is not None:
            x = x[:, logits_indices]
        return self.head(x).astype(jnp.float32), kv

    def __call__(self, tokens):
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def attn(layer, q, k, v, kv):
            rep = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            s = jnp.einsum("bthd,bshd->bhts", q, k) * self.config.scale
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
            return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v), kv

        return self.forward(tokens, pos, attn, None)[0]


class Undeclared(StackedGPT):
    per_layer_weights = False


def test_user_model_with_the_attribute_is_split_and_gives_the_same_logits():
    model = StackedGPT(StackedConfig())
    models.check_model(model)
    graphdef, state = nnx.split(model)
    split = prepare_params(model, state)
    kernels = _per_layer_leaves(split)
    assert len(kernels) == 4  # qkv, out, up, down; not the head
    assert all(len(k.arrays) == 3 for k in kernels)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    np.testing.assert_allclose(fwd(split, tokens), fwd(state, tokens), rtol=1e-6, atol=1e-6)


def test_user_model_without_the_attribute_is_left_unchanged():
    model = Undeclared(StackedConfig())
    _, state = nnx.split(model)
    assert prepare_params(model, state) is state


def test_engine_splits_a_user_model_and_decodes_as_its_dense_forward():
    model = StackedGPT(StackedConfig())
    llm = LLM(models.wrap_model(model), num_kv_blocks=16, block_size=4, max_num_seqs=2)
    assert len(_per_layer_leaves(llm.engine.runner.params)) == 4
    prompt, n = [5, 9, 2, 33, 7], 6
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )
    graphdef, state = nnx.split(model)
    dense = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    seq = list(prompt)
    for _ in range(n):  # right-padded to one width: causality keeps the padding out
        logits = dense(state, jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    assert list(out[0].outputs[0].token_ids) == seq[len(prompt) :]


@pytest.mark.parametrize(
    ("flag", "message"),
    [("yes", "model.per_layer_weights='yes' must be a bool"), (True, "has no 'layers'")],
)
def test_check_model_validates_per_layer_weights(flag, message):
    model = Undeclared(StackedConfig(num_layers=1))
    model.per_layer_weights = flag
    if flag is True:
        del model.layers
    with pytest.raises(models.ModelProtocolError, match=re.escape(message)):
        models.check_model(model)


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


def test_step_sizes_per_platform():
    """`backend.padded_size`: at least ``lo`` and never below ``n``; on a CPU the powers of two
    and their 1.5x multiples (padding at most a third), elsewhere powers of two."""
    from jax_paged import backend

    cpu = sorted({backend.padded_size(n, 16, "cpu") for n in range(1, 513)})
    assert cpu == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    gpu = sorted({backend.padded_size(n, 16, "gpu") for n in range(1, 513)})
    assert gpu == [16, 32, 64, 128, 256, 512]
    for n in range(1, 2000):
        for platform in ("cpu", "tpu"):
            p = backend.padded_size(n, 8, platform)
            assert p >= max(n, 8) and backend.padded_size(p, 8, platform) == p
        p = backend.padded_size(n, 8, "cpu")
        assert n < 8 or 3 * (p - n) <= p  # at most a third of a CPU step is padding
    assert [backend.padded_size(n, 8, "cpu") for n in (1, 9, 12, 13, 17, 25)] == [
        8,
        12,
        12,
        16,
        24,
        32,
    ]
