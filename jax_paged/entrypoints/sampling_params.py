"""Per-request generation parameters in vLLM's shape: `SamplingParams` and `BeamSearchParams`.

Both are frozen, keyword-only dataclasses checked in ``__post_init__``: a bad value raises a
``ValueError`` whose message starts with the field name and says what is allowed, so the engine
can reject one request with a clear message and keep serving the others. Change a field with
``dataclasses.replace(params, temperature=0.0)`` (which runs the checks again).

``from_dict`` builds either class from a plain mapping (a JSONL line) and rejects unknown keys
with the list of allowed ones, so a typo such as ``"temprature"`` fails loudly instead of being
ignored.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

# Temperatures below this are treated as greedy (as vLLM does): dividing logits by a tiny
# temperature overflows f32 and gives NaNs, and the result would be argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_int(name: str, value: Any, allowed: str, ok) -> int:
    if not _is_int(value) or not ok(int(value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def _check_float(name: str, value: Any, allowed: str, ok) -> float:
    if not _is_real(value) or not math.isfinite(float(value)) or not ok(float(value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    # numpy bools are not `bool`; accept them, but not ints (a JSON `1` is most likely a typo).
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _from_dict(cls, d: Mapping[str, Any]):
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls.__name__} must be given as a mapping, got {type(d).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in d
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{cls.__name__} field(s) {', '.join(map(repr, missing))} required")
    return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate the completions of one request (vLLM's field names and defaults).

    Attributes:
      n: completions per prompt (>= 1). The engine runs each as its own sequence; see
        `child_params` for the per-completion parameters.
      temperature: >= 0; 0 (or below `GREEDY_TEMPERATURE_EPS`) means greedy, i.e. argmax of the
        penalised logits, and then top_p, top_k, min_p and seed have no effect.
      top_p: nucleus sampling, in (0, 1]; 1 is off.
      top_k: keep the k most likely tokens; -1 is off, otherwise >= 1.
      min_p: drop tokens whose probability is below ``min_p * max_prob``, in [0, 1]; 0 is off.
      seed: None, or an int in [-2**63, 2**64). A seeded request gives the same tokens whatever
        else is in the batch.
      stop: strings that end the completion when they appear in the text (matched on the host).
        A str or a list of non-empty str; normalised to a list.
      stop_token_ids: token ids (>= 0) that end the completion; normalised to a list. Unlike EOS
        they stop even with ``ignore_eos``.
      ignore_eos: keep generating after EOS (EOS is then neither a stop nor masked by
        min_tokens).
      max_tokens: most tokens to generate (>= 1), or None for "until max_model_len".
      min_tokens: EOS and stop_token_ids are masked until this many tokens exist (>= 0,
        <= max_tokens).
      logprobs: None, or the number (>= 0) of top log-probabilities to return per generated
        token (the sampled token is always added).
      prompt_logprobs: None, or the number (>= 0) of top log-probabilities per prompt token.
      presence_penalty: in [-2, 2]; subtracted once from the logit of every token already
        generated. 0 is off.
      frequency_penalty: in [-2, 2]; subtracted per occurrence in the generated tokens. 0 is off.
      repetition_penalty: > 0; the logits of tokens in the prompt or the output are divided by
        it when positive and multiplied by it when negative. 1 is off.
      skip_special_tokens: drop special tokens from the detokenised text.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("n", _check_int("n", self.n, "an int >= 1", lambda v: v >= 1))
        put(
            "temperature",
            _check_float(
                "temperature",
                self.temperature,
                "a finite number >= 0 (0 = greedy)",
                lambda v: v >= 0,
            ),
        )
        put("top_p", _check_float("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1))
        put(
            "top_k",
            _check_int("top_k", self.top_k, "-1 (off) or an int >= 1", lambda v: v == -1 or v >= 1),
        )
        put("min_p", _check_float("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1))
        if self.seed is not None:
            put(
                "seed",
                _check_int(
                    "seed",
                    self.seed,
                    "None or an int in [-2**63, 2**64)",
                    lambda v: _INT64_MIN <= v <= _UINT64_MAX,
                ),
            )
        put("stop", self._check_stop(self.stop))
        put("stop_token_ids", self._check_stop_token_ids(self.stop_token_ids))
        put("ignore_eos", _check_bool("ignore_eos", self.ignore_eos))
        if self.max_tokens is not None:
            put(
                "max_tokens",
                _check_int("max_tokens", self.max_tokens, "None or an int >= 1", lambda v: v >= 1),
            )
        put(
            "min_tokens", _check_int("min_tokens", self.min_tokens, "an int >= 0", lambda v: v >= 0)
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                put(name, _check_int(name, value, "None or an int >= 0", lambda v: v >= 0))
        for name in ("presence_penalty", "frequency_penalty"):
            put(
                name,
                _check_float(
                    name, getattr(self, name), "a number in [-2, 2]", lambda v: -2 <= v <= 2
                ),
            )
        put(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 = off)",
                lambda v: v > 0,
            ),
        )
        put("skip_special_tokens", _check_bool("skip_special_tokens", self.skip_special_tokens))
        put(
            "include_stop_str_in_output",
            _check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
        )

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"stop must be None, a non-empty str or a list of non-empty str, got {stop!r}"
            )
        return list(stop)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if (
            isinstance(ids, str | bytes)
            or not isinstance(ids, Sequence)
            or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise ValueError(f"stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
        return [int(t) for t in ids]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Builds from a mapping (e.g. a JSONL line); unknown keys raise a `ValueError`."""
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the per-sequence token counts (see `sampling.SamplingState`)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def child_params(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of an ``n > 1`` request: ``n=1`` and, when
        seeded, ``seed + index`` (vLLM's rule), so the completions differ but stay reproducible.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, n={self.n}), got {index}")
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > _UINT64_MAX:
            seed -= 2**64
        return dataclasses.replace(self, n=1, seed=seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Parameters of `LLM.beam_search` (vLLM's shape).

    Attributes:
      beam_width: beams kept per step (>= 1).
      max_tokens: most tokens to generate (>= 1).
      ignore_eos: keep extending beams after EOS.
      temperature: >= 0; accepted as vLLM does, but candidates are always ranked by the raw
        log-probabilities, so it does not change the result.
      length_penalty: finite; finished beams are ranked by
        ``cumulative_logprob / len ** length_penalty``, ``len`` counting the generated tokens
        (EOS included), as HF transformers does.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      early_stopping: when the search ends (HF transformers' meaning): True as soon as
        beam_width hypotheses have finished; False when no running beam can beat the worst
        finished one at its current length; "never" the same, but assuming the running beams
        could grow to max_tokens when length_penalty > 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put(
            "beam_width",
            _check_int("beam_width", self.beam_width, "an int >= 1", lambda v: v >= 1),
        )
        put(
            "max_tokens",
            _check_int("max_tokens", self.max_tokens, "an int >= 1", lambda v: v >= 1),
        )
        put("ignore_eos", _check_bool("ignore_eos", self.ignore_eos))
        put(
            "temperature",
            _check_float("temperature", self.temperature, "a finite number >= 0", lambda v: v >= 0),
        )
        put(
            "length_penalty",
            _check_float("length_penalty", self.length_penalty, "a finite number", lambda v: True),
        )
        put(
            "include_stop_str_in_output",
            _check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
        )
        if not (isinstance(self.early_stopping, str) and self.early_stopping == "never"):
            try:
                put("early_stopping", _check_bool("early_stopping", self.early_stopping))
            except ValueError:
                raise ValueError(
                    f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
                ) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BeamSearchParams:
        """Builds from a mapping; unknown keys raise a `ValueError`."""
        return _from_dict(cls, d)
