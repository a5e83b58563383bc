"""`AsyncLLM`: the engine behind an asyncio front, for servers and concurrent callers.

One background thread owns the engine and is the only code that touches it::

    callers (any thread / event loop)          engine thread
    ---------------------------------          -------------
    generate() -> ("add", ...)   --commands-->  apply adds / aborts (between steps)
    abort()    -> ("abort", rid) -->            engine.step(max_decode_steps=cap)
    async for out in generate()  <--queue----   each progressed request's RequestOutput
                                                goes to its own asyncio.Queue, through its
                                                caller's event loop (call_soon_threadsafe)

The engine is not thread-safe, so adds and aborts are commands the thread applies between
steps; a rejected request's `ValueError` (naming the field) comes back to its caller through a
future. A thread rather than an asyncio task in an executor: the step is a blocking device call
that releases the GIL, so the event loop keeps serving HTTP while it runs, and a dedicated thread
needs no hop through the loop to start the next step.

Admission latency: a request that arrives while a multi-step decode call runs waits for that
call to end. `AsyncLLM` caps each decode call at ``max_decode_wait_s`` of measured decode time
(the per-token step time is tracked as an exponential average), so a new request waits at most
about that long before its prefill is scheduled, whatever ``max_decode_steps`` is.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jax_paged.entrypoints.llm import LLM
from jax_paged.entrypoints.outputs import RequestOutput
from jax_paged.entrypoints.sampling_params import SamplingParams

logger = logging.getLogger("jax_paged")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (`AsyncLLM.shutdown`, or an error outside any step)."""


