"""Paged attention for the CPU as a native XLA FFI kernel (``impl="cpu"``), built on first use.

The XLA path (`xla_paged_attention`) has to gather each chunk of pages into a buffer before its
small batched matmuls can read it, and on the CPU those gathers and matmuls, not the bytes, set
its cost. This kernel reads the pages in place. One work item is one query row and one KV head
(`cpu_paged_attention.cc`): its ``G = H / KVH`` query heads walk the row's visible keys through
the block table, straight out of the stacked pool ``[L, KVH, N, bs, D]``, each key and value
row loaded once for all G heads, take an exact float32 softmax and read the values the same
way. The items are shared out over XLA's own intra-op thread pool. On 2 threads of a
Sapphire Rapids, SmolLM2's 30 layers of decode attention at batch 64 with 100 keys per row take
19-23 ms with float32 pages (295 MB of K/V, 13-16 GB/s against about 25 GB/s of read
bandwidth) and 15-16 ms with bfloat16 pages (`docs/benchmarks.md` has the engine's figures
from `scripts/bench_decode.py`). Rows,
positions and padding come from `layout.ragged_rows`, as for every other implementation, so
the contract is the reference's (docs/DESIGN.md): rows see keys ``max(0, pos - window + 1) ..
pos``, soft cap ``cap * tanh(s / cap)``, padding rows and rows
that see no key give zeros. Only keys a row sees are ever read, so garbage (even NaN) in other
pages or slots never matters.

The same library holds the pool's two in-place updates for a bfloat16 cache (`write_rows`,
`copy_pages`), which XLA's CPU backend would otherwise do by widening the whole pool to float32.

Building: the C++ source is compiled with the system's C++ compiler (``$CXX``, else ``c++``)
against jaxlib's FFI headers (`jax.ffi.include_dir`), in three parts at once (the handlers with
the float32 kernels, the bfloat16 ones, the float16 ones; about 8 s on 2 cores), linked into a
shared library cached under ``$JAX_PAGED_KERNEL_DIR`` (default ``~/.cache/jax_paged``), keyed by
the source, the compiler, the flags and the CPU (`library_path`), and registered with XLA once
per process. ``.ci/setup.sh`` builds it, so the first `generate` does not. ``-march=native``:
the library is built for the machine that runs it. Where no compiler is found or the build
fails, `available` is False, `build_error` says why and ``impl="auto"`` keeps the XLA path;
``JAX_PAGED_NATIVE=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import decode_as_ragged, ragged_rows, stacked_pages

__all__ = [
    "available",
    "build_error",
    "copy_pages",
    "cpu_paged_attention_decode",
    "cpu_ragged_paged_attention",
    "library_path",
    "write_rows",
]

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
_TARGET = "jax_paged_cpu_paged_attention"
_SYMBOL = "JaxPagedCpuPagedAttention"
# The pool's in-place updates, from the same library (see write_rows, copy_pages).
_UPDATES = {
    "jax_paged_cpu_write_rows": "JaxPagedCpuWriteRows",
    "jax_paged_cpu_copy_pages": "JaxPagedCpuCopyPages",
}
_FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fopenmp-simd",  # the `#pragma omp simd` reductions, with no OpenMP runtime
    "-fno-math-errno",
    "-ffp-contract=fast",  # fused multiply-adds (ISO -std= modes turn them off)
    "-fPIC",
)
# The source's parts (JAX_PAGED_PART): the handlers and float32 kernels, the bfloat16 ones, the
# float16 ones. They compile at once, in parallel, then link into one library.
_PARTS = 3
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _cache_dir() -> Path:
    root = os.environ.get("JAX_PAGED_KERNEL_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jax_paged"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    return cxx


def library_path() -> Path:
    """Where the compiled library is cached for this source, compiler, flags and CPU (it may not
    exist yet). Raises RuntimeError when no C++ compiler is found."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                _SOURCE.read_text(),
                cxx,
                version,
                " ".join(_FLAGS),
                jax.ffi.include_dir(),
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"cpu_paged_attention-{key}.so"


def _failure(cmd: list[str], returncode: int, stderr: str) -> str:
    """A failed compiler run in a few lines: the command, its exit status, its errors (or the end
    of its output when no line says error)."""
    lines = stderr.splitlines()
    shown = [line for line in lines if "error" in line][:10] or lines[-10:]
    return f"{' '.join(cmd)} failed (exit status {returncode}):\n" + "\n".join(shown)


