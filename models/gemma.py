"""Gemma 3 (text) as HF's `Gemma3ForCausalLM` configures it, and Gemma 2 (`Gemma2ForCausalLM`),
in Flax NNX.

Gemma 2 is the same decoder without the q/k norms, with one RoPE for every layer (local and
global layers alternate) and attention scores soft-capped (``attn_logit_softcapping``: the
attention function applies it, `dense_attention` / the paged kernels' ``soft_cap``); `Gemma3`
builds both from their configs.

`Gemma3` subclasses `models.llama.Transformer` (embedding, stacked layers, LM head, dense
forward), `GemmaAttention` and `GemmaMLP` the Llama attention and MLP; what differs:

- RMSNorm scales by ``(1 + w)`` and casts after the scale (`GemmaRMSNorm`); the weights are
  stored as ``w`` (HF's zeros-centred form).
- Four norms per layer: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` ->
  residual, ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` -> residual.
- q/k RMSNorm per head before RoPE; softmax scale ``query_pre_attn_scalar**-0.5``.
- GeGLU MLP (tanh-approximate GELU); embeddings scaled by ``sqrt(hidden_size)``, rounded to the
  model dtype first as HF does; tied embeddings by default; optional final-logit soft cap
  (``attn_logit_softcapping`` is ignored, as HF's Gemma 3 attention ignores it).
- Local (sliding-window) and global layers interleaved, each kind with its own RoPE: local
  layers ``rope_local_theta`` unscaled, global ones ``rope_theta`` with its scaling.

Mixed layers under one scan. The engine's paged kernels take the window as a static argument,
so a layer's window must be a Python value at trace time, while the layer index stays traced.
`layer_pattern` finds the shortest repeating pattern of per-layer windows (Gemma 3: five local
and one global); `forward` scans over *groups* of that pattern, the scan body running the
pattern's layers one after the other with their windows (and RoPE tables) static, and runs the
``L mod P`` remainder layers (the pattern's first ones) after the scan::

    layers  0 1 2 3 4 5 | 6 7 8 9 10 11 | ... | 24 25       (Gemma 3 1B: L = 26, P = 6)
    window  w w w w w - | w w w w w  -  | ... |  w  w
            scan over 4 groups, one body of 6 layers          remainder, unrolled (< P)

Parameters stay stacked over all ``L`` layers (`layers.*[i]` is HF's `model.layers.{i}.*`, the
same names as `models.llama`); each layer's slice is taken by a dynamic index inside the body,
which is what `lax.scan` over stacked inputs does anyway, so nothing is copied. Every layer calls
``attn(layer, q, k, v, kv, sliding_window=w)`` with ``w`` its static window (None: global): an
attention function for this model must accept that keyword (`make_dense_attention` and
`make_contiguous_cache_attention` do).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layer_weights import layer_at
from models.llama import (
    MLP,
    Attention,
    AttentionFn,
    Transformer,
    rope_cos_sin,
)


def layer_pattern(windows: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """The shortest prefix ``p`` of ``windows`` with ``windows[i] == p[i % len(p)]`` for all i.

    (w, w, None, w, w, None, w) -> (w, w, None): two groups of 3 and a remainder of one.
    """
    n = len(windows)
    for size in range(1, n + 1):
        if all(windows[i] == windows[i % size] for i in range(n)):
            return windows[:size]
    raise ValueError("no layers")  # n == 0


@functools.lru_cache(maxsize=64)
def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The config whose RoPE is that of the local (windowed) layers: base rope_local_theta,
    unscaled. Global layers use ``config`` itself."""
    if config.rope_local_theta is None:
        return config
    return dataclasses.replace(
        config, rope_theta=config.rope_local_theta, rope_type="default", rope_factor=1.0
    )


class GemmaRMSNorm(nnx.Module):
    """RMSNorm with a ``(1 + weight)`` scale: x[..., dim] -> same shape and dtype.

    Normalises and scales in f32, then casts (HF's Gemma order; Llama casts before the scale).
    weight: [dim], zeros at init (a unit scale).
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GemmaAttention(Attention):
    """`models.llama.Attention` with Gemma's (1 + w) q/k norms (``config.qk_norm`` is set)."""

    norm_cls = GemmaRMSNorm


class GemmaMLP(MLP):
    """GeGLU: `models.llama.MLP` with tanh-approximate GELU."""

    @staticmethod
    def act(x):
        return jax.nn.gelu(x, approximate=True)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(e, eps, dtype=dtype)
        self.self_attn = GemmaAttention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = GemmaRMSNorm(e, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(e, eps, dtype=dtype)
        self.mlp = GemmaMLP(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(e, eps, dtype=dtype)

    def __call__(self, x, cos, sin, attn: AttentionFn, kv, layer, *, sliding_window):
        """x[B,T,E] -> (x[B,T,E], kv); pre- and post-norms around attention and MLP."""
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv, layer, sliding_window)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, kv


class Gemma3(Transformer):
    """The Gemma 3 text decoder; satisfies `models.PagedModel` like `models.Transformer`.

    `model.config` is its `ModelConfig` (``layer_windows`` lists the local layers' window and
    None for global ones), `model.dtype` the parameters' dtype. Build real weights with
    `models.load`; `Gemma3(config, rngs=nnx.Rngs(0))` gives a random one.
    """

    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

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

        With ``logits_indices`` (i32[R]) only those token indices reach the LM head: logits
        f32[B,R,V]. Layers run in groups of `layer_pattern` (module docstring).
        """
        c = self.config
        # HF multiplies by sqrt(E) rounded to the model dtype (55.4256 -> 55.5 in bf16).
        x = self.embed_tokens(tokens) * jnp.asarray(c.hidden_size**0.5, self.dtype)  # [B,T,E]
        rope = {
            "global": rope_cos_sin(c, positions),  # ([B,T,D], [B,T,D]) f32
            "local": rope_cos_sin(local_rope_config(c), positions),
        }
        windows = tuple(c.window_of(i) for i in range(c.num_layers))
        pattern = layer_pattern(windows)
        size = len(pattern)
        groups, rest = divmod(c.num_layers, size)
        layer_def, layer_params = nnx.split(self.layers)  # params: [L, ...] leaves

        def run_layer(carry, i, window):
            x, kv = carry
            params = layer_at(layer_params, i)
            cos, sin = rope["global" if window is None else "local"]
            return nnx.merge(layer_def, params)(x, cos, sin, attn, kv, i, sliding_window=window)

        def group(carry, g):
            for j, window in enumerate(pattern):
                carry = run_layer(carry, g * size + j, window)
            return carry, None

        carry, _ = jax.lax.scan(group, (x, kv), jnp.arange(groups, dtype=jnp.int32))
        for j in range(rest):
            carry = run_layer(carry, jnp.int32(groups * size + j), pattern[j])
        x, kv = carry
        return self.lm_logits(x, logits_indices), kv
