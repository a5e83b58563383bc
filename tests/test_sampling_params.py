"""SamplingParams / BeamSearchParams validation and the output types."""

import dataclasses
import json
import math

import pytest

from jax_paged.entrypoints.outputs import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    make_logprobs_dict,
)
from jax_paged.entrypoints.sampling_params import BeamSearchParams, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.uses_penalties


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SamplingParams(2)  # noqa
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    q = dataclasses.replace(p, temperature=0.0)
    assert q.is_greedy
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)  # replace re-validates


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("n", 0, ">= 1"),
        ("n", 1.5, ">= 1"),
        ("n", True, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", "hot", ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("top_k", 0, "-1 (off)"),
        ("top_k", -2, "-1 (off)"),
        ("top_k", 2.0, "-1 (off)"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("seed", 1.0, "None or an int"),
        ("seed", "42", "None or an int"),
        ("seed", 2**64, "None or an int"),
        ("stop", [""], "non-empty str"),
        ("stop", 3, "non-empty str"),
        ("stop", ["a", 1], "non-empty str"),
        ("stop_token_ids", [-1], "ints >= 0"),
        ("stop_token_ids", "2", "ints >= 0"),
        ("stop_token_ids", [1.0], "ints >= 0"),
        ("ignore_eos", 1, "true or false"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("logprobs", -1, ">= 0"),
        ("prompt_logprobs", -1, ">= 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.5, "[-2, 2]"),
        ("frequency_penalty", math.nan, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_penalty", math.inf, "> 0"),
        ("skip_special_tokens", "yes", "true or false"),
        ("include_stop_str_in_output", None, "true or false"),
    ],
)
def test_bad_field_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.startswith(field), msg
    assert allowed in msg, msg
    assert repr(value) in msg, msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).max_tokens is None


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=(7, 9), temperature=1, top_p=1)
    assert p.stop == ["END"] and p.stop_token_ids == [7, 9]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # tiny temperatures are greedy
    assert SamplingParams(seed=-5).seed == -5
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2).uses_penalties


def test_child_params():
    p = SamplingParams(n=3, seed=10, temperature=0.5)
    kids = [p.child_params(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.temperature == 0.5 for k in kids)
    assert SamplingParams(n=2).child_params(1).seed is None
    assert SamplingParams(n=2, seed=2**64 - 1).child_params(1).seed == 0  # wraps mod 2**64
    with pytest.raises(ValueError, match="index"):
        p.child_params(3)


def test_from_dict_round_trip_and_unknown_fields():
    d = json.loads('{"temperature": 0.0, "max_tokens": 5, "stop": ["\\n"], "seed": 1}')
    p = SamplingParams.from_dict(d)
    assert (p.temperature, p.max_tokens, p.stop, p.seed) == (0.0, 5, ["\n"], 1)
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temprature": 0.5, "max_tokens": 3})
    msg = str(e.value)
    assert "'temprature'" in msg and "allowed:" in msg
    for f in dataclasses.fields(SamplingParams):
        assert f.name in msg
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 0.0)])
    with pytest.raises(ValueError, match="^top_k"):
        SamplingParams.from_dict({"top_k": 0})


def test_beam_search_params():
    b = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (b.ignore_eos, b.temperature, b.length_penalty) == (False, 0.0, 1.0)
    assert BeamSearchParams.from_dict({"beam_width": 2, "max_tokens": 3}).beam_width == 2
    for field, value in [
        ("beam_width", 0),
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("length_penalty", math.nan),
        ("ignore_eos", "no"),
    ]:
        kwargs = {"beam_width": 2, "max_tokens": 3, field: value}
        with pytest.raises(ValueError, match=f"^{field}"):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="'beam_width'.*required"):
        BeamSearchParams.from_dict({"max_tokens": 3})
    with pytest.raises(ValueError, match="'width'.*allowed: beam_width"):
        BeamSearchParams.from_dict({"width": 3, "beam_width": 2, "max_tokens": 3})


def test_output_types():
    lp = make_logprobs_dict(5, -3.0, 7, [1, 2, 5], [-0.5, -1.0, -3.0], num=2, decode=str)
    # The sampled token comes first and keeps its own rank when outside the requested top-N.
    assert list(lp) == [5, 1, 2]
    assert lp[5] == Logprob(-3.0, 7, "5") and lp[1] == Logprob(-0.5, 1, "1")
    lp = make_logprobs_dict(2, -1.0, 2, [1, 2], [-0.5, -1.0], num=2)
    assert list(lp) == [2, 1] and lp[2].rank == 2 and lp[2].decoded_token is None
    c = CompletionOutput(index=0, text="hi", token_ids=[1, 2], finish_reason="length")
    assert c.finished() and c.cumulative_logprob is None and c.logprobs is None
    r = RequestOutput(
        request_id="0",
        prompt="x",
        prompt_token_ids=[3],
        prompt_logprobs=None,
        outputs=[c],
        finished=True,
    )
    assert r.num_cached_tokens == 0 and r.metrics is None and r.error is None
