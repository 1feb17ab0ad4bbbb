"""TTFT with and without cached tokens, and the robust prefill-cost fit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvscope.advisor import PrefillCost
from kvscope.advisor.prefill import request_prefill_s, request_ttft_s, theil_sen


def _requests(
    n: int, slope: float, *, seed: int = 0, noise: float = 0.1, related: bool = True
) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(100, 3001, n)
    cached = np.where(rng.random(n) < 0.5, prompt // 2, 0)
    computed = prompt - cached
    base = 0.03 + slope * (computed if related else rng.permutation(computed))
    prefill = base * rng.lognormal(0, noise, n) + np.where(rng.random(n) < 0.1, 2.0, 0.0)
    queue = rng.exponential(0.5, n)  # load noise, unrelated to length
    return pd.DataFrame(
        {
            "engine_id": "e",
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "queue_s": queue,
            "prefill_s": prefill,
            "ttft_s": queue + prefill,
        }
    )


def test_theil_sen_ignores_a_gross_outlier() -> None:
    x = np.arange(20, dtype=float)
    y = 3.0 + 0.5 * x
    y[7] = 1_000.0
    slope, intercept = theil_sen(x, y)
    assert slope == pytest.approx(0.5) and intercept == pytest.approx(3.0)
    assert np.isnan(theil_sen(np.ones(5), np.arange(5.0))[0])  # no spread in x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slope_recovered_despite_queueing_and_stragglers(seed: int) -> None:
    r = _requests(400, 2e-4, seed=seed)
    p = PrefillCost().fit(r)
    assert p.usable_ and p.good_
    assert p.slope_s_per_token_ == pytest.approx(2e-4, rel=0.05)
    assert p.r2_ > 0.8 and p.n_ == 400
    assert p.ttft_change_s(500) == pytest.approx(-500 * p.slope_s_per_token_)
    assert p.confidence_ > 0.8


def test_unrelated_ttft_gives_a_poor_fit_and_low_confidence() -> None:
    p = PrefillCost().fit(_requests(400, 2e-4, related=False))
    assert not p.good_
    assert p.confidence_ <= 0.5
    assert "poor fit" in p.summary() or "no prefill cost fit" in p.summary()


def test_too_few_requests_give_no_prediction() -> None:
    p = PrefillCost().fit(_requests(10, 2e-4))
    assert not p.usable_ and p.ttft_change_s(100) is None and p.confidence_ == 0.0
    assert PrefillCost().fit(pd.DataFrame()).n_ == 0


def test_cached_vs_uncached_percentiles_and_missing_ttft() -> None:
    r = pd.DataFrame(
        {
            "prompt_tokens": [100, 100, 100, 100, 100],
            "cached_tokens": [50, 50, 0, 0, 0],
            "ttft_s": [0.1, 0.3, None, 1.0, 2.0],
            "queue_s": [0.0, 0.1, 0.5, 0.2, 0.5],
            "prefill_s": [0.1, 0.2, 0.3, 0.8, 1.5],
        }
    )
    ttft = request_ttft_s(r)
    assert ttft[2] == pytest.approx(0.8)  # queue + prefill where TTFT is missing
    assert request_prefill_s(r).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.8, 1.5])
    p = PrefillCost().fit(r)
    assert p.cached_["n"] == 2 and p.cached_["p50_s"] == pytest.approx(0.2)
    assert p.uncached_["n"] == 3 and p.uncached_["p50_s"] == pytest.approx(1.0)
    assert p.mean_ttft_s_ == pytest.approx((0.1 + 0.3 + 0.8 + 1.0 + 2.0) / 5)
