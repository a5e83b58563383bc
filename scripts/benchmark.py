"""jax-paged head to head with a contiguous-cache engine and HF transformers, as JSON (and plots).

    python scripts/benchmark.py                          # SmolLM2, scaled ShareGPT-like, CPU
    python scripts/benchmark.py --quick                  # tiny random Llama, seconds
    python scripts/benchmark.py --plots docs/results     # also PNG plots (needs matplotlib)
    python scripts/benchmark.py --workload alpaca --scale 1 --num-requests 200
    python scripts/benchmark.py --online-rates 2,4,8     # also Poisson arrivals: TTFT/TPOT/ITL
    python scripts/benchmark.py --gpu                    # the H200 shape (Llama-3-8B, random bf16)

Systems, all in one process, on the same weights and the same token ids:

- ``paged``: `jax_paged.LLMEngine` (paged KV cache, continuous batching, multi-step decode,
  prefix caching), driven through ``add_request`` / ``step``;
- ``contiguous``: `bench_support.contiguous.ContiguousEngine`, the same model code with a
  contiguous cache: each running sequence reserves ``max_model_len`` slots, static batches that
  wait for their longest member, no paging, no sharing (the paper's Orca / FasterTransformer
  baseline);
- ``hf``: HF transformers ``generate`` (torch, CPU, f32, the same weights copied from the
  loaded model), static FCFS batches of ``--hf-batch-size`` (default: the contiguous engine's
  rows), greedy, each batch generating its longest member's output length.

Every request's output length is forced (``ignore_eos``; HF with ``min_new_tokens``), so every
system does the same useful work; HF's extra tokens past a request's length are discarded and
not counted. Both engines get the same KV budget, in token slots: ``--kv-budget`` multiples of
``max_model_len`` (default 8, so the contiguous engine runs 8 sequences at once; the paged pool
has ``budget / block_size`` blocks). ``max_model_len`` defaults to the workload's longest
allowed total (2048 x scale for ShareGPT/Alpaca, vLLM's filter).

Offline mode (all requests at once): a warm-up run of the whole workload per engine compiles
every shape (reported apart: ``compile_seconds``, ``warmup_seconds``), then ``--repeats``
interleaved timed runs (the order rotates); medians. Per system: requests/s, output tokens/s,
total (prompt + output) tokens/s, ``kv_utilisation`` (time-averaged share of the KV slots
allocated to sequences that hold real tokens: token-seconds / slot-seconds, both integrated by
the trapezoid rule over the states after each engine step; a sequence's real tokens are those
whose K/V is cached, prompt + generated - 1; allocated = blocks held x block size for paged,
the running batch's rows x ``max_model_len`` for contiguous), ``kv_budget_utilisation`` (the
same over the whole budget), peak concurrent sequences, preemptions, and achieved FLOP/s
(2 x non-embedding parameters x tokens processed / wall; attention FLOPs left out) as a share of
a measured f32 matmul peak. Ratios: ``paged_over_contiguous`` and ``paged_over_hf`` (output
tokens/s), with the targets (KV utilisation >= 96%, paged / contiguous >= 2.5x, paged / HF >=
1.8x) in ``goals``.

Extra sections: ``--budget-sweep`` (throughput of paged and contiguous at several KV budgets,
one timed run each after a warm-up), ``--block-sizes`` (paged at several block sizes:
utilisation and throughput), ``--online-rates`` (Poisson arrivals at each rate for both
engines: TTFT, TPOT, ITL percentiles as vLLM's ``benchmark_serving`` reports them; a token's
time is when the engine step that made it returned, so ITL has the granularity of a step),
``--plots DIR`` (PNGs: throughput per system, throughput vs KV budget, KV utilisation over
time, the block-size ablation, TTFT/TPOT vs rate). The persistent compilation cache is off
(``JAX_PAGED_CACHE_DIR=""``) so that compile times are real. Progress goes to stderr; stdout is
the JSON alone.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("JAX_PAGED_CACHE_DIR", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_support import emit, run_metadata  # noqa: E402
from bench_support.contiguous import ContiguousEngine, kv_bytes_per_token  # noqa: E402
from bench_support.workloads import (  # noqa: E402
    filter_bounds,
    make_workload,
    poisson_arrivals,
    with_new_ids,
)

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402

SYSTEMS = ("paged", "contiguous", "hf")
TARGETS = dict(paged_kv_utilisation=0.96, paged_over_contiguous=2.5, paged_over_hf=1.8)
PAPER = dict(
    kv_utilisation=dict(orca_max=0.204, orca_pow2=0.268, orca_oracle=0.382, vllm=0.963),
    sharegpt_requests_per_s_opt13b=dict(vllm=30.42, orca_oracle=13.62, orca_max=7.00),
)
VLLM_H100_TOTAL_TOKENS_PER_S = 12450  # vLLM's published offline throughput, 1000 x (256, 256)


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[benchmark {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# KV utilisation accounting


class KVMeter:
    """Real tokens and allocated KV slots over time; utilisation = their integrals' ratio.

    ``sample(t, tokens, allocated, budget)`` records the state after an engine step at time
    ``t`` (seconds); between two samples both quantities are taken to change linearly (the
    trapezoid rule). The first sample starts from (``t0``, 0, 0, budget).
    """

    def __init__(self, t0: float = 0.0):
        self.t = [t0]
        self.tokens = [0]
        self.allocated = [0]
        self.budget = [0]
        self.running = [0]

    def sample(self, t: float, tokens: int, allocated: int, budget: int, running: int = 0):
        self.t.append(t)
        self.tokens.append(tokens)
        self.allocated.append(allocated)
        self.budget.append(budget)
        self.running.append(running)
        if len(self.budget) == 2:
            self.budget[0] = budget

    @staticmethod
    def _integral(t, y) -> float:
        t, y = np.asarray(t, float), np.asarray(y, float)
        return float(np.sum(np.diff(t) * (y[1:] + y[:-1]) / 2))

    def utilisation(self) -> float | None:
        """Token-seconds over allocated slot-seconds; None if nothing was ever allocated."""
        alloc = self._integral(self.t, self.allocated)
        return None if alloc <= 0 else self._integral(self.t, self.tokens) / alloc

    def budget_utilisation(self) -> float | None:
        """Token-seconds over the whole budget's slot-seconds."""
        b = self._integral(self.t, self.budget)
        return None if b <= 0 else self._integral(self.t, self.tokens) / b

    @property
    def peak_running(self) -> int:
        return max(self.running)

    def series(self, points: int = 200) -> dict:
        """Downsampled time series for plots: seconds from the start, tokens, allocated."""
        idx = np.unique(np.linspace(0, len(self.t) - 1, min(points, len(self.t))).astype(int))
        t0 = self.t[0]
        return dict(
            t=[round(self.t[i] - t0, 4) for i in idx],
            tokens=[self.tokens[i] for i in idx],
            allocated=[self.allocated[i] for i in idx],
        )


