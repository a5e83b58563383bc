"""Beam search on the engine, in vLLM's shape, scoring like HF transformers.

The beams live on the host; the engine only ever sees ordinary one-token requests. Each round,
every running beam of every prompt becomes one request ``prompt + beam tokens`` with
``SamplingParams(temperature=0, max_tokens=1, logprobs=K)``; they are all queued together, so the
engine batches them (and, with prefix caching, the beams of a prompt share the KV blocks of
their common prefix). A pruned beam is simply not submitted again. A prompt whose requests have
all come back advances at once and queues its next round, without waiting for the other prompts.

One round of one prompt follows ``GenerationMixin._beam_search`` of HF transformers:

1. Candidates: every running beam extended by each of its K most likely next tokens, scored by
   the beam's cumulative log-probability plus the token's (raw log-softmax) log-probability;
   keep the K best overall, K = ``max(2, 1 + number of EOS ids) * beam_width``. (A beam's own
   top K is enough: the K best overall cannot include its (K+1)-th token.)
2. A candidate "finishes" when its token is an EOS id or it reaches ``max_tokens``. Finished
   candidates among the first ``beam_width`` join the finished hypotheses with the score
   ``cumulative_logprob / generated_len ** length_penalty`` (generated_len counts the EOS);
   only the ``beam_width`` best hypotheses are kept. With ``early_stopping=True`` nothing is
   added once ``beam_width`` hypotheses exist.
3. The ``beam_width`` best unfinished candidates are the next running beams.
4. The search ends when a candidate reached ``max_tokens``; or with ``early_stopping=True``
   when ``beam_width`` hypotheses exist; or, with ``beam_width`` hypotheses, when the best
   running beam's cumulative log-probability divided by ``L ** length_penalty`` is not above
   the worst hypothesis, L being its current generated length (``early_stopping`` False) or
   ``max_tokens`` ("never" with ``length_penalty > 0``).

The hypotheses come back best first; `BeamSearchSequence.score` equals HF's
``sequences_scores``. Unlike vLLM (which divides by the total length, prompt included, without
the EOS), the length penalty uses HF's generated length, so the two libraries' results agree.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Sequence

from jax_paged.engine import inputs
from jax_paged.entrypoints.outputs import LogprobsDict, describe_error
from jax_paged.entrypoints.sampling_params import BeamSearchParams, SamplingParams

_request_ids = itertools.count()


@dataclasses.dataclass
class BeamSearchSequence:
    """One finished hypothesis.

    Attributes:
      tokens: the prompt's token ids followed by the generated ones (vLLM's convention).
      logprobs: per generated token, the top-K log-probabilities at that position (K as in the
        module docstring), the chosen token among them.
      cum_logprob: sum of the generated tokens' log-probabilities.
      score: ``cum_logprob / len(output_token_ids) ** length_penalty``, the ranking key (HF's
        ``sequences_scores``).
      text: the generated text (the EOS token's text only with
        ``include_stop_str_in_output``); None when the model has no tokenizer.
      finish_reason: "stop" (ended with an EOS token) or "length" (max_tokens).
      stop_reason: None (EOS and length carry no stop string or stop token).
      num_prompt_tokens: how many of ``tokens`` are the prompt.
    """

    tokens: list[int]
    logprobs: list[LogprobsDict]
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclasses.dataclass
class BeamSearchOutput:
    """The result of one prompt.

    Attributes:
      sequences: the ``beam_width`` hypotheses, best score first.
      prompt: the prompt text, or None for a token-id prompt.
      prompt_token_ids: the prompt's token ids.
      error: set (and ``sequences`` empty) when the prompt could not be served; the other
        prompts of the call are unaffected.
    """

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None


@dataclasses.dataclass(eq=False)
class _Beam:
    tokens: list[int]  # generated tokens only
    logprobs: list[LogprobsDict]
    cum_logprob: float


@dataclasses.dataclass(eq=False)
class _Hypothesis:
    beam: _Beam
    score: float
    finish_reason: str


@dataclasses.dataclass(eq=False)
class _PromptState:
    """The host bookkeeping of one prompt's search."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    running: list[_Beam]
    finished: list[_Hypothesis] = dataclasses.field(default_factory=list)
    # request id -> position in `running`, for the round in flight; and the results so far.
    pending: dict[str, int] = dataclasses.field(default_factory=dict)
    results: dict[int, LogprobsDict] = dataclasses.field(default_factory=dict)
    done: bool = False
    error: str | None = None


