"""Decode throughput of jax-paged against its bound (the dense forward) and its peer (HF), as JSON.

    python scripts/bench_decode.py                       # embedded SmolLM2, B = 8, 32, 64
    python scripts/bench_decode.py --batch-sizes 64 --max-tokens 128 --repeats 5
    python scripts/bench_decode.py --quick --no-hf       # smoke run: B = 4, 8 tokens, 1 repeat
    python scripts/bench_decode.py --compare-single-step # also 1 decode step per device call

Everything runs in one process, on the same token ids. For every batch size B the workload is
the first B of a deterministic list of varied English prompts of 20-60 words, tokenised once
(with the model's tokenizer; a model without one gets one id per word, a stable hash of the
word modulo the vocabulary), greedy, ``ignore_eos`` and ``max_tokens`` = ``--max-tokens``, so
that every system generates exactly B x max_tokens tokens. Per batch size:

1. ``paged``: `jax_paged.LLM.generate` on ``{"prompt_token_ids": ids}`` with
   ``max_num_seqs=B`` at each KV pool size of ``--pools`` (default ``64,1GiB,4GiB``): a bare
   number is a pool of that many blocks, raised to the smallest pool that holds the whole batch
   without preemption (sum over requests of ceil((prompt + max_tokens) / block_size), plus the
   null block); ``MiB``/``GiB`` is ``kv_cache_memory_bytes``. One `LLM` per pool, built once and
   warmed up (the warm-up run compiles every shape, and is reported apart: ``warmup_seconds``,
   ``compile_seconds``, ``compiled_variants``, and ``compile_seconds_by_program`` with its max
   when the engine reports it; on a CPU the native kernel's one-time build, cached per machine,
   comes first and apart: ``native_cpu_kernel``). Output tokens/s is output tokens / wall time
   of `generate` (prefill included), the median over ``--repeats``. ``pool_spread`` = max / min
   - 1 over the pools (goal < 5%). Prefix caching is off unless ``--prefix-caching`` (the
   repeats reuse the same prompts, which would otherwise turn into cache hits in the pools
   large enough to keep them, and HF recomputes every prompt).
   ``pool_steps`` (``--pool-rounds``, default 9; 0 skips it): the same question asked of the
   decode step alone, where the machine's drift cannot hide or fake it. One
   `research.PagedDecoder` per pool (same block count as that pool's `LLM`) holds
   the prefilled batch; each round runs ``--pool-round-steps`` (8) greedy decode steps at every
   pool in a rotated order, so all pools see the same contexts round by round: median step
   seconds per pool, ``spread`` (goal < 5%) and ``paired_spread`` (within rounds). The dense
   forward of item 2 takes a turn in every round as well (``--pool-round-steps`` calls):
   ``paired_share_of_bound`` is the median over rounds of its step time / the slowest pool's
   decode step in the same round, the decode step's share of the bound with drift cancelled
   (the decode steps run at contexts from the prompt up to the prompt + rounds x steps).
   The dense forward reads no K/V, which a decode step cannot avoid: ``read_bandwidth_gb_s``
   (a jitted sum over 512 MB, best of 5) prices each round's live K/V bytes
   (``kv_read_floor_seconds``), and ``paired_share_of_bound_with_kv_read`` is the median over
   rounds of (dense step + that floor) / the slowest pool's step.
2. ``dense_bound``: the model's own jitted dense forward ``loaded.model(tokens[B, 1])`` (one
   token per sequence, no cache, LM head included), on the weights as the engine holds them
   (`jax_paged.backend.prepare_params`: per-layer kernels on a CPU), best of 5 after a warm-up:
   ``tokens_per_s`` = B / step time. ``paged_share_of_bound`` = end-to-end paged tokens/s
   (prefill included) / that; ``decode_share_of_bound`` = the decode phase alone (tokens made
   in decode loops over the time inside them, ``paged_decode_tokens_per_s``) / that (goal >=
   0.9 at B = 64). The bound reads no KV cache at all, so at any real context the decode step
   must also pay for reading the K/V; ``contiguous_decode`` times the same model decoding with
   a plain contiguous cache in JAX (`dense.greedy_generate`, ``[L, B, S, KVH, D]`` buffers),
   the cost a paged cache should match: ``decode_share_of_contiguous``.
3. ``hf``: HF transformers ``generate`` (torch on the CPU, fp32, torch's default thread count
   unless ``--torch-threads``) on the same ids, static batches of B, left padding with an
   attention mask, greedy, ``min_new_tokens = max_new_tokens = max_tokens`` and no EOS id (EOS
   is an ordinary token, as ``ignore_eos`` makes it for jax-paged). The HF model is built from
   ``loaded.config`` and given jax-paged's own loaded weights (per-layer ``layers.<i>.<name>``
   or stacked ``layers.<name>`` with a leading [L] axis; ``nnx.Linear`` kernels [in, out] are
   transposed to HF's [out, in]), so both run the very same numbers. ``paged_over_hf`` per
   batch size, and ``best_paged_over_best_hf``: each system at its own best batch size (goal
   >= 2). ``hf_matches_first_tokens``: HF on the first prompt alone gives the same first
   min(8, max_tokens) greedy tokens as jax-paged's warm-up run;
   ``hf_batch_first_tokens_match_rate`` is the share of the batch's rows that agree too.

The paged tokens/s that the ratios use is the slowest pool's (``paged_tokens_per_s``), so a
goal is met only if every pool meets it. Repeats are interleaved (each repeat runs every system
once, in a rotated order); ``paired`` gives the median over repeats of the ratios taken inside
each repeat (``pool_spread``, ``paged_over_hf``), which cancels drift of the machine's speed
between repeats. The goals use the medians above; the pool spreads also have a paired goal each
(``paired_pool_spread_under_5pct``, ``paired_pool_step_spread_under_5pct``), and the decode
step's share of the bound is judged both ways (``paired_decode_step_share_...``). Preemptions
and compile seconds inside timed runs are reported and should be 0. ``--compare-single-step``
adds an engine with ``max_decode_steps=1`` (a host round trip per token) at the first pool and
reports ``multi_over_single_speedup``. The persistent
compilation cache is off (``JAX_PAGED_CACHE_DIR=""``) so that compile times are real. Progress
goes to stderr; stdout is the JSON alone.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support
# Measure real compile times: no persistent compilation cache for this process.
os.environ.setdefault("JAX_PAGED_CACHE_DIR", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_support import (  # noqa: E402
    add_output_arg,
    dense,  # noqa: E402
    emit,
    read_bandwidth,
    run_metadata,
)
from flax import nnx  # noqa: E402

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.backend import prepare_params  # noqa: E402
from jax_paged.engine.config import KV_CACHE_DTYPES  # noqa: E402

DEFAULTS = dict(
    batch_sizes="8,32,64", max_tokens=64, repeats=3, pools="64,1GiB,4GiB", pool_rounds=9
)
QUICK = dict(batch_sizes="4", max_tokens=8, repeats=1, pools="64,64MiB", pool_rounds=2)
CHECK_TOKENS = 8  # first tokens compared between HF and jax-paged
BOUND_TRIALS = 5

# ----------------------------------------------------------------------------------------------
# Prompts: deterministic, varied English, 20-60 words each

OPENERS = [
    "Continue the following story in the same style.",
    "Summarise this passage in two sentences.",
    "Explain the following to a curious twelve year old.",
    "Rewrite this paragraph so that it sounds more formal.",
    "Answer the question that follows the background.",
    "Translate the tone of this text into something cheerful.",
    "Write a short reply to the message below.",
    "List the main ideas of the text that follows.",
]
SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Rain had fallen for three days, and the river was rising faster than anyone expected.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
    "The committee met on Tuesday to discuss the budget for the new library.",
    "A good loaf of bread needs flour, water, salt, yeast and a great deal of patience.",
    "She packed a map, a compass and two sandwiches before setting off into the hills.",
    "Copper conducts electricity well, which is why it is used in most household wiring.",
    "The train was late again, so the passengers crowded around the small heater.",
    "In the seventeenth century, merchants sailed across oceans to trade spices and silk.",
    "Regular exercise improves sleep, mood and the health of the heart.",
    "The robot paused at the door, unsure whether it was allowed to enter the garden.",
    "Our team shipped the new release on Friday after fixing the last two bugs.",
    "Bees visit thousands of flowers each day and carry pollen from one to the next.",
    "The recipe says to whisk the eggs until they are pale and fluffy.",
    "Mountains in the north stay covered in snow until the middle of summer.",
    "He had never seen the city from above until the day he rode the cable car.",
    "Most modern computers store numbers in binary, as long strings of ones and zeros.",
    "The market opens at dawn, when farmers arrive with baskets of fresh vegetables.",
    "A gentle wind moved through the tall grass and carried the smell of the sea.",
    "Please remember to bring your ticket and a form of identification to the exam.",
    "The museum's new exhibit shows how people lived in the valley ten thousand years ago.",
    "Our neighbour's cat sleeps on the warm roof of the car every afternoon.",
    "The orchestra tuned their instruments while the audience slowly found their seats.",
    "Saving a little money each month adds up to a surprising amount over the years.",
    "The glacier has retreated almost a kilometre since the first photographs were taken.",
    "When the power went out, the whole street gathered outside to watch the stars.",
    "Learning a new language is easier when you practise a few minutes every day.",
    "The bridge was designed to sway slightly so that strong winds would not break it.",
    "A letter arrived with no return address and a single pressed flower inside.",
    "Engineers tested the engine for hours before they declared it safe to fly.",
    "The children built a fort out of blankets, chairs and a very patient dog.",
    "Volcanic soil is rich in minerals, so farmers grow grapes on the slopes.",
]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic prompts of 20-60 words: an instruction, then sentences, cut at a
    drawn word count."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.randint(20, 60)
        words = OPENERS[i % len(OPENERS)].split()
        for j in rng.sample(range(len(SENTENCES)), len(SENTENCES)):
            if len(words) >= target:
                break
            words += SENTENCES[j].split()
        out.append(" ".join(words[:target]))
    return out


def tokenize(loaded: models.LoadedModel, texts: list[str]) -> tuple[list[list[int]], str]:
    """Token ids of every prompt, and how they were made."""
    vocab = loaded.config.vocab_size
    if loaded.tokenizer is not None:
        ids = loaded.tokenizer.encode_batch(texts)
        if all(0 <= t < vocab for p in ids for t in p):
            return ids, "model tokenizer"
    # No (usable) tokenizer: one id per word, a stable hash of the word.
    return [[zlib.crc32(w.encode()) % vocab for w in t.split()] for t in texts], "word hash"


# ----------------------------------------------------------------------------------------------
# KV pools


def parse_pool(spec: str) -> tuple[str, int, str]:
    """ "64" -> (name, 64, "blocks"); "1GiB" / "64MiB" -> (name, bytes, "bytes")."""
    m = re.fullmatch(r"\s*(\d+)\s*(GiB|MiB|KiB|G|M|K)?\s*", spec)
    if not m:
        raise ValueError(f"pool {spec!r}: expected a block count (64) or a size (64MiB, 1GiB)")
    n, unit = int(m.group(1)), m.group(2)
    if unit is None:
        return f"{n}_blocks", n, "blocks"
    shift = {"K": 10, "M": 20, "G": 30}[unit[0]]
    return spec.strip(), n << shift, "bytes"


def blocks_needed(prompts: list[list[int]], max_tokens: int, block_size: int) -> int:
    """Blocks that hold every request of the batch at full length, plus the null block."""
    return sum(math.ceil((len(p) + max_tokens) / block_size) for p in prompts) + 1


# ----------------------------------------------------------------------------------------------
# jax-paged


def run_paged(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = llm.get_metrics()
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"jax-paged rejected {len(errors)} requests: {errors[0]}")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    inside = after["compiled_seconds"] - before["compiled_seconds"]
    # The decode phase alone: tokens made inside decode loops over the time spent in them.
    dec_tokens = after["decode_loop_tokens"] - before["decode_loop_tokens"]
    by_kind_0 = before["compiled_seconds_by_kind"]
    dec_s = after["compiled_seconds_by_kind"].get("decode", 0.0) - by_kind_0.get("decode", 0.0)
    return dict(
        wall_s=wall,
        output_tokens=n,
        output_tokens_per_s=n / wall,
        decode_tokens_per_s=dec_tokens / dec_s if dec_s > 0 else 0.0,
        prefill_seconds=after["compiled_seconds_by_kind"].get("mixed", 0.0)
        - by_kind_0.get("mixed", 0.0),
        host_share=max(0.0, 1.0 - inside / wall),
        device_calls=after["num_device_calls"] - before["num_device_calls"],
        compile_s=after["compile_seconds"] - before["compile_seconds"],
        preemptions=after["num_preemptions"] - before["num_preemptions"],
        tokens=tokens,
    )


def compile_report(m: dict) -> dict:
    out = dict(
        compile_seconds=round(m["compile_seconds"], 3),
        compiled_variants=m["compiled_variants"],
    )
    by_program = m.get("compile_seconds_by_program")
    if by_program is not None:
        out["compile_seconds_by_program"] = {k: round(v, 3) for k, v in by_program.items()}
        out["max_program_compile_seconds"] = round(max(by_program.values(), default=0.0), 3)
    return out


# ----------------------------------------------------------------------------------------------
# The dense-forward bound


def native_kernel_report() -> dict | None:
    """The native CPU kernel's one-time build (per machine, cached on disk like an installed
    extension; ``.ci/setup.sh`` builds it), done here before any program compiles so that it
    is reported apart from the programs' compile times. None off the CPU."""
    if jax.default_backend() != "cpu":
        return None
    from pallas_kernels import cpu_paged_attention as cpu

    try:
        was_cached = cpu.library_path().exists()
    except (OSError, RuntimeError):  # no compiler, or $CXX not runnable: available() says why
        was_cached = False
    t0 = time.perf_counter()
    ok = cpu.available()
    return dict(
        available=ok,
        build_error=cpu.build_error(),
        was_cached=was_cached,
        seconds=round(time.perf_counter() - t0, 3),
    )


