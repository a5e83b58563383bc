"""`AsyncLLM` in process: streams from several event loops and threads, aborts, admission while
a multi-step decode call runs (its length capped), a failed engine step failing only its own
requests (also through the HTTP app), and the engine switching to penalty tracking mid-run."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from test_serve import load_bench_script  # noqa: E402

from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.serve import AsyncLLM  # noqa: E402
from jax_paged.serve.api_server import build_app  # noqa: E402
from jax_paged.serve.metrics import ServerMetrics  # noqa: E402

ENGINE = dict(num_kv_blocks=128, max_num_seqs=8, max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return load_bench_script().write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_async"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture
def llm(offline):
    """An `AsyncLLM` over the offline LLM's engine (its compiled programs are reused)."""
    a = AsyncLLM(offline, max_decode_wait_s=None)
    yield a
    a.shutdown()
    assert not offline.engine.has_unfinished_requests()


def _ids(*ids):
    return {"prompt_token_ids": list(ids)}


async def _collect(llm, prompt, params):
    outs = [out async for out in llm.generate(prompt, params)]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs[-1]


def test_streams_from_several_threads_equal_offline(llm, offline):
    prompts = [_ids(5, 6, 7), _ids(9, 10, 11, 12), _ids(40, 41), _ids(100, 3, 3, 3, 3)]
    ref = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    got = [None] * 4

    def worker(i):  # each thread runs its own event loop
        got[i] = asyncio.run(_collect(llm, prompts[i], GREEDY)).outputs[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == ref


def test_rejected_request_raises_naming_the_field(llm):
    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await llm.add_request(_ids(5, 100000), GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            a = await llm.add_request(
                _ids(5, 6), SamplingParams(max_tokens=200, ignore_eos=True), "x"
            )
            try:
                await llm.add_request(_ids(5, 6), GREEDY, "x")
            finally:
                a.close()
        return await _collect(llm, _ids(5, 6, 7), GREEDY)  # still serving

    assert len(asyncio.run(main()).outputs[0].token_ids) == 12


def test_leaving_a_stream_aborts_it_and_frees_its_blocks(llm, offline):
    engine = offline.engine
    aborted = engine.get_metrics()["num_aborted"]

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        n = 0
        async for _out in llm.generate(_ids(5, 6, 7), params):
            n += 1
            if n == 2:
                break
        for _ in range(200):  # the engine thread applies the abort, then frees on a step
            m = llm.engine_metrics
            if m["num_aborted"] == aborted + 1 and m["kv_usage"] == 0 and m["num_running"] == 0:
                return m
            await asyncio.sleep(0.01)
        raise AssertionError(f"not aborted: {llm.engine_metrics}")

    made = engine.get_metrics()["generated_tokens"]
    m = asyncio.run(main())
    assert m["generated_tokens"] - made < 400


def test_request_arriving_mid_decode_waits_for_one_capped_call(offline):
    """A long request decodes in multi-step calls; one that arrives meanwhile gets its first
    token after the call in flight and its own prefill step, and every call is capped at about
    max_decode_wait_s of measured decode time."""
    engine = offline.engine
    wait = 0.004
    llm = AsyncLLM(offline, max_decode_wait_s=wait)
    ks, real_step = [], engine.step
    estimates = []  # the per-step time estimate each call's cap was computed from

    def step(*, max_decode_steps=None):
        ks.append(max_decode_steps)
        estimates.append(llm._step_time)
        return real_step(max_decode_steps=max_decode_steps)

    engine.step = step
    try:

        async def main():
            long = await llm.add_request(
                _ids(5, 6, 7), SamplingParams(max_tokens=300, ignore_eos=True)
            )
            it = aiter(long)
            for _ in range(6):  # decoding in multi-step calls by now
                await anext(it)
            before = len(ks)
            first = await _first_output(llm, _ids(8, 9, 10))
            steps_waited = len(ks) - before
            long.close()
            return first, steps_waited

        first, steps_waited = asyncio.run(main())
    finally:
        engine.step = real_step
        llm.shutdown()
    assert len(first.outputs[0].token_ids) == 1
    assert steps_waited <= 3  # the call in flight, the admission step (and one more at most)
    # The estimate moves after every call: each call is checked against the one it was given.
    assert estimates[-1] is not None
    for k, per_step in zip(ks, estimates, strict=True):
        if per_step is not None:
            assert k <= min(32, max(2, int(wait / per_step)))
    assert all(k <= 32 for k in ks)


async def _first_output(llm, prompt):
    stream = await llm.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    try:
        async for out in stream:
            return out
    finally:
        stream.close()


def test_decode_cap_follows_the_measured_step_time(offline):
    llm = AsyncLLM(offline, max_decode_wait_s=0.05)
    try:
        assert llm.decode_cap() == 32  # nothing measured yet
        llm._step_time = 0.01
        assert llm.decode_cap() == 5
        llm._step_time = 1.0
        assert llm.decode_cap() == 2  # never below 2, so the loop keeps being measured
        llm._step_time = 1e-6
        assert llm.decode_cap() == 32
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_decode_wait_s"):
        AsyncLLM(offline, max_decode_wait_s=0)


def test_penalties_after_plain_requests(llm, offline):
    """A request with penalties after others without: the engine switches its sampling state
    to token tracking, and the idle engine's bookkeeping call compiles for the new state."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True)

    async def main():
        a = await _collect(llm, _ids(5, 6, 7), GREEDY)
        b = await _collect(llm, _ids(5, 6, 7), sp)
        return a, b

    failures = offline.engine.get_metrics()["num_step_failures"]
    a, b = asyncio.run(main())
    assert a.error is None and b.error is None
    assert offline.engine.get_metrics()["num_step_failures"] == failures
    ref = LLM(offline.engine.loaded, **ENGINE)  # tracks tokens from its first request
    assert b.outputs[0].token_ids == ref.generate(_ids(5, 6, 7), sp)[0].outputs[0].token_ids


def _inject_fault(monkeypatch, engine, kind: str):
    """The next compiled call of ``kind`` runs, then raises (as a device fault would)."""
    real = engine.runner.wait  # every compiled call ends there
    fired = []

    def wait(launched):
        out = real(launched)
        if launched.kind == kind and not fired:
            fired.append(1)
            raise RuntimeError(f"injected fault in {kind}")
        return out

    monkeypatch.setattr(engine.runner, "wait", wait)
    return fired


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_step_fails_only_its_own_requests_over_http(offline, monkeypatch):
    """Ten requests arrive together; a fault hits the first step that runs: its requests get
    HTTP 500 in OpenAI's shape, the others (still waiting) finish with their offline outputs,
    and the server keeps serving."""
    metrics = ServerMetrics("tiny")
    llm = AsyncLLM(offline, max_decode_wait_s=None, metrics=metrics)
    app = build_app(llm, served_model_names=["tiny"], metrics=metrics)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(10)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].text for o in offline.generate([_ids(*p) for p in prompts], sp)]
    try:
        while not server.started:
            time.sleep(0.05)
        fired = _inject_fault(monkeypatch, offline.engine, "mixed")

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                bodies = [
                    {"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                    for p in prompts
                ]
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

        answers = asyncio.run(main())
        assert fired
        monkeypatch.undo()
        failed = [r for r in answers if r.status_code == 500]
        assert 1 <= len(failed) < len(answers)
        for r in failed:
            err = r.json()["error"]
            assert "injected fault in mixed" in err["message"] and err["code"] == 500
        for r, want in zip(answers, ref, strict=True):
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == want
        again = httpx.post(url + "/v1/completions", json={"prompt": [8, 9], "max_tokens": 3})
        assert again.status_code == 200
        assert llm.engine_metrics["num_step_failures"] >= 1
        assert httpx.get(url + "/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()


def test_fault_in_the_idle_cleanup_keeps_the_finished_outputs(offline, monkeypatch):
    """The call that frees a finished request's blocks once the engine is idle belongs to no
    request: if it raises, the outputs of the step that finished them still come back (they
    were lost, and a caller waited for them forever), and the state is rebuilt."""
    engine = offline.engine
    real = engine.runner.wait
    kinds = []

    def count(launched):
        kinds.append(launched.kind)
        return real(launched)

    monkeypatch.setattr(engine.runner, "wait", count)
    ref = offline.generate(_ids(5, 6, 7), GREEDY)[0].outputs[0].token_ids
    monkeypatch.undo()
    assert kinds[-1] == "prepare"  # the idle cleanup is the run's last call
    failures = engine.get_metrics()["num_step_failures"]
    seen = []

    def fail_last(launched):
        out = real(launched)
        seen.append(launched.kind)
        if len(seen) == len(kinds):
            raise RuntimeError("injected fault in the idle cleanup")
        return out

    monkeypatch.setattr(engine.runner, "wait", fail_last)
    out = offline.generate(_ids(5, 6, 7), GREEDY)[0]
    monkeypatch.undo()
    assert out.error is None and out.outputs[0].token_ids == ref
    assert engine.get_metrics()["num_step_failures"] == failures + 1
    assert offline.generate(_ids(5, 6, 7), GREEDY)[0].outputs[0].token_ids == ref


def test_client_leaving_a_non_streamed_request_aborts_it(offline, monkeypatch):
    """A client that gives up on a whole (non-streamed) answer: the server notices the
    disconnect, aborts the request and frees its blocks."""
    metrics = ServerMetrics("tiny")
    llm = AsyncLLM(offline, max_decode_wait_s=None, metrics=metrics)
    real_step = offline.engine.step

    def slow_step(**kw):  # about 50 ms a step: the request outlives the client's patience
        time.sleep(0.05)
        return real_step(**kw)

    monkeypatch.setattr(offline.engine, "step", slow_step)
    app = build_app(llm, served_model_names=["tiny"], metrics=metrics)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        aborted = llm.engine_metrics["num_aborted"]
        made = llm.engine_metrics["generated_tokens"]
        body = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.time() + 20
        while True:
            m = llm.engine_metrics
            if m["num_aborted"] == aborted + 1 and m["num_running"] == 0 and m["kv_usage"] == 0:
                break
            assert time.time() < deadline, f"not aborted: {m}"
            time.sleep(0.02)
        assert m["generated_tokens"] - made < 480
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()
