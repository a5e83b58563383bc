"""scripts/bench_ab.py: pairs the runs of a benchmark script round by round and reports the
median ratio of every number; a failing run stops it with the script's error."""

from __future__ import annotations

import textwrap

import bench_ab
import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    fast = "--fast" in sys.argv
    print(json.dumps({"run": {"tok_s": 30.0 if fast else 10.0, "ok": True}, "n": [1, 2]}))
    """
)


def test_flatten_and_paired():
    flat = bench_ab.flatten({"a": {"b": 2, "c": [1.5, {"d": 4}]}, "e": True, "f": "x"})
    assert flat == {"a.b": 2.0, "a.c.0": 1.5, "a.c.1.d": 4.0}
    rows = bench_ab.paired([{"x": 2.0}, {"x": 4.0}], [{"x": 3.0}, {"x": 4.0}], keys=[])
    assert rows["x"]["ratio"] == pytest.approx(1.25)  # rounds: 1.5 and 1.0
    assert rows["x"]["ratio_min"] == 1.0 and rows["x"]["ratio_max"] == 1.5


def test_two_argument_sets_alternate(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT)
    out = bench_ab.main(
        ["--rounds", "2", "--new-args=--fast", "--keys", "tok_s", "--", str(script)]
    )
    assert out["metrics"] == {
        "run.tok_s": dict(base=10.0, new=30.0, ratio=3.0, ratio_min=3.0, ratio_max=3.0)
    }
    assert len(out["wall_seconds"]["base"]) == len(out["wall_seconds"]["new"]) == 2


def test_a_failing_run_names_its_command(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import sys; sys.exit('no such model')")
    with pytest.raises(SystemExit, match="no such model"):
        bench_ab.main(["--rounds", "1", "--", str(script)])
