"""Finished requests past the collector's request retention, from its request tier.

The collector keeps one row per finished request for ``--request-retention`` and, per engine
and minute, cumulative histograms of the same requests for months (``requests_1m``).
:func:`requests_from_tier` turns such rows back into rows that stand for requests, so every
analysis of finished requests runs unchanged over a range longer than the retention:

* each measure's values are spread over its buckets as ``histogram_quantile`` interpolates
  (:func:`quantiles_from_buckets`), each inside its own bucket, so the share at or under a
  bucket bound (an SLO target) is exact;
* the measures are paired by rank (the tier keeps distributions, not pairs): attainment of
  every target at once is an estimate, of each target alone it is not;
* lengths are rescaled to the tier's exact means, latencies are not; past
  ``max_rows_per_engine`` rows are thinned and carry a ``weight``.

Every such row has ``estimated`` true. Pure: no I/O.

See docs/collector.md#the-request-tier.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

__all__ = [
    "MAX_TIER_ROWS_PER_ENGINE",
    "TIER_MEASURES",
    "cumulative_round",
    "quantiles_from_buckets",
    "requests_from_tier",
    "tier_buckets",
]

MAX_TIER_ROWS_PER_ENGINE = 20_000
"""Rows standing for one engine's requests of the tier, at most (then weighted)."""
TIER_MEASURES = (
    "ttft_s",
    "itl_s",
    "e2e_s",
    "queue_s",
    "prefill_s",
    "decode_s",
    "prompt_tokens",
    "generation_tokens",
)
_LENGTHS = ("prompt_tokens", "generation_tokens")
_REASONS = ("stop", "length", "abort", "error", "other")
_BUCKET = re.compile(r"(\w+)\{le=([^}]+)\}")


def cumulative_round(x: np.ndarray) -> np.ndarray:
    """Non-negative reals to integers whose running sums stay within 0.5 of the reals'."""
    c = np.round(np.cumsum(np.clip(np.nan_to_num(np.asarray(x, float)), 0.0, None)))
    return np.diff(np.concatenate([[0.0], c])).astype(int)


def quantiles_from_buckets(les: np.ndarray, cumulative: np.ndarray, n: int) -> np.ndarray:
    """``n`` values spread over a histogram: the quantiles ``(i + 0.5) / n``.

    ``les`` are the upper bounds (ascending, the last may be +Inf), ``cumulative`` the
    cumulative counts (may be fractional: rates times the window). Within a bucket the
    values are interpolated linearly, as ``histogram_quantile`` does; the first bucket
    starts at 0; values falling in the +Inf bucket get the highest finite bound.
    """
    les = np.asarray(les, float)
    cum = np.maximum.accumulate(np.clip(np.nan_to_num(np.asarray(cumulative, float)), 0, None))
    total = float(cum[-1]) if len(cum) else 0.0
    if n <= 0 or total <= 0:
        return np.full(max(n, 0), math.nan)
    rank = (np.arange(n) + 0.5) / n * total
    b = np.clip(np.searchsorted(cum, rank, side="left"), 0, len(cum) - 1)
    lower = np.concatenate([[0.0], les[:-1]])
    prev = np.concatenate([[0.0], cum[:-1]])
    finite = les[np.isfinite(les)]
    top = float(finite.max()) if len(finite) else math.nan
    lo, hi = lower[b], les[b]
    span = cum[b] - prev[b]
    frac = np.where(span > 0, (rank - prev[b]) / np.where(span > 0, span, 1.0), 0.5)
    out = np.where(np.isfinite(hi), lo + (hi - lo) * frac, np.maximum(lo, top))
    return np.asarray(out, float)


def tier_buckets(frame: pd.DataFrame) -> dict[str, tuple[np.ndarray, list[str]]]:
    """measure -> (its bucket bounds ascending, +Inf last; their column names) for the
    bucket columns of a tier frame (``ttft_s{le=0.5}``)."""
    found: dict[str, list[tuple[float, str]]] = {}
    for c in frame.columns:
        m = _BUCKET.fullmatch(str(c))
        if m is not None:
            le = math.inf if m.group(2) == "+Inf" else float(m.group(2))
            found.setdefault(m.group(1), []).append((le, str(c)))
    return {
        k: (np.array([le for le, _ in sorted(v)]), [c for _, c in sorted(v)])
        for k, v in found.items()
    }


def _num(frame: pd.DataFrame, col: str) -> np.ndarray:
    if col not in frame:
        return np.full(len(frame), math.nan)
    return pd.to_numeric(frame[col], errors="coerce").to_numpy(float)


