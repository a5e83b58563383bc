"""Decode paged-attention benchmark: prints one JSON document, on any platform.

For Llama-3-8B-like shapes (32 query heads, 8 KV heads, head dim 128, bfloat16) at each batch
and context it times, interleaved in the same run and on the same data:

* ``paged``: `pallas_kernels.paged_attention(impl="auto")`, i.e. the Pallas GPU kernel on a GPU,
  the TPU kernel on a TPU and the plain-jnp reference on a CPU;
* ``jax_pallas``: jax's own `jax.experimental.pallas.ops.gpu.paged_attention` (GPU only; it does
  not scale, so q is pre-scaled outside the timed call);
* ``dense``: attention over contiguous K/V holding the same tokens (XLA einsum + masked softmax),
  the cost-of-paging baseline;

and the device's copy bandwidth (``x + 1`` over a large int32 buffer, bytes read + written).
On a GPU every GPU kernel is also timed by name (``paged_gpu``: Pallas Triton lowering,
``paged_mosaic_gpu``: Mosaic GPU), whichever "auto" picks. ``--prefill SEQS Q_LEN CONTEXT``
adds ragged prefill cases, in TFLOP/s against a measured bf16 matmul.
Achieved bandwidth = (live K and V bytes + q + block tables + lengths) / time. Compile time is
reported apart; times are medians over repeats, each repeat a loop of calls ending in one sync.
Block tables are shuffled page ids (a fragmented pool); every sequence holds ``context`` tokens.

    python scripts/bench_kernel.py --quick          # CPU: a minute or two
    python scripts/bench_kernel.py --out bench.json  # GPU: the full grid
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_support import run_metadata

from pallas_kernels import gpu_paged_attention_decode, paged_attention, resolve_impl

H, KVH, D = 32, 8, 128
DTYPE = jnp.bfloat16
# The GPU kernels by their `impl` name: Pallas's Triton lowering and Mosaic GPU (Hopper+).
GPU_KERNELS = ("gpu", "mosaic_gpu")


def _sync(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)
    return x


def _time_loop(fn, args, iters: int) -> float:
    """Seconds per call over `iters` back-to-back calls ending in one sync."""
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    _sync(out)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Measured device copy bandwidth in GB/s: `x + 1` reads and writes `num_bytes` each."""
    x = jnp.zeros((num_bytes // 4,), jnp.int32)
    f = jax.jit(lambda x: x + 1)
    _sync(f(x))
    t = statistics.median(_time_loop(f, (x,), 10) for _ in range(repeats))
    return 2 * num_bytes / t / 1e9


def dense_decode(q, k, v, kv_lens, *, scale):
    """Decode attention over contiguous K/V.

    q: [B, H, D]; k, v: [B, KVH, L, D]; kv_lens: i32[B] -> [B, H, D].
    """
    b, h, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    s = jnp.einsum("bkgd,bkld->bkgl", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.arange(length)[None, :] < kv_lens[:, None]  # [B, L]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgl,bkld->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, h, d).astype(q.dtype)


def make_data(batch: int, context: int, block_size: int, seed: int = 0):
    """Random pages for `batch` sequences of `context` tokens, shuffled tables, and q."""
    pages_per_seq = -(-context // block_size)
    num_pages = batch * pages_per_seq + 1  # + the null block 0
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(key_q, (batch, H, D), DTYPE)
    k_pages = jax.random.normal(key_k, (KVH, num_pages, block_size, D), DTYPE)
    v_pages = jax.random.normal(key_v, (KVH, num_pages, block_size, D), DTYPE)
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages, dtype=np.int32))
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq))
    kv_lens = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, tables, kv_lens


def bytes_read(q, tables, kv_lens) -> int:
    live_kv = 2 * int(kv_lens.sum()) * KVH * D * jnp.dtype(DTYPE).itemsize
    return live_kv + q.nbytes + tables.nbytes + kv_lens.nbytes


