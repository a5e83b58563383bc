"""Greedy text generation with a model loaded by `models.load` (minimal, until the engine lands).

    python scripts/generate.py       # SmolLM2 answers "What is the capital of France?"
    python scripts/generate.py --chat "Tell me a joke." "Name three colours."
    python scripts/generate.py --model path/to/hf_folder_or.gguf "Once upon a time"

Prompts run as one batch through `models.greedy_generate` (dense forward with a contiguous KV
cache); each row stops at the model's EOS ids or after --max-tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("prompts", nargs="*", help=f"prompts (default: --chat {DEFAULT_PROMPT!r})")
    ap.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file or checkpoint folder "
        "(default: the embedded SmolLM2-135M-Instruct GGUF)",
    )
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    prompts, chat = args.prompts, args.chat
    if not prompts:
        prompts, chat = [DEFAULT_PROMPT], True

    t0 = time.perf_counter()
    loaded = models.load(args.model, dtype=args.dtype)
    tok = loaded.tokenizer
    if tok is None:
        ap.error(f"{loaded.source} has no tokenizer (tokenizer.json); cannot encode text prompts")
    t1 = time.perf_counter()
    if chat:
        ids = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
            for p in prompts
        ]
    else:
        ids = [tok.encode(p) for p in prompts]
    eos = loaded.generation_config.eos_token_ids
    out = models.greedy_generate(loaded.model, ids, args.max_tokens, eos_token_ids=eos)
    t2 = time.perf_counter()
    for prompt, new in zip(prompts, out, strict=True):
        text = tok.decode(new, skip_special_tokens=True)
        # Chat: the prompt, then the answer. Plain: the continuation right after its prompt.
        print(f">>> {prompt}\n{text.strip()}\n" if chat else f"{prompt}{text}\n")
    n = sum(len(o) for o in out)
    print(f"[load {t1 - t0:.1f}s, generate {n} tokens in {t2 - t1:.1f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
