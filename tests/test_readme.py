"""The README's Python examples run as written (the model swapped for a tiny one where the
example allows it), and every Python block of the README is one of them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import models

README = Path(__file__).resolve().parent.parent / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_research_scan_example(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    tiny = models.load(str(path))
    monkeypatch.setattr(models, "load", lambda *a, **k: tiny)
    scope: dict = {}
    exec(compile(_block_after("### Research API"), "README.md", "exec"), scope)
    tokens = np.asarray(scope["tokens"])
    assert tokens.shape == (64, 4)
    first = np.asarray(scope["first"])
    assert (first >= 0).all()
    # Rows 0 and 2 have the same prompt and greedy sampling: the same continuation.
    assert (tokens[:, 0] == tokens[:, 2]).all()


@pytest.mark.slow
def test_vllm_shaped_example_on_smollm2(capsys):
    """The first Python example, as written, on the embedded SmolLM2."""
    scope: dict = {}
    exec(compile(_block_after("### Offline generation"), "README.md", "exec"), scope)
    outs = scope["outs"]
    assert len(outs) == 2 and all(o.error is None for o in outs)
    assert len(outs[0].outputs[0].token_ids) > 0
    assert outs[0].outputs[0].finish_reason in ("stop", "length")
    printed = capsys.readouterr().out
    assert "generation_tokens_per_s" in printed


def test_block_manager_example(capsys):
    exec(compile(_block_after("### The block manager"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "1023"


# The heading above each Python block and the test that runs it (the own-model example runs in
# tests/test_own_model.py::test_readme_example_runs).
RUN_BY = {
    "### Offline generation": "test_vllm_shaped_example_on_smollm2",
    "### Research API": "test_research_scan_example",
    "### Bring your own model": "test_own_model.py::test_readme_example_runs",
    "### The block manager": "test_block_manager_example",
}


def test_every_python_block_is_run():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    run = [_block_after(h) for h in RUN_BY]
    assert sorted(blocks) == sorted(run), "a README Python block that no test runs"
