"""`ModelConfig`: the frozen, hashable description of a decoder (Llama family or Gemma 3).

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
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
# model_types built by `models.gemma.Gemma3` instead of `models.llama.Transformer`.
GEMMA_MODEL_TYPES = ("gemma3_text", "gemma2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
      model_type: "llama", "mistral", "qwen2", "qwen3" (SmolLM2 is "llama"), "gemma3_text" or
        "gemma2".
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
        rule), in every layer. None when the layers differ (see ``layer_windows``).
      layer_windows: per-layer windows (an int or None, full attention, per layer) when the
        layers differ (Gemma 3's local and global layers); empty when every layer uses
        ``sliding_window``. Read it through `window_of`.
      hidden_act: "silu" (SwiGLU MLP) or "gelu_pytorch_tanh" (Gemma's GeGLU, tanh-approximate).
      query_pre_attn_scalar: if set, the softmax scale is ``query_pre_attn_scalar**-0.5`` (Gemma)
        instead of ``head_dim**-0.5``.
      rope_local_theta: RoPE base of the windowed (local) layers (Gemma 3's
        ``rope_local_base_freq``, no scaling); the global layers use ``rope_theta`` and its
        scaling. None: every layer uses ``rope_theta``.
      final_logit_softcapping: if set, logits become ``cap * tanh(logits / cap)``.
      attn_logit_softcapping: if set, attention scores become ``cap * tanh(scores / cap)``
        before the mask and softmax (Gemma 2).
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
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    def __post_init__(self):
        # A list (from JSON: our checkpoints) would make the config unhashable.
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows or ()))
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
        if self.layer_windows:
            if len(self.layer_windows) != self.num_layers:
                raise ValueError(
                    f"layer_windows has {len(self.layer_windows)} entries for "
                    f"num_layers={self.num_layers}"
                )
            if self.sliding_window is not None:
                raise ValueError("set sliding_window or layer_windows, not both")
            if any(w is not None and w < 1 for w in self.layer_windows):
                raise ValueError(f"layer_windows={self.layer_windows}: windows must be >= 1")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}"
            )

    @property
    def scale(self) -> float:
        """Softmax scale of q.k; the engine hands it to the paged kernels (they never pre-scale)."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (a Python int): None is full attention."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

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
        if model_type in GEMMA_MODEL_TYPES:
            return cls(**_gemma3_from_hf(d, source))
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
            layer_windows=_qwen_layer_windows(d, model_type),
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
            return None  # windows on some layers only: `_qwen_layer_windows`
    return None if window is None else int(window)


def _qwen_layer_windows(d: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Per-layer windows of a Qwen2/3 config that windows only some layers (those past
    ``max_window_layers``, or as ``layer_types`` says); () when the layers are alike."""
    if model_type not in ("qwen2", "qwen3") or not d.get("use_sliding_window", False):
        return ()
    n = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    if all(t == "sliding_attention" for t in layer_types) or d.get("sliding_window") is None:
        return ()
    w = int(d["sliding_window"])
    return tuple(w if t == "sliding_attention" else None for t in layer_types)


def _gemma3_from_hf(d: dict[str, Any], source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a Gemma 3 text config (`Gemma3TextConfig`, transformers 4 or 5)
    or a Gemma 2 one (`Gemma2Config`: no q/k norms, one RoPE for every layer, every other
    layer windowed by default, and attention scores soft-capped by ``attn_logit_softcapping``).

    Layer kinds come from ``layer_types`` or, in older files, ``sliding_window_pattern`` (every
    pattern-th layer global, as HF derives them). RoPE: transformers 5 writes one
    ``rope_parameters`` entry per layer kind; older files ``rope_theta`` (+ ``rope_scaling``) for
    the global layers and ``rope_local_base_freq`` for the local ones. HF's defaults apply to
    missing fields. Gemma 3's ``attn_logit_softcapping`` is ignored, as HF's Gemma 3 ignores it
    (its attention never reads the field); ``final_logit_softcapping`` is applied.
    """
    gemma2 = d["model_type"] == "gemma2"
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{source}: unsupported hidden_activation {act!r}; only gelu_pytorch_tanh")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention (an encoder) is not supported")
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        default = 2 if gemma2 else 6
        pattern = int(
            d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or default
        )
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(
            f"{source}: layer_types has {len(layer_types)} entries for "
            f"num_hidden_layers={num_layers}"
        )
    bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ValueError(f"{source}: unsupported layer type {bad[0]!r}")
    window = int(d.get("sliding_window") or 4096)
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)

    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        rope = _rope_from_hf({"rope_parameters": full}, source)
        local_theta = local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
        local_type = local.get("rope_type", local.get("type", "default"))
    else:  # transformers 4 spelling
        rope = _rope_from_hf(
            {
                "rope_scaling": d.get("rope_scaling"),
                "rope_parameters": params,
                "rope_theta": d.get("rope_theta", 1_000_000.0),
            },
            source,
        )
        local_theta, local_type = d.get("rope_local_base_freq", 10_000.0), "default"
    if gemma2:  # one RoPE for all layers
        local_theta = None
    if local_type != "default":
        raise ValueError(
            f"{source}: unsupported rope type {local_type!r} on the sliding-window layers; "
            "only 'default'"
        )

    num_heads = int(d["num_attention_heads"])
    bias = bool(d.get("attention_bias", False))
    same = len(set(windows)) == 1
    return dict(
        model_type=d["model_type"],
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=not gemma2,
        # One window for every layer when they agree (the engine's plain case).
        sliding_window=windows[0] if same else None,
        layer_windows=() if same else windows,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        rope_local_theta=_opt_float(local_theta),
        final_logit_softcapping=_opt_float(d.get("final_logit_softcapping")),
        attn_logit_softcapping=_opt_float(d.get("attn_logit_softcapping")) if gemma2 else None,
        **rope,
    )


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)
