"""What every benchmark's JSON records about the run that produced it, and where it is written.

A figure means little without the code, the machine and the libraries behind it, so each script
adds `run_metadata()` to its JSON under ``"run"``: the commit (and whether the work tree had
uncommitted changes), the UTC date, the machine (CPU model, cores, memory, the accelerator jax
sees, and the memory read bandwidth measured now) and the versions of the libraries
that shape the numbers. ``docs/results/`` keeps one file per benchmark configuration, named by
what it measures (`docs/benchmarks.md` lists them); a new run overwrites its file and git keeps
the history.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "docs" / "results"

# Distributions whose versions change the figures (absent ones are reported as None).
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _accelerator() -> dict | None:
    """The devices jax uses, if this process has imported jax (never imports it itself)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "kind": devices[0].device_kind,
        "count": len(devices),
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def read_bandwidth(nbytes: int = 512 << 20, trials: int = 5) -> float:
    """Bytes/s at which XLA reads memory here: a jitted sum over ``nbytes`` of float32 (far
    beyond the caches), best of ``trials`` after a warm-up. What reading K/V must cost at least,
    and the figure that tells one run's machine from another's (this machine kind has read
    28-44 GB/s on different days)."""
    import time

    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best


def run_metadata(*, memory_bandwidth_gb_s: float | None = None) -> dict:
    """{"commit", "commit_dirty", "date_utc", "machine", "versions"} for a benchmark's JSON.

    ``memory_bandwidth_gb_s``: the bandwidth the script measured on this machine (GB/s), recorded
    under ``machine``; when None, `read_bandwidth` measures it now (under a second).
    """
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    machine = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gib": _memory_gib(),
        "arch": platform.machine(),
        "os": platform.system(),
        "accelerator": _accelerator(),
    }
    if memory_bandwidth_gb_s is None:
        memory_bandwidth_gb_s = read_bandwidth() / 1e9
    machine["memory_bandwidth_gb_s"] = round(float(memory_bandwidth_gb_s), 2)
    return {
        "commit": _git("rev-parse", "HEAD"),
        "commit_dirty": None if status is None else bool(status),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "versions": {"python": platform.python_version()}
        | {name: _version(name) for name in PACKAGES},
    }


def add_output_arg(parser, default_name: str) -> None:
    """``--output PATH``: also write the JSON there (``docs/results/<default_name>`` is the
    file this benchmark's standard configuration keeps)."""
    parser.add_argument(
        "--output",
        default=None,
        help=f"also write the JSON to this file (the standard run's: docs/results/{default_name})",
    )


def emit(result: dict, output: str | None) -> str:
    """Prints ``result`` as JSON on stdout and, with ``output``, writes the same text there
    (creating its folder). Returns the text."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return text