def num_candidates(beam_width: int, num_eos: int) -> int:
    """K: candidates kept per round, and log-probabilities asked per beam (HF's rule)."""
    return max(2, 1 + num_eos) * beam_width


def advance(
    state: _PromptState,
    beam_logprobs: Sequence[LogprobsDict],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
) -> None:
    """One round of the search for one prompt, given each running beam's next-token
    log-probabilities (at least K entries each). Updates ``state`` in place; sets ``done``."""
    width = params.beam_width
    k = num_candidates(width, len(eos_token_ids))
    cands = []
    for beam, lps in zip(state.running, beam_logprobs, strict=True):
        top = sorted(lps.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:k]
        for token, lp in top:
            cands.append((beam.cum_logprob + lp.logprob, beam, token, lps))
    # Stable: among equal scores, earlier beams and smaller token ids first (HF's flat order).
    cands.sort(key=lambda c: -c[0])
    cands = cands[:k]

    new_len = len(state.running[0].tokens) + 1
    at_max = new_len >= state.max_tokens
    lp_pow = float(new_len) ** params.length_penalty
    # HF checks "full" before this round's hypotheses are merged.
    closed = params.early_stopping is True and len(state.finished) >= width
    running: list[_Beam] = []
    for i, (score, parent, token, lps) in enumerate(cands):
        is_eos = token in eos_token_ids
        child = None
        if is_eos or at_max:
            if i < width and not closed:
                child = _Beam(parent.tokens + [token], parent.logprobs + [lps], score)
                reason = "stop" if is_eos else "length"
                state.finished.append(_Hypothesis(child, score / lp_pow, reason))
        elif len(running) < width:
            running.append(_Beam(parent.tokens + [token], parent.logprobs + [lps], score))
    state.finished.sort(key=lambda h: -h.score)
    del state.finished[width:]
    state.running = running

    full = len(state.finished) >= width
    if at_max or not running:
        state.done = True
    elif full and params.early_stopping is True:
        state.done = True
    elif full:
        if params.early_stopping == "never" and params.length_penalty > 0:
            best_len = state.max_tokens
        else:
            best_len = new_len
        best_possible = running[0].cum_logprob / float(best_len) ** params.length_penalty
        if not best_possible > state.finished[-1].score:
            state.done = True


