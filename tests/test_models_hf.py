"""Tiny random HF models per family: our loader + decoder against HF transformers (f32).

Families and what each covers are listed in conftest.TINY_SPECS: GQA ratios 1, 3, 4; head dims
32 and 64; tied and untied embeddings; llama3 RoPE scaling; q/k/v (and o, MLP) biases; Qwen3 q/k
norms; a Mistral sliding window of 8 with prompts up to 21 tokens; sharded safetensors.
"""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_support import dense
from conftest import TINY_SPECS, build_tiny_hf_model, hf_logits, oracle, right_pad, write_tiny_gguf
from flax import nnx

import models
from models.llama import dense_attention

PROMPT_LENGTHS = (5, 13, 21)
NEW_TOKENS = 32

# Jitted dense forward: one compile per (model, shape) beats eager's per-op compiles here.
logits_of = nnx.jit(lambda model, tokens: model(tokens))


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def loaded(tiny_hf):
    cache = {}

    def get(name, dtype=jnp.float32):
        if (name, dtype) not in cache:
            cache[name, dtype] = models.load(tiny_hf(name)[1], dtype=dtype)
        return cache[name, dtype]

    return get


def _assert_logits_match(ours_padded, refs, tol=1e-4, rel=False):
    for i, ref in enumerate(refs):
        diff = np.abs(np.asarray(ours_padded[i, : len(ref)]) - ref).max()
        bound = tol * np.abs(ref).max() if rel else tol
        assert diff <= bound, f"prompt {i}: max abs diff {diff:.2e} > {bound:.2e}"


def _hf_greedy(model, prompts, n):
    torch, _ = oracle()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_logits_match_hf(name, tiny_hf, loaded):
    hf_model, _ = tiny_hf(name)
    lm = loaded(name)
    prompts = _prompts(lm.config.vocab_size)
    ours = logits_of(lm.model, jnp.asarray(right_pad(prompts)))
    assert ours.shape == (3, max(PROMPT_LENGTHS), lm.config.vocab_size)
    assert ours.dtype == jnp.float32
    _assert_logits_match(ours, hf_logits(hf_model, prompts))


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_greedy_matches_hf(name, tiny_hf, loaded):
    hf_model, _ = tiny_hf(name)
    lm = loaded(name)
    prompts = _prompts(lm.config.vocab_size, seed=2)
    ours = dense.greedy_generate(lm.model, prompts, NEW_TOKENS)
    assert ours == _hf_greedy(hf_model, prompts, NEW_TOKENS)


