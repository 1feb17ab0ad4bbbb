"""Latency against load: TTFT, queue and end-to-end percentiles per load level.

Each finished request is placed at the mean load over its life (the load it met decides how
long it queued; its arrival second alone is fragile) and grouped into the load bins of a fitted
:class:`~kvscope.advisor.curve.ThroughputCurve`; per bin the P50 and P99 of ``ttft_s``,
``queue_s`` and ``e2e_s`` are taken, with the share of requests vLLM preempted (where a
KV-starved engine's tail comes from). The **tail starts climbing** at the smallest bin load
whose e2e P99 is ``tail_factor`` times the lowest bin's; :meth:`LatencyVsLoad.p99_at`
interpolates between bins, made non-decreasing first.

Parameters
----------
tail_factor : multiple of the low-load e2e P99 that counts as a climbing tail (2.0).
min_requests : requests per bin at least (default 5).

See docs/advise.md#latency-against-load.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.findings import Finding, Scope
from kvscope.advisor.frames import covered_seconds, frame_of

_COLS = ("ttft_s", "queue_s", "e2e_s")


def _mean_load(windows: pd.DataFrame, start_s: pd.Series, end_s: pd.Series) -> np.ndarray:
    """Mean window load over the seconds [floor(start), floor(end)] (NaN: no window); a
    window read from the 1-minute tier stands for each second of its minute."""
    if not len(windows) or not len(start_s):
        return np.full(len(start_s), math.nan)
    secs, rows = covered_seconds(windows)
    ts = secs.astype("int64")
    t0 = int(ts.min())
    n = int(ts.max()) - t0 + 2
    val = np.zeros(n)
    cnt = np.zeros(n)
    val[ts - t0] = windows["load"].to_numpy(float)[rows]
    cnt[ts - t0] = 1.0
    cv = np.concatenate([[0.0], np.cumsum(val)])
    cc = np.concatenate([[0.0], np.cumsum(cnt)])
    lo = np.clip(np.floor(start_s.to_numpy(float)).astype("int64") - t0, 0, n - 1)
    hi = np.clip(np.floor(end_s.to_numpy(float)).astype("int64") - t0, 0, n - 1) + 1
    hi = np.maximum(hi, lo + 1)
    c = cc[hi] - cc[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, (cv[hi] - cv[lo]) / np.where(c > 0, c, 1.0), math.nan)


class LatencyVsLoad:
    """Latency percentiles per load bin (see the module docstring)."""

    def __init__(self, *, tail_factor: float = 2.0, min_requests: int = 5) -> None:
        self.tail_factor = tail_factor
        self.min_requests = min_requests

    def fit(self, requests: pd.DataFrame, curve: ThroughputCurve) -> LatencyVsLoad:
        r = requests.copy()
        for c in (*_COLS, "finished_unix_s"):
            r[c] = pd.to_numeric(r[c], errors="coerce") if c in r else np.nan
        r = r[r["e2e_s"].notna() & r["finished_unix_s"].notna()]
        preempted = (
            pd.to_numeric(r["preemptions"], errors="coerce")
            if "preemptions" in r
            else pd.Series(math.nan, index=r.index)
        )
        r = r.assign(preempted=preempted.gt(0).where(preempted.notna()))
        r = r.assign(
            load=_mean_load(curve.windows_, r["finished_unix_s"] - r["e2e_s"], r["finished_unix_s"])
        )
        r = r[r["load"].notna()]
        centers = np.log(curve.bins_["load"].to_numpy(float))
        if len(r):
            idx = np.abs(np.log(r["load"].to_numpy(float))[:, None] - centers[None, :]).argmin(1)
        else:
            idx = np.zeros(0, dtype=int)
        r = r.assign(bin=idx)
        rows: list[dict[str, Any]] = []
        for b, grp in r.groupby("bin"):
            if len(grp) < self.min_requests:
                continue
            row: dict[str, Any] = {
                "load": float(curve.bins_["load"].iloc[int(b)]),
                "n_requests": len(grp),
            }
            for c in _COLS:
                v = grp[c].dropna()
                row[f"{c}_p50"] = float(v.quantile(0.5)) if len(v) else math.nan
                row[f"{c}_p99"] = float(v.quantile(0.99)) if len(v) else math.nan
            pre = grp["preempted"].dropna()
            row["preempted_share"] = float(pre.astype(float).mean()) if len(pre) else math.nan
            rows.append(row)
        self.bins_ = pd.DataFrame(rows)
        self.n_requests_ = len(r)
        self.tail_start_load_: float | None = None
        if len(self.bins_):
            base = float(self.bins_["e2e_s_p99"].iloc[0])
            climbing = self.bins_[self.bins_["e2e_s_p99"] >= self.tail_factor * base]
            if len(climbing):
                self.tail_start_load_ = float(climbing["load"].iloc[0])
        return self

    def p99_at(self, load: float, col: str = "e2e_s") -> float:
        """The P99 of ``col`` at ``load`` (interpolated; NaN without data)."""
        key = f"{col}_p99"
        if not len(self.bins_) or key not in self.bins_:
            return math.nan
        b = self.bins_[self.bins_[key].notna()]
        if not len(b):
            return math.nan
        y = np.maximum.accumulate(b[key].to_numpy(float))
        return float(np.interp(load, b["load"].to_numpy(float), y))

    def finding(self, scope: Scope) -> Finding:
        if not len(self.bins_):
            return Finding(
                kind="latency_vs_load",
                scope=scope,
                confidence=0.0,
                summary="no finished requests matched to load windows",
            )
        lo, hi = self.bins_.iloc[0], self.bins_.iloc[-1]
        tail = (
            f"the tail climbs from {self.tail_start_load_:.1f} in flight"
            if self.tail_start_load_ is not None
            else "the tail does not climb"
        )
        summary = (
            f"e2e P99 {lo['e2e_s_p99']:.2f} s at {lo['load']:.1f} in flight -> "
            f"{hi['e2e_s_p99']:.2f} s at {hi['load']:.1f}; TTFT P99 "
            f"{lo['ttft_s_p99']:.2f} s -> {hi['ttft_s_p99']:.2f} s; {tail}"
        )
        return Finding(
            kind="latency_vs_load",
            scope=scope,
            summary=summary,
            severity="warning" if self.tail_start_load_ is not None else "info",
            confidence=round(min(1.0, self.n_requests_ / 100.0), 3),
            evidence={
                "tail_start_load": self.tail_start_load_,
                "n_requests": self.n_requests_,
                "tail_factor": self.tail_factor,
                "e2e_p99_s_low_load": float(lo["e2e_s_p99"]),
                "e2e_p99_s_max_load": float(hi["e2e_s_p99"]),
            },
            frame=frame_of(self.bins_, list(self.bins_.columns)),
        )
