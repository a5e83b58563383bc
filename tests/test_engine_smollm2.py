"""The engine on the real SmolLM2-135M-Instruct (embedded GGUF), against HF transformers.

HF's own `generate` on this model takes minutes on 2 shared cores, so greedy equality is checked
by teacher forcing: one HF forward over prompt + our tokens must give each of our tokens as its
argmax (by induction, the same as HF's greedy continuation).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_paged import LLM, SamplingParams
from jax_paged.memory import block_manager as bm

# SmolLM2-135M through the engine against HF's own SmolLM2: minutes on 2 cores.
pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of Germany is",
    "def add(a, b):",
    "Water boils at",
    "My favourite colour is",
    "1, 1, 2, 3, 5, 8,",
    "The opposite of hot is",
    "Photosynthesis is the process",
    "Once upon a time, there was a",
]


def _assert_hf_greedy(hf_model, prompt_ids, out_ids):
    import torch

    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].numpy()
    n = len(prompt_ids)
    for j, t in enumerate(out_ids):
        row = logits[n - 1 + j]
        best = int(np.argmax(row))
        # Equal, or a float near-tie that f32 summation order may break either way.
        assert best == t or row[best] - row[t] < 1e-4, (j, best, t)


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, max_num_seqs=8, max_num_batched_tokens=256)


def test_eight_prompts_greedy_match_hf(llm, smollm2_hf_model):
    tok = llm.tokenizer
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32))
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 32 or c.finish_reason == "stop"
        _assert_hf_greedy(smollm2_hf_model, o.prompt_token_ids, c.token_ids)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # The chat answer that the README's first command prints.
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=16),
    )
    assert "Paris" in chat[0].outputs[0].text


def test_prefix_caching_on_off_identical(llm, smollm2):
    system = (
        "You are a helpful assistant who answers briefly and precisely, in plain English, "
        "without lists or code unless the user asks for them."
    )
    tok = llm.tokenizer
    sys_ids = tok.encode(system)
    bs = llm.engine.config.block_size
    # System prompts ending exactly on a block boundary and one token past it.
    cut = len(sys_ids) // bs * bs
    prompts = []
    for n_sys in (cut, cut + 1):
        for q in ("Name a fruit.", "What is 2+2?", "Say hello."):
            prompts.append({"prompt_token_ids": sys_ids[:n_sys] + tok.encode(q)})
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    on = llm.generate(prompts, sp)  # one batch: each computes its own system prompt
    hits = llm.get_metrics()["prefix_cache_hits"]
    on_again = llm.generate(prompts, sp)  # the system prompts' blocks are cached now
    assert llm.get_metrics()["prefix_cache_hits"] > hits
    assert all(o.num_cached_tokens >= cut for o in on_again)
    off_llm = LLM(smollm2, max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    off = off_llm.generate(prompts, sp)
    ids = [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].token_ids for o in on] == ids
    assert [o.outputs[0].token_ids for o in on_again] == ids
    for x in (llm, off_llm):
        state = x.engine.state.blocks
        bm.check_invariants(state)
        assert int(bm.num_free_blocks(state)) == x.engine.num_blocks - 1


def test_stop_strings_on_detokenised_text(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert "Paris" in full.text
    cut = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"]))[0]
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "Paris"
    assert c.text == full.text[: full.text.index("Paris")]
    kept = llm.chat(
        chat,
        SamplingParams(
            temperature=0.0, max_tokens=16, stop=["Paris"], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index("Paris") + len("Paris")]


def test_prompt_the_tokenizer_cannot_encode_is_its_own_error(llm):
    """A lone surrogate makes `tokenizers` raise TypeError: that prompt's error, the others run,
    and nothing is left queued for the next call."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["good one", "good two", "bad \ud800"], sp)
    assert [len(o.outputs[0].token_ids) for o in outs[:2]] == [4, 4]
    assert "tokenizer cannot encode" in outs[2].error and "TypeError" in outs[2].error
    conv = [{"role": "user", "content": "hi"}]
    chats = llm.chat([conv, [{"role": "user"}]], sp)  # the second has no content
    assert chats[0].error is None and chats[1].error.startswith("messages:")
    before = llm.get_metrics()["generated_tokens"]
    later = llm.generate(["later"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(later[0].outputs[0].token_ids) == 5
    assert llm.get_metrics()["generated_tokens"] - before == 5
    assert not llm.engine.has_unfinished_requests()
