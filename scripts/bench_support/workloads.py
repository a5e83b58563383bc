"""Seeded synthetic serving workloads: what the public benchmark data sets look like, offline.

The real data sets (ShareGPT, Alpaca) cannot be downloaded on the machines here, so the
benchmarks draw stand-ins with the same length statistics (vLLM paper, OPT tokenizer):

- ``sharegpt``: heavy-tailed log-normal prompt / output lengths, means 161.31 / 337.99 tokens;
- ``alpaca``: short, even instructions, means 19.31 / 58.45;
- ``random``: vLLM's "random" data set: prompt and output lengths uniform in
  ``[L (1 - r), L (1 + r)]`` around ``input_len`` (1024) and ``output_len`` (128), ``r`` the
  range ratio;
- ``shared_prefix``: one system prompt (``prefix_len`` tokens) shared by every request, then a
  unique Alpaca-like instruction and output.

ShareGPT- and Alpaca-like lengths go through vLLM's filters (a side under 4 tokens, a prompt
over 1024 or a total over 2048 is dropped and redrawn); the log-normals' locations are
calibrated so that the means *after* the filters hit the targets (dropping the long tail would
otherwise pull them down by several percent). A ``scale`` multiplies every length, the targets
and the filters' bounds alike, so a CPU run finishes in minutes. Prompts are random token ids.
Everything is a function of a `numpy.random.Generator`: the same seed gives the same workload.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

__all__ = [
    "WORKLOADS",
    "Request",
    "draw_lengths",
    "filter_bounds",
    "make_workload",
    "poisson_arrivals",
    "random_lengths",
    "random_prompts",
    "with_new_ids",
]

# Mean lengths of the data sets (vLLM paper, OPT tokenizer) and the log-normal shapes used for
# them (sigma of the log): ShareGPT is heavy-tailed, Alpaca's instructions are short and even.
WORKLOADS = {
    "sharegpt": dict(mean_in=161.31, mean_out=337.99, sigma_in=1.0, sigma_out=0.8),
    "alpaca": dict(mean_in=19.31, mean_out=58.45, sigma_in=0.5, sigma_out=0.6),
}

_CALIBRATION_SAMPLES = 200_000


def filter_bounds(scale: float) -> tuple[int, int, int]:
    """vLLM's filters at ``scale``: (shortest side, longest prompt, longest total)."""
    return max(1, round(4 * scale)), int(1024 * scale), int(2048 * scale)


def _lengths(mu: float, sigma: float, z: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(np.exp(mu + sigma * z))).astype(np.int64)


def _keep(p: np.ndarray, o: np.ndarray, scale: float) -> np.ndarray:
    lo, max_in, max_total = filter_bounds(scale)
    return (p >= lo) & (o >= lo) & (p <= max_in) & (p + o <= max_total)


@functools.lru_cache(maxsize=64)
def _calibrated_mu(mean_in, mean_out, sigma_in, sigma_out, scale) -> tuple[float, float]:
    """Log-normal locations whose rounded, filtered draws have the target means (fixed point
    iteration on a fixed sample of standard normals: deterministic)."""
    z = np.random.default_rng(12345).standard_normal((2, _CALIBRATION_SAMPLES))
    targets = (mean_in * scale, mean_out * scale)
    mus = [math.log(t) - s**2 / 2 for t, s in zip(targets, (sigma_in, sigma_out), strict=True)]
    for _ in range(30):
        p, o = _lengths(mus[0], sigma_in, z[0]), _lengths(mus[1], sigma_out, z[1])
        keep = _keep(p, o, scale)
        means = (p[keep].mean(), o[keep].mean())
        if all(abs(m / t - 1) < 1e-4 for m, t in zip(means, targets, strict=True)):
            break
        mus = [mu + math.log(t / m) for mu, t, m in zip(mus, targets, means, strict=True)]
    return mus[0], mus[1]


