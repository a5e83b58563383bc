"""OpenAI response bodies, and their server-sent-event streams, built from `RequestOutput`s.

Non-streamed: `completion_response` (``text_completion``) and `chat_response`
(``chat.completion``). Streamed (``data: {...}`` events ending in ``data: [DONE]``):
`stream_completion` and `stream_chat`, each chunk carrying only what is new since the last
(text past the characters sent, log-probabilities past the tokens sent). ``model`` is the name
every response carries.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from jax_paged.entrypoints.outputs import RequestOutput
from jax_paged.serve.async_engine import RequestStream
from jax_paged.serve.errors import error_body


def _usage(finals: list[RequestOutput]) -> dict:
    """The ``usage`` object of finished requests (cached prompt tokens included)."""
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    gen = sum(len(c.token_ids) for f in finals for c in f.outputs)
    cached = sum(f.num_cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": gen,
        "total_tokens": prompt + gen,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(finals: list[RequestOutput], n: int, model: str) -> dict:
    """The ``text_completion`` body for the final outputs of a request's prompts (``n``
    choices each)."""
    choices = []
    for i, f in enumerate(finals):
        for c in f.outputs:
            choices.append(
                {
                    "index": i * n + c.index,
                    "text": c.text,
                    "logprobs": _completion_logprobs(c.logprobs, c.token_ids, 0, 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": _public_id(finals[0].request_id),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(finals),
    }


def chat_response(final: RequestOutput, logprobs: bool, top: int, model: str) -> dict:
    """The ``chat.completion`` body for a chat request's final output."""
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(c.logprobs, c.token_ids, 0, top) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in final.outputs
    ]
    return {
        "id": _public_id(final.request_id),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage([final]),
    }


async def stream_completion(
    streams: list[RequestStream], n: int, include_usage: bool, model: str
) -> AsyncIterator[str]:
    """The ``text_completion`` chunks of a request's prompts as server-sent events, then
    ``data: [DONE]`` (an error chunk instead when an engine step fails the request)."""
    rid, created = _public_id(streams[0].request_id), int(time.time())
    seen: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, index) -> (chars, tokens)
    finals: dict[int, RequestOutput] = {}
    async for i, out in _merge(streams):
        choices = []
        for c in out.outputs:
            chars, toks = seen.get((i, c.index), (0, 0))
            if _nothing_new(c, chars, toks):
                continue
            lps = _completion_logprobs(c.logprobs, c.token_ids, toks, chars)
            seen[(i, c.index)] = (len(c.text), len(c.token_ids))
            choices.append(
                {
                    "index": i * n + c.index,
                    "text": c.text[chars:],
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        if out.finished:
            finals[i] = out
        if out.error is not None:
            yield _sse(error_body(500, out.error, None, "InternalServerError"))
            return
        if choices:
            chunk = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
    if include_usage:
        ordered = [finals[i] for i in sorted(finals)]
        yield _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(ordered),
            }
        )
    yield "data: [DONE]\n\n"


async def stream_chat(
    stream: RequestStream, n: int, include_usage: bool, logprobs: bool, top: int, model: str
) -> AsyncIterator[str]:
    """The ``chat.completion.chunk`` events of a chat request: the role first, then the
    deltas, then ``data: [DONE]``."""
    rid, created = _public_id(stream.request_id), int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created}
    base["model"] = model

    def chunk(choices, usage=False):
        out = {**base, "choices": choices}
        if include_usage:
            out["usage"] = usage or None
        return _sse(out)

    # The role first, one chunk per choice, as OpenAI and vLLM send it.
    yield chunk(
        [
            {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for j in range(n)
        ]
    )
    seen: dict[int, tuple[int, int]] = {}
    final = None
    async for out in stream:
        choices = []
        for c in out.outputs:
            chars, toks = seen.get(c.index, (0, 0))
            if _nothing_new(c, chars, toks):
                continue
            seen[c.index] = (len(c.text), len(c.token_ids))
            choices.append(
                {
                    "index": c.index,
                    "delta": {"content": c.text[chars:]},
                    "logprobs": _chat_logprobs(c.logprobs, c.token_ids, toks, top)
                    if logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        if out.error is not None:
            yield _sse(error_body(500, out.error, None, "InternalServerError"))
            return
        if choices:
            yield chunk(choices)
        final = out
    if include_usage and final is not None:
        yield chunk([], _usage([final]))
    yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _nothing_new(c, chars: int, toks: int) -> bool:
    """Whether completion ``c`` has nothing to stream past ``chars`` characters and ``toks``
    tokens: no text (tokens that do not form a whole character yet count only when their
    log-probabilities were asked for) and no finish."""
    if c.finish_reason is not None or len(c.text) > chars:
        return False
    return c.logprobs is None or len(c.token_ids) == toks


def _public_id(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0] if request_id.count("-") > 1 else request_id


def _token_text(lp_dict, token_id: int) -> str:
    lp = lp_dict.get(token_id) if lp_dict else None
    return (lp.decoded_token if lp is not None else None) or ""


def _completion_logprobs(logprobs, token_ids, start: int, offset: int) -> dict | None:
    """The legacy completions ``logprobs`` object for tokens ``start:`` (text offsets from
    ``offset``, the characters already sent)."""
    if logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for d, t in zip(logprobs[start:], token_ids[start:], strict=False):
        text = _token_text(d, t)
        tokens.append(text)
        token_lps.append(d[t].logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in d.values()})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_logprobs(logprobs, token_ids, start: int, top: int) -> dict | None:
    """The chat ``logprobs`` object (``content``: one entry per token) for tokens ``start:``."""
    if logprobs is None:
        return None
    content = []
    for d, t in zip(logprobs[start:], token_ids[start:], strict=False):
        text = _token_text(d, t)
        ranked = sorted(
            (lp.rank, lp.decoded_token or "", lp.logprob)
            for lp in d.values()
            if lp.rank is not None and lp.rank <= top
        )[:top]
        content.append(
            {
                "token": text,
                "logprob": d[t].logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
                    for _, s, v in ranked
                ],
            }
        )
    return {"content": content}
