"""`ModelConfig`: the frozen, hashable description of a Llama-family decoder.

Built from an HF `config.json` dict (`ModelConfig.from_hf_dict`) or from a GGUF file's metadata
(see `models.loading`). It is hashable so it can sit in static jit arguments and in the NNX graph.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# model_type -> the HF architecture class that goes with it.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know; every field is a plain hashable scalar.

    Attributes:
      model_type: "llama", "mistral", "qwen2" or "qwen3" (SmolLM2 is "llama").
      vocab_size, hidden_size, intermediate_size: V, E and the FFN width F.
      num_layers, num_heads, num_kv_heads, head_dim: L, H, KVH, D. GQA: query head h reads KV
        head h // (H // KVH).
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base. rope_type "default" | "linear" | "llama3" and its parameters.
      max_position_embeddings: the context length the model was trained for.
      tie_word_embeddings: the LM head reuses the token embedding.
      qkv_bias / o_bias / mlp_bias: which projections carry a bias (Qwen2: qkv only).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
      sliding_window: if set, query i sees key j only when 0 <= i - j < sliding_window (HF's
        rule), in every layer.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")

    @property
    def scale(self) -> float:
        """Softmax scale of q.k; the engine hands it to the paged kernels (they never pre-scale)."""
        return self.head_dim**-0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (our own checkpoints)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Reads an HF `config.json` dict (transformers 4 or 5 spelling)."""
        model_type = d.get("model_type")
        if model_type is None:
            raise ValueError(f"{source}: missing required field 'model_type'")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; supported: "
                + ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
            )
        archs = d.get("architectures") or []
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES.values()]
        if bad:
            raise ValueError(
                f"{source}: unsupported architecture {bad[0]!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES.values())
            )
        for name in _REQUIRED:
            if d.get(name) is None:
                raise ValueError(f"{source}: missing required field {name!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {d['hidden_act']!r}; only 'silu'")

        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope = _rope_from_hf(d, source)
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            o_bias=model_type in ("llama", "qwen3") and bool(d.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window_from_hf(d, model_type, source),
            **rope,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))


def _rope_from_hf(d: dict[str, Any], source: str) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` = {"rope_theta", "rope_type", ...scaling params};
    # older files write `rope_theta` at the top and an optional `rope_scaling` dict.
    params = dict(d.get("rope_scaling") or {})
    params.update(d.get("rope_parameters") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        if params.get("factor") is None:
            raise ValueError(
                f"{source}: rope type {rope_type!r} is missing required field 'factor'"
            )
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        for ours, theirs in (
            ("rope_low_freq_factor", "low_freq_factor"),
            ("rope_high_freq_factor", "high_freq_factor"),
            ("rope_original_max_position", "original_max_position_embeddings"),
        ):
            if params.get(theirs) is None:
                raise ValueError(
                    f"{source}: llama3 rope scaling is missing required field {theirs!r}"
                )
            out[ours] = params[theirs]
        out["rope_original_max_position"] = int(out["rope_original_max_position"])
    return out


def _sliding_window_from_hf(d: dict[str, Any], model_type: str, source: str) -> int | None:
    if model_type == "llama":
        return None
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types") or [
            "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
            for i in range(int(d["num_hidden_layers"]))
        ]
        if any(t != "sliding_attention" for t in layer_types):
            # Qwen windows only the layers past max_window_layers; one window for all is all
            # the engine's kernels take today.
            raise ValueError(
                f"{source}: sliding windows on only some layers are not supported "
                "(use_sliding_window with mixed layer_types)"
            )
    return None if window is None else int(window)
