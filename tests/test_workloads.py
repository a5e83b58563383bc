"""Synthetic workloads (`bench_support.workloads`): means on target after vLLM's filters, the
filters applied, seeds reproducible, vLLM's random shape and Poisson arrivals."""

from __future__ import annotations

import numpy as np
import pytest
from bench_support import workloads as wl


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_means_within_5pct_after_filters(name, scale):
    spec = wl.WORKLOADS[name]
    pairs = np.array(wl.draw_lengths(np.random.default_rng(7), spec, 20_000, scale))
    assert pairs.shape == (20_000, 2)
    assert abs(pairs[:, 0].mean() / (spec["mean_in"] * scale) - 1) < 0.05
    assert abs(pairs[:, 1].mean() / (spec["mean_out"] * scale) - 1) < 0.05


def test_paper_means_at_full_scale():
    assert wl.WORKLOADS["sharegpt"]["mean_in"] == 161.31
    assert wl.WORKLOADS["sharegpt"]["mean_out"] == 337.99
    assert wl.WORKLOADS["alpaca"]["mean_in"] == 19.31
    assert wl.WORKLOADS["alpaca"]["mean_out"] == 58.45


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.25])
def test_filters_applied(scale):
    lo, max_in, max_total = wl.filter_bounds(scale)
    assert (lo, max_in, max_total) == (max(1, round(4 * scale)), 1024 * scale, 2048 * scale)
    pairs = np.array(
        wl.draw_lengths(np.random.default_rng(1), wl.WORKLOADS["sharegpt"], 20_000, scale)
    )
    p, o = pairs[:, 0], pairs[:, 1]
    assert p.min() >= lo and o.min() >= lo
    assert p.max() <= max_in
    assert (p + o).max() <= max_total
    # The heavy tail reaches the bounds: the filters did drop something.
    assert p.max() > 0.8 * max_in and (p + o).max() > 0.8 * max_total


def test_seeds_reproducible():
    spec = wl.WORKLOADS["sharegpt"]
    a = wl.draw_lengths(np.random.default_rng(3), spec, 500, 0.25)
    b = wl.draw_lengths(np.random.default_rng(3), spec, 500, 0.25)
    c = wl.draw_lengths(np.random.default_rng(4), spec, 500, 0.25)
    assert a == b and a != c
    for name in ("sharegpt", "alpaca", "random", "shared_prefix"):
        x = wl.make_workload(name, np.random.default_rng(9), 20, 1000, scale=0.25)
        y = wl.make_workload(name, np.random.default_rng(9), 20, 1000, scale=0.25)
        assert x == y
        assert len(x) == 20
        assert all(0 <= t < 1000 for r in x for t in r.prompt_token_ids)
        assert all(r.max_tokens >= 1 and r.prompt_len >= 1 for r in x)


def test_random_shape():
    pairs = np.array(wl.random_lengths(np.random.default_rng(0), 5000, 1024, 128, 0.25))
    assert pairs[:, 0].min() >= 768 and pairs[:, 0].max() <= 1280
    assert pairs[:, 1].min() >= 96 and pairs[:, 1].max() <= 160
    assert abs(pairs[:, 0].mean() / 1024 - 1) < 0.01 and abs(pairs[:, 1].mean() / 128 - 1) < 0.01
    fixed = wl.random_lengths(np.random.default_rng(0), 10, 1024, 128, 0.0, scale=0.5)
    assert fixed == [(512, 64)] * 10
    with pytest.raises(ValueError, match="range_ratio"):
        wl.random_lengths(np.random.default_rng(0), 1, range_ratio=1.0)


def test_shared_prefix_and_unknown_name():
    reqs = wl.make_workload("shared_prefix", np.random.default_rng(2), 8, 500, prefix_len=64)
    prefix = reqs[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix for r in reqs)
    assert len({tuple(r.prompt_token_ids[64:]) for r in reqs}) == 8  # unique suffixes
    fresh = wl.with_new_ids(reqs, np.random.default_rng(5), 500, keep_prefix=64)
    assert [(r.prompt_len, r.max_tokens) for r in fresh] == [
        (r.prompt_len, r.max_tokens) for r in reqs
    ]
    assert all(r.prompt_token_ids[:64] == prefix for r in fresh)
    assert all(
        a.prompt_token_ids[64:] != b.prompt_token_ids[64:] for a, b in zip(fresh, reqs, strict=True)
    )
    with pytest.raises(ValueError, match="not one of"):
        wl.make_workload("nope", np.random.default_rng(0), 1, 10)


def test_poisson_arrivals():
    t = wl.poisson_arrivals(np.random.default_rng(0), 20_000, 4.0)
    assert np.all(np.diff(t) >= 0)
    assert abs(np.diff(t).mean() / 0.25 - 1) < 0.03
    assert wl.poisson_arrivals(np.random.default_rng(0), 3, float("inf")).tolist() == [0, 0, 0]