# ----------------------------------------------------------------------------------------------
# Driving the engines (offline or with arrivals)


class PagedSystem:
    name = "paged"

    def __init__(self, loaded, budget: int, block_size: int, args, max_num_seqs: int):
        self.block_size = block_size
        self.llm = LLM(
            loaded,
            block_size=block_size,
            num_kv_blocks=budget // block_size + 1,  # + the null block
            max_model_len=args.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_decode_steps=args.max_decode_steps,
            enable_prefix_caching=not args.no_prefix_caching,
            async_scheduling=args.async_scheduling,
            precompile=args.precompile,
        )
        self.engine = self.llm.engine
        self.budget = (self.engine.num_blocks - 1) * block_size

    def metrics(self) -> dict:
        return self.engine.get_metrics()

    def held_tokens(self) -> int:
        """K/V positions written for the running sequences (mid-prefill ones included)."""
        return sum(s.num_computed for s in self.engine.scheduler.running)

    def allocated(self) -> int:
        """KV slots the next step cannot give out: blocks in use x block size. Free and
        evictable cached blocks do not count, nor the blocks of finished sequences that the
        next step frees before it reserves (the scheduler's pool leaves out the null block)."""
        sched = self.engine.scheduler
        return (sched.num_blocks - sched.num_available_blocks) * self.block_size


