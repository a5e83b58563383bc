"""The public front: `LLM` (vLLM's offline API), the jittable research API (`research`),
`SamplingParams` / `BeamSearchParams`, `RequestOutput` and beam search."""
