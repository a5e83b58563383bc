"""Our tokenizer (built from the SmolLM2 GGUF, and from an HF folder) against HF's."""

import shutil

import pytest

import models
from models import Tokenizer

STRINGS = [
    "",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "mixed \t \n whitespace \r\n runs      here",
    "The year 2024 had 366 days; 1234567890.",
    "3.14159 2.71828 -42 +7 1e-9 0x1F",
    "phone: +44 (0)20 7946 0958",
    "CamelCaseIdentifiersAndsnake_case_names",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    "<html><body><p class='x'>Hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)",
    "Café, naïve, résumé, façade, coöperate",
    "Straße, Grüße, Ölfass",
    "Ελληνικά: γειά σου κόσμε",
    "Русский текст: привет, мир!",
    "中文：你好，世界。",
    "日本語のテキスト：こんにちは",
    "한국어: 안녕하세요",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦",
    "🚀🚀🚀 rockets",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∀x ∈ ℝ",
    "Arrows → ← ↑ ↓ and © ® ™",
    "Zero\u200bwidth\u200bspace and non\u00a0breaking",
    "don't won't it's we're they've I'm you'll he'd",
    "DON'T SHOUT, It'S fine",
    "a" * 40,
    "ab " * 20,
    "!!!???...---___***",
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<repo_name>jax-paged<file_sep>models/llama.py",
    "<|im_start|><|im_start|> doubled",
    "not special: <|im_start |> and < |im_end|>",
    "https://example.com/path?query=1&other=two#frag",
    "email@example.org, @mention #hashtag",
    "Mixed: English, français, 中文, 😀, and code `x = 1`",
    "end with newline\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3 in français 😀"},
    ],
]


def test_fifty_strings(smollm2_tokenizer, smollm2_hf_tokenizer):
    assert len(STRINGS) == 50
    ours, hf = smollm2_tokenizer, smollm2_hf_tokenizer
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == hf(s)["input_ids"], repr(s)
        assert ours.decode(ids) == s, repr(s)
    assert ours.encode_batch(STRINGS[:5]) == [ours.encode(s) for s in STRINGS[:5]]


def test_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>"
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm2_tokenizer, smollm2_hf_tokenizer, add_generation_prompt):
    for conv in CONVERSATIONS:
        ours = smollm2_tokenizer.apply_chat_template(conv, add_generation_prompt)
        hf = smollm2_hf_tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == hf
        ours_ids = smollm2_tokenizer.apply_chat_template(conv, add_generation_prompt, tokenize=True)
        assert ours_ids == smollm2_tokenizer.encode(hf, add_special_tokens=False)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_hf_folder_tokenizer(smollm2_hf_tokenizer, tiny_hf, tmp_path):
    """The same tokenizer as HF saves it to a folder (tokenizer.json + tokenizer_config.json),
    found by `models.load` next to a model's weights."""
    _, model_folder = tiny_hf("llama_mha_tied_bias")
    for f in model_folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    smollm2_hf_tokenizer.save_pretrained(tmp_path)
    ours = models.load(tmp_path).tokenizer
    assert ours.eos_token == smollm2_hf_tokenizer.eos_token
    for s in STRINGS:
        assert ours.encode(s) == smollm2_hf_tokenizer(s)["input_ids"], repr(s)
    for conv in CONVERSATIONS:
        assert ours.apply_chat_template(conv) == smollm2_hf_tokenizer.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=False
        )


def test_save_roundtrip(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    back = Tokenizer.from_folder(tmp_path)
    assert back.chat_template == smollm2_tokenizer.chat_template
    assert back.eos_token_id == smollm2_tokenizer.eos_token_id
    assert [back.encode(s) for s in STRINGS] == [smollm2_tokenizer.encode(s) for s in STRINGS]


def test_template_raise_exception():
    import jinja2
    import tokenizers

    tmpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=tmpl)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
