"""SmolLM2-135M-Instruct from the embedded GGUF against HF transformers loading the same file.

HF's side is computed once per test run: one batched f32 forward over each prompt followed by our
32 greedy tokens. That single forward checks both claims:
  - logits: ours vs HF's on every real position, max abs diff <= 1e-3;
  - greedy: at every step HF's argmax, given the prompt and the tokens before, is our token. By
    induction that is exactly "HF's greedy continuation equals ours" (teacher forcing), at a
    fraction of the cost of HF's generate loop on 2 CPU cores.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from bench_support import dense
from conftest import oracle, right_pad
from flax import nnx

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The three primary colours are",
    "Water boils at",
    "Translate to French: Good morning, how are you?",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def run(smollm2, smollm2_hf_model):
    torch, _ = oracle()
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True))
    assert len(prompts) == 8
    generated = dense.greedy_generate(smollm2.model, prompts, NEW_TOKENS)
    full = [p + g for p, g in zip(prompts, generated, strict=True)]
    tokens = right_pad(full, pad=0)
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(smollm2.model, jnp.asarray(tokens)))
    mask = np.zeros(tokens.shape, np.int64)
    for i, f in enumerate(full):
        mask[i, : len(f)] = 1
    with torch.no_grad():
        hf = smollm2_hf_model(
            input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)
        ).logits.numpy()
    return dict(prompts=prompts, generated=generated, full=full, ours=ours, hf=hf)


# Slow: loading the real weights takes seconds. The fast tier loads tiny GGUF files
# (test_loading_errors, test_models_hf) and reads this file's tokenizer (test_tokenizer).
@pytest.mark.slow
def test_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.head_dim) == (1536, 49152, 64)
    assert c.rope_theta == 1e5 and c.tie_word_embeddings
    assert smollm2.generation_config.eos_token_ids == [smollm2.tokenizer.token_to_id("<|im_end|>")]


@pytest.mark.slow
def test_logits_match_hf(run):
    for i, f in enumerate(run["full"]):
        diff = np.abs(run["ours"][i, : len(f)] - run["hf"][i, : len(f)]).max()
        assert diff <= 1e-3, f"prompt {i}: max abs diff {diff:.2e}"


@pytest.mark.slow
def test_greedy_matches_hf(run):
    for i, (p, g) in enumerate(zip(run["prompts"], run["generated"], strict=True)):
        assert len(g) == NEW_TOKENS
        hf_next = run["hf"][i, len(p) - 1 : len(p) - 1 + NEW_TOKENS].argmax(-1)
        assert g == hf_next.tolist(), f"prompt {i}: greedy continuation differs from HF's"


@pytest.mark.slow
def test_chat_answers_paris(smollm2, run):
    tok = smollm2.tokenizer
    answer = run["generated"][-1]
    eos = smollm2.generation_config.eos_token_ids[0]
    assert eos in answer
    text = tok.decode(answer[: answer.index(eos)])
    assert "Paris" in text, text
