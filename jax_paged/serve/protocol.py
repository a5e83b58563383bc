"""Request bodies of the OpenAI-compatible API (pydantic), and their `SamplingParams`.

Field names, types and defaults follow OpenAI's API, plus vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...). Types are strict
(a JSON ``"2"`` is not an int, a ``1`` is not a bool), so a wrong type is a 400 naming the field
rather than a silent conversion. Unknown fields are ignored, as OpenAI and vLLM do. Range checks
are `SamplingParams`' own (its ``ValueError`` names the field), so they are not repeated here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jax_paged.entrypoints.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The sampling fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The `SamplingParams` of this body (ValueError naming the field if out of range)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            seed=self.seed,
        )
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop is not None and isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError(f"stop: at most 4 stop strings, got {len(self.stop)}")
        return SamplingParams(**kw)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or
    a list of lists of token ids (one completion set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo: echoing the prompt is not supported; leave echo false")
        if self.suffix:
            raise ValueError("suffix: not supported; leave it unset")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: must equal n ({self.n}) or be unset, got {self.best_of}")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported; leave it unset or empty")
        return self._sampling(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | dict]:
        """The prompts as the engine takes them (ValueError if the list is empty)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(t, int) for t in p):
            return [{"prompt_token_ids": list(p)}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: text parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"messages: content part {i} must be {{'type': 'text', 'text': str}}; "
                        f"only text is supported, got type {part.get('type')!r}"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs}")
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported; leave it unset or empty")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
