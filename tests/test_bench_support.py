"""scripts/bench_support: the run metadata every benchmark JSON carries, and writing it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_support  # noqa: E402


def test_run_metadata_names_commit_date_machine_and_versions():
    meta = bench_support.run_metadata(memory_bandwidth_gb_s=41.234)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert meta["commit"] == head and len(head) == 40
    assert isinstance(meta["commit_dirty"], bool)
    assert meta["date_utc"].endswith("Z") and meta["date_utc"][:2] == "20"
    m = meta["machine"]
    assert m["cpu_model"] and m["cpu_count"] >= 1 and 1 <= m["usable_cpus"] <= m["cpu_count"]
    assert m["memory_bandwidth_gb_s"] == 41.23
    assert m["memory_gib"] is None or m["memory_gib"] > 0
    v = meta["versions"]
    import jax
    import numpy

    assert v["jax"] == jax.__version__ and v["numpy"] == numpy.__version__ and v["python"]
    assert m["accelerator"]["platform"] == jax.devices()[0].platform  # jax is imported here
    # Without a figure from the script, the read bandwidth is measured here (a small buffer,
    # still far beyond the caches).
    measured = bench_support.read_bandwidth(64 << 20, trials=2) / 1e9
    assert 0.5 < measured < 10_000


def test_emit_prints_and_writes_the_same_json(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    bench_support.emit({"a": 1, "run": {"commit": "x"}}, str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"a": 1, "run": {"commit": "x"}}
    bench_support.emit({"b": 2}, None)
    assert json.loads(capsys.readouterr().out) == {"b": 2}