def test_greedy_prefill_runs_the_lm_head_on_the_last_column_only(loaded):
    """Left padding puts every row's last prompt token in one column, so the prefill program
    makes logits [B, 1, V], never [B, T, V] (4.8 GB at 256 SmolLM2 prompts of 96 tokens)."""
    from bench_support.dense import _forward_step

    lm = loaded("llama_mha_tied_bias")  # V = 256, no other width of 256
    c = lm.config
    b, t, s = 3, 32, 64
    tokens = jnp.zeros((b, t), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv = (jnp.zeros((c.num_layers, b, s, c.num_kv_heads, c.head_dim)),) * 2
    graphdef, state = nnx.split(lm.model)
    hlo = _forward_step.lower(graphdef, state, tokens, positions, kv).compile().as_text()
    assert f"f32[{b},1,{c.vocab_size}]" in hlo
    assert f"f32[{b},{t},{c.vocab_size}]" not in hlo


def test_configs_cover_the_matrix(loaded):
    cfgs = [loaded(n).config for n in TINY_SPECS]
    assert {c.num_queries_per_kv for c in cfgs} >= {1, 3, 4}
    assert {c.head_dim for c in cfgs} >= {32, 64}
    assert {c.tie_word_embeddings for c in cfgs} == {True, False}
    assert {c.model_type for c in cfgs} == {"llama", "mistral", "qwen2", "qwen3"}
    by = {n: loaded(n).config for n in TINY_SPECS}
    assert by["llama3_gqa4"].rope_type == "llama3"
    assert by["mistral_window"].sliding_window == 8 < max(PROMPT_LENGTHS)
    assert by["qwen2_tied"].qkv_bias and not by["qwen2_tied"].o_bias
    assert by["qwen3_qknorm"].qk_norm and by["qwen3_qknorm"].head_dim == 64
    assert by["llama_mha_tied_bias"].o_bias and by["llama_mha_tied_bias"].mlp_bias
    assert by["llama3_gqa4"].scale == 32**-0.5


def test_sharded_folder_was_sharded(tiny_hf):
    _, folder = tiny_hf("qwen2_tied")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_old_rope_spelling(tiny_hf, loaded, tmp_path):
    """transformers < 5 wrote `rope_theta` and `rope_scaling` at the top level."""
    _, folder = tiny_hf("llama3_gqa4")
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = models.load(tmp_path)
    assert old.config == loaded("llama3_gqa4").config
    tokens = jnp.asarray(right_pad(_prompts(256)))
    np.testing.assert_array_equal(
        logits_of(old.model, tokens), logits_of(loaded("llama3_gqa4").model, tokens)
    )


def test_bfloat16(tiny_hf, loaded):
    hf_model, _ = tiny_hf("mistral_window")
    lm = loaded("mistral_window", jnp.bfloat16)
    assert lm.model.embed_tokens.embedding.dtype == jnp.bfloat16
    assert lm.model.layers.self_attn.q_proj.kernel.dtype == jnp.bfloat16
    prompts = _prompts(256)
    ours = logits_of(lm.model, jnp.asarray(right_pad(prompts)))
    assert ours.dtype == jnp.float32
    # bf16 keeps 8 bits of mantissa: allow a few percent of the logit range.
    _assert_logits_match(ours, hf_logits(hf_model, prompts), tol=0.05, rel=True)
    # Against HF run in bf16 itself: as close as the two bf16 roundings allow (about 2% of the
    # range here, as far as HF bf16 is from HF f32), and the same greedy token wherever HF's
    # top two are not tied within that rounding.
    torch, _ = oracle()
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    with torch.no_grad():
        refs = [hf_bf16(torch.tensor([p])).logits[0].float().numpy() for p in prompts]
    _assert_logits_match(ours, refs, tol=0.035, rel=True)
    for i, ref in enumerate(refs):
        pick = np.asarray(ours[i, : len(ref)]).argmax(-1)
        gap = ref.max(-1) - np.take_along_axis(ref, pick[:, None], -1)[:, 0]
        assert (gap <= 0.035 * np.abs(ref).max()).all(), f"prompt {i}: greedy token gaps {gap}"
        assert (pick == ref.argmax(-1)).mean() >= 0.9


def test_bfloat16_safetensors_file(tmp_path):
    """A bf16 checkpoint loads exactly into f32 (bf16 -> f32 is lossless)."""
    torch, _ = oracle()
    hf_model = build_tiny_hf_model(TINY_SPECS["qwen3_qknorm"], seed=3)
    with torch.no_grad():  # round the parameters (not the RoPE buffers) to bf16 in place
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    lm = models.load(tmp_path)
    prompts = _prompts(256)
    _assert_logits_match(
        logits_of(lm.model, jnp.asarray(right_pad(prompts))), hf_logits(hf_model, prompts)
    )


def test_generation_config_and_no_tokenizer(tiny_hf, tmp_path):
    _, folder = tiny_hf("llama_mha_tied_bias")
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    gen = {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    lm = models.load(tmp_path)
    assert lm.tokenizer is None
    assert lm.generation_config.eos_token_ids == [2, 7]
    assert lm.generation_config.temperature == 0.6 and lm.generation_config.top_p == 0.9
    assert lm.generation_config.do_sample is True
    (tmp_path / "generation_config.json").unlink()
    assert models.load(tmp_path).generation_config.eos_token_ids == [2]  # from config.json


def test_orbax_checkpoint_roundtrip(loaded, tmp_path):
    lm = loaded("qwen3_qknorm")
    models.save_checkpoint(lm, tmp_path / "ckpt")
    back = models.load(tmp_path / "ckpt")
    assert back.config == lm.config
    assert back.generation_config == lm.generation_config
    tokens = jnp.asarray(right_pad(_prompts(256)))
    np.testing.assert_array_equal(logits_of(back.model, tokens), logits_of(lm.model, tokens))
    bf16 = models.load(tmp_path / "ckpt", dtype=jnp.bfloat16)
    assert bf16.model.layers.mlp.up_proj.kernel.dtype == jnp.bfloat16


def test_gguf_from_tiny_llama(tiny_hf, tmp_path):
    """A GGUF written like llama.cpp's converter (Q/K rows permuted) loads back to HF's logits."""
    hf_model, _ = tiny_hf("llama3_gqa4")
    # The llama3 spec's rope scaling has no GGUF spelling; use a default-rope twin for the file.
    torch, transformers = oracle()
    cfg = hf_model.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    twin.load_state_dict(hf_model.state_dict())
    write_tiny_gguf(tmp_path / "tiny.gguf", twin)
    lm = models.load(tmp_path / "tiny.gguf")
    assert lm.config.num_queries_per_kv == 4
    prompts = _prompts(256)
    _assert_logits_match(
        logits_of(lm.model, jnp.asarray(right_pad(prompts))), hf_logits(twin, prompts)
    )
    assert lm.tokenizer.decode(lm.tokenizer.encode("héllo, wörld")) == "héllo, wörld"


# ----------------------------------------------------------------------------------------------
# The attention-function contract the engine builds on


def test_attention_function_contract(loaded):
    lm = loaded("mistral_window")
    c = lm.config
    tokens = jnp.asarray(right_pad(_prompts(256)))
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seen = []

    def attn(layer, q, k, v, kv):
        seen.append((layer, q.shape, k.shape, v.shape))
        out = dense_attention(
            q, k, v, scale=c.scale, q_positions=positions, k_positions=positions,
            sliding_window=c.sliding_window,
        )  # fmt: skip
        return out, kv.at[layer].add(layer + 1)

    # The layers are scanned: `seen` fills once while tracing, with the layer index traced
    # (i32[]), and kv (here i32[L]) travels in the scan carry.
    kv0 = jnp.zeros((c.num_layers,), jnp.int32)
    logits, kv = nnx.jit(lambda m, t, p: m.forward(t, p, attn, kv0))(lm.model, tokens, positions)
    np.testing.assert_array_equal(kv, np.arange(1, c.num_layers + 1))  # layer i called once
    hd = c.head_dim
    assert len(seen) == 1
    layer, *shapes = seen[0]
    assert layer.shape == () and layer.dtype == jnp.int32
    assert shapes == [(b, t, 6, hd), (b, t, 2, hd), (b, t, 2, hd)]
    np.testing.assert_allclose(logits, logits_of(lm.model, tokens), atol=1e-6)


def test_chunked_prefill_with_cache_attention(loaded):
    """Two chunks through a cache-carrying attention function equal one dense pass."""
    lm = loaded("mistral_window")
    c = lm.config
    tokens = jnp.asarray(right_pad(_prompts(256)))[:, :20]
    b = tokens.shape[0]
    shape = (c.num_layers, b, 32, c.num_kv_heads, c.head_dim)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    outs = []

    @nnx.jit
    def chunk(model, tokens, pos, kv):
        attn = dense.make_contiguous_cache_attention(model.config, pos)
        return model.forward(tokens, pos, attn, kv)

    for lo, hi in ((0, 12), (12, 20)):
        pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
        logits, kv = chunk(lm.model, tokens[:, lo:hi], pos, kv)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), logits_of(lm.model, tokens), atol=1e-5)