def _build() -> Path:
    """The compiled library's path, building it if the cache lacks it. Raises RuntimeError."""
    cxx, include = _compiler(), jax.ffi.include_dir()
    lib = library_path()
    out_dir = lib.parent
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        objs = [str(Path(work) / f"part{i}.o") for i in range(_PARTS)]
        cmds = [
            [cxx, *_FLAGS, f"-DJAX_PAGED_PART={i}", "-I", include, "-c", str(_SOURCE), "-o", obj]
            for i, obj in enumerate(objs)
        ]
        procs = []
        try:
            for cmd in cmds:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    )
                )
            stderrs = [proc.communicate()[1] for proc in procs]  # waits for every part
        finally:  # interrupted: no compiler may go on writing into the folder being removed
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for cmd, proc, stderr in zip(cmds, procs, stderrs, strict=True):
            if proc.returncode != 0:
                raise RuntimeError(_failure(cmd, proc.returncode, stderr))
        tmp = str(Path(work) / "lib.so")
        cmd = [cxx, "-shared", *objs, "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(_failure(cmd, res.returncode, res.stderr))
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


@functools.cache
def _load() -> str | None:
    """Builds, loads and registers the kernel once per process: None, or why it is missing."""
    if os.environ.get("JAX_PAGED_NATIVE", "1") == "0":
        return "turned off by JAX_PAGED_NATIVE=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in {_TARGET: _SYMBOL, **_UPDATES}.items():
            handler = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, handler, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """Whether the native kernel is built and registered (building it on the first call)."""
    return _load() is None


def build_error() -> str | None:
    """Why the native kernel is unavailable, or None when it is available."""
    return _load()


def cpu_ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [L, KVH, N, bs, D] (or one layer's [KVH, N, bs, D])
    v_pages: jax.Array,  # same as k_pages
    block_tables: jax.Array,  # i32[S, P]
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    layer: jax.Array | int = 0,  # i32[]
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, H, D] in q.dtype
    """Ragged paged attention (contract of docs/DESIGN.md) by the native CPU kernel.

    Raises:
      RuntimeError: the kernel could not be built (the message says why).
      ValueError: a dtype other than float32, bfloat16 or float16, or more than 64 query heads
        per KV head.
    """
    why = build_error()
    if why is not None:
        raise RuntimeError(f"the native CPU paged-attention kernel is unavailable: {why}")
    if k_pages.dtype not in _DTYPES:
        raise ValueError(f"{k_pages.dtype=} must be float32, bfloat16 or float16 for impl='cpu'")
    k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
    if q.shape[1] // k_pages.shape[1] > 64:
        raise ValueError(f"H / KVH = {q.shape[1] // k_pages.shape[1]} must be <= 64")
    rows = ragged_rows(q.shape[0], kv_lens.astype(jnp.int32), cu_q_lens, num_seqs)
    call = jax.ffi.ffi_call(
        _TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )
    out = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        rows.seq,
        jnp.where(rows.live, rows.pos, -1),
        layer,
        scale=np.float32(scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)


def cpu_paged_attention_decode(q, k_pages, v_pages, block_tables, kv_lens, **options):
    """Decode form: one query per sequence at position ``kv_lens[b] - 1``
    (`layout.decode_as_ragged`). ``q[B, H, D]``, pages ``[L, KVH, N, bs, D]`` (or one layer's),
    ``block_tables`` ``i32[B, P]``, ``kv_lens`` ``i32[B]``; options as
    `cpu_ragged_paged_attention`. Returns ``[B, H, D]`` in ``q.dtype``."""
    return decode_as_ragged(
        cpu_ragged_paged_attention, q, k_pages, v_pages, block_tables, kv_lens, **options
    )


def write_rows(pages: jax.Array, layer, blk: jax.Array, off: jax.Array, rows: jax.Array):
    """``pages.at[layer, :, blk, off].set(rows, mode="drop")`` by the native library, in place.

    ``pages`` ``[L, KVH, N, bs, D]``, ``rows`` ``[T, KVH, D]`` (cast to the pages' dtype),
    ``blk``/``off`` ``i32[T]``, ``layer`` an int (may be traced); tokens whose slot is outside
    the pool are dropped. The result aliases ``pages`` (donate it, or XLA copies it first).
    XLA's CPU backend widens a bfloat16 pool to float32 around a scatter into it (the whole
    pool, three passes per layer and step); this moves the rows' bytes only. Raises
    RuntimeError where the library is unavailable.
    """
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    args = (rows.astype(pages.dtype), i32(layer).reshape(()), i32(blk), i32(off))
    return _update_in_place("jax_paged_cpu_write_rows", pages, *args)


def copy_pages(pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``pages.at[:, :, dst].set(pages[:, :, src])`` by the native library, in place.

    ``pages`` ``[L, KVH, N, bs, D]``, ``src``/``dst`` ``i32[M]``; pairs with ``src == dst``
    (padding) or an index outside the pool are skipped; all sources are read before any
    destination is written. The result aliases ``pages``. Raises RuntimeError where the
    library is unavailable.
    """
    args = (jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    return _update_in_place("jax_paged_cpu_copy_pages", pages, *args)


def _update_in_place(target: str, pages: jax.Array, *args) -> jax.Array:
    """The FFI call ``target(pages, *args)``, whose result is ``pages``' own buffer."""
    why = build_error()
    if why is not None:
        raise RuntimeError(f"the native CPU kernels are unavailable: {why}")
    call = jax.ffi.ffi_call(
        target,
        jax.ShapeDtypeStruct(pages.shape, pages.dtype),
        input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(pages, *args)