def draw_lengths(rng, spec: dict, num: int, scale: float = 1.0) -> list[tuple[int, int]]:
    """``num`` (prompt, output) lengths from log-normals whose means after vLLM's filters are
    ``spec``'s means times ``scale``; a pair the filters drop is redrawn."""
    mu_in, mu_out = _calibrated_mu(
        spec["mean_in"], spec["mean_out"], spec["sigma_in"], spec["sigma_out"], scale
    )
    out: list[tuple[int, int]] = []
    while len(out) < num:
        k = 2 * (num - len(out)) + 16
        p = _lengths(mu_in, spec["sigma_in"], rng.standard_normal(k))
        o = _lengths(mu_out, spec["sigma_out"], rng.standard_normal(k))
        keep = _keep(p, o, scale)
        out += list(zip(p[keep].tolist(), o[keep].tolist(), strict=True))
    return out[:num]


def random_lengths(
    rng,
    num: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    scale: float = 1.0,
) -> list[tuple[int, int]]:
    """vLLM's "random" data set: each side uniform over the integers in
    ``[L (1 - r), L (1 + r)]`` (``L`` times ``scale``; at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")

    def side(length):
        mid = length * scale
        lo = max(1, round(mid * (1 - range_ratio)))
        hi = max(lo, round(mid * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, num)

    p, o = side(input_len), side(output_len)
    return list(zip(p.tolist(), o.tolist(), strict=True))


def random_prompts(rng, lengths, vocab: int) -> list[dict]:
    """``{"prompt_token_ids": ...}`` of random ids, one per length."""
    return [{"prompt_token_ids": rng.integers(0, vocab, n).tolist()} for n in lengths]


@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: its prompt ids and the output length it is forced to."""

    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(
    name: str,
    rng,
    num: int,
    vocab: int,
    *,
    scale: float = 1.0,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 512,
) -> list[Request]:
    """``num`` requests of workload ``name`` (``sharegpt``, ``alpaca``, ``random``,
    ``shared_prefix``) with random prompt ids below ``vocab``. ``input_len``, ``output_len``
    and ``range_ratio`` shape ``random``; ``prefix_len`` (times ``scale``) is the system prompt
    of ``shared_prefix``."""
    if name in WORKLOADS:
        pairs = draw_lengths(rng, WORKLOADS[name], num, scale)
        prefix: list[int] = []
    elif name == "random":
        pairs = random_lengths(rng, num, input_len, output_len, range_ratio, scale)
        prefix = []
    elif name == "shared_prefix":
        prefix = rng.integers(0, vocab, max(1, round(prefix_len * scale))).tolist()
        pairs = draw_lengths(rng, WORKLOADS["alpaca"], num, scale)
    else:
        raise ValueError(
            f"workload {name!r} is not one of {sorted([*WORKLOADS, 'random', 'shared_prefix'])}"
        )
    prompts = random_prompts(rng, [p for p, _ in pairs], vocab)
    return [
        Request(prefix + d["prompt_token_ids"], o) for d, (_, o) in zip(prompts, pairs, strict=True)
    ]


def with_new_ids(requests: list[Request], rng, vocab: int, keep_prefix: int = 0) -> list[Request]:
    """The same lengths with fresh random ids after the first ``keep_prefix`` tokens (a shared
    system prompt stays shared): repeated runs of one shape that a prefix cache cannot serve."""
    return [
        Request(
            r.prompt_token_ids[:keep_prefix]
            + rng.integers(0, vocab, max(0, r.prompt_len - keep_prefix)).tolist(),
            r.max_tokens,
        )
        for r in requests
    ]


def poisson_arrivals(rng, num: int, rate: float) -> np.ndarray:
    """Arrival times (seconds from 0) of ``num`` requests of a Poisson process at ``rate``
    requests/s (``inf``: all at 0)."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0")
    if math.isinf(rate):
        return np.zeros(num)
    return np.cumsum(rng.exponential(1.0 / rate, num))
