"""Host-side output processing: sampled tokens in, `RequestOutput`s out.

For every sequence the processor keeps its text, log-probs and stop state between steps, so a
step costs time in proportion to the tokens it produced, never to the output so far:

* text comes from an incremental detokenizer (`tokenizers`' ``DecodeStream``): each new token
  is decoded once, with the few tokens before it as context (byte-level merges, multi-byte
  characters and SentencePiece spaces come out as a full decode would give them);
* a stop string can only end in the text a token just added, so only that text and the
  ``len(longest stop) - 1`` characters before it are searched;
* the finished text is decoded once in full, so it equals ``tokenizer.decode(token_ids)``
  exactly (a trailing incomplete character included).

`RequestState` is the engine's record of one request; `OutputProcessor.append` applies a
step's tokens to one of its sequences and says whether (and why) the sequence finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from tokenizers.decoders import DecodeStream

from jax_paged.engine.sequence import Sequence, SequenceStatus
from jax_paged.entrypoints.outputs import (
    CompletionOutput,
    LogprobsDict,
    RequestMetrics,
    RequestOutput,
    make_logprobs_dict,
)
from jax_paged.entrypoints.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """The text of a growing token sequence, each token decoded once.

    Args:
      tokenizer: a `models.Tokenizer` (its ``backend`` is a `tokenizers.Tokenizer`).
      skip_special_tokens: as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._chunks: list[str] = []
        self.num_chars = 0  # characters produced so far (what the work is proportional to)

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the text it completes ("" while a character is partial)."""
        new = self._stream.step(self._backend, int(token_id)) or ""
        if new:
            self._chunks.append(new)
            self.num_chars += len(new)
        return new

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""


@dataclasses.dataclass(eq=False)
class SequenceOutput:
    """Output state of one sequence of a request.

    Attributes:
      detok: its incremental detokenizer (None without a tokenizer).
      text: the text to report (final once the sequence finished).
      logprobs: per generated token, when the request asked for them.
      cum_logprob: sum of the generated tokens' log-probabilities, when the request asked for
        log-probs (None otherwise: the device does not compute them).
      stop_at: characters of text kept after a stop string was found.
      tail: the end of the text, as long as the longest stop string minus one.
    """

    detok: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[LogprobsDict] | None = None
    cum_logprob: float | None = None
    stop_at: int | None = None
    tail: str = ""


@dataclasses.dataclass(eq=False)
class RequestState:
    """The engine's record of one request.

    Attributes:
      seqs: its `scheduler.Sequence`s, index i = completion i.
      outputs: one `SequenceOutput` per sequence.
      prompt_logprobs: once complete, one entry per prompt token (the first None).
      plp_partial: prompt log-probs gathered so far by chunked prefill of sequence 0.
      pending_forks: n > 1 siblings waiting for their leader's prefill.
      error: set when an engine step failed under this request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Any]
    metrics: RequestMetrics
    outputs: list[SequenceOutput] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    plp_partial: list | None = None
    pending_forks: list[Any] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class OutputProcessor:
    """Turns sampled tokens into texts, log-probs, stop decisions and `RequestOutput`s.

    Args:
      tokenizer: a `models.Tokenizer`, or None (then texts stay empty).
      eos_token_ids: the model's EOS ids (a stop unless ``ignore_eos``).
      max_model_len: a sequence that reaches it finishes with "length".
    """

    def __init__(self, tokenizer, eos_token_ids, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.chars_decoded = 0  # characters the incremental detokenizers produced, in all
        self.requests: dict[str, RequestState] = {}  # the unfinished requests, by id
        self._seq_ids = itertools.count()  # engine-unique sequence ids, in arrival order

    def new_request(self, request_id, text, ids, params, max_tokens) -> RequestState:
        """Registers an accepted request: its `RequestState` with ``params.n`` sequences, each
        with its own child params, and their outputs."""
        seqs = [
            Sequence(next(self._seq_ids), request_id, list(ids), max_tokens)
            for _ in range(params.n)
        ]
        req = RequestState(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(ids),
            params=params,
            seqs=seqs,
            metrics=RequestMetrics(arrival_time=time.time()),
            outputs=self.new_outputs(params),
        )
        for i, s in enumerate(seqs):
            s.params, s.request, s.index = params.child_params(i), req, i
        self.requests[request_id] = req
        return req

    def fail(self, req: RequestState, message: str) -> RequestOutput:
        """Ends ``req`` with ``error`` set (its sequences already finished); its last output."""
        req.error = message
        req.metrics.finished_time = time.time()
        self.requests.pop(req.request_id, None)
        return self.make_output(req)

    def new_outputs(self, params: SamplingParams) -> list[SequenceOutput]:
        out = []
        for _ in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            out.append(
                SequenceOutput(
                    detok=detok,
                    logprobs=[] if params.logprobs is not None else None,
                    cum_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        return out

    def decode_token(self, t: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([t])

    def append(self, s, tokens, lps, ranks, top_ids, top_lps) -> tuple[int, tuple | None]:
        """Applies a step's tokens to sequence ``s`` in order, up to the first that finishes
        it (a stop token, max_tokens, max_model_len or a stop string); drops the rest (the
        device may run past a stop). Detokenises and records log-probs as it goes.

        Returns:
          (tokens kept, None or ``(finish_reason, stop_reason)``).
        """
        so = s.request.outputs[s.index]
        self._stamp(s.request)
        longest = max((len(x) for x in s.params.stop or ()), default=0)
        reason = None
        kept = 0
        for j, t in enumerate(tokens):
            reason = self._take(s, t)
            kept += 1
            new = self._show(s, so, t, lps[j], ranks[j], top_ids[j], top_lps[j])
            if longest and new:
                hit = self._find_stop(so, new, s.params, longest)
                if hit is not None:
                    reason = ("stop", hit)
            if reason is not None:
                break
        self._end(s, reason)
        self._update_text(s, final=reason is not None)
        return kept, reason

    def commit(self, plan, result, finish) -> tuple[list, int]:
        """The half of a step's output processing that the next plan depends on: appends each
        chunk's new tokens (``plan``: `SchedulerOutput`, ``result``: `StepResult`) to its
        sequence, up to the first stop token, max_tokens or max_model_len, and ends the
        sequences they stop (``finish(seq, reason, stop_reason)``). A sequence with stop
        strings goes through `append` whole (a stop string also ends it). Sequences that
        ended meanwhile (aborted while the step ran) are skipped.

        Returns (what `render` does next, tokens kept); `render` may run while the device
        runs the next step (`EngineConfig.async_scheduling`)."""
        todo: list[tuple[Sequence, tuple | None]] = []
        kept = off = 0
        for r, c in enumerate(plan.chunks):
            s, off = c.seq, off + c.length
            if not result.ok[r] or s.status is SequenceStatus.FINISHED:
                continue
            if result.prompt_lp is not None and s.params.prompt_logprobs is not None:
                self.record_prompt_logprobs(s, c.start, c.length, result.prompt_lp, off - c.length)
            m = int(result.made[r])
            if not m:
                continue
            toks = result.tokens[:m, r].tolist()
            cols = (result.logprobs[:m, r], result.ranks[:m, r])
            tops = (list(result.top_ids[:m, r]), list(result.top_logprobs[:m, r]))
            if s.params.stop:
                n, reason = self.append(s, toks, *(a.tolist() for a in cols), *tops)
                rest = None
            else:
                n, reason = self._take_all(s, toks)
                first = len(s.output_token_ids) - n
                lps, ranks = (a[:n].tolist() for a in cols)
                rest = (first, lps, ranks, tops[0][:n], tops[1][:n], reason is not None)
            kept += n
            if reason is not None:
                finish(s, *reason)
                s.request.metrics.finished_time = time.time()
            todo.append((s, rest))
        return todo, kept

    def render(self, todo: list) -> list[RequestOutput]:
        """The other half (`commit`): detokenises and records the log-probs of the committed
        tokens; returns the outputs of the requests that progressed (the finished ones leave
        ``requests``)."""
        progressed: dict[str, RequestState] = {}
        for s, rest in todo:
            if rest is not None:
                first, lps, ranks, top_ids, top_lps, final = rest
                so = s.request.outputs[s.index]
                ids = s.output_token_ids[first : first + len(lps)]
                for j, t in enumerate(ids):
                    self._show(s, so, t, lps[j], ranks[j], top_ids[j], top_lps[j])
                self._update_text(s, final=final)
            progressed[s.request_id] = s.request
        for req in progressed.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        return [self.make_output(req) for req in progressed.values()]

    def _take_all(self, s, tokens: list[int]) -> tuple[int, tuple | None]:
        """`append` without detokenising: the token ids alone."""
        self._stamp(s.request)
        reason = None
        kept = 0
        for t in tokens:
            reason = self._take(s, t)
            kept += 1
            if reason is not None:
                break
        self._end(s, reason)
        return kept, reason

    @staticmethod
    def _stamp(req: RequestState) -> None:
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now

    def _take(self, s, t: int) -> tuple | None:
        """Appends token ``t`` to ``s``; the finish it causes, if any (a stop id, EOS unless
        ignore_eos, both after min_tokens; max_tokens; max_model_len)."""
        s.output_token_ids.append(t)
        p, n_out = s.params, len(s.output_token_ids)
        if n_out >= p.min_tokens and t in (p.stop_token_ids or ()):
            return ("stop", t)
        if n_out >= p.min_tokens and not p.ignore_eos and t in self.eos_token_ids:
            return ("stop", None)
        if n_out >= s.max_tokens or s.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    @staticmethod
    def _end(s, reason) -> None:
        """A sequence that ended inside a decode loop computed no further than its tokens."""
        if reason is not None and s.num_computed > s.num_tokens:
            s.num_computed = s.num_tokens

    def _show(self, s, so: SequenceOutput, t: int, lp, rank, top_id, top_lp) -> str:
        """Records token ``t``'s log-probs (if asked) and detokenises it; the new text."""
        if so.logprobs is not None:
            so.cum_logprob += lp
            n = s.params.logprobs
            so.logprobs.append(
                make_logprobs_dict(t, lp, rank, top_id, top_lp, n, self.decode_token)
            )
        if so.detok is None:
            return ""
        before = so.detok.num_chars
        new = so.detok.add(t)
        self.chars_decoded += so.detok.num_chars - before
        return new

    @staticmethod
    def _find_stop(so: SequenceOutput, new: str, p: SamplingParams, longest: int) -> str | None:
        """The stop string that ends earliest in ``tail + new``, if any; sets ``stop_at``."""
        window = so.tail + new
        start = so.detok.num_chars - len(window)  # offset of the window in the whole text
        so.tail = window[-(longest - 1) :] if longest > 1 else ""
        best = None
        for st in p.stop:
            i = window.find(st)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, st)
        if best is None:
            return None
        so.stop_at = start + best[0] + (len(best[1]) if p.include_stop_str_in_output else 0)
        return best[1]

    def _update_text(self, s, final: bool) -> None:
        so = s.request.outputs[s.index]
        if so.detok is None:
            return
        if final and so.stop_at is None:
            # Once, in full: exactly what `tokenizer.decode` gives (a partial last character
            # included, which the stream holds back).
            so.text = self.tokenizer.decode(
                s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
            )
        else:
            so.text = so.detok.text
        if so.stop_at is not None:
            so.text = so.text[: so.stop_at]

    def record_prompt_logprobs(self, s, start: int, length: int, plp, off: int) -> None:
        """Adds the prompt log-probs of one prefill chunk (positions ``start:start+length``)
        of sequence 0, rows ``off:`` of ``plp``; completes ``prompt_logprobs`` at the end."""
        req: RequestState = s.request
        if s.index != 0:
            return
        if req.plp_partial is None or start == 0:
            req.plp_partial = [None]
        acc = req.plp_partial
        lps, ranks, top_ids, top_lps = plp
        k = s.params.prompt_logprobs
        n_prompt = len(s.prompt_token_ids)
        for j in range(length):
            pos = start + j
            if pos + 1 >= n_prompt:
                break
            i = off + j
            acc.append(
                make_logprobs_dict(
                    s.prompt_token_ids[pos + 1],
                    lps[i],
                    ranks[i],
                    top_ids[i],
                    top_lps[i],
                    k,
                    self.decode_token,
                )
            )
        if len(acc) == n_prompt:
            req.prompt_logprobs = acc

    @staticmethod
    def make_output(req: RequestState) -> RequestOutput:
        outs = []
        for s in req.seqs:
            so = req.outputs[s.index]
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=so.text,
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=so.cum_logprob,
                    logprobs=None if so.logprobs is None else list(so.logprobs),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            metrics=req.metrics,
            error=req.error,
        )
