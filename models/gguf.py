"""GGUF files (llama.cpp) -> `LoadedModel`: `load_gguf`, called by `models.load` for a `.gguf`
path.

Tensors are read and dequantised with the `gguf` package, renamed to their HF names (llama.cpp's
per-block and global names below; Q and K rows un-permuted for the Llama layout) and placed by
the same `build_model` as an HF folder. The config comes from the file's metadata (Llama, Qwen2,
Qwen3 and Gemma 3 architectures), the tokenizer from its vocabulary (`models.tokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.config import ModelConfig
from models.loading import GGUF_ARCHITECTURES, GenerationConfig, LoadedModel, build_model
from models.tokenizer import Tokenizer

# llama.cpp tensor name -> HF name suffix (per block, then global).
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per block (llama.cpp's ffn_norm is the pre-feed-forward norm there).
_GGUF_GEMMA3_BLOCK_NAMES = {
    **_GGUF_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    if stem.startswith("blk."):
        _, idx, part = stem.split(".", 2)
        hf = (_GGUF_GEMMA3_BLOCK_NAMES if arch == "gemma3" else _GGUF_BLOCK_NAMES).get(part)
        return None if hf is None else f"model.layers.{idx}.{hf}.{kind}"
    hf = _GGUF_GLOBAL_NAMES.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row order (it interleaves the two RoPE halves of every head)."""
    rows = w.shape[0]
    w2 = w.reshape(rows, -1)
    cols = w2.shape[1]
    w2 = w2.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return w2.reshape(w.shape)


def _gguf_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _gguf_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: "
            + ", ".join(GGUF_ARCHITECTURES)
        )

    def req(key):
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{source}: missing required GGUF field '{arch}.{key}'")
        return v

    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{source}: per-frequency RoPE factors (rope_freqs) are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{source}: unsupported RoPE scaling {scaling!r}; supported: linear")
    n_head = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ValueError(f"{source}: missing required GGUF field '{arch}.vocab_size'")
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "gemma3":
        return _gguf_gemma3_config(meta, req, tensor_names, scaling)
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=n_head,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or n_head),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // n_head),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_type="linear" if scaling == "linear" else "default",
        rope_factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=None if window is None else int(window),
    )


def _gguf_gemma3_config(meta, req, tensor_names: set[str], scaling: str) -> ModelConfig:
    """A Gemma 3 GGUF's config, with llama.cpp's rules for what the file leaves out: every
    ``sliding_window_pattern``-th layer global (6 when absent), local RoPE base 10000 (or
    ``rope.freq_base_swa``), softmax scale ``key_length**-0.5`` (27B, 62 layers: hidden /
    heads)."""
    n_head, hidden = int(req("attention.head_count")), int(req("embedding_length"))
    num_layers = int(req("block_count"))
    head_dim = int(meta.get("gemma3.attention.key_length") or 256)
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern") or 6)
    window = int(meta.get("gemma3.attention.sliding_window") or 4096)
    windows = tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    same = len(set(windows)) == 1
    cap = meta.get("gemma3.final_logit_softcapping")
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=int(meta.get("gemma3.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=num_layers,
        num_heads=n_head,
        num_kv_heads=int(meta.get("gemma3.attention.head_count_kv") or n_head),
        head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        rope_type="linear" if scaling == "linear" else "default",
        rope_factor=float(meta.get("gemma3.rope.scaling.factor", 1.0)),
        max_position_embeddings=int(meta.get("gemma3.context_length", 131_072)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=True,
        sliding_window=windows[0] if same else None,
        layer_windows=() if same else windows,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(hidden // n_head if num_layers == 62 else head_dim),
        rope_local_theta=float(meta.get("gemma3.rope.freq_base_swa", 10_000.0)),
        final_logit_softcapping=None if cap is None else float(cap),
    )


def _gguf_supported_types():
    from gguf import GGMLQuantizationType as Q

    return {
        Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    }  # fmt: skip


def load_gguf(path: Path, dtype: np.dtype) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(
            f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})"
        ) from None
    meta = _gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, set(tensors), str(path))
    supported = _gguf_supported_types()
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise ValueError(
                f"{path}: tensor {t.name!r} has unsupported GGUF quantisation type "
                f"{t.tensor_type.name}; supported: {', '.join(sorted(q.name for q in supported))}"
            )
    arch = meta.get("general.architecture")
    by_hf = {}
    for name in tensors:
        hf = _gguf_to_hf_name(name, arch)
        if hf is not None:
            by_hf[hf] = name
    permute_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    def get_tensor(hf_name: str) -> np.ndarray | None:
        name = by_hf.get(hf_name)
        if name is None:
            return None
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # llama.cpp writes the shape innermost-first; numpy order is the reverse (HF's [out, in]).
        w = np.asarray(w, np.float32).reshape([int(n) for n in reversed(t.shape)])
        proj = hf_name.split(".")[-2]
        if config.model_type == "llama" and proj in permute_heads:
            w = _unpermute_qk(w, permute_heads[proj])
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scales with the 1 added
        return w

    model = build_model(config, dtype, get_tensor, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    gen = GenerationConfig(
        eos_token_ids=[int(meta["tokenizer.ggml.eos_token_id"])]
        if "tokenizer.ggml.eos_token_id" in meta
        else [],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    return LoadedModel(model, tokenizer, config, gen, str(path))


# ----------------------------------------------------------------------------------------------
# Orbax checkpoints of converted weights
