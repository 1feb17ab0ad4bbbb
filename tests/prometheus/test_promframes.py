"""Scrape-resolution series into frames: counter increases, histogram quantiles,
pseudo-requests, the inferred sequence cap, the confidence factor."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvscope.sources.prometheus.frames import (
    bucket_quantile,
    confidence_factor,
    cumulative_round,
    footprint_tokens,
    increases,
    infer_max_num_seqs,
    late_groups,
    pseudo_requests,
    quantiles_from_buckets,
    spread_over_groups,
    spread_reasons,
)
from kvscope.sources.prometheus.read import Fetch, Reader

INF = math.inf
T = 1_750_000_000.0


def test_increases_count_a_reset_as_the_new_value() -> None:
    got = increases(np.array([10.0, 15.0, 15.0, 3.0, 7.0, math.nan, 9.0]))
    assert got[:4].tolist() == [5.0, 0.0, 3.0, 4.0]
    assert math.isnan(got[4]) and math.isnan(got[5])  # unknown across a missing point


def test_cumulative_round_keeps_totals() -> None:
    x = np.array([0.4, 0.4, 0.4, 2.6, math.nan, 0.2])
    r = cumulative_round(x)
    assert r.dtype.kind == "i" and r.sum() == 4 and (r >= 0).all()
    assert abs(np.cumsum(r) - np.cumsum(np.nan_to_num(x))).max() <= 0.5 + 1e-9


def test_quantiles_from_buckets_interpolate_like_histogram_quantile() -> None:
    les = np.array([1.0, 2.0, 4.0, INF])
    cum = np.array([0.0, 4.0, 4.0, 4.0])  # four observations in (1, 2]
    assert quantiles_from_buckets(les, cum, 4).tolist() == [1.125, 1.375, 1.625, 1.875]
    # Above the last finite bound: the highest finite bound, as histogram_quantile does.
    assert quantiles_from_buckets(les, np.array([0, 0, 0, 2.0]), 2).tolist() == [4.0, 4.0]
    # The first bucket starts at 0; fractional counts (rates x window) are fine.
    assert quantiles_from_buckets(les, np.array([0.5, 0.5, 0.5, 0.5]), 1).tolist() == [0.5]
    assert np.isnan(quantiles_from_buckets(les, np.zeros(4), 3)).all()


def test_bucket_quantile_per_row() -> None:
    les = np.array([0.5, 0.9, 1.0])
    rows = np.array([[10.0, 10.0, 10.0], [0.0, 0.0, 10.0], [0.0, 0.0, 0.0]])
    got = bucket_quantile(les, rows, 0.5)
    assert got[0] == pytest.approx(0.25) and got[1] == pytest.approx(0.95)
    assert math.isnan(got[2])


def test_pseudo_requests_spread_each_window_over_its_histograms() -> None:
    les = np.array([1.0, 2.0, INF])
    e2e = np.array([[0.0, 0.0, 0.0], [1.0, 3.0, 3.0], [0.0, 2.0, 2.0]])
    gen = np.array([[0.0, 0.0, 0.0], [0.0, 3.0, 3.0], [0.0, 0.0, 2.0]])
    r = pseudo_requests(
        "e",
        np.array([100.0, 101.0, 102.0]),
        np.array([0.0, 3.0, 2.0]),
        {"e2e": (les, e2e), "request_generation_tokens": (les, gen)},
        {"request_generation_tokens": np.array([math.nan, 1.5, math.nan])},
        scale=1.0,
        prompt_tokens=np.array([10.0, 20.0, 30.0]),
        cached_share=0.25,
    )
    assert len(r) == 5 and set(r["engine_id"]) == {"e"}
    assert r["finished_unix_s"].tolist() == [101.5] * 3 + [102.5] * 2
    first = r[r["finished_unix_s"] == 101.5]
    assert first["e2e_s"].is_monotonic_increasing and first["e2e_s"].iloc[0] < 1.0
    assert first["generation_tokens"].mean() == pytest.approx(1.5, abs=0.34)  # rescaled, rounded
    assert first["prompt_tokens"].tolist() == [20.0] * 3 and first["cached_tokens"].iloc[0] == 5
    assert r["ttft_s"].isna().all()  # no TTFT histogram given
    assert (r["weight"] == 1.0).all()
    half = pseudo_requests(
        "e",
        np.array([100.0, 101.0, 102.0]),
        np.array([0.0, 3.0, 2.0]),
        {"e2e": (les, e2e)},
        {},
        scale=0.5,
        prompt_tokens=np.full(3, 10.0),
        cached_share=0.0,
    )
    assert len(half) in (2, 3) and (half["weight"] == 2.0).all()


def test_finish_reasons_follow_the_counters_shares_in_each_window() -> None:
    gen = np.array([128.0, 40.0, 128.0, 7.0, 90.0])
    names = ["abort", "length", "stop"]
    got = spread_reasons(names, np.array([1.0, 2.0, 2.0]), gen)
    # Two outputs reached max_tokens: the two longest; the shortest were stopped or aborted.
    assert sorted(got[gen == 128.0]) == ["length", "length"]
    assert sorted(got.tolist()) == ["abort", "length", "length", "stop", "stop"]
    # Shares rounded to the rows (8 of 10 stop, 2 length over 3 rows: 2 stop, 1 length).
    assert sorted(spread_reasons(names, np.array([0.0, 2.0, 8.0]), gen[:3]).tolist()) == [
        "length",
        "stop",
        "stop",
    ]
    assert set(spread_reasons(names, np.zeros(3), gen)) == {"unknown"}
    assert set(spread_reasons(names, np.full(3, math.nan), gen)) == {"unknown"}
    les = np.array([1.0, INF])
    r = pseudo_requests(
        "e",
        np.array([100.0, 101.0]),
        np.array([2.0, 1.0]),
        {"e2e": (les, np.array([[2.0, 2.0], [0.0, 1.0]]))},
        {},
        scale=1.0,
        prompt_tokens=np.full(2, 10.0),
        cached_share=0.0,
        reasons=(["length", "stop"], np.array([[1.0, 1.0], [0.0, 0.0]])),
    )
    assert sorted(r["finish_reason"].iloc[:2]) == ["length", "stop"]
    assert r["finish_reason"].iloc[2] == "unknown"


def test_footprint_matches_the_capacity_models_formula() -> None:
    r = pd.DataFrame(
        {"prompt_tokens": [100, 100], "generation_tokens": [100, 300], "cached_tokens": [20, 20]}
    )
    # weights g: (100*(80+50) + 300*(80+150)) / 400 + 16/2
    assert footprint_tokens(r, 16) == pytest.approx((100 * 130 + 300 * 230) / 400 + 8)
    assert math.isnan(footprint_tokens(r.iloc[0:0], 16))


def test_infer_max_num_seqs_only_when_the_batch_was_pinned_with_kv_to_spare() -> None:
    n = 20
    pinned = np.full(n, 6.0)
    assert infer_max_num_seqs(pinned, np.full(n, 4.0), np.full(n, 0.1)) == 6
    # KV full: the batch is held by memory, not by a cap.
    assert infer_max_num_seqs(pinned, np.full(n, 4.0), np.full(n, 0.97)) is None
    # Nothing waited: no evidence of any cap.
    assert infer_max_num_seqs(pinned, np.zeros(n), np.full(n, 0.1)) is None
    # The batch wandered below its maximum while requests waited.
    wander = np.where(np.arange(n) % 2 == 0, 6.0, 3.0)
    assert infer_max_num_seqs(wander, np.full(n, 4.0), np.full(n, 0.1)) is None
    # The gauge read the cache at 60% between steps, but vLLM preempted: memory held it.
    assert infer_max_num_seqs(pinned, np.full(n, 4.0), np.full(n, 0.6), np.full(n, 3.0)) is None
    assert infer_max_num_seqs(pinned, np.full(n, 4.0), np.full(n, 0.6), np.zeros(n)) == 6


def test_vllm_windows_batch_is_decode_tokens_per_step_net_of_accepted_drafts() -> None:
    """With speculative decoding each sequence gains 1 + its accepted drafts per step: 20
    sequences, 50 steps/s, 1.5 accepted drafts each per step: 2,500 generated tokens/s
    of which 1,500 are accepted drafts. The batch is 20, not 50. KV usage is the gauge."""
    grid = np.array([T + 1.0, T + 2.0])
    f = Fetch(since=T, until=T + 2, names=set(), step_s=1)
    c = {
        "snapshot": np.array([20.0, 20.0]),
        "batch_max": np.array([20.0, 20.0]),
        "n_steps": np.array([50.0, 50.0]),
        "generation_tokens": np.array([2500.0, 2500.0]),
        "spec_accepted": np.array([1500.0, 1500.0]),
        "kv_usage_sampled": np.array([0.4, 0.4]),
    }
    cfg = {"num_gpu_blocks": 1000, "block_size": 16}
    reqs = pd.DataFrame(
        {"prompt_tokens": [4000.0], "generation_tokens": [100.0], "cached_tokens": [0.0]}
    )
    w = Reader.vllm_windows(c, grid, f, cfg, reqs)
    assert w["batch_mean"].tolist() == [20.0, 20.0]
    # The footprint estimate (20 x ~4,050 tokens > the cache) is kept beside the gauge.
    assert w["kv_usage_mean"].tolist() == [0.4, 0.4]
    assert (w["kv_usage_estimated"] == 1.0).all()
    no_drafts = Reader.vllm_windows(
        {**c, "spec_accepted": np.array([0.0, 0.0])}, grid, f, cfg, reqs
    )
    assert no_drafts["batch_mean"].tolist() == [50.0, 50.0]


def test_confidence_factor_falls_with_resolution() -> None:
    assert confidence_factor(1, per_step_means=True) == 1.0
    assert confidence_factor(2, per_step_means=True) == 1.0  # the shortest kvscope window
    assert confidence_factor(8, per_step_means=True) == 0.5
    assert confidence_factor(1, per_step_means=False) == 0.9
    assert confidence_factor(4, per_step_means=False) == 0.45
    assert confidence_factor(15, per_step_means=False) == pytest.approx(0.305, abs=2e-3)
    assert confidence_factor(86400, per_step_means=False) == 0.2


def _scraped_windows(steps: list[float], batch: list[float], gen: list[float]) -> pd.DataFrame:
    n = len(steps)
    return pd.DataFrame(
        {
            "engine_id": "e",
            "ts_s": np.arange(n),
            "n_steps": steps,
            "batch_mean": batch,
            "waiting_mean": 0.0,
            "generation_tokens": gen,
            "prompt_tokens": 0.0,
            "first_step_unix_s": math.nan,
            "last_step_unix_s": math.nan,
        }
    )


def test_busy_share_from_the_step_count_drops_draining_windows() -> None:
    """Scraped windows have no step times: a window with far fewer steps than its peers
    at the same batch was idle part of the time and is left out of the curve."""
    from kvscope.advisor import ThroughputCurve
    from kvscope.advisor.frames import prepare_windows, step_count_busy_ratio

    levels = [(1, 240), (2, 230), (4, 200), (8, 155), (12, 118)]
    steps, batch = [], []
    for b, s in levels:
        steps += [s, s - 3, s + 2, s - 1, s + 1, s]
        batch += [b] * 6
    steps += [21.0, 40.0]  # the load draining away within these seconds
    batch += [12.0, 12.2]
    gen = [s * b for s, b in zip(steps, batch, strict=True)]
    w = prepare_windows(_scraped_windows(steps, batch, gen))
    busy = step_count_busy_ratio(w)
    assert busy.iloc[-2] == pytest.approx(21 / 118.75, rel=0.02)
    assert (busy.iloc[:-2] > 0.95).all()
    kept = ThroughputCurve().fit(w).windows_
    assert len(kept) == len(w) - 2 and kept["ts_s"].max() == len(w) - 3
    # Too few peers: unknown, kept.
    lone = step_count_busy_ratio(prepare_windows(_scraped_windows([50, 100], [3, 3], [1, 1])))
    assert lone.isna().all()


def _marks(covered: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Points 0..n and the collector's latest step time at each: ``covered[k]`` at point
    ``k + 1``, one second less at point 0."""
    points = np.arange(len(covered) + 1, dtype=float)
    return np.array([covered[0] - 1.0, *covered]), points


