"""The continuous-batching engine: `LLMEngine` (`llm_engine`) steps a `Scheduler` (the host's
plan and block accounting), a `ModelRunner` (the device state and the compiled `programs`) and
an `OutputProcessor`; `config`, `inputs` and `metrics` support them."""
