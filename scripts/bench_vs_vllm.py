"""jax-paged against the real vLLM, offline: the same machine, weights and token ids, as JSON.

    bash scripts/setup_vllm.sh                          # vLLM's own venv, .venv-vllm (once)
    python scripts/bench_vs_vllm.py                     # SmolLM2 float32, B = 8, 32, 64
    python scripts/bench_vs_vllm.py --dtype bfloat16    # both systems in bfloat16
    python scripts/bench_vs_vllm.py --quick --no-vllm   # smoke run of jax-paged's side alone

Both systems load one HF folder (a GGUF model, such as the default SmolLM2, is first written
out as float32 safetensors, so both run the same dequantised weights) in ``--dtype``. jax-paged
runs in this process (`jax_paged.LLM`); vLLM runs in a subprocess of its own venv
(`bench_support.vllm_peer.OfflineVLLM`, started once, so its start-up is not timed). Both get the
same settings: ``max_num_seqs`` = the largest batch, a 2 GiB KV cache, prefix caching off (the
repeats reuse the prompts), greedy with ``ignore_eos``.

For each batch size B the prompts are the first B of `bench_decode`'s deterministic English
prompts (20-60 words), tokenised once by our tokenizer; both systems get the token ids. Each
system first runs the batch once untimed (jax-paged compiles its programs there). Then
``--repeats`` rounds, the systems' order swapped every round (ours first, then vLLM first, ...),
each system timing, inside its own process, two `generate` calls on the batch:
``max_tokens=1`` (the prefill: ``prefill_s``) and ``max_tokens=--max-tokens`` (``total_s``).
Reported per system, medians over the rounds: ``output_tokens_per_s`` = B x max_tokens /
total_s, ``prefill_s``, ``decode_tokens_per_s`` = B x (max_tokens - 1) / (total_s -
prefill_s). ``paired_ratio`` is the median over rounds of ours / vLLM's output tokens/s (above
1: jax-paged faster), with ``prefill_ratio`` (vLLM's prefill seconds / ours) and
``decode_ratio`` likewise. ``first_tokens_agree``: the share of rows whose first 8 greedy
tokens are the same in both systems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
from bench_decode import make_prompts, tokenize
from bench_support import add_output_arg, run_metadata
from bench_support.vllm_peer import DEFAULT_PYTHON, OfflineVLLM, export_hf_folder

import models
from jax_paged import LLM, SamplingParams

CHECK_TOKENS = 8
KV_BYTES = 2 << 30  # vLLM's VLLM_CPU_KVCACHE_SPACE=2 (GiB), the same for jax-paged


def _log(msg: str) -> None:
    print(f"[bench_vs_vllm] {msg}", file=sys.stderr, flush=True)


class Ours:
    """jax-paged's side, answering like `OfflineVLLM.generate`."""

    def __init__(self, loaded, *, max_num_seqs: int, max_model_len: int):
        self.llm = LLM(
            loaded,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=KV_BYTES,
            enable_prefix_caching=False,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        seconds = time.perf_counter() - t0
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"jax-paged rejected {len(errors)} requests: {errors[0]}")
        return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _system_summary(rounds: list[dict], b: int, t: int) -> dict:
    total = statistics.median(r["total_s"] for r in rounds)
    prefill = statistics.median(r["prefill_s"] for r in rounds)
    return dict(
        output_tokens_per_s=round(b * t / total, 2),
        prefill_s=round(prefill, 4),
        decode_tokens_per_s=round(statistics.median(_decode_rate(r, b, t) for r in rounds), 2),
        runs=rounds,
    )


def _decode_rate(r: dict, b: int, t: int) -> float:
    return b * (t - 1) / max(r["total_s"] - r["prefill_s"], 1e-9)


def _median_ratio(pairs: list[tuple[dict, dict]], ratio) -> float:
    return round(statistics.median(ratio(o, v) for o, v in pairs), 3)


