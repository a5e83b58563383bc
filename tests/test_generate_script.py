"""scripts/generate.py over a JSONL file: good lines run, bad lines get an error record each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == list(range(7))
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