@dataclasses.dataclass
class _Stream:
    """Where the engine thread sends one request's outputs."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_tokens: int = 0  # tokens reported so far, all completions together
    longest: int = 0  # tokens of its longest completion so far
    last_time: float | None = None  # when the last tokens were reported


class RequestStream:
    """One request's outputs: ``async for out in stream`` yields its `RequestOutput` after
    every step that advanced it (cumulative text and tokens), the last one ``finished``.
    `close` (or leaving the loop through `AsyncLLM.generate`) aborts it if still running."""

    def __init__(self, owner: AsyncLLM, request_id: str, stream: _Stream):
        self.owner = owner
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    def __aiter__(self):
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._stream.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        """Aborts the request unless it has finished (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """An `LLM`'s engine stepped by a background thread; requests stream their outputs.

    Args:
      model: as `LLM` (an HF folder, a ``.gguf`` file, a checkpoint, None, a `LoadedModel`),
        or an `LLM` already built.
      dtype: as `LLM`.
      max_decode_wait_s: the longest a multi-step decode call may run (estimated from the
        measured time per decode step), so that a request arriving during one waits at most
        about this long; None leaves ``max_decode_steps`` alone.
      metrics: an observer with ``on_step([(output, new tokens, time of the previous
        tokens or None), ...], now)`` and ``on_engine(metrics dict)``
        (`jax_paged.serve.metrics.ServerMetrics`), or None.
      **engine_kwargs: `EngineConfig` fields, as `LLM`.

    Use ``async for out in llm.generate(prompt, params)``; each ``out`` is the request's
    `RequestOutput` so far (cumulative text and tokens), the last one ``finished``. Leaving the
    loop early (break, cancellation, a client that went away) aborts the request. Or
    ``stream = await llm.add_request(...)`` (rejections raise here) then ``async for`` over it.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        dtype: str = "float32",
        max_decode_wait_s: float | None = 0.05,
        metrics=None,
        **engine_kwargs,
    ):
        if max_decode_wait_s is not None and not max_decode_wait_s > 0:
            raise ValueError(f"max_decode_wait_s must be None or > 0, got {max_decode_wait_s!r}")
        self.llm = model if isinstance(model, LLM) else LLM(model, dtype=dtype, **engine_kwargs)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.max_decode_wait_s = max_decode_wait_s
        self.metrics = metrics
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._step_time: float | None = None  # EMA of seconds per decode step
        self._stopped = False
        self._dead: BaseException | None = None
        self.engine_metrics: dict[str, Any] = self.engine.get_metrics()
        self._thread = threading.Thread(target=self._run, name="jax-paged-engine", daemon=True)
        self._thread.start()

    # -- callers -----------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Adds a request; returns its `RequestStream` once the engine has accepted it.

        Raises ValueError (naming the field) if the engine rejects the request, and
        `EngineDeadError` if the engine thread is gone."""
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", rid, prompt, params, stream, added))
        try:
            await asyncio.shield(asyncio.wrap_future(added))
        except asyncio.CancelledError:
            self.abort(rid)  # cancelled while the engine thread adds it: do not leave it running
            raise
        return RequestStream(self, rid, stream)

    async def generate(
        self,
        prompt: str | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request`, then its outputs: yields the request's `RequestOutput` after every
        step that advanced it; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread (applied before the next step; unknown ids are
        ignored). Its blocks go back to the pool."""
        if not self._stopped:
            self._send(("abort", str(request_id)))

    def shutdown(self) -> None:
        """Stops the engine thread; waiting callers get `EngineDeadError`."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=60)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def _send(self, cmd: tuple) -> None:
        with self._cond:
            if self._dead is not None or self._stopped:
                raise EngineDeadError(f"the engine has stopped: {self._dead or 'shut down'}")
            self._commands.append(cmd)
            self._cond.notify()

    # -- the engine thread -------------------------------------------------------------------
    def decode_cap(self) -> int:
        """The most decode steps the next multi-step call may run (see the module docstring)."""
        most = self.engine.config.max_decode_steps
        if self.max_decode_wait_s is None or self._step_time is None:
            return most
        # At least 2: a decode call of one step is not a loop, and would stop the measuring.
        return max(min(2, most), min(most, int(self.max_decode_wait_s / self._step_time)))

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopped or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopped:
                        break
                    commands, self._commands = self._commands, collections.deque()
                aborted = False
                for cmd in commands:
                    aborted |= self._apply(cmd)
                # A step after an abort even when nothing else runs: it frees the blocks.
                if engine.has_unfinished_requests() or aborted:
                    self._step()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting caller
            logger.exception("the engine thread stopped")
            self._dead = e
        finally:
            self._close()

    def _close(self) -> None:
        """Ends every request still known (pending adds fail, streams get `EngineDeadError`,
        the engine's requests are aborted and their blocks freed), so the engine can be reused
        (e.g. by the `LLM` it came from)."""
        with self._cond:
            self._stopped = True
            pending, self._commands = list(self._commands), collections.deque()
        err = EngineDeadError(f"the engine has stopped: {self._dead or 'shut down'}")
        for cmd in pending:
            if cmd[0] == "add":
                cmd[5].set_exception(err)
        for rid, stream in self._streams.items():
            self.engine.abort(rid)
            _deliver(stream, err)
        self._streams.clear()
        if self._dead is None:
            try:
                self.engine.step()  # frees the aborted requests' blocks
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("the last step after shutdown failed")

    def _apply(self, cmd: tuple) -> bool:
        """Applies one command; True if it aborted a request."""
        if cmd[0] == "abort":
            if self._streams.pop(cmd[1], None) is not None:
                return self.engine.abort(cmd[1])
            return False
        _, rid, prompt, params, stream, added = cmd
        if rid in self._streams:
            added.set_exception(ValueError(f"request_id {rid!r} is already in use"))
            return False
        try:
            self.engine.add_request(rid, prompt, params)
        except Exception as e:  # noqa: BLE001 - the caller's error (ValueError names the field)
            added.set_exception(e)
            return False
        self._streams[rid] = stream
        added.set_result(None)
        return False

    def _step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step(max_decode_steps=self.decode_cap())
        dt = time.perf_counter() - t0
        now = time.time()
        progressed, most = [], 0
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its caller meanwhile
                continue
            made = sum(len(c.token_ids) for c in out.outputs)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            progressed.append((out, made - stream.num_tokens, stream.last_time))
            most = max(most, longest - stream.longest)
            stream.num_tokens, stream.longest, stream.last_time = made, longest, now
            if out.finished:
                del self._streams[out.request_id]
            _deliver(stream, out)
        lost = [rid for rid in self._streams if not self.engine.has_request(rid)]
        for rid in lost:  # never left waiting: a request the engine dropped without an output
            stream = self._streams.pop(rid)
            err = RuntimeError(f"the engine lost request {rid} without finishing it")
            _deliver(stream, err)
        if lost:
            logger.error("the engine lost %d requests: %s", len(lost), lost[:5])
        if most > 1:  # a multi-step decode call: dt / steps is the time of one decode step
            per = dt / most
            self._step_time = per if self._step_time is None else 0.8 * self._step_time + 0.2 * per
        self.engine_metrics = self.engine.get_metrics()
        if self.metrics is not None:
            self.metrics.on_step(progressed, now)
            self.metrics.on_engine(self.engine_metrics)


def _deliver(stream: _Stream, item) -> None:
    """Puts ``item`` in ``stream``'s queue through its event loop; a caller whose loop has
    closed is gone (its request is aborted when its stream is closed or at shutdown)."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the event loop is closed
        pass


__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]
