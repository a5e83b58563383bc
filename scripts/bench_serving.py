"""Online serving benchmark: Poisson arrivals against an OpenAI-compatible server over HTTP.

Reports what `vllm bench serve` reports, in its JSON keys: request throughput, output and
total token throughput, and mean / median / p90 / p99 of TTFT (time to first token), TPOT
(time per output token after the first), ITL (gaps between streamed chunks) and E2EL
(end-to-end latency), in milliseconds.

    # against a running server (jax-paged serve, vllm serve, ...)
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model NAME \\
        --request-rate 1,2,4,inf --num-prompts 64 --input-len 128 --output-len 128

    # smoke run: writes a tiny random model, starts `jax-paged serve` on it, drives it (CI)
    python scripts/bench_serving.py --quick

    # head to head: start `jax-paged serve` and then `vllm serve` (VLLM_BIN) on one HF folder,
    # drive each with the same request stream, one after the other
    python scripts/bench_serving.py --head-to-head --model-path DIR --vllm-bin V/bin/vllm

Prompts are token ids (``--dataset random``: uniform lengths in [L(1-r), L(1+r)], as vLLM's
random data set) sent to ``/v1/completions`` with ``stream``, ``ignore_eos`` and
``max_tokens``, so both servers see identical inputs and make identical numbers of tokens;
``--shared-prefix-len`` starts every prompt with the same tokens (a shared system prompt).
A request's tokens are counted from the server's streamed ``usage`` (``include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_support import run_metadata
from bench_support.vllm_peer import export_hf_folder, vllm_env

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# A tiny model with a tokenizer and a chat template (for --quick and the server's tests)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_chat_model(directory: str | Path, *, seed: int = 0) -> Path:
    """Writes a random 2-layer Llama (vocab 272: 256 byte tokens, ``<|im_start|>`` 256,
    ``<|im_end|>`` 257 = EOS, the rest unused) with a byte-level tokenizer and a ChatML
    template, as a jax-paged checkpoint that `models.load` (and so `jax-paged serve`) reads."""
    import jax.numpy as jnp
    import tokenizers
    from flax import nnx
    from tokenizers import AddedToken

    import models

    directory = Path(directory)
    alphabet = models.tokenizer.byte_level_alphabet()
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    tok = models.Tokenizer(backend, chat_template=CHATML, eos_token="<|im_end|>")
    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    model = models.Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    loaded = models.LoadedModel(
        model=model,
        tokenizer=tok,
        config=cfg,
        generation_config=models.GenerationConfig(eos_token_ids=[257]),
        source="tiny random chat model (scripts/bench_serving.py)",
    )
    models.save_checkpoint(loaded, directory)
    return directory


# ----------------------------------------------------------------------------------------------
# The request stream and the client


def make_prompts(
    n: int,
    input_len: int,
    range_ratio: float,
    vocab: tuple[int, int],
    shared_prefix_len: int,
    seed: int,
) -> list[list[int]]:
    """``n`` token-id prompts: lengths uniform in [L(1-r), L(1+r)] (vLLM's random data set),
    ids uniform in ``vocab`` = [lo, hi); with ``shared_prefix_len`` the first that many ids are
    the same for every prompt (counted in the length)."""
    rng = np.random.default_rng(seed)
    lo_len = max(1, int(input_len * (1 - range_ratio)))
    hi_len = max(lo_len, int(input_len * (1 + range_ratio)))
    prefix = rng.integers(vocab[0], vocab[1], shared_prefix_len).tolist()
    out = []
    for _ in range(n):
        length = int(rng.integers(lo_len, hi_len + 1))
        rest = rng.integers(vocab[0], vocab[1], max(1, length - shared_prefix_len)).tolist()
        out.append(prefix + rest)
    return out


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at ``rate``
    requests per second (exponential gaps), or all at once for ``inf``."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps).tolist()


async def _one_request(http, url: str, body: dict, start: float) -> dict:
    """Sends one streaming completion; returns its timings (seconds) and token counts."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    t0 = time.perf_counter()
    ttft, itl, last, output_len, ok, error = None, [], t0, None, False, ""
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        ok = True
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    if chunk.get("choices"):
                        if ttft is None:
                            ttft = now - t0
                        else:
                            itl.append(now - last)
                        last = now
                    elif chunk.get("usage"):
                        output_len = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        error = f"{type(e).__name__}: {e}"
    latency = time.perf_counter() - t0
    return dict(
        ok=ok and ttft is not None and output_len is not None,
        ttft=ttft,
        itl=itl,
        latency=latency,
        output_len=output_len or 0,
        prompt_len=len(body["prompt"]),
        error=error,
    )


async def run_load(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    *,
    seed: int = 0,
    api_key: str | None = None,
    max_concurrency: int | None = None,
) -> dict:
    """Sends ``prompts`` at ``rate`` (Poisson) to ``base_url``/v1/completions, each asking for
    exactly ``output_len`` tokens; returns `vllm bench serve`'s metrics."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=60)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        begin = time.perf_counter()
        starts = [begin + t for t in arrival_times(len(prompts), rate, seed)]

        async def one(p, start):
            body = {
                "model": model,
                "prompt": p,
                "max_tokens": output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if gate is None:
                return await _one_request(http, url, body, start)
            async with gate:
                return await _one_request(http, url, body, start)

        results = await asyncio.gather(*(one(p, s) for p, s in zip(prompts, starts, strict=True)))
        duration = time.perf_counter() - begin
    return summarize(results, duration, rate, max_concurrency)


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, float) * 1000 if values_s else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p90_{name}_ms": float(np.percentile(ms, 90)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(results: list[dict], duration: float, rate: float, max_concurrency) -> dict:
    """`vllm bench serve`'s result keys from per-request timings."""
    done = [r for r in results if r["ok"]]
    tpots = [
        (r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in done if r["output_len"] > 1
    ]
    out_tokens = sum(r["output_len"] for r in done)
    in_tokens = sum(r["prompt_len"] for r in done)
    summary = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    summary.update(_stats("ttft", [r["ttft"] for r in done]))
    summary.update(_stats("tpot", tpots))
    summary.update(_stats("itl", [x for r in done for x in r["itl"]]))
    summary.update(_stats("e2el", [r["latency"] for r in done]))
    return summary


# ----------------------------------------------------------------------------------------------
# Servers started by this script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process started with ``cmd`` (its port appended), stopped on exit; waits for
    ``/health``. Its output goes to ``log``."""

    def __init__(self, cmd: list[str], *, env=None, log: Path, timeout: float = 900.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*cmd, "--port", str(self.port)]
        self.env, self.log, self.timeout = env, log, timeout

    def __enter__(self) -> Server:
        import httpx

        self._log = open(self.log, "w")  # noqa: SIM115 - closed in __exit__
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}):\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > self.timeout:
                self.__exit__()
                raise RuntimeError(f"{self.cmd} did not answer /health in {self.timeout} s")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def jax_paged_cmd(model: str, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "jax_paged.serve", model, "--served-model-name", name, *extra]


def vllm_cmd(vllm_bin: str, model: str, name: str, extra: list[str]) -> list[str]:
    return [vllm_bin, "serve", model, "--served-model-name", name, "--dtype", "float32", *extra]


def run_vllm_bench(url: str, name: str, args, workload: str, rate: float, run: int) -> dict:
    """One run of `vllm bench serve` itself as the client (random data set, the same lengths,
    ``--ignore-eos``); returns its result JSON with ``workload`` added."""
    out_dir = Path(tempfile.mkdtemp(prefix="vllm_bench_"))
    prefix = args.shared_prefix_len if workload == "shared_prefix" else 0
    cmd = [
        args.vllm_bin, "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", name, "--tokenizer", args.model_path,
        "--dataset-name", "random", "--random-input-len", str(args.input_len - prefix),
        "--random-output-len", str(args.output_len), "--random-prefix-len", str(prefix),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
        "--request-rate", "inf" if math.isinf(rate) else str(rate), "--ignore-eos",
        "--seed", str(args.seed * 1000 + 10 * (run + 1) + (workload == "shared_prefix")),
        "--save-result", "--result-dir", str(out_dir), "--result-filename", "result.json",
    ]  # fmt: skip
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    proc = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    result = json.loads((out_dir / "result.json").read_text())
    keep = {k: v for k, v in result.items() if not isinstance(v, list)}  # per-request lists
    keep["workload"] = workload
    keep["client"] = "vllm bench serve"
    return keep


def run_rates(url: str, name: str, args) -> list[dict]:
    """Each workload at each rate against ``url``, after a warm-up at the largest batch.

    Every run gets prompts of its own (seeded by workload and rate, the same for every
    server), so a run does not find the previous run's prompts in the prefix cache."""
    runs = []
    warm = workload_prompts(args, "random", -1)
    asyncio.run(run_load(url, name, warm, args.output_len, math.inf))
    for workload in args.workloads:
        for i, rate in enumerate(args.rates):
            if args.client == "vllm":
                r = run_vllm_bench(url, name, args, workload, rate, i)
                runs.append(r)
                print(f"{workload} rate={rate}: {json.dumps(r)[:300]}", file=sys.stderr)
                continue
            prompts = workload_prompts(args, workload, i)
            r = asyncio.run(
                run_load(
                    url,
                    name,
                    prompts,
                    args.output_len,
                    rate,
                    seed=args.seed + i,
                    max_concurrency=args.max_concurrency,
                )
            )
            r["workload"] = workload
            runs.append(r)
            print(
                f"{workload} rate={r['request_rate']}: {r['request_throughput']:.2f} req/s, "
                f"{r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                f"TPOT p50 {r['median_tpot_ms']:.1f} ms, failed {r['failed']}",
                file=sys.stderr,
            )
    return runs


def workload_prompts(args, workload: str, run: int) -> list[list[int]]:
    """The prompts of run ``run`` (-1: the warm-up) of ``workload``."""
    prefix = args.shared_prefix_len if workload == "shared_prefix" else 0
    seed = args.seed * 1000 + 10 * (run + 1) + (workload == "shared_prefix")
    return make_prompts(
        args.num_prompts, args.input_len, args.range_ratio, args.vocab, prefix, seed
    )


def _rates(text: str) -> list[float]:
    return [math.inf if x.strip() in ("inf", "all") else float(x) for x in text.split(",")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server (else one is started)")
    ap.add_argument("--model", default="model", help="the served model name requests use")
    ap.add_argument("--model-path", default=None, help="model folder for servers started here")
    ap.add_argument("--request-rate", default="1,2,4,inf", help="req/s list; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="also run a workload whose prompts share this many leading tokens",
    )
    ap.add_argument("--vocab-range", default="100,10000", help="token ids are drawn from [lo, hi)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-to-head", action="store_true", help="jax-paged serve, then vllm serve")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start and measure each server this many times, alternating (A B, B A, ...)",
    )
    ap.add_argument("--vllm-bin", default=os.environ.get("VLLM_BIN", "vllm"))
    ap.add_argument("--server-args", default="", help="extra options for jax-paged serve")
    ap.add_argument("--vllm-args", default="", help="extra options for vllm serve")
    ap.add_argument(
        "--client",
        default="ours",
        choices=["ours", "vllm"],
        help="the load generator: this script's, or `vllm bench serve` (--vllm-bin; needs "
        "--model-path for the tokenizer)",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny random model, a few requests")
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    if args.quick:
        args.model_path = str(write_tiny_chat_model(tmp / "tiny"))
        args.model, args.num_prompts, args.input_len, args.output_len = "tiny", 16, 32, 16
        args.request_rate, args.vocab_range = "inf,20", "3,256"
        # Small engine limits: the server compiles every step variant they allow at start-up.
        args.server_args = args.server_args or (
            "--num-kv-blocks 256 --max-num-seqs 16 --max-num-batched-tokens 64"
        )
        if not args.shared_prefix_len:
            args.shared_prefix_len = 16
    args.rates = _rates(args.request_rate)
    lo, hi = (int(x) for x in args.vocab_range.split(","))
    args.vocab = (lo, hi)
    args.workloads = ["random"] + (["shared_prefix"] if args.shared_prefix_len else [])
    config = {
        k: getattr(args, k)
        for k in (
            "model",
            "model_path",
            "request_rate",
            "num_prompts",
            "input_len",
            "output_len",
            "range_ratio",
            "shared_prefix_len",
            "vocab_range",
            "max_concurrency",
            "seed",
            "server_args",
            "vllm_args",
            "client",
            "rounds",
        )
    }
    result: dict = {"benchmark": "serving", "config": config, "servers": {}}
    if args.base_url:
        result["servers"]["given"] = {"runs": run_rates(args.base_url, args.model, args)}
    else:
        if not args.model_path:
            ap.error("give --base-url, or --model-path (or --quick) to start a server")
        if args.model_path.endswith(".gguf") and (args.head_to_head or args.client == "vllm"):
            # vLLM needs an HF folder: serve both from the same exported one.
            folder = Path(tempfile.gettempdir()) / f"hf_{Path(args.model_path).stem}"
            args.model_path = str(export_hf_folder(args.model_path, folder))
            result["config"]["model_path"] = args.model_path
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        servers = [
            ("jax-paged", jax_paged_cmd(args.model_path, args.model, args.server_args.split()), env)
        ]
        if args.head_to_head:
            cmd = vllm_cmd(args.vllm_bin, args.model_path, args.model, args.vllm_args.split())
            servers.append(("vllm", cmd, vllm_env()))
        rounds: dict[str, list] = {label: [] for label, _, _ in servers}
        for r in range(args.rounds):  # the servers' order swaps every round: A B, B A, ...
            for label, cmd, env_ in servers if r % 2 == 0 else servers[::-1]:
                print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr)
                try:
                    with Server(cmd, env=env_, log=tmp / f"{label}.log") as s:
                        runs = run_rates(s.url, args.model, args)
                        rounds[label].append({"startup_s": s.startup_s, "runs": runs})
                except Exception as e:  # noqa: BLE001 - recorded; the other server still runs
                    result["servers"][label] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
                    print(f"{label} failed: {e}", file=sys.stderr)
                    break
                result["servers"][label] = _merge_rounds(rounds[label])
                if args.output:  # what has run so far, in case a later server fails
                    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
            if any("error" in v for v in result["servers"].values()):
                break
        if args.head_to_head and all("error" not in v for v in result["servers"].values()):
            result["ratios"] = _ratios(rounds["jax-paged"], rounds["vllm"])
    result["run"] = run_metadata()
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return result


_GOAL_KEYS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def _merge_rounds(rounds: list[dict]) -> dict:
    """One server's rounds: each run's numbers as medians over the rounds (``runs``, in the
    shape of one round's), start-up times, and every round as measured (``rounds``)."""
    runs = []
    for i, first in enumerate(rounds[0]["runs"]):
        same = [rd["runs"][i] for rd in rounds]
        runs.append({
            k: statistics.median(r[k] for r in same)
            if isinstance(v, int | float) and not isinstance(v, bool) else v
            for k, v in first.items()
        })  # fmt: skip
    return {"startup_s": [rd["startup_s"] for rd in rounds], "runs": runs, "rounds": rounds}


def _ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Per run, jax-paged / vLLM for the goals (request throughput >= 1 wanted, TTFT p50 and
    p99 <= 1, TPOT p50 <= 1.1): the median over rounds of the ratio within each round (the two
    servers ran next to each other), with its min and max."""
    out = []
    for i, run in enumerate(ours[0]["runs"]):
        row = {"workload": run["workload"], "request_rate": run["request_rate"]}
        for k in _GOAL_KEYS:
            per_round = [
                a["runs"][i][k] / b["runs"][i][k]
                for a, b in zip(ours, theirs, strict=False)
                if b["runs"][i][k]
            ]
            row[k] = statistics.median(per_round) if per_round else None
            row[k + "_range"] = [min(per_round), max(per_round)] if per_round else None
        out.append(row)
    return out


if __name__ == "__main__":
    main()
