"""TTFT with and without cached prompt tokens, and what a computed prompt token costs.

* :func:`request_ttft_s`: ``ttft_s``, else ``queue_s + prefill_s``.
* Cached vs uncached: P50 and P90 TTFT and counts of requests with and without cached
  tokens; a description, not the cache's effect (the groups differ in length and load).
* :class:`PrefillCost`: a Theil-Sen line (:func:`theil_sen`) of the prefill part of TTFT
  (``ttft_s - queue_s``, which leaves out the queue wait that follows the load) against
  the computed prompt tokens ``prompt_tokens - cached_tokens``, with a robust ``r2_``
  (from the MAD of the residuals). :meth:`PrefillCost.ttft_change_s` turns tokens saved
  per request into a mean TTFT change, with the queue wait held as it was.

Parameters
----------
min_requests : requests needed for a fit (default 20).
min_distinct : distinct computed-token counts needed (default 3).
good_r2 : r2 at or above which the fit counts as good (default 0.3).
full_confidence_requests : requests for full confidence (default 200).
max_points : requests the line is fitted on at most, a seeded sample beyond (default 400).
random_state : seed for the sample (default 0).

Why this fit, the robust r2 and the confidence: docs/fleet.md#prefill-cost-and-load-balance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats


def _col(df: pd.DataFrame, name: str) -> np.ndarray:
    if name not in df:
        return np.full(len(df), math.nan)
    return pd.to_numeric(df[name], errors="coerce").to_numpy(float)


def request_ttft_s(requests: pd.DataFrame) -> np.ndarray:
    """TTFT per request: ``ttft_s``, else ``queue_s + prefill_s`` (NaN when neither)."""
    ttft = _col(requests, "ttft_s")
    parts = _col(requests, "queue_s") + _col(requests, "prefill_s")
    return np.where(np.isfinite(ttft), ttft, parts)


def request_prefill_s(requests: pd.DataFrame) -> np.ndarray:
    """The prefill part of TTFT: ``ttft_s - queue_s``, else ``prefill_s`` (NaN when neither)."""
    part = _col(requests, "ttft_s") - _col(requests, "queue_s")
    return np.where(np.isfinite(part), part, _col(requests, "prefill_s"))


def theil_sen(
    x: np.ndarray, y: np.ndarray, *, max_points: int = 400, random_state: int = 0
) -> tuple[float, float]:
    """Slope and intercept of the Theil-Sen line through ``(x, y)`` (NaN without pairs).

    SciPy's :func:`scipy.stats.theilslopes` (the median of pairwise slopes; intercept
    the median of ``y - slope x``, its "joint" method): robust to the minority of
    requests whose TTFT a queue or a preemption inflated. It weighs every pair, so
    beyond ``max_points`` requests a seeded sample of them is used."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) > max_points:
        pick = np.random.default_rng(random_state).choice(len(x), max_points, replace=False)
        x, y = x[pick], y[pick]
    if len(x) < 2 or np.ptp(x) == 0:
        return math.nan, math.nan
    res = stats.theilslopes(y, x, method="joint")
    return float(res.slope), float(res.intercept)


def _mad(v: np.ndarray) -> float:
    return float(np.median(np.abs(v - np.median(v))))


def _pcts(v: np.ndarray) -> dict[str, Any]:
    v = v[np.isfinite(v)]
    if not len(v):
        return {"n": 0, "p50_s": None, "p90_s": None, "mean_s": None}
    return {
        "n": len(v),
        "p50_s": float(np.quantile(v, 0.5)),
        "p90_s": float(np.quantile(v, 0.9)),
        "mean_s": float(v.mean()),
    }


class PrefillCost:
    """TTFT of cached vs uncached requests and the cost of a computed prompt token."""

    def __init__(
        self,
        *,
        min_requests: int = 20,
        min_distinct: int = 3,
        good_r2: float = 0.3,
        full_confidence_requests: int = 200,
        max_points: int = 400,
        random_state: int = 0,
    ) -> None:
        self.min_requests = min_requests
        self.min_distinct = min_distinct
        self.good_r2 = good_r2
        self.full_confidence_requests = full_confidence_requests
        self.max_points = max_points
        self.random_state = random_state

    def fit(self, requests: pd.DataFrame) -> PrefillCost:
        r = requests if len(requests) else pd.DataFrame()
        ttft = request_ttft_s(r)
        prompt = _col(r, "prompt_tokens")
        cached = np.nan_to_num(_col(r, "cached_tokens"), nan=0.0)
        x = np.maximum(prompt - cached, 0.0)
        ok = np.isfinite(ttft) & np.isfinite(x)
        self.cached_ = _pcts(ttft[ok & (cached > 0)])
        self.uncached_ = _pcts(ttft[ok & (cached <= 0)])
        self.mean_ttft_s_ = float(ttft[ok].mean()) if ok.any() else math.nan
        y = request_prefill_s(r)
        ok = np.isfinite(y) & np.isfinite(x)
        self.n_ = int(ok.sum())
        x, y = x[ok], y[ok]
        self.slope_s_per_token_, self.intercept_s_ = theil_sen(
            x, y, max_points=self.max_points, random_state=self.random_state
        )
        self.r2_ = math.nan
        if self.n_ >= 2 and math.isfinite(self.slope_s_per_token_):
            mad_y = _mad(y)
            mad_res = _mad(y - self.intercept_s_ - self.slope_s_per_token_ * x)
            self.r2_ = 1.0 - (mad_res / mad_y) ** 2 if mad_y > 0 else math.nan
        self.usable_ = bool(
            self.n_ >= self.min_requests
            and len(np.unique(x)) >= self.min_distinct
            and self.slope_s_per_token_ > 0
        )
        r2 = self.r2_ if math.isfinite(self.r2_) else 0.0
        self.good_ = bool(self.usable_ and r2 >= self.good_r2)
        self.confidence_ = (
            min(1.0, self.n_ / self.full_confidence_requests) * min(1.0, max(0.25, r2))
            if self.usable_
            else 0.0
        )
        return self

    def ttft_change_s(self, tokens_saved_per_request: float) -> float | None:
        """Mean TTFT change when each request computes ``tokens_saved_per_request`` fewer
        prompt tokens (None when the fit is not usable)."""
        if not self.usable_:
            return None
        return -self.slope_s_per_token_ * tokens_saved_per_request

    def evidence(self) -> dict[str, Any]:
        return {
            "ttft_cached": self.cached_,
            "ttft_uncached": self.uncached_,
            "prefill_s_per_token": self.slope_s_per_token_,
            "prefill_intercept_s": self.intercept_s_,
            "prefill_fit_r2": self.r2_,
            "prefill_fit_n": self.n_,
            "prefill_fit_usable": self.usable_,
            "prefill_fit_good": self.good_,
            "mean_ttft_s": self.mean_ttft_s_,
        }

    def summary(self) -> str:
        c, u = self.cached_, self.uncached_
        parts = []
        if c["n"] or u["n"]:
            parts.append(
                f"TTFT P50/P90 with cached tokens {_s(c['p50_s'])}/{_s(c['p90_s'])} "
                f"(n={c['n']}), without {_s(u['p50_s'])}/{_s(u['p90_s'])} "
                f"(n={u['n']})"
            )
        if self.usable_:
            quality = "" if self.good_ else ", poor fit"
            parts.append(
                f"prefill {self.slope_s_per_token_ * 1e3:.3f} ms per computed prompt "
                f"token (r2 {self.r2_:.2f}, n={self.n_}{quality})"
            )
        else:
            parts.append(f"no prefill cost fit ({self.n_} requests)")
        return "; ".join(parts)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"