class ContiguousSystem:
    name = "contiguous"

    def __init__(self, loaded, budget: int, args):
        self.engine = ContiguousEngine(
            loaded,
            max_model_len=args.max_model_len,
            num_kv_slots=budget,
            max_decode_steps=args.max_decode_steps,
        )
        self.budget = self.engine.num_rows * self.engine.max_model_len

    def metrics(self) -> dict:
        return self.engine.get_metrics()

    def held_tokens(self) -> int:
        """K/V positions of the running batch's unfinished members that hold real tokens."""
        return self.engine.kv_stats()["tokens"]

    def allocated(self) -> int:
        """KV slots reserved after the step: the running batch's rows x max_model_len (a
        finished member's row stays reserved until its batch ends)."""
        return self.engine.kv_stats()["reserved"]


def drive(system, requests, arrivals=None) -> dict:
    """Runs ``requests`` to completion on ``system``'s engine (all at once, or each at its
    arrival time in seconds); returns wall time, tokens, the KV meter and per-request token
    times."""
    eng = system.engine
    n = len(requests)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    before = system.metrics()
    t0 = time.perf_counter()
    meter = KVMeter(t0)
    times: dict[str, list[tuple[float, int]]] = {}
    arrival_at: dict[str, float] = {}
    final: dict[str, list[int]] = {}
    nxt = 0
    order = np.arange(n) if arrivals is None else np.argsort(arrivals, kind="stable")
    while len(final) < n:
        now = time.perf_counter() - t0
        while nxt < n and (arrivals is None or arrivals[order[nxt]] <= now):
            i = int(order[nxt])
            rid = f"r{i}"
            eng.add_request(rid, {"prompt_token_ids": requests[i].prompt_token_ids}, params[i])
            arrival_at[rid] = t0 + (0.0 if arrivals is None else float(arrivals[i]))
            times[rid] = []
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, float(arrivals[order[nxt]]) - now)))
            continue
        outs = eng.step()
        t = time.perf_counter()
        for o in outs:
            if o.error:
                raise RuntimeError(f"{system.name}: request {o.request_id} failed: {o.error}")
            toks = o.outputs[0].token_ids
            seen = times[o.request_id]
            have = seen[-1][1] if seen else 0
            if len(toks) > have:
                seen.append((t, len(toks)))
            if o.finished:
                final[o.request_id] = list(toks)
        meter.sample(t, system.held_tokens(), system.allocated(), system.budget, len(outs))
    wall = time.perf_counter() - t0
    after = system.metrics()
    out_tokens = sum(len(v) for v in final.values())
    if out_tokens != sum(r.max_tokens for r in requests):
        raise RuntimeError(f"{system.name}: {out_tokens} output tokens, expected the forced total")
    return dict(
        wall_s=wall,
        output_tokens=out_tokens,
        meter=meter,
        times=times,
        arrival_at=arrival_at,
        tokens=[final[f"r{i}"] for i in range(n)],
        compile_s=after["compile_seconds"] - before["compile_seconds"],
        preemptions=after.get("num_preemptions", 0) - before.get("num_preemptions", 0),
    )


def offline_row(run: dict, requests) -> dict:
    prompt_tokens = sum(r.prompt_len for r in requests)
    m = run.get("meter")
    return dict(
        wall_s=run["wall_s"],
        requests_per_s=len(requests) / run["wall_s"],
        output_tokens_per_s=run["output_tokens"] / run["wall_s"],
        total_tokens_per_s=(run["output_tokens"] + prompt_tokens) / run["wall_s"],
        kv_utilisation=None if m is None else m.utilisation(),
        kv_budget_utilisation=None if m is None else m.budget_utilisation(),
        peak_running=None if m is None else m.peak_running,
        preemptions=run.get("preemptions", 0),
        compile_s=run.get("compile_s", 0.0),
    )


# ----------------------------------------------------------------------------------------------
# HF transformers


class HFSystem:
    name = "hf"

    def __init__(self, loaded, batch_size: int, threads: int | None):
        import bench_decode
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.bench_decode = bench_decode
        self.model = bench_decode.build_hf_model(loaded)
        self.batch_size = batch_size
        self.threads = torch.get_num_threads()

    def run(self, requests) -> dict:
        t0 = time.perf_counter()
        tokens = []
        for s in range(0, len(requests), self.batch_size):
            batch = requests[s : s + self.batch_size]
            longest = max(r.max_tokens for r in batch)
            out = self.bench_decode.run_hf(
                self.model, [r.prompt_token_ids for r in batch], longest, pad_id=0
            )
            tokens += [t[: r.max_tokens] for t, r in zip(out["tokens"], batch, strict=True)]
        wall = time.perf_counter() - t0
        return dict(wall_s=wall, output_tokens=sum(len(t) for t in tokens), tokens=tokens)


