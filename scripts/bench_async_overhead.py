"""Where a server's time goes: the same requests through `LLM.generate` and through
`AsyncLLM` (no HTTP), with and without the decode-call cap, on one engine; prints JSON with the
wall time and the engine's counters (steps, device calls, time inside compiled calls by kind,
compiles met during the run). The engine compiles every step variant first, as the server does.

    python scripts/bench_async_overhead.py                 # SmolLM2, 32 x (128 in, 128 out)
    python scripts/bench_async_overhead.py --quick         # a smaller run
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support
from bench_support import add_output_arg, emit, run_metadata  # noqa: E402

from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.serve import AsyncLLM  # noqa: E402

_KEYS = (
    "num_steps",
    "num_device_calls",
    "device_seconds",
    "compiled_seconds",
    "decode_loop_tokens",
    "generated_tokens",
    "compile_seconds",
    "compiled_variants",
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-decode-wait-ms", type=float, default=50.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--no-precompile", action="store_true", help="compile variants on first use instead"
    )
    add_output_arg(ap, "serving_async_overhead_smollm2.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 32, 32
    # As `jax-paged serve` does: every step variant compiled up front, so the runs below time
    # the engine and its async front, not compiles (`compile_seconds` in each run says so).
    llm = LLM(args.model, max_model_len=2048, precompile=not args.no_precompile)
    vocab = llm.engine.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def prompts(seed):  # fresh prompts per run: no run reuses another's prefix-cache entries
        r = np.random.default_rng(seed)
        n, length = args.num_prompts, args.input_len
        return [{"prompt_token_ids": r.integers(3, vocab, length).tolist()} for _ in range(n)]

    def snap():
        m = llm.get_metrics()
        return {k: m[k] for k in _KEYS} | {"by_kind": dict(m["compiled_seconds_by_kind"])}

    def diff(a, b):
        out = {k: round(b[k] - a[k], 3) for k in _KEYS}
        kinds = b["by_kind"]
        out["compiled_seconds_by_kind"] = {
            k: round(v - a["by_kind"].get(k, 0.0), 3) for k, v in kinds.items()
        }
        return out

    llm.generate(prompts(1), sp)  # compiles
    result = {"benchmark": "async_overhead", "config": vars(args), "runs": {}}
    a, t = snap(), time.perf_counter()
    llm.generate(prompts(2), sp)
    result["runs"]["LLM.generate"] = {
        "wall_s": round(time.perf_counter() - t, 3),
        **diff(a, snap()),
    }
    for i, wait_ms in enumerate((0.0, args.max_decode_wait_ms)):
        allm = AsyncLLM(llm, max_decode_wait_s=wait_ms / 1000 or None)

        a, t = snap(), time.perf_counter()
        asyncio.run(_run_all(allm, prompts(3 + i), sp))
        wall = time.perf_counter() - t
        allm.shutdown()
        name = f"AsyncLLM max_decode_wait_ms={wait_ms:g}" if wait_ms else "AsyncLLM no cap"
        result["runs"][name] = {"wall_s": round(wall, 3), **diff(a, snap())}
    result["run"] = run_metadata()
    emit(result, args.output)
    return result


async def _run_all(allm: AsyncLLM, prompts: list, sp: SamplingParams) -> None:
    async def one(p):
        async for _ in allm.generate(p, sp):
            pass

    await asyncio.gather(*(one(p) for p in prompts))


if __name__ == "__main__":
    main()
