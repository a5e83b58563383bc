"""Llama 2 / Mistral GGUF tokenizers (``tokenizer.ggml.model = llama`` with scores): the
SentencePiece BPE that `models.Tokenizer.from_gguf_metadata` builds equals the one
transformers' GGUF converter builds from the same metadata (the oracle), on 50 strings.

No such GGUF can be downloaded here, so the vocabulary is trained on the spot with `tokenizers`
in SentencePiece's shape: "<unk>", "<s>", "</s>", the 256 byte-fallback tokens "<0x00>".."<0xFF>",
then the BPE pieces ("\u2581" for a space) scored -rank, as SentencePiece scores its merges.
"""

from __future__ import annotations

import pytest
import tokenizers
from conftest import oracle

from models import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed blocks of sixteen tokens.",
    "A prompt shared by many samples is stored once; writing into a shared block copies it.",
    "def forward(self, tokens, positions):\n    return self.layers(tokens)",
    "Numbers like 3.14159, 2024 and 1,000,000 appear in text too.",
    "Sequences join and leave the running batch at every step.",
] * 20
TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces",
    "   three leading spaces",
    "trailing space ",
    "new\nline",
    "tab\there",
    "",
    " ",
    "The quick brown fox",
    "paged attention blocks",
    "unseen wörds like naïve café",
    "日本語のテキスト",
    "emoji 🙂🚀",
    "<s> a control token as text",
    "</s>",
    "x" * 40,
    "def f(x):\n    return x * 2",
    "3.14159 and 2024",
    "KV-cache, copy-on-write; prefix caching!",
    "MiXeD CaSe WoRdS",
    "punctuation?!... (brackets) [square] {curly}",
    "a",
    "ab",
    "▁ the marker itself",
    "\u00a0non-breaking space",
    "zero\u200bwidth",
    "quotes 'single' \"double\"",
    "hyphen-ated and under_scored",
    "URL https://example.com/a?b=c",
    "email name@example.org",
    "Ünïcödé ÀÉÎÕÜ",
    "Ελληνικά κείμενο",
    "русский текст",
    "עברית",
    "العربية",
    "हिन्दी",
    "한국어",
    "mixed 日本 and English",
    "numbers 0 1 2 3 4 5 6 7 8 9",
    "1,000,000",
    "sixteen tokens per block",
    "stored once",
    "shared block copies",
    "Sequences join and leave",
    "\n\n\n",
    "end.",
    "  ",
    "A prompt shared by many samples is stored once.",
    "the the the the",
]


def _spm_metadata(arch: str = "llama") -> dict:
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    pieces = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    learned = [t for t, _ in pieces if t not in specials]
    tokens = specials + byte_tokens + learned
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(learned))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    return {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


@pytest.fixture(scope="module")
def pair():
    oracle()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = _spm_metadata()
    hf_dict = {
        "tokenizer_type": "llama",
        "tokens": meta["tokenizer.ggml.tokens"],
        "scores": meta["tokenizer.ggml.scores"],
        "token_type": meta["tokenizer.ggml.token_type"],
    }
    hf, _ = convert_gguf_tokenizer("llama", hf_dict)
    return Tokenizer.from_gguf_metadata(meta), hf


def test_fifty_strings_equal_transformers(pair):
    ours, hf = pair
    assert len(TEXTS) == 50
    multi = 0
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), text
        multi += any(i >= 3 + 256 and len(hf.id_to_token(i)) > 2 for i in ids)
    assert multi > 20  # the merges are exercised, not just single characters
    # Byte fallback for characters the vocabulary lacks, and BOS by default.
    assert any(3 <= i < 3 + 256 for i in ours.encode("日本語", add_special_tokens=False))
    assert ours.encode("Hello")[0] == 1 and ours.bos_token_id == 1 and ours.eos_token_id == 2


def test_mistral_architecture_uses_the_same_builder(pair):
    ours, _ = pair
    mistral = Tokenizer.from_gguf_metadata(_spm_metadata("mistral"))
    assert mistral.encode(TEXTS[9]) == ours.encode(TEXTS[9])
    with pytest.raises(ValueError, match="not Phi-3's"):
        Tokenizer.from_gguf_metadata(_spm_metadata("phi3"))
