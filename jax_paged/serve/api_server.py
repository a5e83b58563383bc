"""The OpenAI-compatible HTTP server (FastAPI) over an `AsyncLLM`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (each with
``stream``: server-sent events ending in ``data: [DONE]``), ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (Prometheus text, `ServerMetrics`).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (the message and ``param`` name the field), 401 for a missing or wrong API key when
one is set (the ``/v1`` routes, as vLLM), 404 for an unknown model, 500 when an engine step
failed the request. A client that goes away (mid-stream or while waiting for a whole answer)
aborts its request, whose blocks go back to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jax_paged.entrypoints.outputs import RequestOutput
from jax_paged.serve.async_engine import AsyncLLM, EngineDeadError, RequestStream
from jax_paged.serve.metrics import ServerMetrics
from jax_paged.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
        }.get(status, "InternalServerError")

    def response(self) -> JSONResponse:
        return JSONResponse(
            _error_body(self.status, self.message, self.param, self.kind), self.status
        )


def _error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(e: Exception) -> APIError:
    """A request error from a `ValueError` whose message starts with the field's name."""
    message = str(e)
    m = _FIELD.match(message)
    return APIError(400, message, m.group(1) if m else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg', '')}", None)
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = "field required"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    where = f"{param}: " if param else "the request body: "
    return APIError(400, f"{where}{msg}{more}", param)


def build_app(
    llm: AsyncLLM,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    metrics: ServerMetrics | None = None,
    model_path: str = "",
) -> FastAPI:
    """The FastAPI app over ``llm``. The first of ``served_model_names`` is the name responses
    carry; requests may name any of them (or none). ``model_path``: what ``/v1/models`` gives
    as each model's ``root``."""
    app = FastAPI(title="jax-paged", docs_url=None, redoc_url=None)
    state = _Server(llm, served_model_names, api_key, metrics)
    state.model_path = model_path or served_model_names[0]
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {state.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return APIError(401, "invalid or missing API key", None).response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not llm.is_running:
            raise APIError(500, "the engine has stopped", None)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are off", None)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        now = int(state.started)
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "jax-paged",
                "root": state.model_path,
                "max_model_len": llm.max_model_len,
            }
            for name in served_model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except ValueError as e:
            raise bad_request(e) from None
        streams = await state.add_all(prompts, params, "cmpl")
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            gen = state.stream_completion(streams, params.n, usage)
            return StreamingResponse(_closing(gen, streams), media_type="text/event-stream")
        finals = await state.collect(request, streams)
        return state.completion_response(finals, params.n)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        try:
            params = body.sampling_params()
            ids = state.render_chat(body.messages, body.add_generation_prompt)
        except ValueError as e:
            raise bad_request(e) from None
        try:
            streams = await state.add_all([{"prompt_token_ids": ids}], params, "chatcmpl")
        except APIError as e:
            if e.param == "logprobs":  # the engine's name for what chat calls top_logprobs
                e.param, e.message = "top_logprobs", "top_" + e.message
            if e.param == "prompt":  # the rendered conversation
                e.param = "messages"
            raise
        top = body.top_logprobs or 0
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            gen = state.stream_chat(streams[0], params.n, usage, body.logprobs, top)
            return StreamingResponse(_closing(gen, streams), media_type="text/event-stream")
        finals = await state.collect(request, streams)
        return state.chat_response(finals[0], body.logprobs, top)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        tok = state.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        try:
            if body.messages is not None:
                ids = state.render_chat(body.messages, body.add_generation_prompt)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as e:
            raise bad_request(e) from None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        tok = state.need_tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"tokens: {bad[:5]} out of range; ids must be in [0, {tok.vocab_size})",
                "tokens",
            )
        return {"prompt": tok.decode(body.tokens)}

    return app


async def _closing(gen: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """``gen``, aborting every request of ``streams`` still running when it stops (a client
    that disconnects makes Starlette cancel the response, which lands here)."""
    try:
        async for chunk in gen:
            yield chunk
    finally:
        for s in streams:
            s.close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Server:
    """What the routes share: the engine, the names, and the OpenAI response builders."""

    def __init__(self, llm: AsyncLLM, names: list[str], api_key: str | None, metrics):
        self.llm, self.names, self.api_key, self.metrics = llm, names, api_key, metrics
        self.started = time.time()
        self.model_path = names[0]

    # -- requests ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def need_tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", None)
        return self.llm.tokenizer

    def render_chat(self, messages, add_generation_prompt: bool) -> list[int]:
        tok = self.need_tokenizer()
        if tok.chat_template is None:
            raise ValueError("messages: this model's tokenizer has no chat template")
        conv = [m.as_template_message() for m in messages]
        try:
            return tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error names the conversation
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e

    async def add_all(self, prompts, params, prefix: str) -> list[RequestStream]:
        """Adds one request per prompt (all or none: a rejected one aborts the others)."""
        base = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                streams.append(await self.llm.add_request(p, params, rid))
        except ValueError as e:
            for s in streams:
                s.close()
            field = "prompt" if len(prompts) == 1 else f"prompt[{len(streams)}]"
            err = bad_request(e)
            if err.message.startswith("prompt") and len(prompts) > 1:
                err.message, err.param = f"{field}: {err.message}", field
            raise err from None
        except EngineDeadError as e:
            for s in streams:
                s.close()
            raise APIError(500, str(e), None) from None
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream; aborts them all if the client goes away first."""

        async def last(s: RequestStream) -> RequestOutput:
            final = None
            async for out in s:
                final = out
            return final

        work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise APIError(499, "the client disconnected", None)
            finals = work.result()
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            for s in streams:
                s.close()
        for f in finals:
            if f.error is not None:
                raise APIError(500, f.error, None, "InternalServerError")
        return finals

    # -- responses ---------------------------------------------------------------------------
    def _usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        gen = sum(len(c.token_ids) for f in finals for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": gen,
            "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def completion_response(self, finals: list[RequestOutput], n: int) -> dict:
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
            "model": self.names[0],
            "choices": choices,
            "usage": self._usage(finals),
        }

    def chat_response(self, final: RequestOutput, logprobs: bool, top: int) -> dict:
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
            "model": self.names[0],
            "choices": choices,
            "usage": self._usage([final]),
        }

    async def stream_completion(
        self, streams: list[RequestStream], n: int, include_usage: bool
    ) -> AsyncIterator[str]:
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
                yield _sse(_error_body(500, out.error, None, "InternalServerError"))
                return
            if choices:
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.names[0],
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
                    "model": self.names[0],
                    "choices": [],
                    "usage": self._usage(ordered),
                }
            )
        yield "data: [DONE]\n\n"

    async def stream_chat(
        self, stream: RequestStream, n: int, include_usage: bool, logprobs: bool, top: int
    ) -> AsyncIterator[str]:
        rid, created = _public_id(stream.request_id), int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created}
        base["model"] = self.names[0]

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
                yield _sse(_error_body(500, out.error, None, "InternalServerError"))
                return
            if choices:
                yield chunk(choices)
            final = out
        if include_usage and final is not None:
            yield chunk([], self._usage([final]))
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


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