def run_batch(systems: dict, ids: list[list[int]], t: int, repeats: int) -> dict:
    """Warm-up, then ``repeats`` alternated rounds; per-system figures and paired ratios."""
    b = len(ids)
    first = {}
    for name, sys_ in systems.items():
        _log(f"B={b} {name}: warm-up")
        sys_.generate(ids, 1)
        first[name] = sys_.generate(ids, t)["tokens"]
    times = {name: [] for name in systems}
    order = list(systems)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            prefill = systems[name].generate(ids, 1)["seconds"]
            total = systems[name].generate(ids, t)["seconds"]
            times[name].append({"prefill_s": round(prefill, 4), "total_s": round(total, 4)})
            _log(f"B={b} round {r + 1} {name}: {b * t / total:.1f} tok/s")
    out = {name: _system_summary(times[name], b, t) for name in systems}
    if len(systems) == 2:
        ours, vllm = times["jax-paged"], times["vllm"]
        k = min(CHECK_TOKENS, t)
        agree = [a[:k] == v[:k] for a, v in zip(first["jax-paged"], first["vllm"], strict=True)]
        pairs = list(zip(ours, vllm, strict=True))
        out["paired_ratio"] = _median_ratio(pairs, lambda o, v: v["total_s"] / o["total_s"])
        out["prefill_ratio"] = _median_ratio(pairs, lambda o, v: v["prefill_s"] / o["prefill_s"])
        out["decode_ratio"] = _median_ratio(
            pairs, lambda o, v: _decode_rate(o, b, t) / _decode_rate(v, b, t)
        )
        out["first_tokens_agree"] = round(sum(agree) / len(agree), 3)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", default=DEFAULT_PYTHON, help="the python of vLLM's venv")
    ap.add_argument("--no-vllm", action="store_true", help="time jax-paged alone")
    ap.add_argument("--quick", action="store_true", help="smoke run: B = 2, 4 tokens, 1 repeat")
    add_output_arg(ap, "offline_cpu_smollm2_vs_vllm.json (--dtype bfloat16: ..._bf16.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.max_tokens, args.repeats = "2", 4, 1
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes needs positive integers, e.g. 8,32,64")
    if args.max_tokens < 2 or args.repeats < 1:
        ap.error("--max-tokens must be >= 2 (prefill and decode apart) and --repeats >= 1")
    return args


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    path = Path(args.model) if args.model else models.default_model_path()
    if path.suffix == ".gguf":  # one HF folder for both systems: the same dequantised weights
        path = export_hf_folder(path, Path(tempfile.gettempdir()) / f"hf_{path.stem}")
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    loaded = models.load(path, dtype=dt)
    ids_all, tok_source = tokenize(loaded, make_prompts(max(args.batch_sizes)))
    max_len = min(
        loaded.config.max_position_embeddings,
        -(-(max(map(len, ids_all)) + args.max_tokens) // 64) * 64,
    )
    max_seqs = max(args.batch_sizes)
    systems: dict = {"jax-paged": Ours(loaded, max_num_seqs=max_seqs, max_model_len=max_len)}
    result: dict = {
        "benchmark": "offline_vs_vllm",
        "model": str(path),
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prompt_ids": tok_source,
        "max_model_len": max_len,
        "kv_cache_bytes": KV_BYTES,
    }
    vllm = None
    try:
        if not args.no_vllm:
            log = Path(tempfile.gettempdir()) / "bench_vs_vllm_vllm.log"
            _log(f"starting vLLM ({args.vllm_python}); its log: {log}")
            vllm = OfflineVLLM(
                path,
                dtype=args.dtype,
                max_num_seqs=max_seqs,
                max_model_len=max_len,
                python=args.vllm_python,
                log=log,
            )
            systems["vllm"] = vllm
            result["vllm"] = {k: vllm.info[k] for k in ("version", "startup_s")}
        result["results"] = {
            str(b): run_batch(systems, ids_all[:b], args.max_tokens, args.repeats)
            for b in args.batch_sizes
        }
    finally:
        if vllm is not None:
            vllm.close()
    result["run"] = run_metadata()
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    text = json.dumps(run(args), indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
