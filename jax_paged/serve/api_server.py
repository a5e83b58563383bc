"""The OpenAI-compatible HTTP server (FastAPI) over an `AsyncLLM`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (each with
``stream``: server-sent events ending in ``data: [DONE]``), ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (Prometheus text, `ServerMetrics`).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (the message and ``param`` name the field), 401 for a missing or wrong API key when
one is set (the ``/v1`` routes, as vLLM), 404 for an unknown model, 500 when an engine step
failed the request (`jax_paged.serve.errors`). A client that goes away (mid-stream or while
waiting for a whole answer) aborts its request, whose blocks go back to the pool at the next
step. The routes check and submit requests here; `jax_paged.serve.responses` builds the bodies
and event streams from the outputs.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jax_paged.entrypoints.outputs import RequestOutput
from jax_paged.serve import responses
from jax_paged.serve.async_engine import AsyncLLM, EngineDeadError, RequestStream
from jax_paged.serve.errors import APIError, bad_request, validation_error
from jax_paged.serve.metrics import ServerMetrics
from jax_paged.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


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
        return validation_error(exc).response()

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
            gen = responses.stream_completion(streams, params.n, usage, state.names[0])
            return StreamingResponse(_closing(gen, streams), media_type="text/event-stream")
        finals = await state.collect(request, streams)
        return responses.completion_response(finals, params.n, state.names[0])

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
            gen = responses.stream_chat(
                streams[0], params.n, usage, body.logprobs, top, state.names[0]
            )
            return StreamingResponse(_closing(gen, streams), media_type="text/event-stream")
        finals = await state.collect(request, streams)
        return responses.chat_response(finals[0], body.logprobs, top, state.names[0])

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


class _Server:
    """What the routes share: the engine, the names, and the request helpers (the responses
    are built by `jax_paged.serve.responses`)."""

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


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
