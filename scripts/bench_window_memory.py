"""KV memory held by sliding-window models in jax-paged, measured, as JSON.

    python scripts/bench_window_memory.py            # 8 sequences of 64 + 448 tokens, window 32
    python scripts/bench_window_memory.py --quick    # smoke run: 2 sequences, 24 + 40 tokens

jax-paged keeps one block table per sequence for all layers. When every layer attends through
one window (Mistral), the steps return the blocks that fell out of it to the pool
(`block_manager.drop_out_of_window`). When windowed and full-attention layers mix (Gemma 3,
Qwen2 with ``max_window_layers``), the full layers need every block, so every block is kept
for every layer: the windowed layers' out-of-window K/V is memory that a per-layer-group
allocator (vLLM's hybrid allocator: a block table per group) would return. This script
measures that cost.

``measured``: the same random-weight model (4 layers, GQA 4/2, head dim 16) under three
layouts, ``window_all`` (every layer windowed), ``mixed`` (layers 2, 3 windowed) and ``none``,
runs the engine on the same requests (greedy, ``ignore_eos``), stepping it, and after every
step reads the blocks sequences hold on the device (refcount > 0). Per layout: the time
average and peak of those blocks, and of the blocks a per-group allocator would need for the
same lengths (full layers: every block; windowed layers: the blocks a window can still see plus
the last two, `block_manager.window_dead_blocks`), both in layer-blocks (a block of one
layer), and ``held_over_needed``, the memory a single table costs over that.

``real_models``: the same accounting for the published layouts (layer counts and windows of
their configs; no weights needed) at a few context lengths: KV bytes per sequence (bf16)
with jax-paged's choice and with per-group tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_support

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_support import run_metadata  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.memory.block_manager import window_dead_blocks  # noqa: E402

# name: (layers, windowed layers, window, KV heads, head dim) from the models' configs.
REAL_MODELS = {
    "Mistral-7B-v0.1": (32, 32, 4096, 8, 128),
    "Gemma-3-270M": (18, 15, 512, 1, 256),
    "Gemma-3-27B": (62, 52, 1024, 16, 128),
    "Qwen2-7B, max_window_layers=14, window 4096": (28, 14, 4096, 4, 128),
}
CONTEXTS = (1024, 8192, 32768)


def layer_blocks_needed(lens, bs: int, layer_windows) -> int:
    """Layer-blocks a per-group allocator needs for sequences of ``lens`` tokens."""
    lens = np.asarray(lens, np.int64)
    nb = -(-lens // bs)
    total = 0
    for w in layer_windows:
        total += int(nb.sum() if w is None else (nb - window_dead_blocks(lens, bs, w)).sum())
    return total


def random_model(layer_windows, window: int | None) -> models.LoadedModel:
    cfg = models.ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=len(layer_windows),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=window,
        layer_windows=() if window is not None else tuple(layer_windows),
    )
    model = models.Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    gen = models.GenerationConfig(eos_token_ids=[2])
    return models.LoadedModel(model, None, cfg, gen, source="random")


def measure(layout: str, layer_windows, args) -> dict:
    uniform = {w for w in layer_windows}
    window = uniform.pop() if len(uniform) == 1 else None
    loaded = random_model(layer_windows, window)
    llm = LLM(
        loaded,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        ids = rng.integers(3, 256, args.prompt_len).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, sp)
    n_layers = len(layer_windows)
    held, needed = [], []
    while engine.has_unfinished_requests():
        engine.step()
        st = jax.device_get(engine.state.blocks)
        lens = np.asarray(st.seq_lens)[np.asarray(st.live)]
        if not len(lens):
            continue
        held.append(int((np.asarray(st.ref_counts) > 0).sum()) * n_layers)
        needed.append(layer_blocks_needed(lens, args.block_size, layer_windows))
    return dict(
        layer_windows=list(layer_windows),
        drops_blocks=engine.runner.opts.drop_window is not None,
        steps=len(held),
        held_layer_blocks_mean=float(np.mean(held)),
        held_layer_blocks_peak=int(max(held)),
        needed_layer_blocks_mean=float(np.mean(needed)),
        needed_layer_blocks_peak=int(max(needed)),
        held_over_needed=float(np.mean(held) / np.mean(needed)),
    )


def real_models(block_size: int) -> dict:
    out = {}
    for name, (layers, windowed, window, kvh, d) in REAL_MODELS.items():
        per_layer_block = 2 * kvh * d * block_size * 2  # K and V, bf16
        windows = [window] * windowed + [None] * (layers - windowed)
        rows = {}
        for ctx in CONTEXTS:
            ours = (
                layer_blocks_needed([ctx], block_size, windows)
                if windowed == layers  # one window everywhere: jax-paged drops too
                else -(-ctx // block_size) * layers
            )
            hybrid = layer_blocks_needed([ctx], block_size, windows)
            rows[str(ctx)] = dict(
                jax_paged_mib=round(ours * per_layer_block / 2**20, 1),
                per_group_tables_mib=round(hybrid * per_layer_block / 2**20, 1),
                extra=round(ours / hybrid - 1, 3),
            )
        out[name] = dict(layers=layers, windowed_layers=windowed, window=window, contexts=rows)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 short sequences")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=448)
    ap.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs, args.prompt_len, args.output_len, args.block_size = 2, 24, 40, 4
        args.window, args.chunk = 8, 16
    per_seq = -(-(args.prompt_len + args.output_len) // args.block_size)
    args.num_kv_blocks = args.num_seqs * per_seq + 1
    w = args.window
    layouts = {"window_all": [w] * 4, "mixed": [None, None, w, w], "none": [None] * 4}
    result = dict(
        benchmark="window_memory",
        run=run_metadata(),
        platform=jax.devices()[0].platform,
        block_size=args.block_size,
        window=w,
        num_seqs=args.num_seqs,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        measured={name: measure(name, lw, args) for name, lw in layouts.items()},
        real_models=real_models(16),
    )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
