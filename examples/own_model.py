"""A user-written NNX decoder that runs behind `LLM` and `PagedDecoder` (models.PagedModel).

A pre-LayerNorm GPT-style decoder written from scratch: learned position embeddings, GELU MLP,
grouped-query attention (4 query heads over 2 KV heads), unrolled Python-list layers (no
`lax.scan`), untied LM head. `model(tokens)` is its own dense causal forward (the oracle of
tests/test_own_model.py); `model.forward(...)` is the engine's entry point.

    from examples.own_model import TinyGPT, TinyGPTConfig
    import models
    from jax_paged import LLM, SamplingParams
    llm = LLM(models.wrap_model(TinyGPT(TinyGPTConfig(), seed=0), eos_token_ids=[0]))
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)  # frozen: hashable, it sits in the (static) graphdef
class TinyGPTConfig:
    vocab_size: int = 97
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 128
    sliding_window: int | None = None  # full attention in every layer

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def causal_attention(q, k, v, positions, scale):
    """The model's own dense attention: q[B,T,H,D], k/v[B,T,KVH,D] -> [B,T,H,D]."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale
    mask = positions[:, None, :, None] >= positions[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


class Block(nnx.Module):
    def __init__(self, c: TinyGPTConfig, rngs: nnx.Rngs):
        self.c = c
        self.ln1 = nnx.LayerNorm(c.hidden_size, rngs=rngs)
        self.qkv = nnx.Linear(
            c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, rngs=rngs
        )
        self.proj = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.hidden_size, rngs=rngs)
        self.fc = nnx.Linear(c.hidden_size, 4 * c.hidden_size, rngs=rngs)
        self.out = nnx.Linear(4 * c.hidden_size, c.hidden_size, rngs=rngs)

    def __call__(self, x, layer, attn, kv):
        c, (b, t, _) = self.c, x.shape
        h, g = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.qkv(self.ln1(x))
        q = qkv[..., :h].reshape(b, t, c.num_heads, c.head_dim)
        k = qkv[..., h : h + g].reshape(b, t, c.num_kv_heads, c.head_dim)
        v = qkv[..., h + g :].reshape(b, t, c.num_kv_heads, c.head_dim)
        a, kv = attn(layer, q, k, v, kv)  # the only place tokens see each other
        x = x + self.proj(a.reshape(b, t, h))
        x = x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))
        return x, kv


class TinyGPT(nnx.Module):
    def __init__(self, config: TinyGPTConfig, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.config, self.dtype = config, jnp.dtype(jnp.float32)  # dtype: the KV pages
        self.wte = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.wpe = nnx.Embed(config.max_position_embeddings, config.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.ln_f = nnx.LayerNorm(config.hidden_size, rngs=rngs)
        self.head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def forward(self, tokens, positions, attn, kv, *, logits_indices=None):
        """tokens, positions i32[B,T] -> (logits f32[B,T,V] or [B,R,V], kv)."""
        x = self.wte(tokens) + self.wpe(positions)  # positions, never arange(T)
        for i, block in enumerate(self.blocks):  # unrolled: `layer` is a Python int
            x, kv = block(x, i, attn, kv)
        if logits_indices is not None:
            x = x[:, logits_indices]
        return self.head(self.ln_f(x)).astype(jnp.float32), kv

    def __call__(self, tokens):
        """Dense causal forward: tokens i32[B,T] at positions 0..T-1 -> logits f32[B,T,V]."""
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def attn(layer, q, k, v, kv):
            return causal_attention(q, k, v, pos, self.config.scale), kv

        return self.forward(tokens, pos, attn, None)[0]


@nnx.jit
def _dense_logits(model: TinyGPT, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def dense_greedy(model: TinyGPT, prompt, max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step (the oracle; tiny model).

    The sequence is right-padded to a multiple of 32 tokens (causality keeps the padding out of
    the real positions), so a few compiled shapes serve every step of every prompt.
    """
    seq = list(prompt)
    need = len(seq) + max_tokens
    # No wider than the position table (a padded position past it would embed as NaN).
    width = max(need, min(-(-need // 32) * 32, model.config.max_position_embeddings))
    for _ in range(max_tokens):
        tokens = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        logits = _dense_logits(model, tokens)
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]