def _engine_rows(eid: str, g: pd.DataFrame, buckets: dict, max_rows: int) -> pd.DataFrame:
    counts = np.nan_to_num(_num(g, "n_requests"))
    total = float(counts.sum())
    if total <= 0:
        return pd.DataFrame()
    scale = min(1.0, max_rows / total)
    n_rows = cumulative_round(counts * scale)
    ts = _num(g, "ts_s")
    step = _num(g, "step_s") if "step_s" in g else np.full(len(g), 60.0)
    # the minutes a row sums (a tier read before these columns: the whole step)
    lo = np.where(np.isfinite(first := _num(g, "first_minute_s")), first, ts)
    hi = np.where(
        np.isfinite(end := _num(g, "end_minute_s")), end, ts + np.nan_to_num(step, nan=60.0)
    )
    cum = {
        m: g[cols].apply(pd.to_numeric, errors="coerce").to_numpy(float)
        for m, (_, cols) in buckets.items()
    }
    sums = {
        m: np.nan_to_num(_num(g, f"{m}_sum")) for m in (*_LENGTHS, "cached_tokens", "preemptions")
    }
    reason_counts = np.column_stack([np.nan_to_num(_num(g, f"n_{r}")) for r in _REASONS])
    parts: list[pd.DataFrame] = []
    for i in np.flatnonzero(n_rows > 0):
        n, c = int(n_rows[i]), float(counts[i])
        # spread evenly over the minutes the row sums: a range split inside a step (a
        # week's boundary) divides its requests as the minutes do
        row: dict[str, object] = {
            "finished_unix_s": lo[i] + (np.arange(n) + 0.5) * (hi[i] - lo[i]) / n
        }
        for m in TIER_MEASURES:
            vals = np.full(n, math.nan)
            if m in buckets:
                les, _ = buckets[m]
                have = float(np.nan_to_num(cum[m][i][-1]))
                k = min(n, round(n * have / c)) if c > 0 else 0
                v = quantiles_from_buckets(les, cum[m][i], k)
                if m in _LENGTHS and k:
                    exact = float(sums[m][i]) / have if have else math.nan
                    if math.isfinite(exact) and np.nanmean(v) > 0:
                        v = v * (exact / float(np.nanmean(v)))
                # Requests without an ITL had one output token: the shortest outputs,
                # the first ranks; the other measures' missing values go last.
                if m == "itl_s":
                    vals[n - k :] = v
                else:
                    vals[:k] = v
            row[m] = vals
        prompt_sum = float(sums["prompt_tokens"][i])
        cached_share = float(sums["cached_tokens"][i]) / prompt_sum if prompt_sum > 0 else 0.0
        row["cached_tokens"] = np.round(np.asarray(row["prompt_tokens"], float) * cached_share)
        row["preemptions"] = np.full(n, float(sums["preemptions"][i]) / c)
        reasons = reason_counts[i]
        per = (
            cumulative_round(reasons * n / reasons.sum())
            if reasons.sum() > 0
            else np.zeros(len(_REASONS), int)
        )
        labels = np.repeat(np.array(_REASONS, dtype=object), per)[:n]
        row["finish_reason"] = np.concatenate(
            [labels, np.full(n - len(labels), "other", dtype=object)]
        )
        parts.append(pd.DataFrame(row))
    out = pd.concat(parts, ignore_index=True)
    for m in _LENGTHS:
        out[m] = out[m].round()
    out["engine_id"] = eid
    out["boot_id"] = None
    for col in ("pool", "model"):
        if col in g:
            out[col] = g[col].iloc[0]
    out["weight"] = total / float(n_rows.sum()) if n_rows.sum() else 1.0
    out["estimated"] = True
    return out


def requests_from_tier(
    tier: pd.DataFrame, max_rows_per_engine: int = MAX_TIER_ROWS_PER_ENGINE
) -> pd.DataFrame:
    """Rows standing for the requests the tier's rows count (see the module docstring);
    empty for an empty tier."""
    if not len(tier) or "engine_id" not in tier:
        return pd.DataFrame()
    buckets = tier_buckets(tier)
    frames = [
        _engine_rows(str(eid), g.sort_values("ts_s"), buckets, max_rows_per_engine)
        for eid, g in tier.groupby("engine_id", sort=True)
    ]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def tier_step_s(since: float | None, until: float | None, max_steps: int = 240) -> int:
    """Seconds per row to read the tier at: whole minutes, at most ``max_steps`` rows per
    engine over ``[since, until)`` (the bins of the latency-over-time charts)."""
    from kvscope.advisor.request_latency import over_time_bin_s

    if since is None or until is None or not until > since:
        return 3600
    return max(60, over_time_bin_s(until - since, max_steps))


def with_tier(raw: pd.DataFrame, tier: pd.DataFrame) -> pd.DataFrame:
    """``raw`` request rows and the rows standing for the tier's (older) requests, oldest
    first; ``raw`` itself when the tier holds none."""
    older = requests_from_tier(tier)
    if not len(older):
        return raw
    if not len(raw):
        return older
    return pd.concat([older, raw], ignore_index=True)
