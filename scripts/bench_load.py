"""Load time of the SmolLM2 GGUF vs the orbax checkpoint of its converted weights; prints JSON.

    python scripts/bench_load.py [--model FILE.gguf] [--dtype float32|bfloat16] [--dir CKPT_DIR]

The GGUF path reads and dequantises every tensor and rebuilds the tokenizer; the checkpoint
restores the converted arrays directly. Exits 1 if the checkpoint is not faster.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_support import run_metadata  # noqa: E402

import models  # noqa: E402


def _timed_load(path, dtype) -> tuple[float, models.LoadedModel]:
    t = time.perf_counter()
    loaded = models.load(path, dtype=dtype)
    jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda x: x, loaded.model)))
    return time.perf_counter() - t, loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    args = ap.parse_args(argv)
    jnp.zeros(1).block_until_ready()  # start the backend outside the timings

    path = Path(args.model) if args.model else models.default_model_path()
    gguf_s, loaded = _timed_load(path, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.dir) if args.dir else Path(tmp) / "ckpt"
        t = time.perf_counter()
        models.save_checkpoint(loaded, ckpt)
        save_s = time.perf_counter() - t
        del loaded
        ckpt_s, _ = _timed_load(ckpt, args.dtype)
    result = {
        "benchmark": "load",
        "run": run_metadata(),
        "model": str(path),
        "dtype": args.dtype,
        "gguf_load_s": round(gguf_s, 3),
        "checkpoint_save_s": round(save_s, 3),
        "checkpoint_load_s": round(ckpt_s, 3),
        "speedup": round(gguf_s / ckpt_s, 2),
        "checkpoint_faster": ckpt_s < gguf_s,
    }
    print(json.dumps(result, indent=1))
    return 0 if result["checkpoint_faster"] else 1


if __name__ == "__main__":
    sys.exit(main())
