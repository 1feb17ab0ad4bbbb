"""Request latency per engine and pool: percentiles, finish reasons, lengths, SLO attainment.

What latency the finished requests saw, without reference to load (latency against load is
:mod:`kvscope.advisor.latency`). Per request: TTFT (vLLM's, else ``queue_s + prefill_s``),
ITL ``decode_s / (generation_tokens - 1)`` (only for requests of 2 or more output tokens),
e2e, queue, prefill and decode time, and the lengths.

* :func:`request_latency`: P50/P90/P99 (linear interpolation), means and maxima; a request
  without a measure is left out of it. Rows with a ``weight`` column (pseudo-requests from
  Prometheus, or the collector's request tier) count with their weight. The mean life
  splits into queue, prefill, decode and the API server's rest, which add up.
* SLO attainment (:class:`SloTargets`): per target, the share of requests at or under it;
  ``all``, the share meeting every target (a one-token request meets the ITL target).
  Without targets nothing is judged.
* :func:`latency_over_time`: the same percentiles per bin of finish time;
  :func:`length_histogram`: the distribution of a length column.

Pure and deterministic. See docs/advise.md#request-latency-and-slos.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.prefill import request_ttft_s

__all__ = [
    "LATENCY_MEASURES",
    "LENGTH_MEASURES",
    "QUANTILES",
    "Quantiles",
    "RequestLatency",
    "SloAttainment",
    "SloTargets",
    "latency_over_time",
    "length_histogram",
    "request_itl_s",
    "request_latency",
]

QUANTILES = (0.5, 0.9, 0.99)
LATENCY_MEASURES = ("ttft_s", "itl_s", "e2e_s", "queue_s", "prefill_s", "decode_s")
LENGTH_MEASURES = ("prompt_tokens", "generation_tokens")
BIN_CHOICES_S = (60, 300, 900, 3600, 6 * 3600, 86400)
"""Bins :func:`latency_over_time` picks from: the finest that gives at most ``max_bins``."""


def _col(df: pd.DataFrame, name: str) -> np.ndarray:
    if name not in df:
        return np.full(len(df), math.nan)
    return pd.to_numeric(df[name], errors="coerce").to_numpy(float)


def request_itl_s(requests: pd.DataFrame) -> np.ndarray:
    """Inter-token latency per request: ``decode_s / (generation_tokens - 1)`` for
    requests with at least 2 output tokens, NaN for the others."""
    decode = _col(requests, "decode_s")
    gaps = _col(requests, "generation_tokens") - 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(gaps >= 1.0, decode / np.where(gaps >= 1.0, gaps, 1.0), math.nan)


def _measures(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    # Rows from a histogram tier carry their ITL (decode / gaps would pair two marginals).
    itl = request_itl_s(requests)
    if "itl_s" in requests:
        given = _col(requests, "itl_s")
        itl = np.where(np.isfinite(given), given, itl)
    out = {"ttft_s": np.asarray(request_ttft_s(requests), float), "itl_s": itl}
    for c in ("e2e_s", "queue_s", "prefill_s", "decode_s", *LENGTH_MEASURES):
        out[c] = _col(requests, c)
    return out


def _estimated(requests: pd.DataFrame) -> bool:
    """True when some rows come from histograms (:mod:`kvscope.advisor.request_tier`)."""
    return "estimated" in requests and bool(requests["estimated"].fillna(False).astype(bool).any())


def _weights(requests: pd.DataFrame) -> np.ndarray:
    w = _col(requests, "weight") if "weight" in requests else np.ones(len(requests))
    return np.where(np.isfinite(w) & (w > 0), w, 1.0)


@dataclass(frozen=True)
class Quantiles:
    """P50, P90, P99, mean and maximum of one measure (its unit is the key it is under);
    ``n`` requests had a value. All None when ``n`` is 0."""

    n: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: np.ndarray, weights: np.ndarray | None = None) -> Quantiles:
        v = np.asarray(values, float)
        w = np.ones(len(v)) if weights is None else np.asarray(weights, float)
        ok = np.isfinite(v)
        v, w = v[ok], w[ok]
        if not len(v):
            return cls()
        if np.ptp(w) == 0:
            q = np.quantile(v, QUANTILES)
        else:
            q = np.quantile(v, QUANTILES, weights=w, method="inverted_cdf")
        return cls(
            n=round(float(w.sum())),
            p50=float(q[0]),
            p90=float(q[1]),
            p99=float(q[2]),
            mean=float(np.average(v, weights=w)),
            max=float(v.max()),
        )


@dataclass(frozen=True)
class SloTargets:
    """Latency targets in seconds (None: no target for that measure)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    @property
    def given(self) -> dict[str, float]:
        """``{"ttft": 0.5, ...}`` for the targets set."""
        out = {"ttft": self.ttft_s, "itl": self.itl_s, "e2e": self.e2e_s}
        return {k: float(v) for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class SloAttainment:
    """``n_met`` of ``n`` requests met ``target_s`` (None for ``all``): ``share``."""

    target_s: float | None
    n: int
    n_met: int
    share: float | None


@dataclass
class RequestLatency:
    """What the finished requests of one engine or pool saw (see the module docstring).

    The latency keys are in seconds, the length keys in tokens; ``slo`` is keyed
    ``ttft``, ``itl``, ``e2e`` and ``all``, present only for targets given."""

    n_requests: int = 0
    ttft_s: Quantiles = field(default_factory=Quantiles)
    itl_s: Quantiles = field(default_factory=Quantiles)
    e2e_s: Quantiles = field(default_factory=Quantiles)
    queue_s: Quantiles = field(default_factory=Quantiles)
    prefill_s: Quantiles = field(default_factory=Quantiles)
    decode_s: Quantiles = field(default_factory=Quantiles)
    prompt_tokens: Quantiles = field(default_factory=Quantiles)
    generation_tokens: Quantiles = field(default_factory=Quantiles)
    breakdown_mean_s: dict[str, float | None] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    slo: dict[str, SloAttainment] = field(default_factory=dict)
    weighted: bool = False
    """True when rows came from histograms (Prometheus's, or the collector's request tier
    past its request retention): the numbers are estimates."""

    def quantiles(self, measure: str) -> Quantiles:
        """One of :data:`LATENCY_MEASURES` or :data:`LENGTH_MEASURES`."""
        q = getattr(self, measure)
        assert isinstance(q, Quantiles)
        return q

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestLatency:
        kw: dict[str, Any] = {
            m: Quantiles(**(d.get(m) or {})) for m in (*LATENCY_MEASURES, *LENGTH_MEASURES)
        }
        return cls(
            n_requests=int(d.get("n_requests") or 0),
            breakdown_mean_s=dict(d.get("breakdown_mean_s") or {}),
            finish_reasons={str(k): int(v) for k, v in (d.get("finish_reasons") or {}).items()},
            slo={k: SloAttainment(**v) for k, v in (d.get("slo") or {}).items()},
            weighted=bool(d.get("weighted", False)),
            **kw,
        )


def _slo(m: dict[str, np.ndarray], w: np.ndarray, targets: SloTargets) -> dict[str, SloAttainment]:
    out: dict[str, SloAttainment] = {}
    given = targets.given
    if not given:
        return out
    all_counted = np.ones(len(w), bool)
    all_met = np.ones(len(w), bool)
    for key, target in given.items():
        vals = m[f"{key}_s"]
        ok = np.isfinite(vals)
        met = ok & (vals <= target)
        n, n_met = float(w[ok].sum()), float(w[met].sum())
        out[key] = SloAttainment(target, round(n), round(n_met), n_met / n if n else None)
        if key == "itl":  # no gap, nothing late: one output token meets the ITL target
            one = m["generation_tokens"] < 2
            all_counted &= ok | one
            all_met &= met | one
        else:
            all_counted &= ok
            all_met &= met
    all_met &= all_counted
    n, n_met = float(w[all_counted].sum()), float(w[all_met].sum())
    out["all"] = SloAttainment(None, round(n), round(n_met), n_met / n if n else None)
    return out


def request_latency(requests: pd.DataFrame, targets: SloTargets | None = None) -> RequestLatency:
    """Percentiles, lengths, finish reasons and SLO attainment of ``requests``."""
    if not len(requests):
        return RequestLatency()
    m = _measures(requests)
    w = _weights(requests)
    kw: dict[str, Any] = {k: Quantiles.of(m[k], w) for k in (*LATENCY_MEASURES, *LENGTH_MEASURES)}
    parts = np.column_stack([m["queue_s"], m["prefill_s"], m["decode_s"], m["e2e_s"]])
    full = np.isfinite(parts).all(axis=1)
    breakdown: dict[str, float | None] = dict.fromkeys(("queue", "prefill", "decode", "other"))
    if full.any():
        mean = np.average(parts[full], axis=0, weights=w[full])
        breakdown = {
            "queue": float(mean[0]),
            "prefill": float(mean[1]),
            "decode": float(mean[2]),
            "other": float(mean[3] - mean[:3].sum()),
        }
    reasons = (
        requests["finish_reason"].astype("string").fillna("unknown")
        if "finish_reason" in requests
        else pd.Series(["unknown"] * len(requests), dtype="string")
    )
    counts = pd.Series(w, index=reasons.index).groupby(reasons.to_numpy()).sum()
    return RequestLatency(
        n_requests=round(float(w.sum())),
        breakdown_mean_s=breakdown,
        finish_reasons={
            str(k): round(float(v)) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])
        },
        slo=_slo(m, w, targets or SloTargets()),
        weighted=bool(np.any(w != 1.0)) or _estimated(requests),
        **kw,
    )


