"""One readable decoder for the Llama family as HF configures it, in Flax NNX.

Covers Llama 2/3 (GQA, llama3 RoPE scaling), SmolLM2, Mistral (sliding window), Qwen2 (q/k/v
bias, tied embeddings) and Qwen3 (per-head q/k RMSNorm). The model knows nothing of KV caches:
every layer hands its q, k, v to an *attention function* chosen by the caller:

    attn(layer: i32[], q[B,T,H,D], k[B,T,KVH,D], v[B,T,KVH,D], kv) -> (out[B,T,H,D], kv)

(a model whose layers have different windows, `models.gemma`, adds the static keyword
``sliding_window=`` with the layer's own; the functions here accept it).

`model(tokens)` runs the dense causal forward with `dense_attention` (kv=None); the engine's
paged forward passes its `KVCache` as `kv` and a closure that writes K/V into pages and calls the
paged kernels (see docs/DESIGN.md).

The layers are *stacked*: `model.layers` is one `DecoderLayer` whose every parameter has a
leading ``[L]`` axis, and `forward` runs them under `lax.scan`, so a compiled program's size and
compile time do not grow with depth. The layer index reaches the attention function as a traced
``i32[]`` (the scan counter) and `kv` travels in the scan carry: a KV cache stacked over layers
is addressed by that index and updated in place, never sliced per layer. Parameter names follow
HF's with the layer index moved into the leading axis (`layers.self_attn.q_proj.kernel[i]` is
HF's `model.layers.{i}.self_attn.q_proj.weight`, transposed).

`Transformer` sets ``per_layer_weights = True``: it reads its layers through
`models.layer_weights` (`layer_at`, `Linear`), so on a CPU the engine may hand `forward` the same
parameters with each stacked kernel split into L arrays (`jax_paged.backend.prepare_params`,
`models.layer_weights.split_layer_weights`): XLA's CPU dots cannot read a slice of the stack in
place and copied every kernel once per layer per step. The layer body stays one scanned copy;
only its dots dispatch on the layer index (`models.layer_weights.LayerSwitch`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.layer_weights import Embed, Linear, layer_at

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


# ----------------------------------------------------------------------------------------------
# RoPE


@functools.lru_cache(maxsize=64)
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[D/2], with `linear` or `llama3` scaling applied as HF does."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    inv_freq = inv_freq.astype(np.float32)
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the
        # band between the two wavelength thresholds interpolated smoothly.
        factor, old_len = config.rope_factor, config.rope_original_max_position
        lo, hi = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions i32[B,T] -> (cos, sin) f32[B,T,D], halves repeated (HF's rotate_half layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[B,T,N,D] rotated by cos/sin[B,T,D] (non-interleaved: pairs are (i, i + D/2))."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Attention functions


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    q_positions: jax.Array,
    k_positions: jax.Array,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Plain-jnp attention with a position mask; the reference the paged path must agree with.

    q[B,T,H,D], k/v[B,S,KVH,D], q_positions i32[B,T], k_positions i32[B,S] -> out[B,T,H,D].
    Query at position p sees key at position j when j <= p and, with a window, p - j < window.
    ``soft_cap``: scores become ``soft_cap * tanh(scores / soft_cap)`` (Gemma 2).
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)  # GQA: query head h reads KV head h // (H // KVH)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    delta = q_positions[:, :, None] - k_positions[:, None, :]  # [B,T,S]
    mask = delta >= 0
    if sliding_window is not None:
        mask &= delta < sliding_window
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def make_dense_attention(config: ModelConfig, positions: jax.Array) -> AttentionFn:
    """The attention function of the dense causal forward: no cache, kv passes through.

    A model whose layers have different windows (Gemma 3) passes each layer's own as the
    keyword ``sliding_window`` (static: an int or None); others get ``config.sliding_window``.
    """

    def attn(layer: int, q, k, v, kv, sliding_window=config.sliding_window):
        del layer
        out = dense_attention(
            q,
            k,
            v,
            scale=config.scale,
            q_positions=positions,
            k_positions=positions,
            sliding_window=sliding_window,
            soft_cap=config.attn_logit_softcapping,
        )
        return out, kv

    return attn


# ----------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in f32, cast back, then scale (HF's order, which matters for bf16).
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    norm_cls = RMSNorm  # the q/k norms' class; Gemma's differs

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q_proj = _linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, c.o_bias, dtype, rngs)
        if c.qk_norm:
            self.q_norm = self.norm_cls(c.head_dim, c.rms_norm_eps, dtype=dtype)
            self.k_norm = self.norm_cls(c.head_dim, c.rms_norm_eps, dtype=dtype)

    def __call__(self, x, cos, sin, attn: AttentionFn, kv, layer, window=()):
        """x[B,T,E], cos/sin[B,T,D], layer i32[] -> (y[B,T,E], kv). ``window`` (static): the
        layer's own sliding window (an int or None) when the layers differ; () = the config's."""
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)  # [B,T,H,D]
        k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)  # [B,T,KVH,D]
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)  # [B,T,KVH,D]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if window == ():
            out, kv = attn(layer, q, k, v, kv)  # [B,T,H,D]
        else:
            out, kv = attn(layer, q, k, v, kv, sliding_window=window)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim)), kv


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)), x[B,T,E] -> [B,T,E] through width F; act = SiLU (SwiGLU)."""

    @staticmethod
    def act(x):
        return jax.nn.silu(x)

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, rngs)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, rngs)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, c.mlp_bias, dtype, rngs)

    def __call__(self, x):
        # The activation and product in f32, rounded once to x's dtype: in bf16 it is what
        # torch computes inside its activation, and XLA:CPU's bf16 elementwise code is about
        # 2.5x slower than its f32 code (the activation took more time than a matmul in a
        # SmolLM2 bf16 prefill). No change in f32.
        g = self.gate_proj(x).astype(jnp.float32)
        h = self.act(g) * self.up_proj(x).astype(jnp.float32)
        return self.down_proj(h.astype(x.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, attn: AttentionFn, kv, layer, window=()):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv, layer, window)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


