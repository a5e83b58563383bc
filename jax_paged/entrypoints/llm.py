"""`LLM`: offline batched generation in vLLM's shape.

llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp

import models
from jax_paged.engine.llm_engine import EngineConfig, LLMEngine
from jax_paged.entrypoints import beam_search as beam_search_lib
from jax_paged.entrypoints.outputs import RequestOutput, describe_error
from jax_paged.entrypoints.sampling_params import BeamSearchParams, SamplingParams
from jax_paged.parallel.data_parallel import DataParallelEngine

logger = logging.getLogger("jax_paged")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "auto": jnp.float32}


class LLM:
    """A model plus an engine.

    Args:
      model: an HF model folder, a ``.gguf`` file, an orbax checkpoint folder written by
        `models.save_checkpoint`, None for the embedded SmolLM2, or an already loaded
        `models.LoadedModel`.
      dtype: "float32" or "bfloat16" ("auto" = float32).
      **engine_kwargs: `EngineConfig` fields: block_size (16), num_kv_blocks,
        kv_cache_memory_bytes, gpu_memory_utilization, max_model_len, max_num_seqs,
        max_num_batched_tokens, max_decode_steps, seed, attention_impl,
        tensor_parallel_size (devices the model is split over), data_parallel_size (engine
        replicas on their own devices, `jax_paged.parallel.data_parallel`).
    """

    def __init__(self, model: Any = None, *, dtype: str = "float32", **engine_kwargs):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(_DTYPES)}")
        unknown = set(engine_kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown LLM arguments {sorted(unknown)}; allowed: "
                f"{sorted(EngineConfig.__dataclass_fields__)}"
            )
        _enable_compilation_cache()
        if isinstance(model, models.LoadedModel):
            loaded = model
        else:
            loaded = models.load(model, dtype=_DTYPES[dtype])
        config = EngineConfig(**engine_kwargs)
        if config.data_parallel_size > 1:
            self.engine = DataParallelEngine(loaded, config)
        else:
            self.engine = LLMEngine(loaded, config)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable = False,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; returns one `RequestOutput` per prompt, in
        input order. A prompt that cannot be served gets an output with ``error`` set (and no
        completions); the others are unaffected.

        Prompts are strings or ``{"prompt_token_ids": [...]}``; ``sampling_params`` is one
        `SamplingParams` for all or a list with one per prompt.
        """
        prompts, params = self._pair(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm)

    def iter_generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """`generate` as it happens: yields ``(index of the prompt, its finished output)`` in
        the order the requests finish (rejected prompts first). Stopping the iteration early
        (``break``, an exception, ``close()``) aborts the requests still running, so none
        outlives the call."""
        prompts, params = self._pair(prompts, sampling_params)
        return self._iter_run(list(zip(prompts, params, strict=True)))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool | Callable = False,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}``) or a list of conversations, then generates. A conversation
        the template cannot render comes back with ``error`` set."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in convs:
            try:
                ids = self.tokenizer.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt, tokenize=True
                )
                prompts.append({"prompt_token_ids": ids})
            except Exception as e:  # noqa: BLE001 - becomes this conversation's error
                prompts.append(_Rejected(f"messages: {describe_error(e)}"))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _pair(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
                )
        return prompts, params

    def _run(self, prompts, params, use_tqdm) -> list[RequestOutput]:
        results: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            factory = use_tqdm if callable(use_tqdm) else tqdm
            bar = factory(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        try:
            for i, out in self._iter_run(list(zip(prompts, params, strict=True))):
                results[i] = out
                if bar is not None:
                    bar.update(1)
                    m = self.engine.get_metrics()
                    bar.set_postfix_str(f"{m['generation_tokens_per_s']:.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(prompts))]

    def _iter_run(self, items: list) -> Iterator[tuple[int, RequestOutput]]:
        """Adds every (prompt, params) of ``items``, then steps the engine until all of them
        finish, yielding ``(index, output)`` as each does. All or nothing per call: a prompt
        that cannot be added (any exception) yields its error output at once; if the loop
        stops for any reason, the requests still running are aborted before it returns."""
        engine = self.engine
        index: dict[str, int] = {}  # request id -> input index, while running
        try:
            for i, (prompt, p) in enumerate(items):
                rid = f"gen-{self._counter}"
                self._counter += 1
                if isinstance(prompt, _Rejected):
                    engine.count_rejected()
                    yield i, _error_output(rid, None, prompt.message)
                    continue
                try:
                    engine.add_request(rid, prompt, p)
                except Exception as e:  # noqa: BLE001 - becomes this prompt's error
                    if not isinstance(e, ValueError):
                        logger.warning("request %s rejected: %s", rid, describe_error(e))
                    yield i, _error_output(rid, prompt, describe_error(e))
                    continue
                index[rid] = i
            while index:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"the engine lost {len(index)} requests it had accepted: "
                        f"{sorted(index)[:5]}"
                    )
                for out in engine.step():
                    if out.finished and out.request_id in index:
                        yield index.pop(out.request_id), out
        finally:
            for rid in index:
                engine.abort(rid)

    def beam_search(
        self,
        prompts: str | dict | Sequence[str | dict],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | Callable = False,
        concurrency_limit: int | None = None,
    ) -> list[beam_search_lib.BeamSearchOutput]:
        """Beam search for each prompt (str, ``{"prompt": ...}`` or ``{"prompt_token_ids":
        [...]}``); returns one `BeamSearchOutput` per prompt, in input order, its sequences best
        first. Scores match HF transformers' ``generate(num_beams=...)``; see
        `jax_paged.entrypoints.beam_search`."""
        return beam_search_lib.beam_search(
            self.engine, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit
        )


def _enable_compilation_cache() -> None:
    """Turns on jax's persistent compilation cache (``$JAX_PAGED_CACHE_DIR``, default
    ``~/.cache/jax_paged/xla``) unless the user configured one: the engine's step programs
    then compile once per machine, not once per run. ``JAX_PAGED_CACHE_DIR=""`` turns it off."""
    import os

    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("JAX_PAGED_CACHE_DIR", os.path.expanduser("~/.cache/jax_paged/xla"))
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class _Rejected:
    """A prompt that failed before it reached the engine (e.g. its chat template)."""

    def __init__(self, message: str):
        self.message = message


def _error_output(rid: str, prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
    return RequestOutput(
        request_id=rid,
        prompt=text,
        prompt_token_ids=[],
        prompt_logprobs=None,
        outputs=[],
        finished=True,
        error=message,
    )