def over_time_bin_s(span_s: float, max_bins: int = 240) -> int:
    """The finest of :data:`BIN_CHOICES_S` giving at most ``max_bins`` bins over ``span_s``."""
    for b in BIN_CHOICES_S:
        if span_s / b <= max_bins:
            return b
    return BIN_CHOICES_S[-1]


def latency_over_time(
    requests: pd.DataFrame,
    bin_s: int | None = None,
    *,
    measures: tuple[str, ...] = ("ttft_s", "itl_s", "e2e_s"),
    max_bins: int = 240,
) -> pd.DataFrame:
    """Percentiles per bin of finish time (UTC-aligned: a bin starts at a multiple of
    ``bin_s``; default :func:`over_time_bin_s`), long format: ``bin_start_unix_s``,
    ``bin_s``, ``measure``, ``n``, ``p50``, ``p90``, ``p99``. Bins without requests are
    absent."""
    cols = ["bin_start_unix_s", "bin_s", "measure", "n", "p50", "p90", "p99"]
    t = _col(requests, "finished_unix_s")
    if not len(requests) or not np.isfinite(t).any():
        return pd.DataFrame(columns=cols)
    if bin_s is None:
        bin_s = over_time_bin_s(float(np.nanmax(t) - np.nanmin(t)), max_bins)
    m, w = _measures(requests), _weights(requests)
    bins = np.floor(t / bin_s) * bin_s
    rows: list[dict[str, Any]] = []
    for b in np.unique(bins[np.isfinite(bins)]):
        sel = bins == b
        for name in measures:
            q = Quantiles.of(m[name][sel], w[sel])
            if q.n:
                rows.append(
                    {
                        "bin_start_unix_s": float(b),
                        "bin_s": int(bin_s),
                        "measure": name,
                        "n": q.n,
                        "p50": q.p50,
                        "p90": q.p90,
                        "p99": q.p99,
                    }
                )
    return pd.DataFrame(rows, columns=cols)


def length_histogram(requests: pd.DataFrame, column: str, n_bins: int = 30) -> pd.DataFrame:
    """Requests per length bin of ``column`` (``prompt_tokens``, ``generation_tokens``):
    ``lo``, ``hi`` (tokens, ``lo <= x < hi``, the last bin closed) and ``n``; at most
    ``n_bins`` equal bins of whole tokens over the range seen."""
    v = _col(requests, column)
    w = _weights(requests)
    ok = np.isfinite(v)
    if not ok.any():
        return pd.DataFrame(columns=["lo", "hi", "n"])
    lo, hi = math.floor(float(v[ok].min())), math.floor(float(v[ok].max())) + 1
    width = max(1, math.ceil((hi - lo) / n_bins))
    edges = np.arange(lo, hi + width, width, dtype=float)
    counts, _ = np.histogram(v[ok], bins=edges, weights=w[ok])
    return pd.DataFrame({"lo": edges[:-1], "hi": edges[1:], "n": np.round(counts).astype(int)})
