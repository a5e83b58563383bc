"""Decode throughput of the engine: multi-step decode on the device vs one host sync per token.

    python scripts/bench_decode.py                 # embedded SmolLM2, 16 requests x 64 tokens
    python scripts/bench_decode.py --num-requests 32 --max-tokens 128 --repeats 3

Both engines run in this process on the same requests, interleaved, after a warm-up run that
compiles every shape; the JSON reports per configuration the median over repeats of:
output tokens/s, the share of wall time spent outside compiled code (host scheduling, input
preparation, detokenisation), the number of compiled variants and the compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Measure real compile times: no persistent compilation cache for this process.
os.environ.setdefault("JAX_PAGED_CACHE_DIR", "")

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea.",
    "def quicksort(xs):",
    "List three uses of copper:",
    "In a distant galaxy, a small robot",
    "The recipe for pancakes is",
    "Explain photosynthesis to a child.",
    "Once upon a time in Paris,",
]


def run_once(llm: LLM, prompts, params) -> dict:
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    inside = after["compiled_seconds"] - before["compiled_seconds"]
    return dict(
        wall_s=wall,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall,
        compiled_call_s=inside,
        host_share=max(0.0, 1.0 - inside / wall),
        device_calls=after["num_device_calls"] - before["num_device_calls"],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per device call")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)

    loaded = models.load(args.model, dtype=args.dtype)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    # ignore_eos: every request decodes exactly max_tokens, so both configurations do equal work.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = {"multi_step": args.steps, "single_step": 1}
    engines = {}
    for name, steps in configs.items():
        llm = LLM(
            loaded,
            max_num_seqs=max(8, args.num_requests),
            max_num_batched_tokens=512,
            max_decode_steps=steps,
        )
        t0 = time.perf_counter()
        run_once(llm, prompts, params)  # warm-up: compiles every shape this workload uses
        engines[name] = (llm, time.perf_counter() - t0)
    runs = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (llm, _) in engines.items():
            runs[name].append(run_once(llm, prompts, params))

    result = dict(
        benchmark="decode",
        model=loaded.source,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
    )
    for name, (llm, warm) in engines.items():
        m = llm.get_metrics()
        rs = runs[name]
        result[name] = dict(
            decode_steps_per_call=configs[name],
            output_tokens_per_s=statistics.median(r["output_tokens_per_s"] for r in rs),
            host_share_of_wall=statistics.median(r["host_share"] for r in rs),
            device_calls_per_run=statistics.median(r["device_calls"] for r in rs),
            compiled_variants=m["compiled_variants"],
            compile_seconds=m["compile_seconds"],
            warmup_seconds=warm,
        )
    result["multi_over_single_speedup"] = (
        result["multi_step"]["output_tokens_per_s"] / result["single_step"]["output_tokens_per_s"]
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
