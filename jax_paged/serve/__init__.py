"""Online serving: `AsyncLLM` (the engine behind an asyncio front) and an OpenAI-compatible
HTTP server (`jax-paged serve MODEL`, `jax_paged.serve.api_server`). Needs the ``serve``
extra (FastAPI, uvicorn, prometheus-client) for the server; `AsyncLLM` needs nothing more."""

from jax_paged.serve.async_engine import AsyncLLM, EngineDeadError, RequestStream

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]
