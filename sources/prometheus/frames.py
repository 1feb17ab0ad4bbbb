"""Pure helpers of :mod:`kvscope.sources.prometheus.source`: scrape-resolution series into the frames
the analyses read (windows, pseudo-requests from histograms, inferred configuration).

No I/O: every function takes plain arrays or DataFrames.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvscope.advisor.request_tier import cumulative_round, quantiles_from_buckets

__all__ = [
    "HISTOGRAM_COLUMNS",
    "bucket_quantile",
    "confidence_factor",
    "cumulative_round",
    "footprint_tokens",
    "increases",
    "infer_max_num_seqs",
    "pseudo_requests",
    "quantiles_from_buckets",
    "spread_reasons",
]

REASON_ORDER = ("length", "stop")
"""Which reasons go to the longest outputs first (see :func:`spread_reasons`)."""

#: Request column <- histogram role (vLLM's per-request histograms).
HISTOGRAM_COLUMNS: dict[str, str] = {
    "e2e_s": "e2e",
    "ttft_s": "ttft",
    "queue_s": "queue",
    "prefill_s": "prefill",
    "decode_s": "decode",
    "generation_tokens": "request_generation_tokens",
}


def pseudo_requests(
    engine_id: str,
    ts: np.ndarray,
    counts: np.ndarray,
    buckets: dict[str, tuple[np.ndarray, np.ndarray]],
    means: dict[str, np.ndarray],
    *,
    scale: float,
    prompt_tokens: np.ndarray,
    cached_share: float,
    reasons: tuple[list[str], np.ndarray] | None = None,
) -> pd.DataFrame:
    """Rows standing for the requests that finished in each window.

    ``ts`` are the windows' start seconds; ``counts`` the requests finished per window;
    ``buckets[role]`` the per-window cumulative bucket counts (windows x buckets) with
    the bucket bounds; ``means[role]`` per-window means from ``_sum / _count`` (used to
    rescale the token histograms, whose 1-2-5 buckets are too coarse for a mean).
    ``scale`` (<= 1) thins the rows when there are too many; each row then stands for
    ``1 / scale`` requests (column ``weight``). Each marginal is spread over its
    histogram and the columns are paired by rank (comonotonic): the joint distribution
    is not in the metrics, only each column's distribution per window is. ``reasons``:
    the finish reasons' names and their per-window increases (windows x reasons, vLLM's
    ``request_success`` by ``finished_reason``), spread over each window's rows by
    :func:`spread_reasons`; without them every row's reason is ``unknown``.
    """
    n_rows = cumulative_round(np.asarray(counts, float) * scale)
    parts: list[pd.DataFrame] = []
    for i in np.flatnonzero(n_rows > 0):
        n = int(n_rows[i])
        row: dict[str, object] = {"finished_unix_s": np.full(n, float(ts[i]) + 0.5)}
        for col, role in HISTOGRAM_COLUMNS.items():
            if role not in buckets:
                row[col] = np.full(n, math.nan)
                continue
            les, cum = buckets[role]
            vals = quantiles_from_buckets(les, cum[i], n)
            mean = means.get(role)
            if mean is not None and math.isfinite(mean[i]) and np.nanmean(vals) > 0:
                vals = vals * (mean[i] / np.nanmean(vals))
            row[col] = vals
        p = float(prompt_tokens[i]) if math.isfinite(prompt_tokens[i]) else math.nan
        row["prompt_tokens"] = np.full(n, p)
        row["cached_tokens"] = np.full(n, p * cached_share if math.isfinite(p) else math.nan)
        gen = np.asarray(row["generation_tokens"], float)
        row["finish_reason"] = (
            spread_reasons(reasons[0], reasons[1][i], gen)
            if reasons is not None
            else np.full(n, "unknown", dtype=object)
        )
        parts.append(pd.DataFrame(row))
    if not parts:
        return pd.DataFrame()
    out = pd.concat(parts, ignore_index=True)
    out["generation_tokens"] = out["generation_tokens"].round()
    out["prompt_tokens"] = out["prompt_tokens"].round()
    out["cached_tokens"] = out["cached_tokens"].round()
    out["preemptions"] = math.nan
    out["engine_id"] = engine_id
    out["weight"] = 1.0 / scale
    return out


def spread_reasons(
    names: list[str], counts: np.ndarray, generation_tokens: np.ndarray
) -> np.ndarray:
    """One finish reason per row of a window, in the shares of that window's ``counts``.

    The rows' reasons are not in the metrics, only how many requests finished for each
    (vLLM's ``request_success`` counter by ``finished_reason``). The shares are rounded to
    the window's rows (largest remainder); ``length`` (the output reached ``max_tokens``)
    goes to the rows with the longest outputs, then ``stop``, then the rest by name. A
    window with no counted reason gives ``unknown``.
    """
    n = len(generation_tokens)
    c = np.nan_to_num(np.asarray(counts, float), nan=0.0).clip(min=0.0)
    out = np.full(n, "unknown", dtype=object)
    if n == 0 or not c.sum() > 0:
        return out
    order = sorted(
        range(len(names)),
        key=lambda k: (REASON_ORDER.index(names[k]) if names[k] in REASON_ORDER else 9, names[k]),
    )
    share = c[order] / c.sum() * n
    take = np.floor(share).astype(int)
    rest = n - int(take.sum())
    if rest > 0:
        take[np.argsort(-(share - take), kind="stable")[:rest]] += 1
    rows = np.argsort(-np.nan_to_num(np.asarray(generation_tokens, float), nan=-1.0), kind="stable")
    at = 0
    for k, m in zip(order, take, strict=True):
        out[rows[at : at + m]] = names[k]
        at += m
    return out


def infer_max_num_seqs(
    running_max: np.ndarray,
    waiting: np.ndarray,
    kv_usage: np.ndarray,
    preemptions: np.ndarray | None = None,
    *,
    min_windows: int = 5,
    min_share: float = 0.6,
    kv_full: float = 0.9,
) -> int | None:
    """``max_num_seqs`` read off the data when vLLM does not expose it.

    vLLM publishes its cache configuration (``vllm:cache_config_info``) but not the
    scheduler's. When requests waited (``waiting >= 0.5``) in at least ``min_windows``
    windows and, in at least ``min_share`` of them, the batch stood at its highest value
    ``m`` with the KV cache below ``kv_full`` and no preemption (vLLM preempts only when
    the cache runs out, which a gauge sampled between steps can miss), the scheduler's
    cap held it: ``m``. Otherwise None (a KV-bound batch varies below the cap, an
    unloaded one never waits).
    """
    r = np.asarray(running_max, float)
    w = np.asarray(waiting, float)
    kv = np.asarray(kv_usage, float)
    ok = np.isfinite(r) & np.isfinite(w)
    if not ok.any():
        return None
    m = float(np.nanmax(r[ok]))
    queued = ok & (w >= 0.5)
    if m < 1 or queued.sum() < min_windows:
        return None
    calm = (
        np.ones(len(r), bool)
        if preemptions is None
        else ~(np.nan_to_num(np.asarray(preemptions, float), nan=0.0) > 0)
    )
    pinned = queued & (r >= m - 1e-9) & (~np.isfinite(kv) | (kv < kv_full)) & calm
    return round(m) if pinned.sum() >= min_share * queued.sum() else None


def confidence_factor(resolution_s: float, *, per_step_means: bool) -> float:
    """How much of the per-step path's confidence a scrape-resolution read keeps.

    ``1 / (1 + 0.5 log2(r))`` for windows of ``r`` seconds (1 s: 1, 4 s: 0.5, 15 s: 0.34,
    60 s: 0.25): a window averages ``r`` seconds, so load changes faster than that blur
    the throughput-against-load curve. Times 0.9 for vLLM's own series, whose queue and
    KV usage are gauges sampled once per scrape and whose latencies are bucket
    estimates. kvscope's series carry means over every step; at short steps their
    increases are averaged over two steps (the collector's counters move once per plugin
    batch), so for them ``r`` counts from 2 s: ``1 / (1 + 0.5 log2(r / 2))``. Never below
    0.2.
    """
    r = max(1.0, float(resolution_s) / (2.0 if per_step_means else 1.0))
    f = 1.0 / (1.0 + 0.5 * math.log2(r))
    if not per_step_means:
        f *= 0.9
    return round(max(0.2, f), 3)


def increases(values: np.ndarray) -> np.ndarray:
    """Per-interval increases of a counter sampled at consecutive points (``n + 1`` values
    give ``n`` increases). A drop is a reset (the process restarted): the increase is
    the new value, as Prometheus' ``increase()`` counts it. After a missing point the
    increase is unknown (NaN) rather than the whole gap's."""
    v = np.asarray(values, float)
    d = np.diff(v)
    return np.where(d < 0, v[1:], d)


def late_groups(
    steps: np.ndarray, marks: np.ndarray, points: np.ndarray, max_gap: int, peers: int = 5
) -> np.ndarray:
    """Per interval of a collector's counter increases (``steps``, its step counter's,
    between consecutive ``points``), a group: the intervals whose steps reached the
    collector late share one; every other interval is its own.

    A collector's counters move when the plugin's batches reach it: after it was
    unreachable (or the plugin's sends were delayed) the steps of those seconds arrive
    together, and the intervals that got them hold the steps of the ones before, which
    read as idle. The late batches arrive one after another, and a scrape can fall
    among them. Its ``kvscope_engine_last_step_timestamp_seconds`` (``marks``, at the
    ``points``) tells how far behind each scrape was: an interval is *behind* when its
    end's lag (point minus mark) exceeds the usual lag (the median over the intervals
    with steps) by half an interval. A run of behind intervals and the one that caught
    up after it make an episode; its last ``k`` intervals share its steps, ``k`` the
    episode's steps over the median increase of the ``peers`` intervals with steps
    nearest after it (before it where none follow), at most the episode and
    ``max_gap`` long. An engine that idled (its marks stood still too) and resumed holds
    no more than its peers: ``k`` is 1 and its idle intervals stay idle.
    :func:`spread_over_groups` puts each group's increase back over its intervals. An
    unknown increase or mark ends an episode."""
    d = np.asarray(steps, float)
    m = np.asarray(marks, float)
    p = np.asarray(points, float)
    n = len(d)
    if len(m) != n + 1 or len(p) != n + 1:
        raise ValueError(f"{n} increases need {n + 1} marks and points")
    out = np.arange(n)
    lag = p[1:] - m[1:]
    advance = np.diff(m)
    moved = np.isfinite(d) & (d > 0)
    usual = lag[moved & np.isfinite(lag)]
    if not len(usual):
        return out
    width = float(np.median(np.diff(p)))
    behind = np.isfinite(lag) & (lag > float(np.quantile(usual, 0.25)) + 0.5 * width)
    known = np.isfinite(d) & np.isfinite(lag)
    timed = np.flatnonzero(moved & np.isfinite(advance) & (advance > 0))
    i = 0
    while i < n:
        if not (behind[i] and known[i]):
            i += 1
            continue
        first = i
        while i < n and behind[i] and known[i]:
            i += 1
        if i >= n or not known[i]:  # no catching up seen: leave it
            continue
        last = i  # the interval that caught up
        after = timed[timed > last][:peers]
        ref_at = after if len(after) else timed[timed < first][-peers:]
        # steps per interval at the peers' pace: their steps over the step time they span
        span = float(advance[ref_at].sum()) if len(ref_at) else 0.0
        ref = float(d[ref_at].sum()) / span * width if span > 0 else math.nan
        total = float(d[first : last + 1].sum())
        if ref > 0 and total > 0:
            k = min(last - first + 1, max_gap + 1, round(total / ref))
            if k > 1:
                out[last - k + 1 : last + 1] = last
        i = last + 1
    return out


def spread_over_groups(d: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``d`` with each group's (:func:`late_groups`) total shared equally by its intervals;
    NaN in a group stays where it is."""
    d = np.asarray(d, float)
    total = np.bincount(groups, weights=np.nan_to_num(d), minlength=len(d))
    size = np.bincount(groups, minlength=len(d))
    spread = total[groups] / size[groups]
    return np.where(np.isfinite(d) & (size[groups] > 1), spread, d)


#: Window columns that count events per second (beside ``n_steps``).
WINDOW_COUNTS = (
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
)


def kvscope_windows(
    c: dict[str, np.ndarray],
    grid: np.ndarray,
    step: float,
    batch_buckets: tuple[np.ndarray, np.ndarray] | None = None,
    kv_buckets: tuple[np.ndarray, np.ndarray] | None = None,
) -> pd.DataFrame:
    """One engine's windows (the collector's ``windows_1s`` columns) from a collector's
    series on the ``grid``: ``c`` holds each counter's increase per window (``batch:sum``,
    ``batch:count``, ``n_steps``, the token counts, ...; the queue sums, else the
    ``waiting_mean`` / ``deferred_mean`` gauges), the buckets the step histograms'
    bounds and per-window counts. The batch, KV usage and queue are per-step means."""
    n = len(grid)
    nan = np.full(n, math.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        batch = c["batch:sum"] / c["batch:count"]
        kv = c.get("kv:sum", nan) / c.get("kv:count", nan)
        # The queue per step over the window, as the batch; the latest step's gauge from
        # a collector that does not export the sums.
        queue = {
            k: np.where(
                np.isfinite(m := c.get(f"{k}:sum", nan) / c["batch:count"]),
                m,
                c.get(f"{k}_mean", np.zeros(n)),
            )
            for k in ("waiting", "deferred")
        }
    w = pd.DataFrame(
        {
            "ts_s": (grid - step).astype("int64"),
            "batch_mean": batch,
            "batch_p50": batch,
            "batch_p90": bucket_quantile(*batch_buckets, 0.9) if batch_buckets else nan,
            "batch_max": bucket_quantile(*batch_buckets, 1.0) if batch_buckets else nan,
            "kv_usage_mean": kv,
            "kv_usage_max": bucket_quantile(*kv_buckets, 0.99) if kv_buckets else nan,
            "waiting_mean": queue["waiting"],
            "deferred_mean": queue["deferred"],
            **{k: c.get(k, nan) / step for k in ("n_steps", *WINDOW_COUNTS)},
            "first_step_unix_s": nan,
            "last_step_unix_s": nan,
        }
    )
    w["batch_sum"] = w["batch_mean"] * w["n_steps"]
    return w


def bucket_quantile(les: np.ndarray, cumulative: np.ndarray, q: float) -> np.ndarray:
    """``histogram_quantile(q)`` per row of cumulative bucket counts (rows x buckets)."""
    out = np.full(len(cumulative), math.nan)
    for i, row in enumerate(cumulative):
        if np.isfinite(row).all() and row[-1] > 0:
            out[i] = _one_quantile(np.asarray(les, float), np.maximum.accumulate(row), q)
    return out


def _one_quantile(les: np.ndarray, cum: np.ndarray, q: float) -> float:
    rank = q * cum[-1]
    b = int(min(np.searchsorted(cum, rank, side="left"), len(cum) - 1))
    lo = les[b - 1] if b > 0 else 0.0
    hi = les[b]
    prev = cum[b - 1] if b > 0 else 0.0
    if not math.isfinite(hi):
        return float(lo)
    span = cum[b] - prev
    return float(lo + (hi - lo) * ((rank - prev) / span if span > 0 else 1.0))


def footprint_tokens(requests: pd.DataFrame, block_size: float) -> float:
    """Tokens a request holds on average while in the batch, length-biased:
    ``sum(g (p - c + g/2)) / sum(g) + block/2`` (as :class:`~kvscope.advisor.capacity.KvCapacityModel`)."""
    if not len(requests):
        return math.nan
    p = pd.to_numeric(requests["prompt_tokens"], errors="coerce").to_numpy(float)
    g = pd.to_numeric(requests["generation_tokens"], errors="coerce").to_numpy(float)
    c = pd.to_numeric(requests["cached_tokens"], errors="coerce").fillna(0).to_numpy(float)
    ok = np.isfinite(p) & np.isfinite(g)
    if not ok.any():
        return math.nan
    w = np.maximum(g[ok], 1.0)
    held = np.maximum(p[ok] - c[ok], 0.0) + g[ok] / 2.0
    return float(np.average(held, weights=w) + block_size / 2.0)
