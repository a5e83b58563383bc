"""Decode tokens/s at tensor_parallel_size 1, 2, 4, as JSON.

    python scripts/bench_tp.py                     # SmolLM2 is 9 heads / 3 KV heads: tp 1, 3
    python scripts/bench_tp.py --model tiny --tp 1,2,4
    python scripts/bench_tp.py --quick             # tiny random model, tp 1, 2, few tokens

Without accelerators the devices are emulated: the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax starts, so every "device" is
a slice of the same CPU cores. There the figures measure what sharding costs (collectives,
per-shard dispatch), never a speed-up: on this kind of machine tp > 1 is expected to be slower.
On a GPU or TPU host the same command measures real tensor parallelism over its chips.

Per tp: the same requests (greedy, ``ignore_eos``, the same token ids) through
`LLM.generate`, one warm-up run (compiles), then the median output tokens/s over
``--repeats``; the outputs must equal tp 1's; ``kv_cache_bytes_per_device`` from the metrics.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_support import add_output_arg, emit, run_metadata  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402


def tiny_model() -> models.LoadedModel:
    """A random 4-layer model with 8 heads and 4 KV heads (tp 1, 2, 4 divide them)."""
    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
    )
    model = models.Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return models.LoadedModel(model, None, cfg, models.GenerationConfig(eos_token_ids=[2]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="'tiny', or a model path (default SmolLM2)")
    ap.add_argument("--tp", default=None, help="tensor_parallel_size values, e.g. 1,2,4")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    add_output_arg(ap, "tp_cpu_emulated.json (SmolLM2 and --model tiny, as two keys)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.tp, args.batch_size, args.max_tokens, args.repeats = "tiny", "1,2", 4, 8, 1
    loaded = tiny_model() if args.model == "tiny" else models.load(args.model)
    c = loaded.config
    default_tp = "1,3" if c.num_heads % 3 == 0 and c.num_kv_heads % 3 == 0 else "1,2,4"
    tps = [int(t) for t in (args.tp or default_tp).split(",")]
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, c.vocab_size, args.prompt_len).tolist()}
        for _ in range(args.batch_size)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs, ref = {}, None
    for tp in tps:
        llm = LLM(
            loaded,
            tensor_parallel_size=tp,
            max_num_seqs=args.batch_size,
            num_kv_blocks=args.batch_size * -(-(args.prompt_len + args.max_tokens) // 16) + 1,
            enable_prefix_caching=False,
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        warm = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        ref = tokens if ref is None else ref
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            rates.append(args.batch_size * args.max_tokens / (time.perf_counter() - t0))
        m = llm.get_metrics()
        runs[str(tp)] = dict(
            output_tokens_per_s=round(statistics.median(rates), 2),
            runs_tokens_per_s=[round(r, 2) for r in rates],
            warmup_seconds=round(warm, 2),
            kv_cache_bytes_per_device=m["kv_cache_bytes_per_device"],
            outputs_equal_tp1=tokens == ref,
        )
        del llm
    platform = jax.devices()[0].platform
    result = dict(
        benchmark="tensor_parallel_decode",
        run=run_metadata(),
        model=args.model or "SmolLM2-135M-Instruct (embedded)",
        platform=platform,
        devices=jax.device_count(),
        emulated=platform == "cpu",
        note=(
            "emulated CPU devices share the same cores: this measures sharding overhead, "
            "not a speed-up"
            if platform == "cpu"
            else "real devices"
        ),
        batch_size=args.batch_size,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        tp=runs,
    )
    emit(result, args.output)
    return result


if __name__ == "__main__":
    main()
