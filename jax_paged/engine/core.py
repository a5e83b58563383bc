"""`EngineCore`: the step loop of one engine, one compiled call per step.

A step completes the call in flight, if any (`_complete`: wait, `Scheduler.update`, commit the
new tokens to their sequences), schedules and launches the next one, and renders the
committed tokens into `RequestOutput`s (detokenising). With ``async_scheduling`` the render
runs while the device runs the call just launched, and `step` returns with it in flight;
without, each step waits for its own call before rendering. Only an idle engine makes a call
of another kind (`runner.prepare`): to look up prompts that just arrived, and to free what
finished once nothing is left.

A step that raises fails its own requests: they finish with ``error`` set, the device state
is rebuilt empty and every other running sequence is preempted (it re-prefills later, its
output unchanged), so the engine keeps serving.
"""

from __future__ import annotations

import logging
import time
import traceback

from jax_paged.engine.sequence import Sequence, SequenceStatus
from jax_paged.entrypoints.outputs import RequestOutput

logger = logging.getLogger("jax_paged")


class EngineCore:
    """Runs the steps of one engine over its collaborators (an `LLMEngine` builds it).

    Args:
      config: the `EngineConfig`.
      scheduler, runner, output, metrics: the engine's `Scheduler`, `ModelRunner`,
        `OutputProcessor` and `EngineMetrics`.
      max_model_len: the engine's longest sequence.
      log: called every step with nothing; logs the engine's state now and then.
    """

    def __init__(self, config, scheduler, runner, output, metrics, max_model_len: int, log):
        self.config = config
        self.scheduler, self.runner, self.output, self.metrics = scheduler, runner, output, metrics
        self.max_model_len = max_model_len
        self.log = log
        self._step_seqs: list[Sequence] | None = None  # the sequences of the call in flight
        self._inflight = None  # (plan, wait) of a call launched and not yet completed

    @property
    def busy(self) -> bool:
        """Whether a sequence waits or runs, or a call is in flight."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def finish_seq(self, seq: Sequence, reason: str, stop_reason) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def abort_seqs(self, req) -> None:
        """Finishes every unfinished sequence of ``req`` with reason "abort"."""
        self.scheduler.drop_forks(req)  # siblings waiting for a fork are queued nowhere
        for s in req.seqs:
            if s.status is not SequenceStatus.FINISHED:
                self.finish_seq(s, "abort", None)

    def step(self, steps: int) -> list[RequestOutput]:
        """One step, decode calls capped at ``steps`` tokens per sequence; the outputs of the
        requests that progressed."""
        todo = []
        try:
            todo = self._complete()  # the call in flight, if one is
            self._bookkeeping()  # an idle engine looks new arrivals up first
            plan = self.scheduler.schedule(steps, self.max_model_len)
            if not plan.is_empty:
                self._launch(plan)
                if not self.config.async_scheduling:
                    todo += self._complete()
        except Exception as e:  # noqa: BLE001 - contained: see the module docstring
            return self._render(todo) + self._recover(e)
        outs = self._render(todo)  # with async scheduling, while the device runs the next call
        if not self.busy:
            # An idle engine holds no blocks. This call belongs to no request: if it raises,
            # the outputs above still go out and the state is rebuilt.
            self._step_seqs = None
            try:
                self._bookkeeping()
            except Exception as e:  # noqa: BLE001 - contained, as above
                outs += self._recover(e)
            self.runner.mark_idle()
        return outs

    def _bookkeeping(self) -> None:
        plan = self.scheduler.idle_plan()
        if plan is not None:
            t0 = time.perf_counter()
            result = self.runner.execute(plan)
            self.metrics.device_seconds += time.perf_counter() - t0
            self.scheduler.update(plan, result)

    def _launch(self, plan) -> None:
        """Starts ``plan``'s compiled call (`ModelRunner.dispatch`) without waiting for it."""
        self._step_seqs = [c.seq for c in plan.chunks]
        t0 = time.perf_counter()
        self._inflight = (plan, self.runner.dispatch(plan))
        self.metrics.device_seconds += time.perf_counter() - t0

    def _complete(self) -> list:
        """Waits for the step in flight; the scheduler learns its result and its sequences
        their new tokens (`OutputProcessor.commit`). Returns what is left to `_render`."""
        if self._inflight is None:
            return []
        plan, wait = self._inflight
        self._inflight = None
        t0 = time.perf_counter()
        result = wait()
        self.metrics.device_seconds += time.perf_counter() - t0
        self.scheduler.update(plan, result)
        self.metrics.on_step(plan, result, self.scheduler, self.config.enable_prefix_caching)
        todo, kept = self.output.commit(plan, result, self.finish_seq)
        self.metrics.add("generated_tokens", kept)
        self._step_seqs = None
        return todo

    def _render(self, todo) -> list[RequestOutput]:
        """Detokenises the committed tokens; the outputs of the requests that progressed."""
        outs = self.output.render(todo)
        self.metrics.add("num_finished", sum(o.finished for o in outs))
        self.log()
        return outs

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """Fails the requests of the step that raised, rebuilds the device state and puts every
        other running sequence back in the waiting queue (nothing of the old state is read)."""
        step_reqs = {id(q.request): q.request for q in self._step_seqs or []}.values()
        # Requests of the step still in flight (one that finished in it has been reported).
        failed = [r for r in step_reqs if r.request_id in self.output.requests and not r.finished]
        msg = f"engine step failed: {type(exc).__name__}: {exc}"
        n_other = sum(s.request not in failed for s in self.scheduler.running)
        note = f"failing {len(failed)} requests, re-prefilling {n_other} running sequences"
        logger.error("%s; %s, rebuilding the KV cache", msg, note, exc_info=exc)
        # The traceback's frames hold the old state's arrays: let them go before re-allocating.
        traceback.clear_frames(exc.__traceback__)
        self.metrics.add("num_step_failures")
        outs = []
        for req in failed:
            self.abort_seqs(req)
            self.metrics.add("num_failed")
            outs.append(self.output.fail(req, msg))
        self._inflight = None
        self.scheduler.reset()
        self.runner.reset()
        return outs