def beam_search(
    engine,
    prompts: str | dict | Sequence[str | dict],
    params: BeamSearchParams,
    *,
    use_tqdm: bool | Callable = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for every prompt on ``engine`` (an `LLMEngine`); see the module docstring.

    Args:
      prompts: a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, or a list of them.
      params: `BeamSearchParams`.
      use_tqdm: show a progress bar over prompts (or pass a tqdm-like factory).
      concurrency_limit: at most this many prompts searched at once (None: all).

    Returns:
      One `BeamSearchOutput` per prompt, in input order. A prompt that cannot be served gets
      ``error`` set and no sequences; the others complete.
    """
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if concurrency_limit is not None and (
        not isinstance(concurrency_limit, int)
        or isinstance(concurrency_limit, bool)
        or concurrency_limit < 1
    ):
        raise ValueError(
            f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}"
        )
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    prompts = list(prompts)
    eos = frozenset() if params.ignore_eos else frozenset(int(t) for t in engine.eos_token_ids)
    k = num_candidates(params.beam_width, len(eos))
    max_logprobs = engine.config.max_logprobs
    if k > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs the top {k} log-probabilities per step, "
            f"more than the engine's max_logprobs={max_logprobs}; lower beam_width or raise "
            "max_logprobs"
        )
    max_n = engine.config.max_n
    if params.beam_width > max_n:
        raise ValueError(
            f"beam_width={params.beam_width} is more than max_n={max_n} (an EngineConfig / LLM "
            "argument): lower beam_width or raise max_n"
        )
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)

    states: list[_PromptState] = []
    for i, prompt in enumerate(prompts):
        try:
            text, ids = inputs.parse_prompt(prompt, engine.tokenizer)
        except Exception as e:  # noqa: BLE001 - becomes this prompt's error
            text = prompt if isinstance(prompt, str) else None
            st = _PromptState(
                i, text, [], params.max_tokens, [], done=True, error=describe_error(e)
            )
        else:
            # Like `generate`, never run past max_model_len (an over-long prompt is rejected
            # when its first request is added).
            max_tokens = max(1, min(params.max_tokens, engine.max_model_len - len(ids)))
            st = _PromptState(i, text, ids, max_tokens, [_Beam([], [], 0.0)])
        states.append(st)

    owner: dict[str, _PromptState] = {}
    queue = deque(st for st in states if not st.done)
    active = 0
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        factory = use_tqdm if callable(use_tqdm) else tqdm
        bar = factory(total=len(states), desc="Beam search", dynamic_ncols=True)
        bar.update(len(states) - len(queue))

    def fail(st: _PromptState, message: str) -> None:
        for r in st.pending:
            engine.abort(r)
            owner.pop(r, None)
        st.pending.clear()
        st.done, st.error = True, message

    def submit(st: _PromptState) -> None:
        st.results = {}
        for j, beam in enumerate(st.running):
            rid = f"beam-{next(_request_ids)}"
            try:
                engine.add_request(
                    rid, {"prompt_token_ids": st.prompt_token_ids + beam.tokens}, step_params
                )
            except Exception as e:  # noqa: BLE001 - becomes this prompt's error
                fail(st, describe_error(e))
                return
            st.pending[rid] = j
            owner[rid] = st

    try:
        while True:
            while queue and (concurrency_limit is None or active < concurrency_limit):
                st = queue.popleft()
                submit(st)
                if st.done:
                    _tick(bar)
                else:
                    active += 1
            if not owner:
                break
            if not engine.has_unfinished_requests():
                raise RuntimeError("beam search: the engine dropped requests it had accepted")
            for out in engine.step():
                st = owner.get(out.request_id)
                if st is None or not out.finished:
                    continue
                del owner[out.request_id]
                j = st.pending.pop(out.request_id)
                if out.error is not None:  # an engine step failed under this beam
                    fail(st, out.error)
                    active -= 1
                    _tick(bar)
                    continue
                st.results[j] = out.outputs[0].logprobs[0]
                if st.pending:
                    continue
                advance(st, [st.results[j] for j in range(len(st.running))], params, eos)
                if not st.done:
                    submit(st)
                if st.done:
                    active -= 1
                    _tick(bar)
    finally:
        for rid in owner:
            engine.abort(rid)
        if bar is not None:
            bar.close()
    return [_make_output(st, params, eos, engine.tokenizer) for st in states]


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


def _make_output(st: _PromptState, params, eos, tokenizer) -> BeamSearchOutput:
    if st.error is not None:
        return BeamSearchOutput([], st.prompt, st.prompt_token_ids, error=st.error)
    seqs = []
    for h in st.finished:
        out_ids = h.beam.tokens
        text = None
        if tokenizer is not None:
            shown = out_ids
            if h.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = out_ids[:-1]
            text = tokenizer.decode(shown)
        seqs.append(
            BeamSearchSequence(
                tokens=st.prompt_token_ids + out_ids,
                logprobs=list(h.beam.logprobs),
                cum_logprob=h.beam.cum_logprob,
                score=h.score,
                text=text,
                finish_reason=h.finish_reason,
                stop_reason=None,
                num_prompt_tokens=len(st.prompt_token_ids),
            )
        )
    return BeamSearchOutput(seqs, st.prompt, st.prompt_token_ids)


__all__ = ["BeamSearchOutput", "BeamSearchSequence", "beam_search", "num_candidates"]
