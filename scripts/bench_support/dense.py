"""A minimal batched greedy decoder over `Transformer.forward` with a contiguous KV cache.

Stands in for the paged engine in scripts and tests: the cache lives entirely in the attention
function (`make_contiguous_cache_attention`), so the model code is the same one the engine uses.

Cache layout: a pair `(k, v)`, each `[L, B, S, KVH, D]`, indexed by layer and token position; the
layer scan carries it and each layer scatters its K/V in place at its own index.
Prompts are left-padded, so every row's last prompt token sits in the same column and the
prefill's LM head runs on that column alone (logits ``[B, 1, V]``, not ``[B, T, V]``: 4.8 GB
for 256 SmolLM2 prompts of 96 tokens). A pad token's position is ``S``, one past the cache, so
its K/V write is dropped; a query at position p reads only keys at positions <= p, and every
such position was written by a real token first (decode step s writes position len_b + s before
reading it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged.backend import argmax_last, prepare_params
from models.config import ModelConfig
from models.llama import AttentionFn, Transformer, dense_attention


def make_contiguous_cache_attention(config: ModelConfig, positions: jax.Array) -> AttentionFn:
    """Attention function writing K/V at `positions` i32[B,T] into layer `layer` of `kv`.

    kv: (k, v), each [L,B,S,KVH,D]. ``sliding_window`` (static) overrides the config's window
    for one call, as `models.llama.make_dense_attention`'s does.
    """

    def attn(layer, q, k, v, kv, sliding_window=config.sliding_window):
        k_all, v_all = kv
        b, t = positions.shape
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        # Positions past the cache (the pads') are dropped, not clamped onto the last slot.
        k_all = k_all.at[layer, rows, positions].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[layer, rows, positions].set(v.astype(v_all.dtype), mode="drop")
        s = k_all.shape[2]
        out = dense_attention(
            q,
            k_all[layer],
            v_all[layer],
            scale=config.scale,
            q_positions=positions,
            k_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
            sliding_window=sliding_window,
            soft_cap=config.attn_logit_softcapping,
        )
        return out, (k_all, v_all)

    return attn


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _forward_step(graphdef, state, tokens, positions, kv):
    """Runs tokens[B,T] at positions[B,T]; returns the argmax at the last column, i32[B], and
    the cache."""
    model = nnx.merge(graphdef, state)
    attn = make_contiguous_cache_attention(model.config, positions)
    last = jnp.full((1,), tokens.shape[1] - 1, jnp.int32)
    logits, kv = model.forward(tokens, positions, attn, kv, logits_indices=last)  # [B,1,V]
    return argmax_last(logits[:, 0]), kv


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def greedy_generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: tuple[int, ...] | list[int] = (),
) -> list[list[int]]:
    """Greedy continuation of each prompt: up to `max_new_tokens` new ids per prompt.

    A row stops after its first id in `eos_token_ids` (the EOS id is kept). Shapes are padded to
    multiples of 32 so a handful of compiled variants serve many calls.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    c = model.config
    b = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    t_pad = _round_up(int(lens.max()), 32)
    s = _round_up(int(lens.max()) + max_new_tokens, 32)
    tokens = np.zeros((b, t_pad), np.int32)
    positions = np.full((b, t_pad), s, np.int32)  # pads: one past the cache, never written
    for i, p in enumerate(prompts):
        tokens[i, t_pad - len(p) :] = p
        positions[i, t_pad - len(p) :] = np.arange(len(p))
    shape = (c.num_layers, b, s, c.num_kv_heads, c.head_dim)
    kv = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
    graphdef, state = nnx.split(model)
    state = prepare_params(model, state)  # on a CPU, as the engine holds them

    nxt, kv = _forward_step(graphdef, state, tokens, positions, kv)
    out = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    eos = set(int(e) for e in eos_token_ids)
    for step in range(max_new_tokens):
        ids = np.asarray(nxt)
        for i in range(b):
            if not done[i]:
                out[i].append(int(ids[i]))
                done[i] = int(ids[i]) in eos
        if done.all() or step == max_new_tokens - 1:
            break
        pos = (lens + step)[:, None]
        nxt, kv = _forward_step(graphdef, state, ids[:, None], pos, kv)
    return out
