"""Sampling on the device: per-row sampling tensors and history (`sampler`) and the logit
processing they drive (`logit_processing`: penalties, bias, temperature, top-k/p, min-p)."""