def build_impls(q, k_pages, v_pages, tables, kv_lens, *, scale: float, on_gpu: bool, sweep: bool):
    """{name: (jitted fn, args)} for every implementation that runs on this platform."""
    impls = {}
    paged = jax.jit(functools.partial(paged_attention, scale=scale))
    impls["paged"] = (paged, (q, k_pages, v_pages, tables, kv_lens))
    if on_gpu:  # every GPU kernel by name, beside the one "auto" picks
        for name in GPU_KERNELS:
            fn = jax.jit(functools.partial(paged_attention, scale=scale, impl=name))
            impls[f"paged_{name}"] = (fn, impls["paged"][1])
    if on_gpu and sweep:  # the GPU kernel's tuning knobs, to pick better defaults
        for keys in (64, 128):
            for warps in (4, 8):
                fn = functools.partial(
                    gpu_paged_attention_decode,
                    scale=scale,
                    num_warps=warps,
                    pages_per_block=max(1, keys // k_pages.shape[2]),
                )
                impls[f"gpu_bk{keys}_w{warps}"] = (jax.jit(fn), impls["paged"][1])
    # Contiguous copy of the same tokens: [B, KVH, L, D] (built once, outside the timing).
    b, p = tables.shape
    bs = k_pages.shape[2]

    @jax.jit
    def gather(pages, tables):
        return pages[:, tables].reshape(KVH, b, p * bs, D).swapaxes(0, 1)

    k_dense, v_dense = _sync((gather(k_pages, tables), gather(v_pages, tables)))
    impls["dense"] = (
        jax.jit(functools.partial(dense_decode, scale=scale)),
        (q, k_dense, v_dense, kv_lens),
    )
    if on_gpu:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

        q_scaled = _sync(q * jnp.asarray(scale, q.dtype))
        pages_per_seq = tables.shape[1]
        k_splits = 16
        while pages_per_seq % k_splits:
            k_splits //= 2
        fn = jax.jit(functools.partial(jax_pa.paged_attention, k_splits=k_splits))
        impls["jax_pallas"] = (fn, (q_scaled, k_pages, v_pages, tables, kv_lens))
    return impls


def measure(impls, *, repeats: int, target_s: float, atol: float = 5e-2):
    """Compiles, checks and times every ``{name: (fn, args)}``, interleaved.

    Returns ({name: (median seconds, compile seconds, iters, spread)}, errors): an impl that
    fails on this platform is reported in ``errors`` and left out; one whose output differs
    from the first impl's by more than ``atol`` is timed and reported.
    """
    compile_s, iters, errors = {}, {}, {}
    ref = None
    for name, (fn, args) in list(impls.items()):
        try:
            t0 = time.perf_counter()
            out = _sync(fn(*args))
            compile_s[name] = time.perf_counter() - t0
        except Exception as e:  # a baseline that fails on this platform is reported, not fatal
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            del impls[name]
            continue
        out = np.asarray(out, np.float32)
        if ref is None:
            ref = out
        else:  # the baselines compute the same attention on the same data
            errors_max = float(np.max(np.abs(out - ref)))
            if errors_max > atol:
                errors[name] = f"max |out - {next(iter(impls))}| = {errors_max:.3g}"
        once = _time_loop(fn, args, 1)
        iters[name] = int(min(200, max(1, target_s / max(once, 1e-6))))
    times = {name: [] for name in impls}
    for _ in range(repeats):  # interleaved, so machine noise hits every impl alike
        for name, (fn, args) in impls.items():
            times[name].append(_time_loop(fn, args, iters[name]))
    stats = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        stats[name] = (t, compile_s[name], iters[name], (max(ts) - min(ts)) / t)
    return stats, errors


def _row(name, t, compile_s, iters, spread, **extra):
    return dict(
        impl=name,
        ms=round(t * 1e3, 4),
        **extra,
        compile_s=round(compile_s, 3),
        iters=iters,
        spread=round(spread, 3),
    )


def bench_case(batch, context, *, block_size, repeats, on_gpu, target_s, sweep=False):
    scale = D**-0.5
    data = _sync(make_data(batch, context, block_size))
    q, k_pages, v_pages, tables, kv_lens = data
    nbytes = bytes_read(q, tables, kv_lens)
    impls = build_impls(*data, scale=scale, on_gpu=on_gpu, sweep=sweep)
    stats, errors = measure(impls, repeats=repeats, target_s=target_s)
    rows = [_row(n, *st, gbps=round(nbytes / st[0] / 1e9, 2)) for n, st in stats.items()]
    by = {r["impl"]: r["ms"] for r in rows}
    ratios = {}
    if "dense" in by:
        ratios["paged_over_dense_time"] = round(by["paged"] / by["dense"], 3)
    if "jax_pallas" in by:
        ratios["jax_pallas_over_paged_time"] = round(by["jax_pallas"] / by["paged"], 3)
        for name in GPU_KERNELS:
            if f"paged_{name}" in by:
                ratios[f"jax_pallas_over_{name}_time"] = round(
                    by["jax_pallas"] / by[f"paged_{name}"], 3
                )
    return dict(
        batch=batch, context=context, bytes=nbytes, results=rows, ratios=ratios, errors=errors
    )


def matmul_tflops(n: int, repeats: int) -> float:
    """Measured bf16 matmul rate in TFLOP/s: an ``n x n x n`` product, f32 accumulation."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), DTYPE)
    b = jax.random.normal(kb, (n, n), DTYPE)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(DTYPE))
    _sync(f(a, b))
    t = statistics.median(_time_loop(f, (a, b), 10) for _ in range(repeats))
    return 2 * n**3 / t / 1e12


def dense_prefill(q, k, v, *, scale, q_len):
    """Causal attention of each sequence's last ``q_len`` positions over contiguous K/V.

    q: [S, q_len, H, D]; k, v: [S, KVH, C, D] (C = context) -> [S, q_len, H, D].
    """
    s_, t, h, d = q.shape
    kvh, c = k.shape[1], k.shape[2]
    out_dtype = q.dtype
    if jax.default_backend() == "cpu":  # XLA:CPU has no bf16 x bf16 -> f32 batched dot
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    qg = q.reshape(s_, t, kvh, h // kvh, d)
    logits = jnp.einsum("stkgd,skcd->skgtc", qg, k, preferred_element_type=jnp.float32) * scale
    q_pos = c - q_len + jnp.arange(t)
    mask = jnp.arange(c)[None, :] <= q_pos[:, None]  # [t, C]
    logits = jnp.where(mask, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    o = jnp.einsum("skgtc,skcd->stkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(s_, t, h, d).astype(out_dtype)


def bench_prefill_case(num_seqs, q_len, context, *, block_size, repeats, on_gpu, target_s):
    """Ragged prefill: ``num_seqs`` chunks of ``q_len`` tokens ending at ``context`` (the keys
    before the chunk already cached). FLOPs = 4 H D per visible (query, key) pair."""
    scale = D**-0.5
    _, k_pages, v_pages, tables, kv_lens = _sync(make_data(num_seqs, context, block_size))
    q = jax.random.normal(jax.random.key(7), (num_seqs * q_len, H, D), DTYPE)
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
    args = (q, k_pages, v_pages, tables, kv_lens, cu, jnp.int32(num_seqs))
    impls = {"paged": (jax.jit(functools.partial(paged_attention, scale=scale)), args)}
    if on_gpu:
        for name in GPU_KERNELS:
            fn = jax.jit(functools.partial(paged_attention, scale=scale, impl=name))
            impls[f"paged_{name}"] = (fn, args)
    b, p = tables.shape

    @jax.jit
    def gather(pages, tables):
        return pages[:, tables].reshape(KVH, b, p * block_size, D).swapaxes(0, 1)

    k_dense, v_dense = _sync((gather(k_pages, tables), gather(v_pages, tables)))
    k_dense, v_dense = k_dense[:, :, :context], v_dense[:, :, :context]
    q4 = q.reshape(num_seqs, q_len, H, D)
    dense = jax.jit(functools.partial(dense_prefill, scale=scale, q_len=q_len))
    impls["dense"] = (lambda *a: dense(*a).reshape(-1, H, D), (q4, k_dense, v_dense))
    stats, errors = measure(impls, repeats=repeats, target_s=target_s)
    first = context - q_len  # positions first .. context-1 see first+1 .. context keys
    pairs = num_seqs * sum(range(first + 1, context + 1))
    flops = 4 * H * D * pairs
    rows = [_row(n, *st, tflops=round(flops / st[0] / 1e12, 2)) for n, st in stats.items()]
    return dict(
        num_seqs=num_seqs, q_len=q_len, context=context, flops=flops, results=rows, errors=errors
    )


def device_memory_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit")
    except Exception:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, 8 x context 512, 4096")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=100.0, help="time per timed repeat")
    ap.add_argument(
        "--max-kv-gib",
        type=float,
        default=None,
        help="skip cases whose K/V pages exceed this (default: 30%% of device "
        "memory on accelerators, 1 GiB on the CPU)",
    )
    ap.add_argument("--sweep", action="store_true", help="GPU: also time kernel tuning variants")
    ap.add_argument(
        "--prefill",
        type=int,
        nargs=3,
        action="append",
        metavar=("SEQS", "Q_LEN", "CONTEXT"),
        default=None,
        help="also a ragged prefill case: SEQS chunks of Q_LEN tokens ending at CONTEXT "
        "(repeatable); reported against the measured bf16 matmul rate",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.repeats = [1, 8], [512, 4096], 3
        args.target_ms = min(args.target_ms, 50.0)

    platform = jax.default_backend()
    on_gpu = platform == "gpu"
    mem = device_memory_bytes()
    if args.max_kv_gib is not None:
        max_kv = args.max_kv_gib * 2**30
    elif platform != "cpu" and mem:
        max_kv = 0.3 * mem  # pages + the dense copy + temporaries stay well inside
    else:
        max_kv = 2**30
    copy_bytes = 2**30 if platform != "cpu" else 2**28
    copy_gbps = round(copy_bandwidth(copy_bytes, args.repeats), 2)
    report = dict(
        benchmark="kernel",
        run=run_metadata(memory_bandwidth_gb_s=copy_gbps),
        platform=platform,
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        shapes=dict(
            num_heads=H, num_kv_heads=KVH, head_dim=D, dtype="bfloat16", block_size=args.block_size
        ),
        paged_impl=resolve_impl("auto", args.block_size, D),
        copy_gbps=copy_gbps,
        cases=[],
        skipped=[],
    )
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * KVH * D * jnp.dtype(DTYPE).itemsize
            if kv_bytes > max_kv:
                report["skipped"].append(dict(batch=batch, context=context, kv_bytes=kv_bytes))
                continue
            print(f"batch {batch} context {context} ...", file=sys.stderr, flush=True)
            case = bench_case(
                batch,
                context,
                block_size=args.block_size,
                repeats=args.repeats,
                on_gpu=on_gpu,
                target_s=args.target_ms / 1e3,
                sweep=args.sweep,
            )
            for row in case["results"]:
                row["frac_of_copy"] = round(row["gbps"] / report["copy_gbps"], 3)
            report["cases"].append(case)
    if args.prefill:
        report["matmul_tflops"] = round(matmul_tflops(8192 if on_gpu else 512, args.repeats), 2)
        report["prefill_cases"] = []
    for num_seqs, q_len, context in args.prefill or ():
        print(f"prefill {num_seqs} x {q_len} at {context} ...", file=sys.stderr, flush=True)
        case = bench_prefill_case(
            num_seqs,
            q_len,
            context,
            block_size=args.block_size,
            repeats=args.repeats,
            on_gpu=on_gpu,
            target_s=args.target_ms / 1e3,
        )
        for row in case["results"]:
            row["frac_of_matmul"] = round(row["tflops"] / report["matmul_tflops"], 3)
        report["prefill_cases"].append(case)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