# ----------------------------------------------------------------------------------------------
# FLOP/s


def matmul_peak_flops(dtype) -> float:
    """Best of 5 of a jitted 1024^3 matmul (f32: the CPU's practical peak through XLA)."""
    n = 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_params(loaded) -> int:
    """Parameters a token multiplies through: everything but the embedding table, plus the LM
    head (the tied embedding counts once, as the head)."""
    from flax import nnx

    total = sum(int(np.prod(v[...].shape)) for _, v in nnx.to_flat_state(nnx.state(loaded.model)))
    c = loaded.config
    emb = c.vocab_size * c.hidden_size
    return total if c.tie_word_embeddings else total - emb


# ----------------------------------------------------------------------------------------------
# Sections


def _median_rows(rows: list[dict]) -> dict:
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    out["runs_output_tokens_per_s"] = [round(r["output_tokens_per_s"], 2) for r in rows]
    return out


def _match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return same / max(1, len(a))


def bench_offline(loaded, args, variants, hf) -> dict:
    """``variants[0]`` warms up, ``variants[1 + r]`` is repeat r's workload (same lengths, new
    ids: nothing a prefix cache could serve across runs; every system runs the same ids)."""
    requests = variants[0]
    budget = args.kv_budget * args.max_model_len
    systems = {}
    warm = {}
    compile_info = {}
    if "paged" in args.systems:
        systems["paged"] = PagedSystem(loaded, budget, args.block_size, args, len(requests))
    if "contiguous" in args.systems:
        systems["contiguous"] = ContiguousSystem(loaded, budget, args)
    for name, sys_ in systems.items():
        _log(f"offline {name}: warm-up (compiles every shape)")
        t0 = time.perf_counter()
        warm[name] = drive(sys_, variants[0])
        m = sys_.metrics()
        compile_info[name] = dict(
            warmup_seconds=round(time.perf_counter() - t0, 2),
            compile_seconds=round(m["compile_seconds"], 2),
            compiled_variants=m["compiled_variants"],
        )
    hf_batch = None
    if hf is not None:
        hf_batch = hf.batch_size
        _log("offline hf: warm-up (first batch)")
        t0 = time.perf_counter()
        hf.run(variants[0][: hf.batch_size])
        compile_info["hf"] = dict(warmup_seconds=round(time.perf_counter() - t0, 2))
    names = list(systems) + (["hf"] if hf is not None else [])
    runs = {n: [] for n in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            _log(f"offline repeat {r + 1}/{args.repeats}: {name}")
            work = variants[1 + r]
            run = hf.run(work) if name == "hf" else drive(systems[name], work)
            runs[name].append(run)
    result = dict(systems={}, kv_budget_tokens=budget)
    for name in names:
        rows = [offline_row(x, requests) for x in runs[name]]
        row = _median_rows(rows)
        row.update(compile_info[name])
        row["compile_seconds_in_timed_runs"] = round(sum(x["compile_s"] for x in rows), 3)
        if name in systems:
            s = systems[name]
            row["kv_budget_tokens"] = s.budget
            row["kv_budget_bytes"] = s.budget * kv_bytes_per_token(loaded.config, args.jdtype)
        if name == "contiguous":
            row["rows"] = systems[name].engine.num_rows
            m = systems[name].metrics()
            row["wasted_row_steps_share"] = m["wasted_row_steps"] / max(
                1, m["wasted_row_steps"] + m["generated_tokens"] - m["num_finished"]
            )
        if name == "hf":
            row["batch_size"] = hf_batch
            row["torch_threads"] = hf.threads
        result["systems"][name] = row
    # Time series of the last timed run (for the utilisation plot).
    result["kv_series"] = {n: runs[n][-1]["meter"].series() for n in systems}
    ref = runs[names[0]][-1]["tokens"]
    result["tokens_match_rate"] = {n: _match_rate(ref, runs[n][-1]["tokens"]) for n in names}
    result["tokens_reference"] = names[0]
    s = result["systems"]
    if "paged" in s and "contiguous" in s:
        result["paged_over_contiguous"] = (
            s["paged"]["output_tokens_per_s"] / s["contiguous"]["output_tokens_per_s"]
        )
        per = [
            a["output_tokens"] / a["wall_s"] / (b["output_tokens"] / b["wall_s"])
            for a, b in zip(runs["paged"], runs["contiguous"], strict=True)
        ]
        result["paged_over_contiguous_per_repeat"] = [round(x, 3) for x in per]
    if "paged" in s and "hf" in s:
        result["paged_over_hf"] = s["paged"]["output_tokens_per_s"] / s["hf"]["output_tokens_per_s"]
    return result


def bench_budget_sweep(loaded, args, variants, mults) -> dict:
    requests = variants[0]
    out = {"paged": {}, "contiguous": {}}
    for mult in mults:
        budget = mult * args.max_model_len
        for name in ("paged", "contiguous"):
            if name not in args.systems:
                continue
            if name == "paged":
                s = PagedSystem(loaded, budget, args.block_size, args, len(requests))
            else:
                s = ContiguousSystem(loaded, budget, args)
            _log(f"budget x{mult} {name}: warm-up + 1 timed run")
            drive(s, variants[0])
            row = offline_row(drive(s, variants[1]), requests)
            row["kv_budget_tokens"] = s.budget
            out[name][str(mult)] = row
            del s
            gc.collect()
    return out


def bench_block_sizes(loaded, args, variants, sizes) -> dict:
    requests = variants[0]
    out = {}
    budget = args.kv_budget * args.max_model_len
    for bs in sizes:
        s = PagedSystem(loaded, budget, bs, args, len(requests))
        _log(f"block size {bs}: warm-up + 1 timed run")
        drive(s, variants[0])
        row = offline_row(drive(s, variants[1]), requests)
        row["compile_seconds"] = round(s.metrics()["compile_seconds"], 2)
        out[str(bs)] = row
        del s
        gc.collect()
    return out


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return dict(mean=None, p50=None, p90=None, p99=None)
    a = np.asarray(xs) * 1000.0
    return dict(
        mean=float(a.mean()),
        p50=float(np.percentile(a, 50)),
        p90=float(np.percentile(a, 90)),
        p99=float(np.percentile(a, 99)),
    )


def latency_stats(run: dict) -> dict:
    """TTFT, TPOT and ITL in milliseconds (mean and percentiles) from per-request token times.

    TTFT: first token - arrival. TPOT: (last - first) / (tokens - 1), per request with >= 2
    tokens. ITL: the gap between consecutive returns of a request's tokens, one entry per
    token that return carried (a step that makes k tokens at once gives k equal gaps)."""
    ttft, tpot, itl = [], [], []
    for rid, seen in run["times"].items():
        arrival = run["arrival_at"][rid]
        ttft.append(seen[0][0] - arrival)
        n = seen[-1][1]
        if n >= 2:
            tpot.append((seen[-1][0] - seen[0][0]) / (n - 1))
        for (t_a, n_a), (t_b, n_b) in zip(seen, seen[1:], strict=False):
            itl += [(t_b - t_a) / (n_b - n_a)] * (n_b - n_a)
    return dict(ttft_ms=_pcts(ttft), tpot_ms=_pcts(tpot), itl_ms=_pcts(itl))


def bench_online(loaded, args, variants, rng) -> dict:
    requests = variants[0]
    budget = args.kv_budget * args.max_model_len
    systems = {}
    if "paged" in args.systems:
        systems["paged"] = PagedSystem(loaded, budget, args.block_size, args, len(requests))
    if "contiguous" in args.systems:
        systems["contiguous"] = ContiguousSystem(loaded, budget, args)
    for name, s in systems.items():
        _log(f"online {name}: warm-up (offline)")
        drive(s, variants[0])
    out = {n: {} for n in systems}
    for k, rate in enumerate(args.online_rates):
        arrivals = poisson_arrivals(rng, len(requests), rate)
        work = variants[1 + k % (len(variants) - 1)]
        for name, s in systems.items():
            # Arrivals change the batch shapes: a first pass at this rate compiles them.
            _log(f"online rate {rate}/s: {name} (warm-up pass, then the timed one)")
            drive(s, variants[0], arrivals)
            run = drive(s, work, arrivals)
            row = offline_row(run, requests)
            row.update(latency_stats(run), request_rate=rate)
            out[name][str(rate)] = row
    return out


# ----------------------------------------------------------------------------------------------
# Plots


def make_plots(result: dict, folder: Path) -> list[str]:
    """PNG plots of the result; returns the files written. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    colours = dict(paged="tab:blue", contiguous="tab:orange", hf="tab:green")

    def save(fig, name):
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(str(path))

    off = result.get("offline")
    if off:
        names = list(off["systems"])
        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        for ax, key, label in (
            (axes[0], "output_tokens_per_s", "output tokens/s"),
            (axes[1], "requests_per_s", "requests/s"),
        ):
            vals = [off["systems"][n][key] for n in names]
            ax.bar(names, vals, color=[colours[n] for n in names])
            ax.set_ylabel(label)
        fig.suptitle(f"offline, {result['workload']['name']}, KV budget {off['kv_budget_tokens']}")
        save(fig, "benchmark_throughput.png")
        fig, ax = plt.subplots(figsize=(6, 3))
        for n, ser in off["kv_series"].items():
            util = [a and t / a for t, a in zip(ser["tokens"], ser["allocated"], strict=True)]
            ax.plot(ser["t"], [100 * u if u else 0 for u in util], label=n, color=colours[n])
        ax.set_xlabel("seconds")
        ax.set_ylabel("KV slots holding tokens (%)")
        ax.set_ylim(0, 105)
        ax.legend()
        save(fig, "benchmark_kv_utilisation.png")
    sweep = result.get("budget_sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 3))
        for n, rows in sweep.items():
            if rows:
                xs = [int(k) for k in rows]
                ax.plot(
                    xs,
                    [rows[k]["output_tokens_per_s"] for k in rows],
                    "o-",
                    label=n,
                    color=colours[n],
                )
        ax.set_xlabel("KV budget (x max_model_len slots)")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        save(fig, "benchmark_kv_budget.png")
    blocks = result.get("block_sizes")
    if blocks:
        fig, ax = plt.subplots(figsize=(6, 3))
        xs = [int(k) for k in blocks]
        ax.plot(xs, [100 * blocks[k]["kv_utilisation"] for k in blocks], "o-", color="tab:blue")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
        ax.set_ylabel("KV utilisation (%)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(xs, [blocks[k]["output_tokens_per_s"] for k in blocks], "s--", color="tab:red")
        ax2.set_ylabel("output tokens/s", color="tab:red")
        save(fig, "benchmark_block_size.png")
    online = result.get("online")
    if online:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        for n, rows in online.items():
            rates = [float(k) for k in rows]
            axes[0].plot(
                rates, [rows[k]["ttft_ms"]["p50"] for k in rows], "o-", label=n, color=colours[n]
            )
            axes[1].plot(
                rates, [rows[k]["tpot_ms"]["p50"] for k in rows], "o-", label=n, color=colours[n]
            )
        axes[0].set_ylabel("median TTFT (ms)")
        axes[1].set_ylabel("median TPOT (ms)")
        for ax in axes:
            ax.set_xlabel("request rate (req/s)")
            ax.legend()
        save(fig, "benchmark_online.png")
    return written


# ----------------------------------------------------------------------------------------------
# GPU mode


def gpu_mode(args) -> dict:
    """vLLM's offline throughput shape (1000 x (256 in, 256 out)) on a Llama-3-8B-shaped model
    with random bf16 weights."""
    if jax.default_backend() != "gpu":
        msg = (
            f"--gpu needs a CUDA GPU; this machine's JAX backend is {jax.default_backend()!r}: "
            "nothing was run"
        )
        _log(msg)
        return dict(benchmark="gpu", skipped=msg)
    from flax import nnx

    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    t0 = time.perf_counter()
    model = models.Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    loaded = models.LoadedModel(
        model,
        None,
        cfg,
        models.GenerationConfig(eos_token_ids=[]),
        source="Llama-3-8B shape, random bf16",
    )
    build = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    requests = make_workload(
        "random", rng, args.gpu_requests, cfg.vocab_size, input_len=256, output_len=256
    )
    llm = LLM(
        loaded,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        block_size=16,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    t0 = time.perf_counter()
    llm.generate(prompts[:256], params[:256])
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    total = out_tok + sum(r.prompt_len for r in requests)
    return dict(
        benchmark="gpu",
        device=jax.devices()[0].device_kind,
        model=loaded.source,
        build_seconds=round(build, 2),
        warmup_seconds=round(warm, 2),
        num_requests=len(requests),
        wall_s=wall,
        requests_per_s=len(requests) / wall,
        output_tokens_per_s=out_tok / wall,
        total_tokens_per_s=total / wall,
        vllm_h100_total_tokens_per_s=VLLM_H100_TOTAL_TOKENS_PER_S,
        total_over_vllm_h100=total / wall / VLLM_H100_TOTAL_TOKENS_PER_S,
        metrics={k: v for k, v in llm.get_metrics().items() if isinstance(v, int | float)},
    )


# ----------------------------------------------------------------------------------------------
# Main


def tiny_model(max_len: int) -> models.LoadedModel:
    """The --quick model: bench_sharing's 2-layer random Llama (GQA 4/2, head dim 16), vocab 512."""
    import bench_sharing

    return bench_sharing.tiny_model(vocab_size=512, max_len=max_len)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


DEFAULTS = dict(model="smollm2", scale=0.25, num_requests=64, repeats=3)
QUICK = dict(model="tiny", scale=0.05, num_requests=12, repeats=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="'smollm2' (default), 'tiny', HF folder, .gguf")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="tiny model, tiny workload: seconds")
    ap.add_argument("--gpu", action="store_true", help="the H200 shape only (see the docstring)")
    ap.add_argument("--gpu-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload", default="sharegpt", choices=["sharegpt", "alpaca", "random", "shared_prefix"]
    )
    ap.add_argument("--scale", type=float, default=None, help="length scale (default 0.25)")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64")
    ap.add_argument("--input-len", type=int, default=1024, help="random workload")
    ap.add_argument("--output-len", type=int, default=128, help="random workload")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="random workload")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared_prefix (x scale)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="slots a contiguous sequence reserves (default: the workload's bound)",
    )
    ap.add_argument(
        "--kv-budget",
        type=int,
        default=8,
        help="KV budget of both engines, in multiples of max_model_len (default 8)",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-decode-steps", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="paged: detokenise while the next step runs (EngineConfig.async_scheduling)",
    )
    ap.add_argument(
        "--precompile",
        action="store_true",
        help="paged: compile every step variant when the engine starts, as jax-paged serve "
        "does (EngineConfig.precompile); else a timed online pass may meet a compile",
    )
    ap.add_argument("--systems", default="paged,contiguous,hf")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: contiguous rows")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="timed offline runs (default 3)")
    ap.add_argument("--budget-sweep", type=_ints, default=[], help="e.g. 4,8,16 (x max_model_len)")
    ap.add_argument("--block-sizes", type=_ints, default=[], help="e.g. 8,16,32,64,128")
    ap.add_argument("--online-rates", type=_floats, default=[], help="requests/s, e.g. 2,4,8")
    ap.add_argument("--plots", default=None, help="folder for PNG plots (needs matplotlib)")
    ap.add_argument("--output", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    if args.num_requests < 1 or args.repeats < 1 or args.kv_budget < 1:
        ap.error("--num-requests, --repeats and --kv-budget must be >= 1")
    args.jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    return args


def run(argv=None) -> dict:
    args = parse_args(argv)
    if args.gpu:
        return gpu_mode(args)
    t_start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    bound = filter_bounds(args.scale)[2]
    if args.model == "tiny":
        loaded = tiny_model(max_len=max(4096, 2 * bound))
    else:
        loaded = models.load(None if args.model == "smollm2" else args.model, dtype=args.jdtype)
    requests = make_workload(
        args.workload,
        rng,
        args.num_requests,
        loaded.config.vocab_size,
        scale=args.scale,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
    )
    longest = max(r.prompt_len + r.max_tokens for r in requests)
    if args.max_model_len is None:
        args.max_model_len = max(bound, longest) if args.workload != "random" else longest
    if longest > args.max_model_len:
        raise SystemExit(f"a request needs {longest} tokens > --max-model-len {args.max_model_len}")
    if args.max_model_len > loaded.config.max_position_embeddings:
        raise SystemExit(
            f"max_model_len {args.max_model_len} exceeds the model's context "
            f"({loaded.config.max_position_embeddings}); lower --scale"
        )
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(512, args.max_model_len)
    p_lens = [r.prompt_len for r in requests]
    o_lens = [r.max_tokens for r in requests]
    result = dict(
        benchmark="head_to_head",
        run=run_metadata(),
        model=loaded.source,
        dtype=args.dtype,
        platform=jax.devices()[0].platform,
        device=jax.devices()[0].device_kind,
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        jax=jax.__version__,
        command="python scripts/benchmark.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        seed=args.seed,
        workload=dict(
            name=args.workload,
            scale=args.scale,
            num_requests=len(requests),
            mean_prompt_tokens=statistics.mean(p_lens),
            mean_output_tokens=statistics.mean(o_lens),
            max_prompt_tokens=max(p_lens),
            max_output_tokens=max(o_lens),
            prompt_tokens=sum(p_lens),
            output_tokens=sum(o_lens),
        ),
        max_model_len=args.max_model_len,
        kv_budget_x_max_model_len=args.kv_budget,
        block_size=args.block_size,
        max_decode_steps=args.max_decode_steps,
        prefix_caching=not args.no_prefix_caching,
        repeats=args.repeats,
        paper=PAPER,
        targets=TARGETS,
    )
    hf = None
    if "hf" in args.systems:
        rows = min(args.kv_budget, args.num_requests)
        hf = HFSystem(loaded, args.hf_batch_size or rows, args.torch_threads)
    keep = round(args.prefix_len * args.scale) if args.workload == "shared_prefix" else 0
    vocab = loaded.config.vocab_size
    variants = [requests] + [
        with_new_ids(requests, rng, vocab, keep)
        for _ in range(max(args.repeats, len(args.online_rates), 1))
    ]
    result["offline"] = bench_offline(loaded, args, variants, hf)
    del hf
    gc.collect()
    s = result["offline"]["systems"]
    peak = matmul_peak_flops(args.jdtype)
    n_params = matmul_params(loaded)
    result["flops"] = dict(matmul_peak_flops=peak, matmul_params=n_params)
    for row in s.values():
        row["achieved_flops"] = 2 * n_params * row["total_tokens_per_s"]
        row["share_of_matmul_peak"] = row["achieved_flops"] / peak
    if args.budget_sweep:
        # The main run is the sweep's point at --kv-budget (not run twice).
        sweep = bench_budget_sweep(
            loaded, args, variants, [m for m in args.budget_sweep if m != args.kv_budget]
        )
        for name, rows in sweep.items():
            if name in s:
                rows[str(args.kv_budget)] = {
                    k: v for k, v in s[name].items() if not isinstance(v, list)
                }
        result["budget_sweep"] = {
            n: dict(sorted(r.items(), key=lambda kv: int(kv[0]))) for n, r in sweep.items() if r
        }
    if args.block_sizes:
        blocks = bench_block_sizes(
            loaded, args, variants, [b for b in args.block_sizes if b != args.block_size]
        )
        if "paged" in s:
            blocks[str(args.block_size)] = {
                k: v for k, v in s["paged"].items() if not isinstance(v, list)
            }
        result["block_sizes"] = dict(sorted(blocks.items(), key=lambda kv: int(kv[0])))
    if args.online_rates:
        result["online"] = bench_online(loaded, args, variants, rng)
    off = result["offline"]
    util = s.get("paged", {}).get("kv_utilisation")
    result["goals"] = dict(
        paged_kv_utilisation_at_least_96pct=None if util is None else util >= 0.96,
        paged_over_contiguous_at_least_2_5=None
        if "paged_over_contiguous" not in off
        else off["paged_over_contiguous"] >= 2.5,
        paged_over_hf_at_least_1_8=None
        if "paged_over_hf" not in off
        else off["paged_over_hf"] >= 1.8,
    )
    if args.plots:
        try:
            result["plots"] = make_plots(result, Path(args.plots))
        except ImportError:
            msg = "matplotlib is not installed (pip install matplotlib): no plots written"
            _log(msg)
            result["plots"] = msg
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def main(argv=None) -> int:
    result = run(argv)
    emit(result, parse_args(argv).output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
