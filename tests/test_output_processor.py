"""Output processing: incremental detokenization equals a full decode, and stop strings cost
O(n) over a long output (each character decoded and searched once, not once per token)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tokenizers
from conftest import make_tiny_llama

import models
from jax_paged import LLM, SamplingParams
from jax_paged.engine.output_processor import IncrementalDetokenizer


def _byte_tokenizer() -> models.Tokenizer:
    """256 tokens, one per byte, no merges: random ids make invalid UTF-8 often, the hard case
    for an incremental decoder."""
    alphabet = models.tokenizer.byte_level_alphabet()
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return models.Tokenizer(backend)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_full_decode_byte_level(seed):
    tok = _byte_tokenizer()
    rng = np.random.default_rng(seed)
    # Mostly ASCII with runs of multi-byte UTF-8 and stray continuation bytes.
    text = "héllo wörld 日本語 😀 " * 3
    ids = tok.encode(text) + rng.integers(0, 256, 40).tolist() + tok.encode(text)
    d = IncrementalDetokenizer(tok, skip_special_tokens=True)
    for i, t in enumerate(ids):
        d.add(t)
        full = tok.decode(ids[: i + 1])
        _assert_prefix(full, d.text)
    assert d.text == tok.decode(ids)  # valid text at the end: caught up


def _assert_prefix(full: str, streamed: str) -> None:
    """The stream gives the full decode's text, holding back only bytes that do not form a
    character yet (which a full decode shows as replacement characters)."""
    assert full.startswith(streamed)
    assert set(full[len(streamed) :]) <= {"\ufffd"}


@pytest.mark.slow
def test_incremental_text_equals_full_decode_smollm2(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("Héllo wörld, 日本語 emoji 😀 end <|im_end|> and  two  spaces\n\nnew")
    rng = np.random.default_rng(0)
    ids += rng.integers(0, tok.vocab_size, 200).tolist()
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for t in ids:
            d.add(t)
        _assert_prefix(tok.decode(ids, skip_special_tokens=skip), d.text)


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory):
    """A tiny Llama with a 4096-token context and the byte-level tokenizer."""
    model = make_tiny_llama(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    path = tmp_path_factory.mktemp("long_llama")
    model.save_pretrained(path)
    loaded = dataclasses.replace(models.load(str(path)), tokenizer=_byte_tokenizer())
    return LLM(loaded, num_kv_blocks=160, max_num_seqs=2)


def test_stop_string_over_2000_tokens_is_linear(long_llm, monkeypatch):
    tok = long_llm.tokenizer
    sp = dict(temperature=1.0, seed=3, max_tokens=2000, ignore_eos=True)
    full = long_llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**sp))[0]
    text = full.outputs[0].text
    assert len(full.outputs[0].token_ids) == 2000 and text == tok.decode(full.outputs[0].token_ids)
    # A stop string first seen late in the output.
    for end in range(len(text) - 10, 0, -1):
        stop = text[end - 6 : end]
        if "\ufffd" not in stop and text.find(stop) == end - 6:
            break
    assert end > len(text) // 2

    decoded_ids = []
    real_decode = tok.decode

    def counting_decode(ids, skip_special_tokens=False):
        decoded_ids.append(len(ids))
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    before = long_llm.get_metrics()["detokenized_chars"]
    for include in (False, True):
        out = long_llm.generate(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(**sp, stop=[stop], include_stop_str_in_output=include),
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: end if include else end - 6]
        assert out.token_ids == full.outputs[0].token_ids[: len(out.token_ids)]
    # Every character decoded once per run (decoding the whole output after every token would
    # cost about n^2 / 2 token decodes); the only full-text decodes are at finishing.
    chars = long_llm.get_metrics()["detokenized_chars"] - before
    assert chars <= 2 * (end + 8)
    assert sum(decoded_ids) <= 2 * len(out.token_ids)
