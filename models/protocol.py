"""What a model must expose to run behind `LLM` / `LLMEngine` and `research.PagedDecoder`.

Any Flax NNX module works (`models.Transformer` is one; `examples/own_model.py` is a
user-written one) when it has:

- ``model.config`` (`PagedModelConfig`): a *hashable* object (a frozen dataclass) with the
  integer fields ``vocab_size``, ``max_position_embeddings``, ``num_layers``, ``num_heads``,
  ``num_kv_heads``, ``head_dim``, ``sliding_window`` (None, or one window for every layer) and
  ``scale`` (the softmax scale of q.k, a float or a property). It sits in the NNX graphdef,
  which is a static jit argument, hence hashable.
- ``model.dtype``: the dtype of the KV pages (usually the parameters' dtype).
- ``model.forward(tokens, positions, attn, kv, *, logits_indices=None) -> (logits, kv)``:
  tokens and positions i32[B, T]; logits f32[B, T, V], or f32[B, R, V] for the R token
  indices in ``logits_indices`` (only those rows need the LM head). Every layer calls
  ``out, kv = attn(layer, q, k, v, kv)`` exactly once, with ``layer`` its index in
  ``[0, num_layers)`` (a Python int, or an i32[] under `lax.scan`), q[B, T, H, D] and
  k/v[B, T, KVH, D] *after* any position encoding of q and k (RoPE), and threads the returned
  ``kv`` to the next layer and out of `forward`. The attention function writes the KV cache
  and applies the scale, the causal mask and the window; the model never sees blocks.
  Layers with different windows (`models.Gemma3`'s local and global layers): the config's
  ``sliding_window`` is None, ``layer_windows`` lists them, and each layer passes its own as a
  static keyword, ``attn(layer, q, k, v, kv, sliding_window=w)`` (``w`` an int, or None for
  full attention), which the attention function must accept.
- Its parameters are its NNX state: the engine calls `nnx.split(model)` and jits
  `nnx.merge(graphdef, params).forward(...)` (so no Python side effects in `forward`).

Optional: ``per_layer_weights = True`` (a class attribute, a bool; absent means False) declares
that the model stacks its layers in ``model.layers`` (every parameter with a leading ``[L]``
axis) and reads them only through `models.layer_weights` (`layer_at` for a layer's parameters,
`models.layer_weights.Linear` for its kernels), so its forward also runs on the split form of its
parameters (`models.layer_weights.split_layer_weights`). On one CPU device the engine then holds
that form (`jax_paged.backend.prepare_params`); `models.Transformer` sets it.

What a model may ignore: KV caches, blocks, batching and sampling. But the engine flattens a
ragged batch of many sequences into one row (B == 1, T tokens of several sequences, each
token at its own position), so apart from ``attn`` a forward must treat every token on its own
and take positions only from ``positions`` (never ``arange(T)``). End-of-sequence ids are not
the model's: give them to `wrap_model` (or `LoadedModel.generation_config`) and to
`PagedDecoder(eos_token_ids=...)`. A final-logit soft cap is the model's own business (apply it
in `forward`); an attention soft cap is the engine's: set ``config.attn_logit_softcapping``
(a float > 0, or None) and the paged kernels apply ``cap * tanh(score / cap)``. A sequence of
windows in ``config.sliding_window`` is refused.

`check_model(model)` checks all of this that can be checked without running the model and
raises naming every missing or invalid part; `LLMEngine` and `PagedDecoder` call it.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from models.layer_weights import LAYERS
from models.loading import GenerationConfig, LoadedModel

# The integer config fields the engine reads (and num_heads, checked against num_kv_heads).
CONFIG_INT_FIELDS = (
    "vocab_size",
    "max_position_embeddings",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)
FORWARD_SIGNATURE = "forward(tokens, positions, attn, kv, *, logits_indices=None)"


@runtime_checkable
class PagedModelConfig(Protocol):
    """The config fields the engine reads (`models.ModelConfig` has them all)."""

    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None

    @property
    def scale(self) -> float: ...


@runtime_checkable
class PagedModel(Protocol):
    """An NNX module the engine can page (see the module docstring for the contract).

    Attributes:
      config: its `PagedModelConfig`.
      dtype: the dtype of the KV pages.
      forward: `FORWARD_SIGNATURE` -> (logits, kv), as `models.Transformer.forward`: tokens and
        positions i32[B, T], ``attn`` an `AttentionFn`, ``kv`` threaded through every layer,
        logits f32[B, T, V] (f32[B, R, V] for ``logits_indices`` i32[R]). A ``Callable`` type
        cannot name keyword-only parameters: `check_model` checks them.

    Optional, so not a member here: ``per_layer_weights`` (a bool, see the module docstring).
    """

    config: PagedModelConfig
    dtype: Any
    forward: Callable[..., tuple[jax.Array, Any]]


class ModelProtocolError(TypeError):
    """A model does not satisfy `PagedModel`; the message lists every problem found."""


def _config_problems(c: Any) -> list[str]:
    problems = []
    ints = {}
    for name in CONFIG_INT_FIELDS:
        if not hasattr(c, name):
            problems.append(f"model.config has no {name!r}")
            continue
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            problems.append(f"model.config.{name}={v!r} must be a positive int")
        else:
            ints[name] = int(v)
    if "num_heads" in ints and "num_kv_heads" in ints and ints["num_heads"] % ints["num_kv_heads"]:
        problems.append(
            f"model.config.num_heads={ints['num_heads']} is not a multiple of "
            f"num_kv_heads={ints['num_kv_heads']}"
        )
    if not hasattr(c, "sliding_window"):
        problems.append("model.config has no 'sliding_window' (None for full attention)")
    else:
        w = c.sliding_window
        if isinstance(w, Sequence):
            problems.append(
                f"model.config.sliding_window={w!r}: one int for every layer, or None (per-layer "
                "windows go to attn as its sliding_window keyword, see models.protocol)"
            )
        elif w is not None and (
            isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1
        ):
            problems.append(f"model.config.sliding_window={w!r} must be None or an int >= 1")
    try:
        scale = c.scale
    except AttributeError:
        problems.append("model.config has no 'scale' (the softmax scale, e.g. head_dim**-0.5)")
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
            problems.append(f"model.config.scale={scale!r} must be a positive float")
    cap = getattr(c, "attn_logit_softcapping", None)
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0
    ):
        problems.append(f"model.config.attn_logit_softcapping={cap!r} must be None or a float > 0")
    try:
        hash(c)
    except TypeError:
        problems.append(
            f"model.config ({type(c).__name__}) is not hashable: make it a frozen dataclass "
            "(it sits in the NNX graphdef, a static jit argument)"
        )
    return problems


def _forward_problems(model: Any) -> list[str]:
    fwd = getattr(model, "forward", None)
    if fwd is None or not callable(fwd):
        return [f"model has no {FORWARD_SIGNATURE}"]
    try:
        sig = inspect.signature(fwd)
    except (TypeError, ValueError):
        return []  # a builtin or C callable: nothing to check
    try:
        sig.bind(None, None, None, None, logits_indices=None)
    except TypeError as e:
        return [f"model.forward{sig} does not accept {FORWARD_SIGNATURE} ({e})"]
    return []


def _per_layer_problems(model: Any) -> list[str]:
    flag = getattr(model, "per_layer_weights", False)
    if not isinstance(flag, bool):
        return [f"model.per_layer_weights={flag!r} must be a bool"]
    if flag and not hasattr(model, LAYERS):
        return [
            f"model.per_layer_weights is True but model has no {LAYERS!r} (the stacked layers "
            "whose kernels are split, see models.layer_weights)"
        ]
    return []


def check_model(model: Any) -> None:
    """Raises `ModelProtocolError` (a TypeError) naming every part of `PagedModel` that
    ``model`` lacks or gets wrong; returns None for a model the engine can run."""
    problems = []
    if not isinstance(model, nnx.Module):
        problems.append(
            f"model is a {type(model).__name__}, not a flax.nnx.Module (the engine takes its "
            "parameters with nnx.split)"
        )
    if not hasattr(model, "config"):
        problems.append(
            "model has no 'config' (needs " + ", ".join(CONFIG_INT_FIELDS) + ", sliding_window, "
            "scale)"
        )
    else:
        problems += _config_problems(model.config)
    if not hasattr(model, "dtype"):
        problems.append("model has no 'dtype' (the dtype of its KV pages)")
    else:
        try:
            dt = jnp.dtype(model.dtype)
        except TypeError:
            problems.append(f"model.dtype={model.dtype!r} is not a dtype")
        else:
            if not jnp.issubdtype(dt, jnp.floating):
                problems.append(f"model.dtype={dt} must be a floating dtype")
    problems += _forward_problems(model)
    problems += _per_layer_problems(model)
    if problems:
        raise ModelProtocolError(
            f"{type(model).__name__} does not satisfy models.PagedModel: " + "; ".join(problems)
        )


def wrap_model(
    model: Any,
    *,
    eos_token_ids: Sequence[int] = (),
    tokenizer: Any = None,
    source: str = "",
) -> LoadedModel:
    """A `LoadedModel` around your own module, for ``LLM(wrap_model(model, eos_token_ids=[2]))``.

    Without a tokenizer, prompts must be token ids (``{"prompt_token_ids": [...]}``) and outputs
    carry ``token_ids`` only (``text`` is empty). Checks the model first (`check_model`).
    """
    check_model(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        generation_config=GenerationConfig(eos_token_ids=[int(e) for e in eos_token_ids]),
        source=source or type(model).__name__,
    )
