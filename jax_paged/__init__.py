"""jax-paged: PagedAttention for JAX.

from jax_paged import LLM, SamplingParams
llm = LLM()                         # embedded SmolLM2-135M-Instruct
out = llm.generate("Hello", SamplingParams(max_tokens=16))
"""

from jax_paged.engine.llm_engine import EngineConfig, LLMEngine
from jax_paged.entrypoints.beam_search import BeamSearchOutput, BeamSearchSequence
from jax_paged.entrypoints.llm import LLM
from jax_paged.entrypoints.outputs import CompletionOutput, Logprob, RequestOutput
from jax_paged.entrypoints.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