def make_dense_step(model):
    graphdef, state = nnx.split(model)
    state = prepare_params(model, state)  # the weights as the engine holds them

    @jax.jit
    def step(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    return step, state


def dense_bound(step, state, tokens: np.ndarray) -> dict:
    """Best of 5 (after a warm-up) of the jitted dense forward on tokens i32[B, 1]."""
    x = jnp.asarray(tokens, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, x))
    warm = time.perf_counter() - t0
    times = []
    for _ in range(BOUND_TRIALS):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, x))
        times.append(time.perf_counter() - t0)
    best = min(times)
    return dict(
        step_seconds=best,
        tokens_per_s=x.shape[0] / best,
        warmup_seconds=round(warm, 3),
        trials=BOUND_TRIALS,
    )


def kv_bytes_per_step(config, contexts: np.ndarray, itemsize: int) -> float:
    """Bytes of K and V a decode step must read: every layer, every row's visible keys (its
    context, or the layer's sliding window)."""
    total = 0
    for layer in range(config.num_layers):
        window = config.window_of(layer)
        seen = contexts if window is None else np.minimum(contexts, window)
        total += int(seen.sum())
    return 2.0 * total * config.num_kv_heads * config.head_dim * itemsize


def contiguous_decode(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per-step time of the same model decoding with a plain contiguous KV cache in JAX.

    `dense.greedy_generate` (one jitted step per token over ``[L, B, S, KVH, D]`` buffers, what
    a paged cache is measured against): the time of a ``max_tokens`` run minus a one-token run
    (the prefill), over ``max_tokens - 1`` steps, best of 3 after a warm-up.
    """
    if max_tokens < 2:
        return dict(step_seconds=None, tokens_per_s=None)

    def timed(n):
        t0 = time.perf_counter()
        dense.greedy_generate(model, prompts, n)
        return time.perf_counter() - t0

    timed(1), timed(max_tokens)  # compile both shapes
    best = min(timed(max_tokens) - timed(1) for _ in range(3))
    step = max(best, 1e-9) / (max_tokens - 1)
    return dict(step_seconds=step, tokens_per_s=len(prompts) / step)


def paired_spread(series: dict[str, list[float]]) -> float:
    """How far apart systems are: each system's value / the first system's in the same round
    (which cancels the drift common to a round), its median over rounds, then max / min - 1
    over those medians (the first system's being 1). Noise of each system's own is averaged by
    the medians before the max / min is taken, so it inflates this figure far less than the
    median over rounds of each round's max / min - 1 (the figure this replaced), which every
    round's noise pushes up; it still is not zero for alike systems."""
    first, *_ = series.values()
    rel = [statistics.median(x / f for x, f in zip(v, first, strict=True)) for v in series.values()]
    return max(rel) / min(rel) - 1.0


def pool_step_times(
    model,
    prompts: list[list[int]],
    pools: dict[str, int],
    steps: int,
    rounds: int,
    block_size: int,
    dense=None,
    kv_cache_dtype: str = "auto",
    bandwidth: float | None = None,
) -> dict:
    """Decode-step time at every KV pool size, the pools alternated every ``steps`` steps.

    A whole ``generate`` per pool takes tens of seconds on a CPU, and the machine's speed drifts
    by more than the 5% the pools must agree within over that time. Here each pool gets its
    own `research.PagedDecoder` (the engine's `programs.decode_step`) of ``num_blocks``
    blocks (raised to what the batch needs) holding the same prefilled batch; then each of
    ``rounds`` rounds runs ``steps`` greedy decode steps (one jitted ``lax.scan``, state
    donated) at every pool in turn, in a rotated order, each pool going on from where it
    stopped. Every pool thus sees the same contexts in the same round, and a ratio taken within
    a round cancels drift. Returns the median step seconds per pool, ``spread`` (slowest median /
    fastest median - 1) and ``paired_spread`` (`paired_spread`: each pool's step time over the
    first pool's in the same round, its median over rounds, max / min - 1).

    ``dense`` = ``(step, state, tokens i32[B, 1])``, the bound's jitted dense forward: it then
    takes its turn in every round too (``steps`` calls), and ``paired_share_of_bound`` is the
    median over rounds of its step time / the slowest pool's step time in that round.

    ``bandwidth`` (bytes/s, `read_bandwidth`): each round's decode step must also read the live
    K/V (`kv_bytes_per_step` at the round's mean context), which the dense forward never does;
    ``kv_read_floor_seconds`` is that read at this bandwidth per round and
    ``paired_share_of_bound_with_kv_read`` the median over rounds of (dense step + floor) / the
    slowest pool's step: the step against the bound that includes the memory it must read.
    """
    from jax import lax

    from jax_paged.entrypoints.research import PagedDecoder

    b, lmax = len(prompts), max(len(p) for p in prompts)
    max_len = lmax + steps * (rounds + 1) + 2
    padded = np.zeros((b, lmax), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    need = blocks_needed(prompts, max_len - lmax, block_size)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_len)
    runs, states, times, info = {}, {}, {}, {}
    for name, n in pools.items():
        dec = PagedDecoder(
            model,
            max_seqs=b,
            max_len=max_len,
            block_size=block_size,
            num_blocks=max(n, need),
            kv_cache_dtype=kv_cache_dtype,
        )
        state = jax.jit(dec.prefill)(dec.params, dec.init(sp), padded, lens)[0]
        itemsize = jnp.dtype(dec.kv_dtype).itemsize

        def scan(params, state, dec=dec):
            return lax.scan(lambda s, _: dec.decode_step(params, s), state, None, length=steps)

        run = jax.jit(scan, donate_argnums=1)
        states[name], _ = jax.block_until_ready(run(dec.params, state))  # compile, warm up
        runs[name], times[name] = (run, dec.params), []
        info[name] = dict(num_kv_blocks=dec.num_blocks)
    names = list(pools)
    turns = names + (["dense_bound"] if dense is not None else [])
    times["dense_bound"] = []
    for r in range(rounds):
        for name in turns[r % len(turns) :] + turns[: r % len(turns)]:
            if name == "dense_bound":
                step, dense_state, x = dense
                t0 = time.perf_counter()
                for _ in range(steps):
                    jax.block_until_ready(step(dense_state, x))
                times[name].append((time.perf_counter() - t0) / steps)
                continue
            run, params = runs[name]
            t0 = time.perf_counter()
            states[name], tokens = jax.block_until_ready(run(params, states[name]))
            times[name].append((time.perf_counter() - t0) / steps)
            if int(jnp.min(tokens)) < 0:
                raise RuntimeError(f"pool {name}: a row stopped decoding (no blocks?)")
    dense_times = times.pop("dense_bound")
    med = {n: statistics.median(t) for n, t in times.items()}
    for name in names:
        info[name].update(
            step_seconds=med[name], runs_step_seconds=[round(t, 6) for t in times[name]]
        )
    del states
    gc.collect()
    out = dict(
        steps_per_round=steps,
        rounds=rounds,
        pools=info,
        spread=max(med.values()) / min(med.values()) - 1.0,
        paired_spread=paired_spread({n: times[n] for n in names}),
    )
    if dense_times and bandwidth:
        # Step i of round r attends to len + steps * (r + 1) + i + 1 keys.
        floors = [
            kv_bytes_per_step(model.config, lens + steps * (r + 1) + (steps + 1) / 2, itemsize)
            / bandwidth
            for r in range(rounds)
        ]
        out["read_bandwidth_gb_s"] = bandwidth / 1e9
        out["kv_read_floor_seconds"] = floors
        out["paired_share_of_bound_with_kv_read"] = statistics.median(
            (dense_times[r] + floors[r]) / max(times[n][r] for n in names) for r in range(rounds)
        )
    if dense_times:
        out["dense_bound_step_seconds"] = statistics.median(dense_times)
        out["runs_dense_bound_step_seconds"] = [round(t, 5) for t in dense_times]
        out["paired_share_of_bound"] = statistics.median(
            dense_times[r] / max(times[n][r] for n in names) for r in range(rounds)
        )
    return out


# ----------------------------------------------------------------------------------------------
# HF transformers


class HFUnsupported(Exception):
    """The model has a feature the HF reference built here does not reproduce."""


def _is_index(p) -> bool:
    return isinstance(p, int) or str(p).isdigit()


def hf_tensors(flat, num_layers: int) -> dict[str, np.ndarray]:
    """jax-paged parameters [(path, array)] -> HF tensors {name: f32 array, HF's layout}.

    Per-layer paths (``layers.3.self_attn.q_proj.kernel``) and stacked ones
    (``layers.self_attn.q_proj.kernel`` with a leading [L] axis) both map to
    ``model.layers.3.self_attn.q_proj.weight``; kernels [in, out] become HF's [out, in].
    """
    out = {}
    for path, arr in flat:
        keys = [str(p) for p in path]
        *mods, leaf = keys
        transpose = leaf == "kernel"
        hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
        w = np.asarray(arr).astype(np.float32)

        def name(parts, hf_leaf=hf_leaf):
            n = ".".join([*parts, hf_leaf])
            return n if parts[0] == "lm_head" else "model." + n

        if mods[0] == "layers" and not any(_is_index(p) for p in path[1:]):
            if w.shape[:1] != (num_layers,):
                raise ValueError(
                    f"{'.'.join(keys)}: stacked layer parameter of shape {w.shape}, expected a "
                    f"leading axis of {num_layers}"
                )
            for i in range(num_layers):
                out[name(["layers", str(i), *mods[1:]])] = w[i].T if transpose else w[i]
        else:
            out[name(mods)] = w.T if transpose else w
    return out


def _flat_params(model) -> list[tuple[tuple, np.ndarray]]:
    return [(path, v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def hf_config(transformers, c: models.ModelConfig):
    rope = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type in ("linear", "llama3"):
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(
            low_freq_factor=c.rope_low_freq_factor,
            high_freq_factor=c.rope_high_freq_factor,
            original_max_position_embeddings=c.rope_original_max_position,
        )
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    t = c.model_type
    if t == "llama":
        if c.qkv_bias != c.o_bias:
            raise HFUnsupported("a Llama with q/k/v bias but not o bias (or the reverse)")
        kw.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
        cls = transformers.LlamaConfig
    elif t == "mistral":
        kw.update(sliding_window=c.sliding_window)
        cls = transformers.MistralConfig
    elif t in ("qwen2", "qwen3"):
        if c.sliding_window is not None:
            raise HFUnsupported(f"{t} with a sliding window")
        if t == "qwen3":
            kw.update(attention_bias=c.qkv_bias)
        cls = transformers.Qwen2Config if t == "qwen2" else transformers.Qwen3Config
    else:
        raise HFUnsupported(f"model_type {t!r}")
    return cls(**kw)


def build_hf_model(loaded: models.LoadedModel):
    """An HF causal LM (fp32, eval) holding jax-paged's own loaded weights."""
    import torch
    import transformers

    config = hf_config(transformers, loaded.config)
    arch = models.SUPPORTED_ARCHITECTURES[loaded.config.model_type]
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    ours = hf_tensors(_flat_params(loaded.model), loaded.config.num_layers)
    theirs = dict(model.named_parameters())  # tied lm_head is listed once, as the embedding
    missing = sorted(set(theirs) - set(ours))
    extra = sorted(set(ours) - set(theirs))
    if missing or extra:
        raise ValueError(f"weight copy to HF: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in theirs.items():
            w = torch.from_numpy(np.ascontiguousarray(ours[name]))
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{name}: jax-paged {tuple(w.shape)}, HF {tuple(p.shape)}")
            p.copy_(w)
    return model


def run_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict:
    """HF greedy generate of a static batch (left padding + attention mask)."""
    import torch
    import transformers

    b, length = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p) :] = torch.tensor(p)
        mask[i, length - len(p) :] = 1
    gen = transformers.GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
        use_cache=True,
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    wall = time.perf_counter() - t0
    tokens = out[:, length:].tolist()
    n = sum(len(t) for t in tokens)
    if n != b * max_tokens:
        raise RuntimeError(f"HF generated {n} tokens, expected {b * max_tokens}")
    return dict(wall_s=wall, output_tokens=n, output_tokens_per_s=n / wall, tokens=tokens)


# ----------------------------------------------------------------------------------------------
# The benchmark


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _log(msg: str) -> None:
    print(f"[bench_decode] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default=None, help=f"default {DEFAULTS['batch_sizes']}")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument(
        "--pools",
        default=None,
        help="KV pool sizes: block counts (raised to what the batch needs) or sizes "
        f"(MiB, GiB); default {DEFAULTS['pools']}",
    )
    ap.add_argument(
        "--pool-rounds",
        type=int,
        default=None,
        help="rounds of the alternated per-pool decode-step timing (0: skip); default 9",
    )
    ap.add_argument("--pool-round-steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="jax-paged's KV pages (auto: the model's dtype)",
    )
    ap.add_argument("--steps", type=int, default=32, help="max_decode_steps (per device call)")
    ap.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="detokenise while the next step runs (EngineConfig.async_scheduling)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--torch-threads", type=int, default=None, help="default: torch's own")
    ap.add_argument(
        "--compare-single-step",
        action="store_true",
        help="also run max_decode_steps=1 at the first pool",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: batch 4, 8 tokens, 1 repeat, pools 64 blocks and 64 MiB",
    )
    add_output_arg(ap, "decode_cpu_smollm2.json (--kv-cache-dtype bfloat16: ..._bf16_kv.json)")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    args.pools = [parse_pool(p) for p in args.pools.split(",") if p.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes needs positive integers")
    if args.max_tokens < 1 or args.repeats < 1 or not args.pools:
        ap.error("--max-tokens and --repeats must be >= 1, and --pools not empty")
    if args.pool_rounds < 0 or args.pool_round_steps < 1:
        ap.error("--pool-rounds must be >= 0 and --pool-round-steps >= 1")
    return args


def run(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    native = native_kernel_report()
    if native is not None:
        _log(f"native CPU kernel: {native}")
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    loaded = models.load(args.model, dtype=dt)
    cfg = loaded.config
    texts = make_prompts(max(args.batch_sizes))
    all_ids, tok_source = tokenize(loaded, texts)
    longest = max(len(p) for p in all_ids) + args.max_tokens
    if longest > cfg.max_position_embeddings:
        raise SystemExit(
            f"prompt + max_tokens = {longest} tokens exceeds the model's context "
            f"({cfg.max_position_embeddings}); lower --max-tokens"
        )
    T = args.max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=T, ignore_eos=True)
    k_check = min(CHECK_TOKENS, T)

    hf_model, hf_info = None, None
    if not args.no_hf:
        import torch

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        t0 = time.perf_counter()
        try:
            hf_model = build_hf_model(loaded)
            hf_info = dict(
                weights="copied from jax-paged's loaded model",
                dtype="float32",
                torch_threads=torch.get_num_threads(),
                build_seconds=round(time.perf_counter() - t0, 3),
            )
        except HFUnsupported as e:
            hf_info = dict(skipped=f"HF reference not built: {e}")
        _log(f"HF model: {hf_info}")
    gen = loaded.generation_config
    pad_id = next(
        (t for t in (gen.pad_token_id, *gen.eos_token_ids) if t is not None and t < cfg.vocab_size),
        0,
    )

    dense_step, dense_state = make_dense_step(loaded.model)
    bandwidth = read_bandwidth() if args.pool_rounds else None
    per_batch, first_check = {}, None
    for b in args.batch_sizes:
        ids = all_ids[:b]
        prompts = [{"prompt_token_ids": p} for p in ids]
        need = blocks_needed(ids, T, args.block_size)
        llms, pool_info = {}, {}
        systems = []
        for name, value, kind in args.pools:
            kw = dict(
                max_num_seqs=b,
                max_decode_steps=args.steps,
                block_size=args.block_size,
                enable_prefix_caching=args.prefix_caching,
                kv_cache_dtype=args.kv_cache_dtype,
                async_scheduling=args.async_scheduling,
            )
            if kind == "blocks":
                kw["num_kv_blocks"] = max(value, need)
            else:
                kw["kv_cache_memory_bytes"] = value
            llms[name] = (LLM(loaded, **kw), kw)
            systems.append(name)
        if args.compare_single_step:
            first = args.pools[0][0]
            kw = dict(llms[first][1], max_decode_steps=1)
            llms["single_step"] = (LLM(loaded, **kw), kw)
            systems.append("single_step")

        warm = {}
        for name, (llm, _) in llms.items():
            _log(f"B={b} {name}: warm-up (compiles)")
            warm[name] = run_paged(llm, prompts, params)
            pool_info[name] = dict(
                num_kv_blocks=llm.engine.num_blocks,
                holds_batch=llm.engine.num_blocks >= need,
                warmup_seconds=round(warm[name]["wall_s"], 3),
                **compile_report(llm.get_metrics()),
            )
        first_pool = args.pools[0][0]
        ref_tokens = warm[first_pool]["tokens"]
        pools_agree = all(w["tokens"] == ref_tokens for w in warm.values())

        _log(f"B={b}: dense-forward bound")
        bound = dense_bound(dense_step, dense_state, np.asarray([[p[0]] for p in ids], np.int32))
        _log(f"B={b}: contiguous-cache decode")
        contiguous = contiguous_decode(loaded.model, ids, T)

        hf_warm = None
        if hf_model is not None:
            _log(f"B={b} hf: warm-up")
            hf_warm = run_hf(hf_model, ids, T, pad_id)
            systems.append("hf")
            if first_check is None:
                single = run_hf(hf_model, ids[:1], k_check, pad_id)["tokens"][0]
                first_check = dict(
                    tokens=k_check,
                    paged=ref_tokens[0][:k_check],
                    hf=single,
                    match=single == ref_tokens[0][:k_check],
                )

        runs = {s: [] for s in systems}
        for r in range(args.repeats):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for s in order:
                _log(f"B={b} repeat {r + 1}/{args.repeats}: {s}")
                if s == "hf":
                    runs[s].append(run_hf(hf_model, ids, T, pad_id))
                else:
                    runs[s].append(run_paged(llms[s][0], prompts, params))

        paged = {}
        for name in llms:
            rs = runs[name]
            paged[name] = dict(
                output_tokens_per_s=_median(rs, "output_tokens_per_s"),
                runs_tokens_per_s=[round(x["output_tokens_per_s"], 2) for x in rs],
                decode_tokens_per_s=_median(rs, "decode_tokens_per_s"),
                prefill_seconds=_median(rs, "prefill_seconds"),
                host_share_of_wall=_median(rs, "host_share"),
                device_calls_per_run=_median(rs, "device_calls"),
                output_tokens_per_run=rs[0]["output_tokens"],
                preemptions_in_timed_runs=sum(x["preemptions"] for x in rs),
                compile_seconds_in_timed_runs=round(sum(x["compile_s"] for x in rs), 3),
                **pool_info[name],
            )
        pool_tps = {n: paged[n]["output_tokens_per_s"] for n, _, _ in args.pools}
        paged_tps = min(pool_tps.values())
        decode_tps = min(paged[n]["decode_tokens_per_s"] for n, _, _ in args.pools)
        row = dict(
            num_requests=b,
            prompt_tokens=sum(len(p) for p in ids),
            blocks_needed=need,
            paged=paged,
            paged_tokens_per_s=paged_tps,
            pool_spread=max(pool_tps.values()) / paged_tps - 1.0,
            paged_pools_agree=pools_agree,
            dense_bound=bound,
            paged_share_of_bound=paged_tps / bound["tokens_per_s"],
            paged_decode_tokens_per_s=decode_tps,
            decode_share_of_bound=decode_tps / bound["tokens_per_s"],
            decode_pool_spread=max(paged[n]["decode_tokens_per_s"] for n, _, _ in args.pools)
            / max(decode_tps, 1e-9)
            - 1.0,
            contiguous_decode=contiguous,
            decode_share_of_contiguous=None
            if contiguous["tokens_per_s"] is None
            else decode_tps / contiguous["tokens_per_s"],
        )
        # Paired figures: each repeat runs every system back to back, so a ratio taken inside
        # one repeat cancels the machine's drift between repeats; their median is beside the
        # ratio of medians above (the goals use the latter).
        per_repeat_slowest = [
            min(runs[n][r]["output_tokens_per_s"] for n, _, _ in args.pools)
            for r in range(args.repeats)
        ]
        row["paired"] = dict(
            pool_spread=paired_spread(
                {n: [x["output_tokens_per_s"] for x in runs[n]] for n, _, _ in args.pools}
            )
        )
        if args.compare_single_step:
            row["multi_over_single_speedup"] = (
                pool_tps[first_pool] / paged["single_step"]["output_tokens_per_s"]
            )
        if hf_warm is not None:
            hf_tps = _median(runs["hf"], "output_tokens_per_s")
            agree = [
                p[:k_check] == h[:k_check]
                for p, h in zip(ref_tokens, hf_warm["tokens"], strict=True)
            ]
            row["hf"] = dict(
                output_tokens_per_s=hf_tps,
                runs_tokens_per_s=[round(x["output_tokens_per_s"], 2) for x in runs["hf"]],
                warmup_seconds=round(hf_warm["wall_s"], 3),
            )
            row["paged_over_hf"] = paged_tps / hf_tps
            row["paired"]["paged_over_hf"] = statistics.median(
                per_repeat_slowest[r] / runs["hf"][r]["output_tokens_per_s"]
                for r in range(args.repeats)
            )
            row["hf_batch_first_tokens_match_rate"] = sum(agree) / len(agree)
        per_batch[str(b)] = row
        del llms
        gc.collect()
        if args.pool_rounds:
            _log(f"B={b}: decode steps at each pool, alternated")
            row["pool_steps"] = pool_step_times(
                loaded.model,
                ids,
                {n: pool_info[n]["num_kv_blocks"] for n, _, _ in args.pools},
                args.pool_round_steps,
                args.pool_rounds,
                args.block_size,
                dense=(dense_step, dense_state, np.asarray([[p[0]] for p in ids], np.int32)),
                kv_cache_dtype=args.kv_cache_dtype,
                bandwidth=bandwidth,
            )

    result = dict(
        benchmark="decode",
        run=run_metadata(memory_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9),
        model=loaded.source,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        platform=jax.devices()[0].platform,
        device=jax.devices()[0].device_kind,
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        jax=jax.__version__,
        batch_sizes=args.batch_sizes,
        max_tokens=T,
        repeats=args.repeats,
        decode_steps_per_call=args.steps,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        pools=[n for n, _, _ in args.pools],
        prompt_ids=tok_source,
        prompt_words=[min(len(t.split()) for t in texts), max(len(t.split()) for t in texts)],
        prompt_tokens=[min(len(p) for p in all_ids), max(len(p) for p in all_ids)],
        hf=hf_info,
        hf_matches_first_tokens=None if first_check is None else first_check["match"],
        hf_first_tokens=first_check,
        read_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9,
        native_cpu_kernel=native,
        results=per_batch,
    )
    rows = per_batch.values()
    best_paged = max(rows, key=lambda r: r["paged_tokens_per_s"])
    result["best_paged"] = dict(
        batch_size=best_paged["num_requests"], output_tokens_per_s=best_paged["paged_tokens_per_s"]
    )
    if hf_model is not None:
        best_hf = max(rows, key=lambda r: r["hf"]["output_tokens_per_s"])
        result["best_hf"] = dict(
            batch_size=best_hf["num_requests"],
            output_tokens_per_s=best_hf["hf"]["output_tokens_per_s"],
        )
        result["best_paged_over_best_hf"] = (
            result["best_paged"]["output_tokens_per_s"] / result["best_hf"]["output_tokens_per_s"]
        )
    program_max = [
        p["max_program_compile_seconds"]
        for r in rows
        for p in r["paged"].values()
        if "max_program_compile_seconds" in p
    ]
    result["max_program_compile_seconds"] = max(program_max) if program_max else None
    share64 = per_batch["64"]["decode_share_of_bound"] if "64" in per_batch else None
    hf64 = per_batch["64"].get("paged_over_hf") if "64" in per_batch else None
    ratio = result.get("best_paged_over_best_hf")
    compile_max = result["max_program_compile_seconds"]
    result["goals"] = dict(
        pool_spread_under_5pct=all(r["pool_spread"] < 0.05 for r in rows),
        pool_step_spread_under_5pct=None
        if not args.pool_rounds
        else all(r["pool_steps"]["spread"] < 0.05 for r in rows),
        # The same two, each ratio taken within one repeat (round) first: drift cancels.
        paired_pool_spread_under_5pct=all(r["paired"]["pool_spread"] < 0.05 for r in rows),
        paired_pool_step_spread_under_5pct=None
        if not args.pool_rounds
        else all(r["pool_steps"]["paired_spread"] < 0.05 for r in rows),
        decode_share_of_bound_at_least_0_9_at_b64=None if share64 is None else share64 >= 0.9,
        paired_decode_step_share_of_bound_at_least_0_9_at_b64=None
        if not args.pool_rounds or "64" not in per_batch
        else per_batch["64"]["pool_steps"]["paired_share_of_bound"] >= 0.9,
        paired_decode_step_share_of_bound_with_kv_read_at_least_0_9_at_b64=None
        if not args.pool_rounds or "64" not in per_batch
        else per_batch["64"]["pool_steps"]["paired_share_of_bound_with_kv_read"] >= 0.9,
        paged_over_hf_at_least_1_8_at_b64=None if hf64 is None else hf64 >= 1.8,
        best_paged_over_best_hf_at_least_2=None if ratio is None else ratio >= 2.0,
        compile_at_most_15s_per_program=None if compile_max is None else compile_max <= 15.0,
        no_preemptions=all(
            p["preemptions_in_timed_runs"] == 0 for r in rows for p in r["paged"].values()
        ),
        no_compiles_in_timed_runs=all(
            p["compile_seconds_in_timed_runs"] == 0 for r in rows for p in r["paged"].values()
        ),
    )
    result["total_seconds"] = round(time.perf_counter() - t_start, 2)
    return result


def main(argv=None) -> int:
    emit(run(argv), parse_args(argv).output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
