"""How many programs the engine compiles over a long mixed run, and how long each takes, as JSON.

    python scripts/bench_variants.py                    # 1,000 requests, tiny random Llama
    python scripts/bench_variants.py --model default    # the embedded SmolLM2 (slow on a CPU)
    python scripts/bench_variants.py --num-requests 200 --seed 3

Every distinct padded shape or static option is one more XLA compilation: the first request
that hits it waits for the compiler. This run throws a seeded, deliberately varied workload at
one `LLMEngine` and counts what got compiled. Goal: nothing beyond the variants the engine's
limits fix in advance (`ModelRunner.variant_names`, what ``precompile=True`` compiles at
start-up: here 19 on a CPU, whose finer step sizes trade compiles for less padding, and 11
where sizes are powers of two); the run lists what it found:

- prompt lengths log-normal around ``--mean-prompt`` tokens (clipped to [1, 1024]), output
  lengths log-normal around ``--mean-output`` (clipped to [1, 256]): prefill chunks of every
  size, chunked prefill of long prompts, decode batches of every size as requests come and go;
- arrivals online: a Poisson number of new requests before every engine step (``--rate``), so
  batch compositions keep changing;
- sampling mixed in one batch: 40% greedy; the rest sampled with temperatures in [0.3, 1.2],
  half with top-p, a third with top-k, some seeded; 10% ask for 1-5 log-probs, 5% add their
  own stop token ids, 5% are ``n = 2``, 10% ``ignore_eos``.

Left out on purpose: repetition/presence/frequency penalties (the first such request switches
the engine to per-token count tracking, a one-time extra set of variants) and prompt log-probs
(one extra variant per prefill size while such a request prefills). The JSON lists every
compiled program with its compile seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support
# Count real compilations: no persistent compilation cache for this process.
os.environ.setdefault("JAX_PAGED_CACHE_DIR", "")

import numpy as np  # noqa: E402
from bench_support import add_output_arg, emit, run_metadata  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.loading import GenerationConfig, LoadedModel  # noqa: E402


def tiny_model(vocab: int = 512) -> LoadedModel:
    """A small random Llama (2 layers): compile counts do not depend on the weights."""
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    return LoadedModel(model, None, cfg, GenerationConfig(eos_token_ids=[2]), "tiny random Llama")


def make_workload(n: int, vocab: int, mean_prompt: float, mean_output: float, seed: int):
    """(prompt token ids, SamplingParams) per request; see the module docstring."""
    rng = np.random.default_rng(seed)

    def lognormal(mean, lo, hi):
        sigma = 1.0
        x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma)
        return int(np.clip(round(x), lo, hi))

    work = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=lognormal(mean_prompt, 1, 1024)).tolist()
        kw = dict(max_tokens=lognormal(mean_output, 1, 256), ignore_eos=bool(rng.random() < 0.1))
        if rng.random() < 0.6:
            kw["temperature"] = float(rng.uniform(0.3, 1.2))
            if rng.random() < 0.5:
                kw["top_p"] = float(rng.uniform(0.8, 0.99))
            if rng.random() < 0.33:
                kw["top_k"] = int(rng.choice([5, 20, 50]))
            if rng.random() < 0.5:
                kw["seed"] = int(rng.integers(0, 2**31))
            if rng.random() < 0.05 / 0.6:
                kw["n"] = 2
        else:
            kw["temperature"] = 0.0
        if rng.random() < 0.1:
            kw["logprobs"] = int(rng.integers(1, 6))
        if rng.random() < 0.05:
            kw["stop_token_ids"] = rng.integers(3, vocab, size=int(rng.integers(1, 4))).tolist()
        work.append((prompt, SamplingParams(**kw)))
    return work


def run(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf, 'default' (SmolLM2)")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--mean-prompt", type=float, default=160.0)
    ap.add_argument("--mean-output", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=2.0, help="mean new requests per step")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of one step"
    )
    ap.add_argument("--seed", type=int, default=0)
    add_output_arg(ap, "variants_cpu_tiny_llama.json")
    args = ap.parse_args(argv)

    if args.model is None:
        loaded = tiny_model()
    else:
        loaded = models.load(None if args.model == "default" else args.model)
    vocab = loaded.config.vocab_size
    work = make_workload(args.num_requests, vocab, args.mean_prompt, args.mean_output, args.seed)
    llm = LLM(
        loaded,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = llm.engine
    rng = np.random.default_rng(args.seed + 1)
    t0 = time.perf_counter()
    i = finished = tokens = 0
    variants_seen = []  # compiled variants after each request finished, for the curve
    while i < len(work) or engine.has_unfinished_requests():
        for _ in range(int(rng.poisson(args.rate))):
            if i < len(work):
                prompt, params = work[i]
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
                i += 1
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            if out.finished:
                finished += 1
                tokens += sum(len(c.token_ids) for c in out.outputs)
                variants_seen.append(engine.get_metrics()["compiled_variants"])
    wall = time.perf_counter() - t0
    m = engine.get_metrics()
    by_program = m["compile_seconds_by_program"]
    planned = engine.runner.variant_names()
    return dict(
        benchmark="compiled_variants",
        run=run_metadata(),
        output=args.output,
        model=loaded.source,
        num_requests=args.num_requests,
        finished=finished,
        output_tokens=tokens,
        steps=m["num_steps"],
        wall_seconds=round(wall, 2),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        compiled_variants=m["compiled_variants"],
        variants_after_first_100_requests=variants_seen[min(99, len(variants_seen) - 1)]
        if variants_seen
        else 0,
        compile_seconds=round(m["compile_seconds"], 3),
        compile_seconds_by_program={k: round(v, 3) for k, v in sorted(by_program.items())},
        max_program_compile_seconds=round(max(by_program.values(), default=0.0), 3),
        num_preemptions=m["num_preemptions"],
        planned_variants=len(planned),
        unplanned_variants=sorted(set(by_program) - set(planned)),
        goal_met=set(by_program) <= set(planned),
    )


def main(argv=None) -> int:
    result = run(argv)
    emit(result, result.pop("output"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