def test_steps_that_reach_a_collector_late_are_put_back_over_the_seconds_they_left() -> None:
    """A collector's counters move when the plugin's batches arrive, its latest step time
    with them: three seconds of batches held back during an outage land together, the
    three intervals before read no step and their scrapes fell behind. Spread back,
    every interval holds its own second's steps, also when a scrape fell among the late
    batches; an engine that idled and resumed (its marks stood still too, but it holds
    no more than its peers) keeps its idle seconds; an unknown interval ends a run."""
    # outage: the usual lag is one second; intervals 2-4 fall behind, 5 catches up
    steps = np.array([100, 100, 0, 0, 0, 400, 100, 100.0])
    marks, points = _marks([0, 1, 1, 1, 1, 5, 6, 7])
    groups = late_groups(steps, marks, points, max_gap=60)
    assert spread_over_groups(steps, groups).tolist() == [100.0] * 8
    # every counter of the engine shares its step counter's groups: totals are kept
    tokens = steps * 8.0
    assert spread_over_groups(tokens, groups).sum() == pytest.approx(tokens.sum())
    # a scrape among the late batches: one of them in interval 4, the rest in 5
    split = np.array([100, 100, 0, 0, 100, 300, 100, 100.0])
    marks, points = _marks([0, 1, 1, 1, 2, 5, 6, 7])
    spread = spread_over_groups(split, late_groups(split, marks, points, 60))
    assert spread.tolist() == [100.0] * 8
    # at most max_gap intervals join the one that caught up
    marks, points = _marks([0, 1, 1, 1, 1, 5, 6, 7])
    capped = spread_over_groups(steps, late_groups(steps, marks, points, max_gap=1))
    assert capped[3:6].tolist() == [0, 200, 200]
    # idle, then resumed: the marks stood still too, but 60 steps are not five seconds'
    idle = np.array([100, 100, 0, 0, 0, 0, 60, 100, 100.0])
    marks, points = _marks([0, 1, 1, 1, 1, 1, 6, 7, 8])
    spread = spread_over_groups(idle, late_groups(idle, marks, points, 60))
    assert spread.tolist() == idle.tolist()
    # an unknown increase ends the run: what came after it is not spread over it
    gap = np.array([100, 100, 0, np.nan, 0, 300, 100, 100.0])
    marks, points = _marks([0, 1, 1, np.nan, 1, 5, 6, 7])
    spread = spread_over_groups(gap, late_groups(gap, marks, points, 60))
    assert np.isnan(spread[3]) and spread[:3].tolist() == [100, 100, 0]
    assert spread[4:6].tolist() == [150, 150]  # only the interval after it is known late
    # the last steps, with none after them: paced by the ones before
    tail = np.array([100, 100, 0, 0, 300.0])
    marks, points = _marks([0, 1, 1, 1, 4])
    assert spread_over_groups(tail, late_groups(tail, marks, points, 60)).tolist() == [100.0] * 5
    # without marks nothing is known to be late
    none = np.full(len(steps) + 1, np.nan)
    assert late_groups(steps, none, np.arange(len(steps) + 1.0), 60).tolist() == list(range(8))
