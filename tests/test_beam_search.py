"""`LLM.beam_search` on tiny random HF models against HF transformers' beam search.

The oracle is ``generate(num_beams=W, num_return_sequences=W, length_penalty=...,
early_stopping=...)``: the W hypotheses must have the same tokens, in the same order, and the
same ``sequences_scores`` (to 1e-4). Each model is saved again with an EOS id that its beams
actually produce (the `tiny_hf` models never stop otherwise), so EOS, early stopping and the
length penalty of finished hypotheses all matter. One LLM per model keeps compilation short.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import numpy as np
import pytest
from conftest import oracle

from jax_paged import LLM, SamplingParams
from jax_paged.entrypoints.beam_search import (
    BeamSearchOutput,
    BeamSearchSequence,
    _Beam,
    _Hypothesis,
    _make_output,
    _PromptState,
)
from jax_paged.entrypoints.sampling_params import BeamSearchParams

MAX_TOKENS = 10
PROMPT_LENGTHS = (5, 9, 14, 21)

# (length_penalty, early_stopping, ignore_eos)
CASES = [
    (1.0, False, False),
    (1.0, True, False),
    (2.0, False, False),
    (2.0, True, False),
    (-0.5, False, False),
    (1.0, "never", False),
    (1.0, False, True),
]


@dataclasses.dataclass
class Setup:
    hf_model: object
    llm: LLM
    prompts: list[list[int]]
    eos: int


def hf_beam_search(model, prompts, width, max_tokens, length_penalty, early_stopping, eos):
    """HF's hypotheses per prompt: (generated tokens cut after EOS, sequences_scores). The
    prompts run as one left-padded batch (4x faster than one by one, same results)."""
    torch, _ = oracle()
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=eos,
            pad_token_id=0,
        )
    rows = out.sequences[:, longest:].tolist()
    scores = out.sequences_scores.tolist()
    result = []
    for i in range(len(prompts)):
        seqs = []
        for row in rows[i * width : (i + 1) * width]:
            if eos is not None and eos in row:
                row = row[: row.index(eos) + 1]
            seqs.append(row)
        result.append((seqs, scores[i * width : (i + 1) * width]))
    return result


@pytest.fixture(scope="module", params=["llama3_gqa4", "qwen2_tied"])
def setup(request, tiny_hf, tmp_path_factory):
    model, folder = tiny_hf(request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]
    # EOS: the token that HF's beams (without EOS) produce in the most prompts, not first.
    seen = Counter()
    for seqs, _ in hf_beam_search(model, prompts, 4, MAX_TOKENS, 1.0, False, None):
        seen.update({t for s in seqs for t in s[1:]})
    eos = seen.most_common(1)[0][0]
    path = tmp_path_factory.mktemp(f"{request.param}_eos")
    shutil.copytree(folder, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text()) if (path / name).exists() else {}
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    # Few batch shapes to compile: at most 4 rows and 16 tokens a step.
    llm = LLM(str(path), block_size=4, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.eos_token_ids == [eos]
    return Setup(model, llm, prompts, eos)


def _run(setup, width, length_penalty, early_stopping, ignore_eos, **kwargs):
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        ignore_eos=ignore_eos,
    )
    return setup.llm.beam_search([{"prompt_token_ids": p} for p in setup.prompts], params, **kwargs)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lp{c[0]}-es{c[1]}-ignore{c[2]}")
def test_matches_hf(setup, width, case):
    length_penalty, early_stopping, ignore_eos = case
    outs = _run(setup, width, *case)
    assert len(outs) == len(setup.prompts)
    eos = None if ignore_eos else setup.eos
    refs = hf_beam_search(
        setup.hf_model, setup.prompts, width, MAX_TOKENS, length_penalty, early_stopping, eos
    )
    for prompt, out, (ref_seqs, ref_scores) in zip(setup.prompts, outs, refs, strict=True):
        assert isinstance(out, BeamSearchOutput) and out.error is None
        assert [s.output_token_ids for s in out.sequences] == ref_seqs
        np.testing.assert_allclose([s.score for s in out.sequences], ref_scores, atol=1e-4)
        for s in out.sequences:
            _check_sequence(s, prompt, length_penalty, eos)
    # Nothing left behind: no requests, no blocks in use (cached ones are evictable).
    engine = setup.llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert setup.llm.get_metrics()["kv_usage"] == 0.0


def _check_sequence(s: BeamSearchSequence, prompt, length_penalty, eos):
    out = s.output_token_ids
    assert s.tokens[: len(prompt)] == prompt and s.num_prompt_tokens == len(prompt)
    assert len(s.logprobs) == len(out)
    chosen = [d[t].logprob for d, t in zip(s.logprobs, out, strict=True)]
    assert s.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
    assert s.score == pytest.approx(s.cum_logprob / len(out) ** length_penalty, abs=1e-5)
    if eos is not None and out[-1] == eos:
        assert s.finish_reason == "stop" and eos not in out[:-1]
    else:
        assert s.finish_reason == "length" and len(out) == MAX_TOKENS
    assert s.text is None  # the tiny models have no tokenizer


def test_eos_and_early_stopping_matter(setup):
    """The grid above exercises what it claims: hypotheses end with EOS and with length, and
    early_stopping True and "never" each change some result against False."""
    reasons, true_differs, never_differs = set(), False, False
    for width in (2, 4):
        for length_penalty in (1.0, 2.0):
            toks = {}
            for es in (True, False, "never"):
                outs = _run(setup, width, length_penalty, es, False)
                toks[es] = [[s.tokens for s in o.sequences] for o in outs]
                reasons |= {s.finish_reason for o in outs for s in o.sequences}
            true_differs |= toks[True] != toks[False]
            never_differs |= toks["never"] != toks[False]
    assert reasons == {"stop", "length"}
    assert true_differs and never_differs


def test_concurrency_limit_and_prompt_alone(setup):
    """Results do not depend on how many prompts run together."""
    all_at_once = _run(setup, 4, 1.0, False, False)
    bars = []
    one_at_a_time = _run(
        setup, 4, 1.0, False, False, concurrency_limit=1, use_tqdm=lambda **kw: _Bar(bars, **kw)
    )
    assert len(bars) == 1 and bars[0].n == bars[0].total == len(setup.prompts) and bars[0].closed
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    alone = setup.llm.beam_search({"prompt_token_ids": setup.prompts[2]}, params)
    for a, b in zip(all_at_once, one_at_a_time, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        np.testing.assert_allclose(
            [s.score for s in a.sequences], [s.score for s in b.sequences], atol=1e-5
        )
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in all_at_once[2].sequences]


class _Bar:
    def __init__(self, registry, total, **_):
        self.total, self.n, self.closed = total, 0, False
        registry.append(self)

    def update(self, k):
        self.n += k

    def close(self):
        self.closed = True


def test_bad_prompts_fail_alone(setup):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    good = {"prompt_token_ids": setup.prompts[0]}
    outs = setup.llm.beam_search(
        [{"prompt_token_ids": []}, good, {"prompt_token_ids": [5, 999]}, "text, no tokenizer"],
        params,
    )
    assert "empty" in outs[0].error and outs[0].sequences == []
    assert outs[1].error is None and len(outs[1].sequences) == 2
    assert "prompt_token_ids" in outs[2].error
    assert "tokenizer" in outs[3].error and outs[3].prompt == "text, no tokenizer"
    assert not setup.llm.engine.has_unfinished_requests()


def test_bad_arguments_name_the_field(setup):
    llm = setup.llm
    prompt = {"prompt_token_ids": setup.prompts[0]}
    with pytest.raises(ValueError, match="params"):
        llm.beam_search(prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="beam_width.*max_logprobs"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4), concurrency_limit=0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=2.0), "beam_width"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(length_penalty="1"), "length_penalty"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(early_stopping=1), "early_stopping"),
        (dict(early_stopping=None), "early_stopping"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(temperature=-1.0), "temperature"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    args = dict(beam_width=2, max_tokens=4) | kwargs
    with pytest.raises(ValueError, match=f"^{field}"):
        BeamSearchParams(**args)


def test_early_stopping_values():
    for es in (True, False, "never"):
        assert BeamSearchParams(beam_width=2, max_tokens=4, early_stopping=es).early_stopping == es
    p = BeamSearchParams.from_dict({"beam_width": 2, "max_tokens": 4, "early_stopping": "never"})
    assert p.early_stopping == "never"
    assert BeamSearchParams(beam_width=2, max_tokens=4).early_stopping is False


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{t}>" for t in ids)


@pytest.mark.parametrize("include", [False, True])
def test_text_drops_eos_unless_asked(include):
    params = BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=include)
    st = _PromptState(0, "hi", [7, 8], 4, [])
    st.finished = [
        _Hypothesis(_Beam([3, 2], [{}, {}], -1.0), -0.5, "stop"),
        _Hypothesis(_Beam([3, 4, 5, 6], [{}] * 4, -3.0), -0.75, "length"),
    ]
    out = _make_output(st, params, frozenset([2]), _FakeTokenizer())
    assert out.prompt == "hi" and out.prompt_token_ids == [7, 8]
    assert [s.text for s in out.sequences] == ["<3><2>" if include else "<3>", "<3><4><5><6>"]
    assert out.sequences[0].tokens == [7, 8, 3, 2]
    assert out.sequences[1].output_token_ids == [3, 4, 5, 6]
