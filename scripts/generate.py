"""Batch generation from the shell with the jax-paged engine.

    python scripts/generate.py                               # SmolLM2: the capital of France
    python scripts/generate.py --chat "What is the capital of France?" "Name three colours."
    python scripts/generate.py --prompts-file prompts.txt --max-tokens 128 --output out.jsonl
    python scripts/generate.py --prompts-file requests.jsonl --temperature 0.8 --seed 1
    python scripts/generate.py --model path/to/hf_folder_or_file.gguf "Once upon a time"

Prompts come from the positional arguments, or from --prompts-file: a text file (one prompt a
line) or, for a ``.jsonl`` file, one JSON object a line with "prompt" (text), "prompt_token_ids"
or "messages" (a chat), plus any `SamplingParams` field for that request, overriding the flags.
A bad line (malformed JSON, an unknown field, a bad value) gets an error record; the others run.

Output: the completions as text on stdout, or with --output one JSON object a line
(``{"index", "prompt", "outputs": [{"text", "token_ids", "finish_reason", ...}], "error"}``).
A closing summary (requests, tokens, tokens/s, peak KV usage, preemptions, compile time) goes
to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jax_paged import LLM, SamplingParams  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France?"
_SAMPLING_FLAGS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "ignore_eos",
    "stop",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("prompts", nargs="*", help=f"prompts (default: --chat {DEFAULT_PROMPT!r})")
    ap.add_argument("--prompts-file", help="text file (one prompt a line) or .jsonl requests")
    ap.add_argument("--model", default=None, help="HF folder, .gguf file or checkpoint folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chat", action="store_true", help="apply the chat template")
    ap.add_argument("--output", help="write one JSON object per request to this .jsonl file")
    g = ap.add_argument_group("sampling (per-request JSONL fields override these)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    e = ap.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-decode-steps", type=int, default=32)
    e.add_argument(
        "--attention-impl", default="auto", choices=["auto", "reference", "xla", "gpu", "tpu"]
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("-v", "--verbose", action="store_true", help="engine logs (KV usage, ...)")
    return ap


def read_requests(args, base: dict) -> list[tuple[object, dict | None, str | None]]:
    """[(prompt or messages, sampling-field overrides, error)] in input order."""
    if args.prompts_file is None:
        prompts = args.prompts or [DEFAULT_PROMPT]
        chat = args.chat or not args.prompts
        return [(([{"role": "user", "content": p}] if chat else p), {}, None) for p in prompts]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise SystemExit(f"--prompts-file: {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        out = []
        for line in lines:
            if line.strip():
                out.append((([{"role": "user", "content": line}] if args.chat else line), {}, None))
        return out
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            out.append((None, None, f"line {lineno}: malformed JSON ({err.msg})"))
            continue
        if not isinstance(obj, dict):
            out.append((None, None, f"line {lineno}: must be a JSON object"))
            continue
        keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
        if len(keys) != 1:
            out.append(
                (None, None, f"line {lineno}: give one of prompt, prompt_token_ids, messages")
            )
            continue
        key = keys[0]
        value = obj.pop(key)
        if key == "prompt" and args.chat:
            value, key = [{"role": "user", "content": value}], "messages"
        prompt = value if key in ("prompt", "messages") else {"prompt_token_ids": value}
        unknown = set(obj) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            out.append(
                (
                    None,
                    None,
                    f"line {lineno}: unknown fields {sorted(unknown)}; allowed: prompt, "
                    f"prompt_token_ids, messages and the SamplingParams fields "
                    f"{sorted(SamplingParams.__dataclass_fields__)}",
                )
            )
            continue
        out.append((prompt, obj, None))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    base = {f: getattr(args, f) for f in _SAMPLING_FLAGS}
    requests = read_requests(args, base)

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_decode_steps=args.max_decode_steps,
        attention_impl=args.attention_impl,
    )
    load_s = time.perf_counter() - t0
    tok = llm.tokenizer

    prompts, params, errors = [], [], {}
    for i, (prompt, fields, err) in enumerate(requests):
        if err is None:
            try:
                params.append(SamplingParams(**{**base, **fields}))
                if isinstance(prompt, list):  # a chat
                    if tok is None:
                        raise ValueError("messages: this model has no tokenizer / chat template")
                    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                    prompt = {"prompt_token_ids": ids}
                prompts.append(prompt)
                continue
            except ValueError as e:
                err = f"request {i}: {e}"
                params = params[: len(prompts)]
        errors[i] = err

    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress) if prompts else []
    gen_s = time.perf_counter() - t1

    sink = open(args.output, "w", encoding="utf-8") if args.output else None  # noqa: SIM115
    it = iter(outs)
    n_err = 0
    for i in range(len(requests)):
        out = None if i in errors else next(it)
        err = errors.get(i) or (out.error if out is not None else None)
        n_err += err is not None
        if sink is not None:
            rec = {"index": i, "error": err}
            if out is not None:
                rec["prompt"] = out.prompt
                rec["prompt_token_ids"] = out.prompt_token_ids
                rec["outputs"] = [
                    dict(
                        index=c.index,
                        text=c.text,
                        token_ids=c.token_ids,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        cumulative_logprob=c.cumulative_logprob,
                    )
                    for c in out.outputs
                ]
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
        elif err is not None:
            print(f"[{i}] error: {err}", file=sys.stderr)
        else:
            for c in out.outputs:
                tag = f"[{i}]" if len(out.outputs) == 1 else f"[{i}.{c.index}]"
                print(f"{tag} {c.text}")
    if sink is not None:
        sink.close()

    m = llm.get_metrics()
    n_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    summary = dict(
        requests=len(requests),
        errors=n_err,
        output_tokens=n_tokens,
        output_tokens_per_s=round(n_tokens / gen_s, 2) if gen_s > 0 else None,
        # The same with the one-off compile time taken out (what a longer run converges to).
        output_tokens_per_s_after_compile=(
            round(n_tokens / (gen_s - m["compile_seconds"]), 2)
            if gen_s > m["compile_seconds"]
            else None
        ),
        load_seconds=round(load_s, 2),
        generate_seconds=round(gen_s, 2),
        compile_seconds=round(m["compile_seconds"], 2),
        compiled_variants=m["compiled_variants"],
        peak_kv_usage=round(m["peak_kv_usage"], 4),
        preemptions=m["num_preemptions"],
    )
    print("summary: " + json.dumps(summary), file=sys.stderr)
    return 1 if n_err == len(requests) and requests else 0


if __name__ == "__main__":
    sys.exit(main())
