"""Everything a CUDA machine should check, in one run that writes JSON to one folder.

    python scripts/gpu_check.py --out DIR            # on a GPU: the full check
    python scripts/gpu_check.py --out DIR --dry-run  # on a CPU: every stage on tiny shapes

`scripts/gpu_check.sh` is the shell entry point (it installs the ``[gpu]`` extra where jax sees
no GPU and a package index is reachable). Stages, each in a process of its own with its own
time limit, so that one that fails or hangs still leaves the others' results:

* ``env``: the device, its compute capability, the jax / jaxlib / CUDA plugin versions.
* ``kernel_tests``: the GPU kernels' tests on the hardware against the plain-jnp reference
  (`tests/test_gpu_kernel.py`, and `tests/test_mosaic_gpu_kernel.py` where it exists); on a
  GPU those modules run their cases compiled, not interpreted. Per test: outcome and seconds.
* ``bench_kernel``: `scripts/bench_kernel.py` at Llama-3-8B attention shapes (bf16, B = 64 and
  256, contexts 1k-8k): the paged kernel against jax's own Pallas paged kernel, a contiguous
  XLA attention and the measured copy bandwidth.
* ``engine``: `LLM.generate` end to end on a Llama-3-8B-shaped bfloat16 model with random
  weights (vLLM's offline benchmark shape, 256 prompt / 256 output tokens, scaled to fit the
  time limit): compile and warm seconds, output tok/s, device calls per step.
* ``engine_tests``: the engine's tests against the HF transformers oracle
  (`tests/test_engine.py`), with the attention kernel jax-paged picks on this device.

A dry run does the same on the CPU in the Pallas interpreter with a tiny model, so CI checks
that the script itself works. ``DIR/summary.json`` says which stages passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TEST_FILES = ("tests/test_gpu_kernel.py", "tests/test_mosaic_gpu_kernel.py")
# A few cases of each kernel test module in a dry run (the interpreter is slow on a CPU).
ENGINE_TEST_FILES = ("tests/test_engine.py",)
STAGES = ("env", "kernel_tests", "bench_kernel", "engine", "engine_tests")
DRY_RUN_TEST_FILTER = "layers_in_scan or (lowering and decode)"


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_stage(name: str, cmd: list[str], out: Path, timeout: float) -> dict:
    """Runs one stage's command; its output goes to ``out/<name>.log``."""
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    print(f"[gpu_check] {name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=_python_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.perf_counter() - t0, 1)
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print(f"[gpu_check] {name}: rc={rc} in {seconds} s", flush=True)
    print("\n".join("    " + ln for ln in tail), flush=True)
    return dict(stage=name, rc=rc, ok=rc == 0, seconds=seconds, log=log.name)


def pytest_cmd(files, junit_xml: Path) -> list[str]:
    """pytest over ``files`` in this Python, each test named in the log (a stage cut short by
    its time limit writes no JUnit file), results also as JUnit XML."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        *files,
        f"--junitxml={junit_xml}",
    ]


def junit_summary(xml_path: Path) -> dict:
    """{outcome: count} and each test's outcome and seconds from pytest's JUnit XML."""
    if not xml_path.exists():
        return {}
    tests, counts = [], {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = tag
                message = (el.get("message") or "")[:300]
                break
        else:
            message = ""
        counts[outcome] = counts.get(outcome, 0) + 1
        tests.append(
            dict(
                test=f"{case.get('classname')}::{case.get('name')}",
                outcome=outcome,
                seconds=round(float(case.get("time") or 0), 3),
                **({"message": message} if message else {}),
            )
        )
    return dict(counts=counts, tests=tests)


# ----------------------------------------------------------------------------------------------
# Stages that run inside this script (in a subprocess: `python gpu_check.py --stage NAME`)


def stage_env(out: Path) -> None:
    import importlib.metadata

    import jax

    dev = jax.devices()[0]
    versions = {}
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "triton"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    info = dict(
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        num_devices=jax.device_count(),
        compute_capability=getattr(dev, "compute_capability", None),
        memory_stats={k: v for k, v in (dev.memory_stats() or {}).items() if "limit" in k}
        if hasattr(dev, "memory_stats")
        else None,
        versions=versions,
        python=sys.version.split()[0],
    )
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    (out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


def llama3_8b_config(tiny: bool):
    import models

    if tiny:
        return models.ModelConfig(
            model_type="llama",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
        )
    return models.ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def stage_engine(out: Path, dry_run: bool, num_requests: int, input_len: int, output_len: int):
    """`LLM.generate` on a Llama-3-8B-shaped bf16 model with random weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import models
    from jax_paged import LLM, SamplingParams

    config = llama3_8b_config(tiny=dry_run)
    t0 = time.perf_counter()
    model = models.Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    loaded = models.LoadedModel(
        model=model,
        tokenizer=None,
        config=config,
        generation_config=models.GenerationConfig(),
        source="random llama3-8b shape",
    )
    # Prefix caching off: the repeats reuse the same prompts and would skip their prefill.
    kw = dict(
        dtype="bfloat16",
        max_num_seqs=min(256, num_requests),
        max_model_len=input_len + output_len,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,  # vLLM's serving default; ours (512) is sized for CPUs
    )
    if dry_run:
        kw.update(attention_impl="gpu", attention_interpret=True, num_kv_blocks=256)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(1, config.vocab_size, size=input_len).tolist()}
        for _ in range(num_requests)
    ]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    # A probe request first, at the default pool size and, if its step fails (a program that
    # copies the pool runs out of memory), at a pool small enough for such a copy: the
    # failure and the programs' memory are recorded, and the figures still come.
    probes = []
    utils = (None,) if dry_run else (0.9, 0.4)
    for util in utils:
        if util is not None:
            kw["gpu_memory_utilization"] = util
        t0 = time.perf_counter()
        llm = LLM(loaded, **kw)
        setup_s = time.perf_counter() - t0
        probe = llm.generate(prompts[:1], SamplingParams(ignore_eos=True, max_tokens=4))[0]
        probes.append(
            dict(
                gpu_memory_utilization=util,
                num_kv_blocks=llm.get_metrics().get("num_kv_blocks"),
                error=probe.error,
                programs=program_memory(llm, out),
            )
        )
        print(json.dumps(probes[-1], default=str)[:2000], flush=True)
        if not probe.error or util == utils[-1]:
            break
        llm = probe = None  # frees the first pool before the next one
        gc.collect()
    runs = []

    def report():  # written after every run, so a stage cut short still leaves its figures
        metrics = llm.get_metrics()
        result = dict(
            model="Llama-3-8B shape, random weights" if not dry_run else "tiny llama (dry run)",
            dtype="bfloat16",
            backend=jax.default_backend(),
            attention_impl=kw.get("attention_impl", "auto"),
            num_requests=num_requests,
            input_len=input_len,
            output_len=output_len,
            init_seconds=round(init_s, 2),
            engine_setup_seconds=round(setup_s, 2),
            probes=probes,
            runs=runs,
            programs=program_memory(llm, out),
            metrics={k: metrics[k] for k in ENGINE_METRICS if k in metrics},
        )
        (out / "engine.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    report()
    for label in ("first (compiles)", "warm", "warm"):
        if probe.error:  # no pool size worked: the probes say why
            break
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        errors = [o.error for o in outs if o.error]
        generated = sum(len(o.outputs[0].token_ids) for o in outs if not o.error)
        runs.append(
            dict(
                run=label,
                seconds=round(seconds, 3),
                output_tok_s=round(generated / seconds, 1),
                total_tok_s=round((generated + num_requests * input_len) / seconds, 1),
                num_errors=len(errors),
                errors=errors[:3],
            )
        )
        print(json.dumps(runs[-1]), flush=True)
        report()
        if len(errors) == num_requests:  # nothing ran: repeating would only fail again
            break


ENGINE_METRICS = (
    "num_kv_blocks",
    "kv_cache_bytes_per_device",
    "peak_kv_usage",
    "device_calls_per_step",
    "compiled_variants",
    "compile_seconds",
    "num_preemptions",
    "num_step_failures",
)


def program_memory(llm, out: Path) -> dict:
    """Each compiled engine program's bytes (argument, output, alias, temp). A program whose
    alias is well under its argument, or whose temp is over a GiB, copies donated buffers (the
    K/V pages) instead of updating them in place: its optimised HLO goes to ``out`` to read."""
    programs = {}
    for key, compiled in getattr(llm.engine.runner, "compiled", {}).items():
        name = "_".join(map(str, key))
        try:
            ma = compiled.memory_analysis()
            row = {
                f: getattr(ma, f"{f}_size_in_bytes")
                for f in ("argument", "output", "alias", "temp")
            }
        except Exception as e:  # not every backend reports it
            programs[name] = repr(e)[:200]
            continue
        if row["temp"] > 2**30 or row["alias"] < row["argument"] // 2:
            (out / f"{name}.hlo.txt").write_text(compiled.as_text()[: 8 * 2**20])
            row["hlo"] = f"{name}.hlo.txt"
        programs[name] = row
    return programs


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and logs")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--stages", nargs="+", default=list(STAGES))
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in-process
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies stage limits")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = args.num_requests or (8 if args.dry_run else 256)
    li = args.input_len or (16 if args.dry_run else 256)
    lo = args.output_len or (8 if args.dry_run else 256)

    if args.stage == "env":
        return stage_env(out)
    if args.stage == "engine":
        return stage_engine(out, args.dry_run, n, li, lo)

    py = sys.executable
    me = str(Path(__file__).resolve())
    dry = ["--dry-run"] if args.dry_run else []
    scale = args.timeout_scale
    results = []
    for stage in args.stages:
        if stage == "env":
            cmd, limit = [py, me, "--out", str(out), "--stage", "env"], 60
        elif stage == "kernel_tests":
            files = [f for f in KERNEL_TEST_FILES if (ROOT / f).exists()]
            cmd = pytest_cmd(files, out / "kernel_tests.xml")
            if args.dry_run:
                cmd += ["-k", DRY_RUN_TEST_FILTER]
            limit = 240
        elif stage == "bench_kernel":
            cmd = [py, "scripts/bench_kernel.py", "--out", str(out / "bench_kernel.json")]
            if args.dry_run:
                cmd += ["--batches", "2", "--contexts", "64", "--repeats", "1", "--target-ms", "5"]
                cmd += ["--prefill", "2", "32", "96"]
            else:
                cmd += "--batches 64 256 --contexts 1024 4096 8192 --repeats 3".split()
                cmd += "--target-ms 50 --prefill 8 1024 4096 --prefill 2 4096 8192".split()
            limit = 180
        elif stage == "engine_tests":
            # The engine against the HF oracle with the GPU's default kernel ("auto").
            cmd = pytest_cmd(ENGINE_TEST_FILES, out / "engine_tests.xml")
            if args.dry_run:
                cmd += ["-k", "bad_engine_config"]  # the stage's plumbing; the suite runs the rest
            limit = 200
        elif stage == "engine":
            cmd = [
                py,
                me,
                "--out",
                str(out),
                "--stage",
                "engine",
                *dry,
                "--num-requests",
                str(n),
                "--input-len",
                str(li),
                "--output-len",
                str(lo),
            ]
            limit = 240
        else:
            raise SystemExit(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")
        r = run_stage(stage, cmd, out, limit * scale)
        if stage in ("kernel_tests", "engine_tests"):
            summary = junit_summary(out / f"{stage}.xml")
            r["counts"] = summary.get("counts")
            (out / f"{stage}.json").write_text(json.dumps(summary, indent=1) + "\n")
        results.append(r)
        (out / "summary.json").write_text(
            json.dumps(dict(dry_run=args.dry_run, stages=results), indent=1) + "\n"
        )
    print(json.dumps(dict(dry_run=args.dry_run, stages=results), indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