def test_dense_attention_window_by_hand():
    """One head, D=1, k = 0 everywhere so every visible key weighs the same: out = mean of the
    visible values. Values are positions 0..4; window 2 -> query 4 sees keys 3, 4 -> 3.5."""
    q = jnp.ones((1, 5, 1, 1))
    k = jnp.zeros((1, 5, 1, 1))
    v = jnp.arange(5.0).reshape(1, 5, 1, 1)
    pos = jnp.arange(5)[None]
    causal = dense_attention(q, k, v, scale=1.0, q_positions=pos, k_positions=pos)
    np.testing.assert_allclose(causal[0, :, 0, 0], [0, 0.5, 1, 1.5, 2])
    windowed = dense_attention(
        q, k, v, scale=1.0, q_positions=pos, k_positions=pos, sliding_window=2
    )
    np.testing.assert_allclose(windowed[0, :, 0, 0], [0, 0.5, 1.5, 2.5, 3.5])
    assert jax.numpy.isfinite(windowed).all()


def test_greedy_stops_at_eos(loaded):
    lm = loaded("qwen2_tied")
    prompts = _prompts(256, seed=2)
    full = dense.greedy_generate(lm.model, prompts, NEW_TOKENS)
    eos = full[0][5]
    out = dense.greedy_generate(lm.model, prompts, NEW_TOKENS, eos_token_ids=[eos])
    assert out[0] == full[0][: full[0].index(eos) + 1]
    for o, f in zip(out, full, strict=True):
        assert o == (f[: f.index(eos) + 1] if eos in f else f)
