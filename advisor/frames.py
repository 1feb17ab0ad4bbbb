"""Shared frame preparation: derived per-window columns and load bins."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from sklearn.isotonic import IsotonicRegression

_NUMERIC = (
    "n_steps",
    "batch_mean",
    "batch_p50",
    "batch_p90",
    "batch_max",
    "waiting_mean",
    "deferred_mean",
    "kv_usage_mean",
    "kv_usage_max",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
    "first_step_unix_s",
    "last_step_unix_s",
    "batch_min",
    "ts_s",
)


def request_weights(requests: pd.DataFrame) -> pd.Series:
    """The requests each row stands for: its ``weight`` (Prometheus's pseudo-requests read
    from histograms, the request tier's rows), 1 where there is none."""
    if "weight" in requests:
        return pd.to_numeric(requests["weight"], errors="coerce").fillna(1.0)
    return pd.Series(1.0, index=requests.index)


def covered_seconds(windows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Every second the windows cover, and the row (position) of the window covering it: a
    1-second window covers its ``ts_s``, one read from the 1-minute tier (``resolution_s``
    60, :mod:`kvscope.advisor.minute_windows`) the 60 from it."""
    ts = pd.to_numeric(windows["ts_s"], errors="coerce").to_numpy(float)
    span = np.ones(len(ts))
    if "resolution_s" in windows:
        res = pd.to_numeric(windows["resolution_s"], errors="coerce").fillna(1.0)
        span = np.maximum(np.round(res.to_numpy(float)), 1.0)
    ok = np.isfinite(ts)
    rows = np.flatnonzero(ok)
    n = span[ok].astype("int64")
    starts = np.repeat(ts[ok].astype("int64"), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return starts + within, np.repeat(rows, n)


def stepped_seconds(windows: pd.DataFrame) -> np.ndarray:
    """Per window, the seconds of stepping it stands for: 1 for a 1-second window, the
    seconds the engine stepped in for one read from the 1-minute tier (its ``n_parts``,
    :func:`kvscope.advisor.minute_windows.windows_from_minutes`), whose counts are rates per
    such second: a sum of counts over windows weighs each by this."""
    out = np.ones(len(windows))
    if "resolution_s" in windows and "n_parts" in windows:
        res = pd.to_numeric(windows["resolution_s"], errors="coerce").fillna(1.0).to_numpy(float)
        parts = pd.to_numeric(windows["n_parts"], errors="coerce").to_numpy(float)
        coarse = (res > 1.0) & np.isfinite(parts)
        out[coarse] = parts[coarse]
    return out


def prepare_windows(windows: pd.DataFrame) -> pd.DataFrame:
    """Add ``load`` (in-flight: running + waiting + deferred), ``gen_tokens_per_s``,
    ``total_tokens_per_s``, ``computed_tokens_per_s``, ``tokens_per_step``, ``steps_per_s`` and ``busy_ratio``
    (the part of the second between the window's first and last step)."""
    w = windows.copy()
    for c in _NUMERIC:
        w[c] = pd.to_numeric(w[c], errors="coerce") if c in w else np.nan
    w["load"] = (
        w["batch_mean"].fillna(0.0) + w["waiting_mean"].fillna(0.0) + w["deferred_mean"].fillna(0.0)
    )
    w["gen_tokens_per_s"] = w["generation_tokens"].fillna(0.0)
    w["total_tokens_per_s"] = w["gen_tokens_per_s"] + w["prompt_tokens"].fillna(0.0)
    # The work the engine did: prompt tokens it computed (prefix-cache hits cost none)
    # and generated tokens.
    w["computed_tokens_per_s"] = w["gen_tokens_per_s"] + (
        w["prompt_tokens"].fillna(0.0) - w["prefix_hits"].fillna(0.0)
    ).clip(lower=0.0)
    steps = w["n_steps"].fillna(0.0)
    w["steps_per_s"] = steps
    w["tokens_per_step"] = (w["total_tokens_per_s"] / steps.where(steps > 0)).astype(float)
    # A window's steps cover [first, last] plus about one step after the last, and the
    # steps that ran across its edges when the engine held requests on both sides of
    # them (vLLM steps back to back while any request runs: a gap there is a step,
    # not idle time, and a long prefill can take most of a second).
    across_start, across_end = _running_across_edges(w)
    w["running_across_start"] = across_start
    start = w["first_step_unix_s"].where(~across_start, w["ts_s"])
    end = w["last_step_unix_s"].where(~across_end, w["ts_s"] + 1.0)
    span = (end - start).clip(lower=0.0)
    w["busy_ratio"] = (span + 1.0 / steps.where(steps > 0)).clip(upper=1.0)
    return w


def _running_across_edges(w: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per window: whether requests ran at every step of it and of the adjacent second
    (of the same engine) before it, and after it (``batch_min`` of at least one)."""
    none = pd.Series(False, index=w.index)
    if w.empty or "ts_s" not in w or w["batch_min"].isna().all():
        return none, none.copy()
    keys = w["engine_id"] if "engine_id" in w else pd.Series(0, index=w.index)
    o = w.assign(_k=keys).sort_values(["_k", "ts_s"])
    running = o["batch_min"].ge(1)
    after_prev = o["_k"].eq(o["_k"].shift()) & o["ts_s"].sub(o["ts_s"].shift()).eq(1)
    before_next = o["_k"].eq(o["_k"].shift(-1)) & o["ts_s"].shift(-1).sub(o["ts_s"]).eq(1)
    start = after_prev & running & running.shift(fill_value=False)
    end = before_next & running & running.shift(-1, fill_value=False)
    return (
        start.reindex(w.index).fillna(False).astype(bool),
        end.reindex(w.index).fillna(False).astype(bool),
    )


def active_windows(
    w: pd.DataFrame, *, min_steps: int, min_load: float, min_busy_ratio: float
) -> pd.DataFrame:
    """Windows the engine worked through: enough steps, some load, busy most of the second
    (``w`` as :func:`prepare_windows` returns it).

    Where the busy share is unknown (windows read from scraped series carry no step
    times) it is estimated from the step count: see :func:`step_count_busy_ratio`."""
    # Few steps in a second the engine ran through (requests running across its start
    # and at every step: long prefills) are long steps, not idle time: kept.
    through = w["running_across_start"] & (w["n_steps"] >= 1)
    keep = ((w["n_steps"] >= min_steps) | through) & (w["load"] >= min_load)
    busy = w["busy_ratio"]
    if busy.isna().any():
        busy = busy.fillna(step_count_busy_ratio(w[keep]).reindex(w.index))
    keep &= busy.isna() | (busy >= min_busy_ratio)
    return w[keep]


def step_count_busy_ratio(
    w: pd.DataFrame, *, per_doubling: int = 2, quantile: float = 0.75, min_peers: int = 3
) -> pd.Series:
    """The busy share of each window estimated from its step count: the steps it holds
    over what its peers (windows of about the same batch: ``per_doubling`` groups per
    factor of two) hold at their ``quantile``, capped at 1.

    An engine running a given batch steps at about the same rate; a window with far
    fewer steps than its peers was idle part of the time (the load ramping up or
    draining away within it), and its per-step means overstate the load it held. NaN
    where fewer than ``min_peers`` windows share the group."""
    steps = w["n_steps"].astype(float)
    batch = w["batch_mean"].astype(float)
    ok = (steps > 0) & (batch > 0)
    group = np.floor(np.log2(batch.where(ok)) * per_doubling)
    keys = [w["engine_id"], group] if "engine_id" in w else [group]
    by = steps.where(ok).groupby(keys, dropna=True)
    ref = by.transform(lambda s: s.quantile(quantile) if s.count() >= min_peers else np.nan)
    return (steps / ref).clip(upper=1.0).where(ok)


def load_bins(load: np.ndarray, *, bins_per_doubling: int, min_count: int) -> np.ndarray:
    """Log-spaced bin edges over ``load`` with every bin holding ``min_count`` values.

    Starts from ``bins_per_doubling`` bins per factor of two, then merges each bin
    short of ``min_count`` into its right neighbour (the last one into its left), so
    bins stay contiguous and sparse load ranges do not make noisy medians.
    """
    load = np.asarray(load, dtype=float)
    lo, hi = float(load.min()), float(load.max())
    if hi <= lo * 1.0001:
        return np.array([lo * 0.999, hi * 1.001])
    n = max(1, math.ceil(math.log2(hi / lo) * bins_per_doubling))
    edges = list(np.geomspace(lo, hi, n + 1))
    edges[0], edges[-1] = lo * 0.999, hi * 1.001
    half = 2.0 ** (0.5 / bins_per_doubling)
    for k in range(1, len(edges) - 1):
        edges[k] = _widest_gap(load, edges[k] / half, edges[k] * half, edges[k])
    while len(edges) > 2:
        counts, _ = np.histogram(load, bins=np.asarray(edges))
        short = [i for i, c in enumerate(counts) if c < min_count]
        if not short:
            break
        i = short[0]
        del edges[i + 1 if i < len(counts) - 1 else i]
    return np.asarray(edges)


def _widest_gap(load: np.ndarray, lo: float, hi: float, default: float) -> float:
    """The middle (geometric) of the widest stretch of ``[lo, hi]`` holding no value of
    ``load``; ``default`` when values fill it."""
    inside = np.sort(load[(load > lo) & (load < hi)])
    points = np.concatenate(([lo], inside, [hi]))
    gaps = np.diff(np.log(points))
    i = int(np.argmax(gaps))
    if gaps[i] <= 0:
        return default
    return float(math.sqrt(points[i] * points[i + 1]))


def level_rate(values: pd.Series | np.ndarray) -> float:
    """The rate a load bin's 1-second counts stand for: their interquartile mean (the mean
    of the middle half; a plain mean under 4 values).

    Neither the median nor the mean: where vLLM preempts, the seconds of one load level
    alternate between a stalled batch and a full one and a median picks one of the two;
    the first second of a closed-loop level (every new request prefilling at once) and the
    last (clients already gone) are not the level at all and drag a mean down. The middle
    half keeps both kinds out. See docs/advise.md#the-throughput-curve-and-the-knee."""
    x = np.asarray(values, dtype=float)
    x = np.sort(x[np.isfinite(x)])
    if not len(x):
        return math.nan
    # scipy.stats.trim_mean(x, 0.25), without its per-call overhead: the bootstrap of the
    # concurrency cap calls this thousands of times per analysis.
    cut = int(0.25 * len(x))
    return float(x[cut : len(x) - cut].mean())


def isotonic_increasing(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of ``y`` in its order.

    scikit-learn's :class:`~sklearn.isotonic.IsotonicRegression` (pool adjacent
    violators): the maintained implementation of exactly this fit, with sample weights
    (the windows behind each load bin)."""
    y = np.asarray(y, float)
    if len(y) < 2:
        return y.copy()
    w = np.asarray(weights, float)
    if len(y) > _SMALL_FIT or not (np.all(np.isfinite(y)) and np.all(w > 0)):
        x = np.arange(len(y), dtype=float)
        model = IsotonicRegression(increasing=True, out_of_bounds="clip")
        return np.asarray(model.fit(x, y, sample_weight=w).predict(x), float)
    return _pool_adjacent_violators(y, w)


_SMALL_FIT = 256
"""Up to this many points (a curve's load bins) :func:`isotonic_increasing` pools the
violators itself: scikit-learn's input checks cost about a millisecond a call, and the
cap's bootstrap refits the bins hundreds of times per engine."""


def _pool_adjacent_violators(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted non-decreasing least-squares fit (pool adjacent violators), the fit
    :class:`~sklearn.isotonic.IsotonicRegression` makes, for positive weights."""
    means: list[float] = []
    sizes: list[float] = []
    counts: list[int] = []
    for v, wt in zip(y.tolist(), w.tolist(), strict=True):
        means.append(v)
        sizes.append(wt)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m, s, c = means.pop(), sizes.pop(), counts.pop()
            total = sizes[-1] + s
            means[-1] = (means[-1] * sizes[-1] + m * s) / total
            sizes[-1] = total
            counts[-1] += c
    return np.repeat(np.array(means, float), counts)


def interp_crossing(x: np.ndarray, y: np.ndarray, level: float) -> float:
    """Smallest x where the piecewise-linear y(x) (non-decreasing) reaches ``level``."""
    if y[0] >= level:
        return float(x[0])
    for i in range(1, len(x)):
        if y[i] >= level:
            dy = y[i] - y[i - 1]
            t = 1.0 if dy <= 0 else (level - y[i - 1]) / dy
            return float(x[i - 1] + t * (x[i] - x[i - 1]))
    return float(x[-1])


def frame_of(df: pd.DataFrame, cols: list[str]) -> dict[str, list[object]]:
    """A JSON-friendly dict of columns (NaN as None)."""
    out: dict[str, list[object]] = {}
    for c in cols:
        vals = df[c].tolist() if c in df else []
        out[c] = [None if isinstance(v, float) and not math.isfinite(v) else v for v in vals]
    return out
