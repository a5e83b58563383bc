"""Paired A/B of one benchmark script: two versions of the project (a git revision against this
working tree) or two sets of arguments, alternated in one run, as JSON.

    python scripts/bench_ab.py --base 42e5adb -- scripts/bench_decode.py --quick --no-hf
    python scripts/bench_ab.py --new-args=--async-scheduling -- \\
        scripts/benchmark.py --quick --systems paged --online-rates 2,4

Each side is a fresh process of the script with the same arguments (plus ``--base-args`` /
``--new-args``), in a checkout of its revision (``--base``, ``--new``: ``git worktree add`` in a
temporary folder, removed at the end), or in this working tree for a side given none. The
sides alternate ``--rounds`` times, the first in each round swapping every round (A B, B A,
A B, ...), so slow drift of the machine hits both alike. Every run's stdout must be the
script's JSON. For every number found at the same path in all runs (``--keys``: only paths
containing one of these substrings), the output gives each side's median and the median of the
per-round ratios new / base (``ratio``), with their min and max. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value by dotted path (list items by index; bools left out)."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        if isinstance(obj, int | float) and not isinstance(obj, bool):
            out[prefix] = float(obj)
        return out
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def paired(base: list[dict[str, float]], new: list[dict[str, float]], keys: list[str]) -> dict:
    """Per path present in every run: both sides' medians and the per-round ratios' median."""
    paths = set.intersection(*(set(r) for r in base + new))
    if keys:
        paths = {p for p in paths if any(k in p for k in keys)}
    rows = {}
    for p in sorted(paths):
        b = [r[p] for r in base]
        n = [r[p] for r in new]
        ratios = [y / x for x, y in zip(b, n, strict=True) if x]
        rows[p] = dict(
            base=statistics.median(b),
            new=statistics.median(n),
            ratio=statistics.median(ratios) if ratios else None,
            ratio_min=min(ratios) if ratios else None,
            ratio_max=max(ratios) if ratios else None,
        )
    return rows


def run_side(folder: Path, script: list[str], extra: list[str]) -> tuple[dict, float]:
    """Runs the script in ``folder`` with this interpreter; its JSON and the wall seconds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(folder), str(folder / "scripts")] + env.get("PYTHONPATH", "").split(os.pathsep)
    ).rstrip(os.pathsep)
    cmd = [sys.executable, str(folder / script[0]), *script[1:], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{shlex.join(cmd)} (in {folder}) exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    try:
        return json.loads(proc.stdout), dt
    except json.JSONDecodeError as e:
        raise SystemExit(f"{shlex.join(cmd)} printed no JSON on stdout ({e})") from e


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", default=None, help="git revision of the base side (default: here)")
    ap.add_argument("--new", default=None, help="git revision of the new side (default: here)")
    ap.add_argument("--base-args", default="", help="extra arguments of the base side")
    ap.add_argument("--new-args", default="", help="extra arguments of the new side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default="", help="comma-separated path substrings to report")
    ap.add_argument("--output", default=None, help="also write the JSON to this file")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the benchmark after --, e.g. -- scripts/bench_decode.py --quick")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} must be >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    made = []
    dirs = {}
    for name, rev in (("base", args.base), ("new", args.new)):
        dirs[name] = ROOT
        if rev is not None:
            dirs[name] = tmp / name
            cmd = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dirs[name]), rev]
            subprocess.run(cmd, check=True, capture_output=True)
            made.append(dirs[name])
    sides = {
        "base": (dirs["base"], shlex.split(args.base_args)),
        "new": (dirs["new"], shlex.split(args.new_args)),
    }
    runs: dict[str, list] = {"base": [], "new": []}
    seconds: dict[str, list] = {"base": [], "new": []}
    try:
        for i in range(args.rounds):
            order = ("base", "new") if i % 2 == 0 else ("new", "base")
            for name in order:
                folder, extra = sides[name]
                print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                out, dt = run_side(folder, script, extra)
                runs[name].append(out)
                seconds[name].append(round(dt, 1))
    finally:
        for folder in made:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
                capture_output=True,
            )
    keys = [k for k in args.keys.split(",") if k]
    flat = {k: [flatten(r) for r in v] for k, v in runs.items()}
    result = dict(
        script=shlex.join(script),
        base=args.base or "working tree",
        new=args.new or "working tree",
        base_args=args.base_args,
        new_args=args.new_args,
        rounds=args.rounds,
        wall_seconds=seconds,
        metrics=paired(flat["base"], flat["new"], keys),
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
