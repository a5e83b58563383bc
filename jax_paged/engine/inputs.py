"""Prompt normalisation and request checks, shared by `LLM`, beam search and the engine.

A prompt is a string (tokenized with the model's tokenizer), ``{"prompt": str}`` or
``{"prompt_token_ids": [int, ...]}`` (optionally with a ``"prompt"`` text kept for the
output). Every check raises ``ValueError`` naming the field and what is allowed, so a caller can
turn it into that request's error.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_paged.engine.sequence import max_blocks_held
from jax_paged.entrypoints.sampling_params import SamplingParams


def parse_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """``prompt`` -> (its text or None, its token ids). Raises ValueError."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                'prompt: this model has no tokenizer; pass token ids as {"prompt_token_ids": [...]}'
            )
        try:
            return prompt, tokenizer.encode(prompt)
        except Exception as e:  # e.g. a lone surrogate: TypeError from `tokenizers`
            raise ValueError(
                f"prompt: the tokenizer cannot encode it ({type(e).__name__}: {e})"
            ) from e
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(
                f"prompt: unknown keys {sorted(unknown)}; allowed: 'prompt', 'prompt_token_ids'"
            )
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), [int(t) for t in ids]
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"], tokenizer)
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    raise ValueError(
        f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
    )


def eos_token_ids(loaded) -> list[int]:
    """The EOS ids of a `models.LoadedModel`: its generation config's, else its tokenizer's."""
    ids = list(loaded.generation_config.eos_token_ids or [])
    tok = loaded.tokenizer
    if not ids and tok is not None and tok.eos_token_id is not None:
        ids = [tok.eos_token_id]
    return ids


def check_request(
    ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int,
    has_tokenizer: bool,
    max_n: int | None = None,
    block_size: int | None = None,
    usable_blocks: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> int:
    """The checks of one request that need the engine's sizes. Raises ValueError naming the
    field. Returns the request's max_tokens (None means until max_model_len, as in vLLM).

    With ``max_n``, ``n`` (and ``best_of``) must not exceed it; with ``block_size`` and
    ``usable_blocks`` (the KV pool less the null block) the longest sequence must fit the pool:
    all its blocks, or with a sliding ``window`` in every layer (whose dead blocks the steps
    drop) the most it holds at once, growing ``chunk`` tokens a step (`max_blocks_held`).
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if max_n is not None and params.n > max_n:
        raise ValueError(
            f"n={params.n} is more than max_n={max_n} (an EngineConfig / LLM argument): ask "
            "for fewer sequences per request or raise max_n"
        )
    if not ids:
        raise ValueError("prompt is empty: it must hold at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: {bad[:5]} out of range; ids must be in [0, {vocab_size})"
        )
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens; with max_model_len={max_model_len} it must be "
            f"at most {max_model_len - 1} so that one token can be generated"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and v > max_logprobs:
            raise ValueError(f"{name}={v} must be <= max_logprobs={max_logprobs}")
    for t in params.stop_token_ids or []:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids: {t} must be in [0, {vocab_size})")
    max_tokens = params.max_tokens or max_model_len - len(ids)
    if block_size is not None and usable_blocks is not None:
        longest = min(len(ids) + max_tokens, max_model_len)
        need = max_blocks_held(longest, block_size, window, chunk or longest)
        if need > usable_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks ({longest} tokens) but the cache holds "
                f"{usable_blocks}: lower max_tokens or raise num_kv_blocks"
            )
    return max_tokens


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The engine's sizes every request is checked against (`check_request`'s keywords)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    has_tokenizer: bool
    max_n: int | None = None
    block_size: int | None = None
    usable_blocks: int | None = None
    window: int | None = None
    chunk: int | None = None

    def check(self, ids: list[int], params: SamplingParams) -> int:
        """`check_request` under these limits; returns the request's max_tokens."""
        return check_request(ids, params, **dataclasses.asdict(self))
