"""What `LLM.generate` and the engine's `step` return, in vLLM's shapes.

Log-probabilities follow vLLM: per position a ``dict[token_id, Logprob]`` holding the top-N
tokens plus the sampled (or, for prompts, the actual next) token when it is not among them.
`Logprob.rank` is 1 for the most likely token. Prompt log-probabilities start with ``None``:
the first prompt token has no preceding context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

# One position's log-probabilities: token id -> Logprob.
LogprobsDict = dict[int, "Logprob"]


@dataclasses.dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
      logprob: natural-log probability under the model's raw output distribution (before
        penalties, temperature and top-k/top-p/min-p, as vLLM v1 reports by default).
      rank: 1 + the number of tokens with a strictly larger log-probability.
      decoded_token: the token's text, when a tokenizer is present.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
      index: which of the request's ``n`` completions this is.
      text: the generated text (stop string removed unless ``include_stop_str_in_output``).
      token_ids: the generated token ids.
      cumulative_logprob: sum of the sampled tokens' log-probabilities, or None when
        ``logprobs`` was not requested.
      logprobs: per generated token, the top-N dict; None when not requested.
      finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
        max_model_len), "abort", or None while still running.
      stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timings of one request (seconds since the epoch, `time.time()`), filled by the engine.

    Attributes:
      arrival_time: when the request was added.
      first_scheduled_time: when it first ran a step.
      first_token_time: when its first token was sampled.
      last_token_time: when its latest token was sampled.
      finished_time: when it finished.
      num_preemptions: how often it was preempted (recomputed).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: all its completions so far.

    Attributes:
      request_id: the engine's id for the request.
      prompt: the prompt text, or None for a token-id prompt.
      prompt_token_ids: the prompt's token ids.
      prompt_logprobs: None when not requested; else one entry per prompt token, the first None.
      outputs: the completions, ordered by `CompletionOutput.index`.
      finished: whether every completion has finished.
      num_cached_tokens: prompt tokens whose K/V came from the prefix cache.
      metrics: timings (`RequestMetrics`), when the engine records them.
      error: set (``finished`` True) when the request could not be served: rejected when it
        was added (e.g. a bad parameter; ``outputs`` empty), or failed by an engine step that
        raised (``outputs`` hold what was generated before, finish_reason "abort"). The other
        requests of the same call are unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


def make_logprobs_dict(
    token_id: int,
    token_logprob: float,
    token_rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    num: int,
    decode: Callable[[int], str] | None = None,
) -> LogprobsDict:
    """Builds one position's dict from the sampler's per-row outputs (host values).

    Args:
      token_id, token_logprob, token_rank: the sampled (or actual next) token.
      top_ids, top_logprobs: the top-K ids and log-probs, most likely first (K >= num).
      num: how many of the top entries the request asked for.
      decode: token id -> text, or None to leave ``decoded_token`` unset.
    """
    dec: Callable[[int], Any] = decode if decode is not None else (lambda _t: None)
    # The sampled token comes first (as in vLLM v1); if it is also among the top entries it keeps
    # its place and takes its top-list rank.
    out: LogprobsDict = {int(token_id): Logprob(float(token_logprob), int(token_rank), None)}
    for r in range(num):
        t = int(top_ids[r])
        out[t] = Logprob(float(top_logprobs[r]), r + 1, None)
    for t, lp in out.items():
        lp.decoded_token = dec(t)
    return out


def describe_error(e: BaseException) -> str:
    """An exception as a one-line request error: a ValueError as it is (it names the field),
    anything else with its type."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