def window_runs(config: ModelConfig) -> list[tuple[int, int, Any]]:
    """[(first layer, end, window)] runs of consecutive layers sharing a sliding window; the
    window is () (the config's own, for every layer) when ``layer_windows`` is empty."""
    if not config.layer_windows:
        return [(0, config.num_layers, ())]
    runs, start = [], 0
    w = config.layer_windows
    for i in range(1, len(w) + 1):
        if i == len(w) or w[i] != w[start]:
            runs.append((start, i, w[start]))
            start = i
    return runs


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One `DecoderLayer` whose parameters are those of ``layers`` stacked on a new [L] axis."""
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.state(layer) for layer in layers[1:]]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class Transformer(nnx.Module):
    """The decoder. `model.config` is its `ModelConfig`, `model.scale` the softmax scale.

    Build real weights with `models.load`; `Transformer(config, rngs=nnx.Rngs(0))` gives a
    randomly initialised one (tests, shapes). A family that differs in its layers and final
    norm subclasses it (``layer_cls``, ``norm_cls``; `models.gemma.Gemma3`) and may override
    `forward`, keeping the embedding, the stacked layers and the LM head (`lm_logits`); its
    forward takes each layer's parameters with `layer_at`, so that split kernels
    (`models.layer_weights.split_layer_weights`) work there too.
    """

    layer_cls = DecoderLayer
    norm_cls = RMSNorm
    per_layer_weights = True  # reads split kernels too (models.protocol, models.layer_weights)

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = stack_layers(
            [self.layer_cls(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, rngs)

    @property
    def scale(self) -> float:
        return self.config.scale

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attn: AttentionFn,
        kv: Any,
        *,
        logits_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """tokens i32[B,T], positions i32[B,T] -> (logits f32[B,T,V], kv from `attn`).

        With ``logits_indices`` (i32[R]) only the hidden states at those token indices go
        through the LM head, giving logits f32[B,R,V]: the engine needs one row per sequence,
        not one per prompt token.

        The layers run under one scan; with per-layer windows (``config.layer_windows``, Qwen2
        windowing only the layers past ``max_window_layers``) one scan per run of layers that
        share a window, each passing it to ``attn`` (``sliding_window=``, static).
        """
        x = self.embed_tokens(tokens)  # [B,T,E]
        cos, sin = rope_cos_sin(self.config, positions)  # [B,T,D]
        layer_def, layer_params = nnx.split(self.layers)  # params: [L, ...] leaves
        carry = (x, kv)
        for start, stop, window in window_runs(self.config):

            def body(carry, i, window=window):
                x, kv = carry
                layer = nnx.merge(layer_def, layer_at(layer_params, i))
                return layer(x, cos, sin, attn, kv, i, window), None

            carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32))
        x, kv = carry
        return self.lm_logits(x, logits_indices), kv

    def lm_logits(self, x: jax.Array, logits_indices: jax.Array | None = None) -> jax.Array:
        """Final norm and LM head (tied or not): hidden x[B,T,E] -> logits f32[B,T,V], or
        f32[B,R,V] at ``logits_indices`` i32[R]; Gemma-style final soft cap if configured."""
        if logits_indices is not None:
            x = x[:, logits_indices]  # [B,R,E]
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            emb = self.embed_tokens.embedding[...]
            logits = jnp.einsum("bte,ve->btv", x, emb, preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(x)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Dense causal forward: tokens i32[B,T] at positions 0..T-1 -> logits f32[B,T,V].

        Right padding is the caller's business: causality keeps it out of the real positions.
        """
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _ = self.forward(
            tokens, positions, make_dense_attention(self.config, positions), None
        )
        return logits
