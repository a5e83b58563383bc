"""The OpenAI-compatible server, end to end: `python -m jax_paged.serve` on 127.0.0.1 with a
tiny random chat model, driven by OpenAI's own client (and raw HTTP for what a client would not
send). Greedy and seeded outputs equal `LLM.generate` / `LLM.chat` offline; concurrent streams
each get their own tokens while batched; a client that leaves frees its blocks; bad requests get
400 / 404 naming the field; the API key is enforced; /metrics parses and moves."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jax_paged import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
NAME = "tiny"
ENGINE = dict(num_kv_blocks=256, max_num_seqs=32, max_model_len=512, max_n=8)


def load_bench_script():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "scripts/bench_serving.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, args: list[str], timeout: float = 240.0):
    """Starts ``python -m jax_paged.serve`` and waits for /health; returns (process, url)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jax_paged.serve", str(model_dir), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read().decode()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start: {proc.stdout.read().decode()[-3000:]}")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def engine_args(**kw) -> list[str]:
    out = []
    for k, v in {**ENGINE, **kw}.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return load_bench_script().write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = start_server(
        model_dir, [*engine_args(), "--served-model-name", NAME, "--api-key", KEY]
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    """The server's metric samples, by name (one model, so one sample per name)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model_name") == NAME and "le" not in s.labels:
                key = s.name if "finished_reason" not in s.labels else (
                    f"{s.name}[{s.labels['finished_reason']}]"
                )  # fmt: skip
                out[key] = s.value
    return out


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and the KV pool holds only evictable cache."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if idle and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.time() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.1)


PROMPTS = ["Hello, world", "The capital of France is", "1, 2, 3, 4,", "héllo wörld 日本"]
IDS = [[5, 6, 7, 8, 9], [100, 101, 102], [3] * 40]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]


# ---------------------------------------------------------------------------------------------
# Every endpoint, streaming and not, against the offline engine


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].max_model_len == 512
    assert httpx.get(server + "/health").status_code == 200


def _stream_completion(client, **kw):
    texts, finish, usage = {}, {}, None
    for chunk in client.completions.create(model=NAME, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_completions_greedy_equal_offline(client, offline):
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = offline.generate(PROMPTS + [{"prompt_token_ids": p} for p in IDS], sp)
    extra = {"ignore_eos": True}
    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
        )
        assert r.choices[0].text == ref[i].outputs[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == len(ref[i].prompt_token_ids)
        texts, finish, usage = _stream_completion(
            client,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body=extra,
            stream_options={"include_usage": True},
        )
        assert texts == {0: ref[i].outputs[0].text} and finish == {0: "length"}
        assert usage.completion_tokens == 12
    # Token-id prompts, several in one request: choices in prompt order.
    r = client.completions.create(
        model=NAME, prompt=IDS, max_tokens=12, temperature=0, extra_body=extra
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref[len(PROMPTS) :]]
    texts, _, _ = _stream_completion(
        client, prompt=IDS, max_tokens=12, temperature=0, extra_body=extra
    )
    assert texts == {i: o.outputs[0].text for i, o in enumerate(ref[len(PROMPTS) :])}


def test_completions_sampling_parameters_equal_offline(client, offline):
    """n, seed, top_p / top_k / min_p, penalties and min_tokens reach the engine as given."""
    kw = dict(
        n=3,
        temperature=0.9,
        top_p=0.8,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        max_tokens=10,
    )
    vllm_extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=2)
    sp = SamplingParams(**kw, **vllm_extra)
    ref = offline.generate(PROMPTS[1], sp)[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], extra_body=vllm_extra, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    got = {c.index: c.text for c in r.choices}
    assert got == {c.index: c.text for c in ref.outputs}
    assert len(set(got.values())) > 1  # the seeds differ per completion
    texts, finish, _ = _stream_completion(client, prompt=PROMPTS[1], extra_body=vllm_extra, **kw)
    assert texts == got and set(finish) == {0, 1, 2}


def test_stop_strings_and_stop_tokens(client, offline):
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = offline.generate(PROMPTS[2], sp)[0].outputs[0]
    stop = next(ch for ch in full.text[3:] if ch.isprintable() and ch != "\ufffd")
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == full.text[: full.text.index(stop)]
    assert c.model_extra["stop_reason"] == stop
    tok = full.token_ids[4]
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [tok]},
    )  # fmt: skip
    made = full.token_ids.index(tok) + 1  # the stop token is kept in the token count
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == made


def test_completion_logprobs_equal_offline(client, offline):
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    ref = offline.generate(PROMPTS[0], sp)[0].outputs[0]
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    want = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # top-2 plus the sampled token
    assert lp.text_offset[0] == 0
    texts, _, _ = _stream_completion(
        client, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert texts[0] == ref.text


def test_chat_equal_offline(client, offline):
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = offline.chat(CHAT, sp)[0]
    extra = {"ignore_eos": True}
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=16, temperature=0, extra_body=extra
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 16
    # max_completion_tokens is the newer name of max_tokens.
    r2 = client.chat.completions.create(
        model=NAME, messages=CHAT, max_completion_tokens=16, temperature=0, extra_body=extra
    )
    assert r2.choices[0].message.content == ref.outputs[0].text
    # The same prompt again: its full blocks come from the prefix cache.
    assert r2.usage.prompt_tokens_details.cached_tokens >= 16
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_logprobs_and_n(client, offline):
    sp = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    ref = offline.chat(CHAT, sp)[0].outputs[0]
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    want = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    tops = [c.top_logprobs[0].logprob for c in content]
    assert tops == pytest.approx(want, abs=1e-5)  # greedy: the sampled token is the top one
    # n = 2, streamed: both choices arrive, each with its own finish.
    seen, finish = {}, {}
    stream = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=5, temperature=1.0, seed=3, n=2, stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(seen) == {0, 1} and set(finish) == {0, 1}


def test_tokenize_and_detokenize(server, offline):
    h = {"Authorization": f"Bearer {KEY}"}
    tok = offline.tokenizer
    r = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[3]}, headers=h).json()
    assert r["tokens"] == tok.encode(PROMPTS[3]) and r["count"] == len(r["tokens"])
    r = httpx.post(server + "/tokenize", json={"messages": CHAT}).json()
    assert r["tokens"] == tok.apply_chat_template(CHAT, tokenize=True)
    r = httpx.post(server + "/detokenize", json={"tokens": tok.encode(PROMPTS[3])}).json()
    assert r["prompt"] == PROMPTS[3]


# ---------------------------------------------------------------------------------------------
# Concurrency, disconnects, bad requests, the key, the metrics


# The fast tier streams concurrently from several threads in test_serve_async.py.
@pytest.mark.slow
def test_32_concurrent_streams_each_get_their_own_tokens(server, offline):
    prompts = [[7 + i, 30 + 2 * i, 90 + i, 11, 12 + i % 5] for i in range(32)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = [
        o.outputs[0].text for o in offline.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ]
    assert len(set(ref)) > 16  # the prompts lead to different outputs
    before = metrics(server)

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        peak, done = [], asyncio.Event()

        async def watch():
            async with httpx.AsyncClient() as h:
                while not done.is_set():
                    text = (await h.get(server + "/metrics")).text
                    for fam in text_string_to_metric_families(text):
                        if fam.name == "vllm:num_requests_running":
                            peak.append(fam.samples[0].value)
                    await asyncio.sleep(0.02)

        async def one(p):
            text = ""
            stream = await client.completions.create(
                model=NAME, prompt=p, max_tokens=40, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                text += chunk.choices[0].text
            return text

        watcher = asyncio.ensure_future(watch())
        try:
            texts = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            done.set()
            await watcher
        await client.close()
        return texts, max(peak)

    texts, peak = asyncio.run(main())
    assert texts == ref
    assert peak > 1
    after = wait_idle(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 32 * 40
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 32 * 5
    success = "vllm:request_success_total[length]"
    assert after[success] - before.get(success, 0) == 32


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    body = {
        "model": NAME,
        "prompt": [5, 6, 7],
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    h = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", server + "/v1/completions", json=body, headers=h) as r,
    ):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break  # leaves the stream, closing the connection
    deadline = time.time() + 30
    while True:
        m = metrics(server)
        aborted = m["jax_paged:requests_aborted_total"] - before["jax_paged:requests_aborted_total"]
        if aborted == 1:
            break
        assert time.time() < deadline, f"the request was not aborted: {m}"
        time.sleep(0.05)
    after = wait_idle(server)
    made = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 1 <= made < 480


def _bad_requests(long_prompt: list[int]):
    """(route, body or raw text, expected status, the field the answer must name)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": NAME, "prompt": "hi", "max_tokens": 4}
    msg = [{"role": "user", "content": "hi"}]
    return [
        (c, '{"model": "tiny", "prompt": "hi",', 400, "JSON"),
        (c, {**ok, "temperature": "hot"}, 400, "temperature"),
        (c, {**ok, "temperature": -1}, 400, "temperature"),
        (c, {**ok, "top_p": 1.5}, 400, "top_p"),
        (c, {**ok, "top_k": 0}, 400, "top_k"),
        (c, {**ok, "min_p": 2.0}, 400, "min_p"),
        (c, {**ok, "n": 0}, 400, "n"),
        (c, {**ok, "n": 9}, 400, "n"),  # over --max-n 8
        (c, {**ok, "max_tokens": 0}, 400, "max_tokens"),
        (c, {**ok, "max_tokens": "4"}, 400, "max_tokens"),
        (c, {**ok, "model": "gpt-4"}, 404, "model"),
        (c, {**ok, "prompt": long_prompt}, 400, "prompt"),  # over max_model_len
        (c, {**ok, "prompt": ""}, 400, "prompt"),
        (c, {**ok, "prompt": [5, 999]}, 400, "prompt_token_ids"),
        (c, {"model": NAME, "max_tokens": 4}, 400, "prompt"),
        (c, {**ok, "logprobs": 21}, 400, "logprobs"),  # over max_logprobs 20
        (c, {**ok, "presence_penalty": 3}, 400, "presence_penalty"),
        (c, {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (c, {**ok, "seed": 1.5}, 400, "seed"),
        (c, {**ok, "stream": "yes"}, 400, "stream"),
        (c, {**ok, "echo": True}, 400, "echo"),
        (c, [1, 2, 3], 400, "body"),
        (ch, {"model": NAME, "messages": []}, 400, "messages"),
        (ch, {"model": NAME, "messages": "hi"}, 400, "messages"),
        (ch, {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            ch,
            {"model": NAME, "messages": msg, "top_logprobs": 30, "logprobs": True},
            400,
            "top_logprobs",
        ),  # fmt: skip
        (ch, {"model": NAME, "messages": msg, "top_logprobs": 2}, 400, "top_logprobs"),
        (ch, {"model": "nope", "messages": msg}, 404, "model"),
        (
            ch,
            {"model": NAME, "messages": msg, "frequency_penalty": -2.5},
            400,
            "frequency_penalty",
        ),  # fmt: skip
        ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ]


def test_bad_requests_get_400_naming_the_field_while_good_ones_complete(server):
    cases = _bad_requests([5] * 600)
    assert len(cases) >= 15
    h = {"Authorization": f"Bearer {KEY}"}

    async def main():
        async with httpx.AsyncClient(base_url=server, headers=h, timeout=120) as http:

            async def good(i):
                body = {"model": NAME, "prompt": [9, 8, 7 + i], "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                n = 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            n += json.loads(line[6:])["choices"][0]["text"] is not None
                        if line == "data: [DONE]":
                            return n
                return -1

            async def bad(route, body):
                if isinstance(body, str):
                    r = await http.post(
                        route, content=body, headers={"content-type": "application/json"}
                    )
                else:
                    r = await http.post(route, json=body)
                return r.status_code, r.json()

            goods = [asyncio.ensure_future(good(i)) for i in range(4)]
            answers = [await bad(route, body) for route, body, _, _ in cases]
            return answers, await asyncio.gather(*goods)

    answers, goods = asyncio.run(main())
    for (route, body, status, field), (got, js) in zip(cases, answers, strict=True):
        where = f"{route} {body!r}"
        assert got == status, f"{where}: {got} {js}"
        err = js["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, where
        assert field in err["message"] or field in (err["param"] or ""), f"{where}: {err}"
    assert all(n >= 1 for n in goods)
    assert httpx.get(server + "/health").status_code == 200  # still serving
    wait_idle(server)


def test_api_key(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server + "/v1/models").status_code == 401
    r = httpx.post(
        server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_parse_and_move(server, client):
    before = metrics(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[1] * 3, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    n_prompt = r.usage.prompt_tokens
    client.completions.create(model=NAME, prompt=PROMPTS[1] * 3, max_tokens=8, temperature=0)
    after = wait_idle(server)

    def moved(name):
        return after[name] - before[name]

    assert moved("vllm:prompt_tokens_total") == 2 * n_prompt
    assert moved("vllm:prefix_cache_queries_total") == 2 * n_prompt
    assert moved("vllm:prefix_cache_hits_total") >= 16  # the second found the first's blocks
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") >= 7
    assert moved("vllm:generation_tokens_total") >= 9
