"""Flax NNX decoders (Llama family, Gemma 3), loaded from HF folders, GGUF files or orbax
checkpoints.

loaded = models.load()            # embedded SmolLM2-135M-Instruct (GGUF)
logits = loaded.model(tokens)     # [B, T] -> [B, T, V], dense causal forward

Your own NNX module runs in the engine when it satisfies `models.PagedModel` (`check_model`).
"""

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.gemma import Gemma3
from models.llama import (
    AttentionFn,
    Transformer,
    dense_attention,
    make_dense_attention,
)
from models.loading import (
    GenerationConfig,
    LoadedModel,
    default_model_path,
    load,
    save_checkpoint,
)
from models.protocol import (
    ModelProtocolError,
    PagedModel,
    PagedModelConfig,
    check_model,
    wrap_model,
)
from models.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionFn",
    "Gemma3",
    "GenerationConfig",
    "LoadedModel",
    "ModelConfig",
    "ModelProtocolError",
    "PagedModel",
    "PagedModelConfig",
    "Tokenizer",
    "Transformer",
    "check_model",
    "default_model_path",
    "dense_attention",
    "load",
    "make_dense_attention",
    "save_checkpoint",
    "wrap_model",
]
