"""``jax-paged serve MODEL`` (also ``python -m jax_paged.serve MODEL``): the OpenAI-compatible
server, vLLM's ``vllm serve`` options where they apply.

    jax-paged serve path/to/hf_folder --port 8000 --api-key secret --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

API_KEY_ENV = "JAX_PAGED_API_KEY"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="an HF model folder, a .gguf file or a checkpoint folder (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) requests use; the first is the one responses carry "
        "(default: MODEL as given)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool size in bytes")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument(
        "--max-decode-steps", type=int, default=32, help="decode steps per device call (most)"
    )
    e.add_argument(
        "--max-decode-wait-ms",
        type=float,
        default=50.0,
        help="cap a multi-step decode call at about this long so an arriving request waits "
        "no more; 0 = no cap (default 50)",
    )
    e.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of earlier prompts' prefixes (default on)",
    )
    e.add_argument(
        "--async-scheduling",
        action="store_true",
        help="detokenise a step's outputs while the device runs the next one",
    )
    e.add_argument("--max-logprobs", type=int, default=20)
    e.add_argument("--max-n", type=int, default=256, help="the most completions per request")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument(
        "--attention-impl",
        default="auto",
        choices=["auto", "reference", "xla", "cpu", "gpu", "mosaic_gpu", "tpu"],
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip compiling every step variant at start-up (then the first requests of each "
        "batch size wait for a compile)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields of the parsed options."""
    return dict(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_decode_steps=args.max_decode_steps,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        seed=args.seed,
        attention_impl=args.attention_impl,
    )


def serve(args: argparse.Namespace) -> int:
    """Loads the model, warms it up, and serves until interrupted."""
    try:
        import uvicorn

        from jax_paged.serve.api_server import build_app
        from jax_paged.serve.async_engine import AsyncLLM
        from jax_paged.serve.metrics import ServerMetrics
    except ImportError as e:
        print(f"jax-paged serve needs the serve extra ({e}): pip install 'jax-paged[serve]'",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.max_decode_wait_ms < 0:
        print("--max-decode-wait-ms must be >= 0", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    names = args.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    metrics = ServerMetrics(names[0])
    wait = args.max_decode_wait_ms / 1000 or None
    try:
        llm = AsyncLLM(
            args.model, dtype=args.dtype, max_decode_wait_s=wait, metrics=metrics,
            precompile=not args.no_warmup, **engine_kwargs(args),
        )  # fmt: skip
    except (ValueError, FileNotFoundError, MemoryError) as e:
        print(f"jax-paged serve: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        _warm_up(llm)
    app = build_app(
        llm, served_model_names=names, api_key=api_key, metrics=metrics, model_path=args.model or ""
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        llm.shutdown()
    return 0


def _warm_up(llm) -> None:
    """Runs one short request through the engine thread (the programs are compiled already,
    `EngineConfig.precompile`): the first client meets a server that has served."""
    import asyncio

    from jax_paged.entrypoints.sampling_params import SamplingParams

    async def run():
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        async for _ in llm.generate({"prompt_token_ids": [1, 2, 3]}, params):
            pass

    asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jax-paged", description="jax-paged command line")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="the OpenAI-compatible server"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m jax_paged.serve MODEL [options]``: ``jax-paged serve`` without the word."""
    parser = argparse.ArgumentParser(prog="python -m jax_paged.serve")
    add_serve_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
