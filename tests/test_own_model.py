"""A user-written NNX decoder (examples/own_model.py, not in models/) behind `LLM` and
`PagedDecoder`: greedy outputs equal its own dense forward, and models that miss a part of
`models.PagedModel` are refused at construction with a message naming the part."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import research_greedy
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from examples.own_model import TinyGPT, TinyGPTConfig, dense_greedy  # noqa: E402
from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.entrypoints.research import PagedDecoder  # noqa: E402

MAX_TOKENS = 12
LENS = (3, 9, 17, 5, 30)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def model():
    return TinyGPT(TinyGPTConfig(), seed=0)


@pytest.fixture(scope="module")
def prompts_and_expected(model):
    rng = np.random.default_rng(0)
    v = model.config.vocab_size
    prompts = [rng.integers(1, v, size=n).tolist() for n in LENS]
    prompts.append(prompts[2][:12] + rng.integers(1, v, size=4).tolist())  # shares a prefix
    return prompts, [dense_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_example_satisfies_protocol(model):
    models.check_model(model)
    assert isinstance(model, models.PagedModel)
    assert isinstance(model.config, models.PagedModelConfig)


def test_llm_greedy_equals_dense(model, prompts_and_expected):
    """Prefix caching on, a pool too small for all rows at once (preemption by recompute)."""
    prompts, expected = prompts_and_expected
    llm = LLM(
        models.wrap_model(model),
        num_kv_blocks=12,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    for _ in range(2):  # the second pass reads cached prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_llm_stops_at_eos(model, prompts_and_expected):
    prompts, expected = prompts_and_expected
    eos = expected[1][4]
    llm = LLM(models.wrap_model(model, eos_token_ids=[eos]), num_kv_blocks=64, block_size=4)
    out = llm.generate(
        {"prompt_token_ids": prompts[1]}, dataclasses.replace(GREEDY, ignore_eos=False)
    )
    toks = list(out[0].outputs[0].token_ids)
    assert toks == expected[1][: expected[1].index(eos) + 1]
    assert out[0].outputs[0].finish_reason == "stop"


def test_paged_decoder_equals_dense(model, prompts_and_expected):
    prompts, expected = prompts_and_expected
    dec = PagedDecoder(model, max_seqs=len(prompts), max_len=48, block_size=8)
    got = research_greedy(dec, GREEDY, prompts, MAX_TOKENS)
    assert got == expected


# ----------------------------------------------------------------------------------------------
# Models that do not satisfy the protocol


@dataclasses.dataclass(frozen=True)
class NoKVHeads:
    vocab_size: int = 97
    max_position_embeddings: int = 128
    num_layers: int = 1
    num_heads: int = 4
    head_dim: int = 16
    sliding_window: int | None = None
    scale: float = 0.25


class NoForward(nnx.Module):
    def __init__(self):
        self.config, self.dtype = TinyGPTConfig(), jnp.dtype(jnp.float32)
        self.w = nnx.Param(jnp.zeros((2,)))


def _bad_models():
    no_kv = TinyGPT(TinyGPTConfig(num_layers=1))
    no_kv.config = NoKVHeads()
    bad_gqa = TinyGPT(TinyGPTConfig(num_layers=1))
    bad_gqa.config = TinyGPTConfig(num_heads=6, num_kv_heads=4)
    return [
        (no_kv, "model.config has no 'num_kv_heads'"),
        (NoForward(), "model has no forward(tokens, positions, attn, kv, *, logits_indices"),
        (bad_gqa, "num_heads=6 is not a multiple of num_kv_heads=4"),
    ]


@pytest.mark.parametrize("case", range(3), ids=["no_num_kv_heads", "no_forward", "bad_gqa"])
def test_bad_model_refused_at_construction(case):
    bad, message = _bad_models()[case]
    loaded = models.LoadedModel(bad, None, bad.config, models.GenerationConfig())
    with pytest.raises(models.ModelProtocolError, match=_re(message)):
        LLM(loaded, num_kv_blocks=8, block_size=4)
    with pytest.raises(models.ModelProtocolError, match=_re(message)):
        PagedDecoder(bad, max_seqs=1, max_len=16)
    with pytest.raises(models.ModelProtocolError, match=_re(message)):
        models.wrap_model(bad)


def test_forward_with_wrong_signature_named():
    class OldForward(NoForward):
        def forward(self, tokens, attn):
            return tokens, None

    with pytest.raises(TypeError, match=r"model\.forward\(self, tokens, attn\)|does not accept"):
        models.check_model(OldForward())


def _re(s: str) -> str:
    import re

    return re.escape(s)


def test_real_models_pass(tiny_llama):
    path, _ = tiny_llama
    models.check_model(models.load(str(path)).model)


def test_readme_example_runs():
    import re

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Bring your own model") :]
    scope: dict = {}
    exec(
        compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "README", "exec"), scope
    )
    toks = list(scope["outs"][0].outputs[0].token_ids)
    assert 0 < len(toks) <= 8
    assert toks == dense_greedy(scope["model"], [5, 6, 7], 8)[: len(toks)]


def test_dense_greedy_pads_no_wider_than_the_position_table():
    """A table of 100 positions and 98 tokens: padding to 128 would embed positions past the
    table (NaN); the oracle must agree with plain eager recomputation at the unpadded width.
    One eager forward over the prompt and the oracle's tokens checks every step: at each
    position the argmax is the next token, which by induction is greedy decoding itself."""
    model = TinyGPT(TinyGPTConfig(max_position_embeddings=100), seed=1)
    prompt = list(range(1, 91))
    got = dense_greedy(model, prompt, 8)
    seq = prompt + got
    logits = np.asarray(model(jnp.asarray([seq[:-1]], jnp.int32))[0])
    assert np.all(np.isfinite(logits))
    assert np.argmax(logits[len(prompt) - 1 :], axis=-1).tolist() == got
