"""scripts/generate.py: good lines run, bad lines get an error record each naming their line;
a bad command line fails in one line before the model loads; results are written as they
finish."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts/generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_jsonl_requests_with_bad_lines(tiny_hf, tmp_path, capsys):
    hf_model, folder = tiny_hf("qwen2_tied")
    lines = [
        json.dumps({"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 5}),
        "{not json",
        json.dumps({"prompt_token_ids": [9, 10], "temperature": -1}),
        json.dumps({"prompt_token_ids": [9, 10], "colour": "red"}),
        json.dumps({"prompt_token_ids": [11, 12, 13], "max_tokens": 3, "ignore_eos": True}),
        json.dumps({"prompt": "needs a tokenizer"}),
        json.dumps([1, 2, 3]),
    ]
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    gen = _load_script()
    rc = gen.main(
        [
            "--model",
            str(folder),
            "--prompts-file",
            str(src),
            "--output",
            str(out),
            "--no-progress",
            "--num-kv-blocks",
            "64",
            "--max-num-seqs",
            "4",
        ]
    )
    assert rc == 0
    # Written as they finish (rejected first): in input order once sorted by index.
    recs = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in recs] == list(range(7))
    assert [r["line"] for r in recs] == list(range(1, 8))
    assert recs[0]["error"] is None and len(recs[0]["outputs"][0]["token_ids"]) == 5
    assert "malformed JSON" in recs[1]["error"]
    assert "temperature" in recs[2]["error"]
    assert "unknown fields" in recs[3]["error"] and "colour" in recs[3]["error"]
    assert recs[4]["error"] is None and len(recs[4]["outputs"][0]["token_ids"]) == 3
    assert "tokenizer" in recs[5]["error"]
    assert "JSON object" in recs[6]["error"]
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("summary: ")
    s = json.loads(summary[len("summary: ") :])
    assert s["requests"] == 7 and s["errors"] == 5 and s["output_tokens"] == 8

    # Greedy output equals HF's.
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7, 8]])
        ref = hf_model.generate(ids, max_new_tokens=5, do_sample=False, attention_mask=ids * 0 + 1)
    assert recs[0]["outputs"][0]["token_ids"] == ref[0, 4:].tolist()


ENGINE = ["--no-progress", "--num-kv-blocks", "64", "--max-num-seqs", "4"]


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [x for x in err.splitlines() if x.startswith("error:")]


@pytest.fixture
def no_llm(monkeypatch):
    """The script module with `LLM` replaced by one that fails the test if it is built."""
    gen = _load_script()

    def llm(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(gen, "LLM", llm)
    return gen


@pytest.mark.parametrize("kind", ["missing", "empty folder", "not gguf"])
def test_bad_model_path_fails_in_one_line_before_loading(no_llm, tmp_path, capsys, kind):
    model = {
        "missing": "/nonexistent",
        "empty folder": str(tmp_path),
        "not gguf": str(tmp_path / "weights.bin"),
    }[kind]
    (tmp_path / "weights.bin").write_bytes(b"\0")
    rc = no_llm.main(["--model", model, "Hello", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == _error_lines(err)
    assert len(_error_lines(err)) == 1 and "--model" in err and model in err


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_unwritable_output_fails_before_loading(no_llm, tiny_hf, tmp_path, capsys, where):
    _, folder = tiny_hf("qwen2_tied")
    output = tmp_path / "missing" / "out.jsonl" if where == "missing folder" else tmp_path
    rc = no_llm.main(["--model", str(folder), "--output", str(output), "Hello", *ENGINE])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == _error_lines(err)
    assert "--output" in err and str(output) in err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("name,text", [("p.txt", ""), ("p.txt", "\n  \n\n"), ("r.jsonl", "\n \n")])
def test_empty_prompts_file_fails_before_loading(no_llm, tmp_path, capsys, name, text):
    src = tmp_path / name
    src.write_text(text)
    rc = no_llm.main(["--prompts-file", str(src), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert _error_lines(err) == [f"error: --prompts-file {src} holds no prompts"]


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("exc", [MemoryError("KV cache\nwill not fit"), ValueError("bad")])
def test_engine_construction_failure_is_one_line(monkeypatch, capsys, exc, verbose):
    gen = _load_script()

    def llm(*a, **k):
        raise exc

    monkeypatch.setattr(gen, "LLM", llm)
    rc = gen.main(["Hello", "--no-progress"] + (["-v"] if verbose else []))
    assert rc == 1
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines == err.strip().splitlines()[-1:]
    assert lines[0].startswith("error: cannot start the engine") and str(exc)[:4] in lines[0]
    assert ("Traceback" in err) == verbose


def test_every_error_names_its_file_line(tiny_hf, tmp_path, capsys):
    """Parse errors, bad fields, SamplingParams and chat errors, and errors the engine reports:
    all as ``line N:`` with N the line in the file (blank lines counted), and in "line"."""
    _, folder = tiny_hf("qwen2_tied")
    lines = {
        1: json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}),
        3: "{not json",
        5: json.dumps({"prompt_token_ids": [5], "temperature": -1}),  # SamplingParams
        6: json.dumps({"prompt": "needs a tokenizer"}),  # the engine's error
        8: json.dumps({"messages": [{"role": "user", "content": "hi"}]}),  # chat: no template
        9: json.dumps({"prompt_token_ids": [5], "colour": "red"}),
        10: json.dumps({"prompt_token_ids": []}),  # the engine's error
        12: json.dumps({"prompt_token_ids": [9, 10], "max_tokens": 2}),
    }
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(lines.get(n, " " * (n % 2)) for n in range(1, 14)) + "\n")
    out = tmp_path / "out.jsonl"
    rc = _load_script().main(
        ["--model", str(folder), "--prompts-file", str(src), "--output", str(out), *ENGINE]
    )
    assert rc == 0
    recs = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == list(range(len(lines)))
    assert [recs[i]["line"] for i in range(len(lines))] == list(lines)
    bad = [r for r in recs.values() if r["error"] is not None]
    assert sorted(r["line"] for r in bad) == [3, 5, 6, 8, 9, 10]
    for r in bad:
        assert r["error"].startswith(f"line {r['line']}: "), r
    assert recs[0]["error"] is None and recs[7]["error"] is None

    # Positional prompts: "prompt N:" from 1, "line" null; on stdout mode the tag is the index.
    capsys.readouterr()
    rc = _load_script().main(["--model", str(folder), "needs", "a tokenizer", *ENGINE])
    assert rc == 1  # every request failed
    err = capsys.readouterr().err
    assert "[0] error: prompt 1: " in err and "[1] error: prompt 2: " in err
    rc = _load_script().main(["--model", str(folder), "--output", str(out), "x", *ENGINE])
    (rec,) = map(json.loads, out.read_text().splitlines())
    assert rec["line"] is None and rec["error"].startswith("prompt 1: ")


def test_results_are_written_as_they_finish(tiny_hf, tmp_path, capsys, monkeypatch):
    """A run that crashes after its first result has that result on disk, and fails in one
    line, no traceback."""
    _, folder = tiny_hf("qwen2_tied")
    gen = _load_script()
    out = tmp_path / "out.jsonl"
    seen = []

    class CrashingLLM(gen.LLM):
        def iter_generate(self, prompts, params):
            results = super().iter_generate(prompts, params)
            yield next(results)
            seen.append(out.read_text())  # what the file holds once the caller took it
            results.close()
            raise RuntimeError("device lost")

    monkeypatch.setattr(gen, "LLM", CrashingLLM)
    src = tmp_path / "r.jsonl"
    src.write_text(
        "\n".join(
            [
                json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 1}),
                json.dumps({"prompt_token_ids": [7, 8], "max_tokens": 30, "ignore_eos": True}),
            ]
        )
    )
    rc = gen.main(
        ["--model", str(folder), "--prompts-file", str(src), "--output", str(out), *ENGINE]
    )
    assert rc == 1
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
    assert "device lost" in line and "1 of 2" in line
    assert len(seen) == 1
    (rec,) = map(json.loads, seen[0].splitlines())
    assert rec["error"] is None and rec["line"] == 1 and len(rec["outputs"][0]["token_ids"]) == 1
    assert out.read_text() == seen[0]


@pytest.mark.parametrize(
    "flags,want", [([], "auto"), (["--kv-cache-dtype", "bfloat16"], "bfloat16")]
)
def test_kv_cache_dtype_flag_reaches_the_engine(monkeypatch, capsys, flags, want):
    gen = _load_script()
    seen = {}

    def llm(*a, **k):
        seen.update(k)
        raise ValueError("stop here")

    monkeypatch.setattr(gen, "LLM", llm)
    assert gen.main(["Hello", "--no-progress", *flags]) == 1
    assert seen["kv_cache_dtype"] == want
