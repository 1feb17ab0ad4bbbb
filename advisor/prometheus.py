"""The advisor over a Prometheus-compatible query API: vLLM's own ``/metrics``, scraped.

:class:`PrometheusSource` implements :class:`~advisor.sources.Source` over the HTTP
API of Prometheus, Thanos, Mimir or VictoriaMetrics, so the same analyses run on the
series a fleet already stores, with nothing installed in the engines.

Engines and pools
-----------------
An engine is one ``(instance, pod, engine)`` label combination of
``vllm:num_requests_running`` (``engine`` is vLLM's data-parallel index); its id is
``instance:engine``, like the plugin's ``host:port:index``. Its pool is the value of
``pool_label`` (default ``model_name``: replicas serving one model; ``namespace`` or
``job`` are the usual alternatives). A kvscope collector's own series
(``kvscope_engine_*``, labels ``engine``, ``pool``, ``model``) are read too, so several
collectors behind one Prometheus form one fleet: their engines keep their kvscope id
and pool (``pool_label`` applies when given), and when a kvscope engine id equals a
vLLM engine id the kvscope series supply the windows and vLLM's histograms the
requests. ``series="vllm"`` or ``"kvscope"`` reads only one kind.

Names across vLLM versions
--------------------------
Which names the fleet exposes is asked first (``/api/v1/label/__name__/values`` with
the selector over the time range); each quantity uses every known name of it that is
present (:data:`advisor.vllm_metrics.ROLES`, e.g. ``vllm:kv_cache_usage_perc`` and the
older ``vllm:gpu_cache_usage_perc``), so a fleet in the middle of an upgrade reads whole.

Windows at scrape resolution
----------------------------
The resolution ``step`` is the scrape interval (the median gap of the raw samples of
the running gauge), never finer (a finer step repeats samples), coarser when the range
would exceed ``max_windows`` windows per engine. Window ``k`` covers
``(t_k - step, t_k]`` and its ``ts_s`` is ``t_k - step``; its values are per second
(rates), as the analyses expect of 1-second windows:

* at ``step`` equal to the scrape interval, the gauges (running, waiting, KV usage) are
  the scraped value and the counters ``irate``: the increase since the previous scrape,
  exact, counter resets handled by the backend;
* at coarser steps, gauges are ``avg_over_time`` (``max_over_time`` for the maxima)
  and counters ``rate`` over ``step`` plus one scrape interval;
* ``n_steps`` is the rate of ``vllm:iteration_tokens_total_count`` (one observation
  per engine step); ``busy_ratio`` is unknown (the first/last step times are not
  exported); ``waiting_mean`` is ``vllm:num_requests_waiting`` (which includes the
  deferred requests) and ``deferred_mean`` 0.

From kvscope's series the batch and KV usage are exact means over every step in the
window (``rate(_sum) / rate(_count)`` of the per-step histograms).

Requests from histograms
------------------------
The analyses read finished requests. vLLM exports only histograms of them, so each
window gets *pseudo-requests*: as many rows as requests finished in it (the increase
of ``vllm:e2e_request_latency_seconds_count``), each column's values spread over that
window's histogram at the quantiles ``(i + 0.5) / n`` (linear within a bucket, as
``histogram_quantile``), columns paired by rank. Per-window percentiles are therefore
bucket estimates and the joint distribution is assumed comonotonic. Generated tokens
are rescaled to the window's exact mean (``_sum / _count``), prompt tokens are the
window's mean, cached tokens the prompt times the engine's prefix hit rate. Rows are
placed half a second into their window; past ``max_requests`` rows in all, each row
stands for several requests (column ``weight``).

What the resolution costs
-------------------------
:func:`annotate_report` (called by :func:`analyze_prometheus`) scales every confidence
by :func:`~advisor._promframes.confidence_factor` and adds a ``scrape_resolution``
finding and ``coverage`` fields (``source``, ``resolution_s``, ``scrape_interval_s``,
``confidence_factor``, ``metric_names``, ``requests_from_histograms``).
``max_num_seqs`` is not exported by vLLM: it is inferred where the batch was pinned
(:func:`~advisor._promframes.infer_max_num_seqs`), else unknown, so a sequence cap that
never bound reads as no cap; ``max_num_batched_tokens`` is unknown (no
``token_budget_bound`` verdict from vLLM's series alone).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from advisor._promapi import PromClient
from advisor._promframes import (
    HISTOGRAM_COLUMNS,
    bucket_quantile,
    confidence_factor,
    footprint_tokens,
    increases,
    infer_max_num_seqs,
    pseudo_requests,
)
from advisor._promql import matchers_of_selector, with_matchers
from advisor.analyze import analyze
from advisor.findings import Finding, Report, Scope
from advisor.sources import SourceError
from advisor.vllm_metrics import HISTOGRAM, ROLES, wire_names

__all__ = ["PrometheusSource", "analyze_prometheus", "annotate_report"]

_VLLM_KEYS = ("instance", "pod", "engine")
_KV = "kvscope_engine_"
_KV_PROBE = "kvscope_engine_steps_total"
KVSCOPE_SMOOTH_STEPS = 2
"""Windows a kvscope counter increase is averaged over at short steps (see _read_kvscope)."""
_INT_CFG = ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
            "data_parallel_size")


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def _bool(v: Any) -> bool | None:
    s = str(v).strip().lower()
    return True if s == "true" else False if s == "false" else None


@dataclass
class _Fetch:
    """Everything read for one time range."""

    since: float
    until: float
    names: set[str]
    vllm: dict[str, list[str]] = field(default_factory=dict)
    kvscope: bool = False
    step_s: int = 0
    kv_step_s: int = 0
    scrape_s: float = math.nan
    fine: bool = True
    windows: pd.DataFrame = field(default_factory=pd.DataFrame)
    requests: pd.DataFrame = field(default_factory=pd.DataFrame)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    request_scale: float = 1.0
    inferred: dict[str, int] = field(default_factory=dict)


class PrometheusSource:
    """A :class:`~advisor.sources.Source` reading vLLM's (and kvscope's) series from a
    Prometheus-compatible query API (see the module docstring).

    ``selector`` (``{namespace="prod"}``) is added to every query; ``pool_label`` names
    the label that groups replicas into pools; ``step`` forces the resolution in
    seconds; ``lookback_s`` is how far back :meth:`engines` looks when no time range
    was read yet; ``default_range_s`` the range when ``since`` is None.
    """

    def __init__(self, url: str, selector: str | None = None, pool_label: str | None = None,
                 step: float | None = None, *, timeout_s: float = 30.0,
                 lookback_s: float = 7 * 86400.0, default_range_s: float = 1800.0,
                 series: str = "auto", max_windows: int = 20_000, max_requests: int = 200_000,
                 headers: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if series not in ("auto", "vllm", "kvscope"):
            raise ValueError(f"series must be auto, vllm or kvscope, not {series!r}")
        if step is not None and step < 1:
            raise ValueError(f"step must be at least 1 s, got {step}")
        self.url = url.rstrip("/")
        self.selector = selector or ""
        self.inner = matchers_of_selector(selector)
        self.pool_label = pool_label
        self.step = step
        self.lookback_s = lookback_s
        self.default_range_s = default_range_s
        self.series = series
        self.max_windows = max_windows
        self.max_requests = max_requests
        self.clock = clock
        self.client = PromClient(self.url, timeout_s=timeout_s, headers=headers)
        self._fetches: dict[tuple[float | None, float | None], _Fetch] = {}
        self.last_fetch: _Fetch | None = None

    # -- what the fleet exposes --------------------------------------------------------

    def names_tried(self) -> list[str]:
        """The names whose presence makes an engine (for error messages)."""
        out = [] if self.series == "kvscope" else list(ROLES["running"].names)
        return out + ([] if self.series == "vllm" else [_KV_PROBE])

    def exposed_names(self, since: float, until: float) -> set[str]:
        """``vllm:*`` and ``kvscope_engine_*`` sample names stored over the range."""
        match = with_matchers("", self.inner, f'__name__=~"vllm:.+|{_KV}.+"')
        try:
            return set(self.client.label_values("__name__", match, since, until))
        except SourceError as e:
            if e.status is None or e.status >= 500:
                raise
        # Backends without match[] on label values: the series present at `until`.
        got = self.client.query(f"count by (__name__) ({match})", until)
        return {lab.get("__name__", "") for lab, _ in got} - {""}

    def _roles(self, names: set[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for role in ROLES.values():
            fams = [f for f in role.names
                    if (wire_names(f, role.kind)[-1] if role.kind == HISTOGRAM
                        else wire_names(f, role.kind)[0]) in names]
            if fams:
                out[role.key] = fams
        return out

    # -- query building ----------------------------------------------------------------

    def _sel(self, fams: list[str], kind: str, suffix: str = "") -> str:
        wires = [(f + suffix) if kind == HISTOGRAM else wire_names(f, kind)[0] for f in fams]
        if len(wires) == 1:
            return with_matchers(wires[0], self.inner)
        alt = "|".join(w.replace(".", "\\\\.") for w in wires)
        return with_matchers("", self.inner, f'__name__=~"{alt}"')

    @staticmethod
    def _dur(seconds: float) -> str:
        return f"{max(1, round(seconds * 1000))}ms"

    def _gauge(self, sel: str, by: str, f: _Fetch, agg: str = "avg") -> str:
        """A gauge per window: the scraped value, or its ``agg`` over the window."""
        if f.fine:
            return f"max by ({by}) ({sel})"
        return f"max by ({by}) ({agg}_over_time({sel}[{self._dur(f.step_s)}]))"

    @staticmethod
    def _raw(sel: str, by: str) -> str:
        """A counter's latest value at each grid point (differenced here, see _counters)."""
        return f"max by ({by}) ({sel})"

    # -- reading -----------------------------------------------------------------------

    def _scrape_interval(self, probe: str, since: float, until: float) -> float:
        """Median gap between raw samples of ``probe`` (at the end of the range, else its
        start); 15 s when no series has two samples there."""
        span = min(600.0, max(1.0, until - since))
        for at in (until, min(until, since + span)):
            gaps: list[float] = []
            for _, pts in self.client.raw_samples(f"{probe}[{self._dur(span)}]", at):
                ts = [t for t, _ in pts]
                gaps.extend(b - a for a, b in itertools.pairwise(ts) if b > a)
            if gaps:
                return float(statistics.median(gaps))
        return 15.0

    def _grid(self, f: _Fetch) -> np.ndarray:
        """Window end times ``t_k``; window ``k`` covers ``(t_k - step, t_k]``."""
        step = f.step_s
        first = math.ceil(f.since / step) * step + step
        last = math.floor(f.until / step) * step
        return np.arange(first, last + step, step, dtype=float) if last >= first else \
            np.zeros(0)

    def _on_grid(self, expr: str, grid: np.ndarray, f: _Fetch, lead: int = 1
                 ) -> list[tuple[dict[str, str], np.ndarray]]:
        """Each series of ``expr`` at ``lead`` points before the grid and on it (NaN where
        the backend has no value): the points before the first window are for differences."""
        if not len(grid):
            return []
        t0 = float(grid[0]) - lead * f.step_s
        n = len(grid) + lead
        out = []
        for labels, pts in self.client.query_range(expr, t0, float(grid[-1]), f.step_s):
            arr = np.full(n, math.nan)
            for t, v in pts:
                k = round((t - t0) / f.step_s)
                if 0 <= k < n:
                    arr[k] = v
            out.append((labels, arr))
        return out

    @staticmethod
    def _smoothed(arr: np.ndarray, intervals: int) -> np.ndarray:
        """Increases per window, averaged over the last ``intervals`` grid intervals (NaN
        ones left out); ``arr`` has ``intervals`` leading points."""
        d = increases(arr)
        if intervals == 1:
            return d
        stack = np.stack([d[i:len(d) - intervals + 1 + i] for i in range(intervals)])
        ok = np.isfinite(stack)
        n = ok.sum(axis=0)
        total = np.where(ok, stack, 0.0).sum(axis=0)
        return np.where(n > 0, total / np.maximum(n, 1), math.nan)

    def _engine_id(self, labels: dict[str, str], kind: str) -> str:
        if kind == "kvscope":
            return labels.get("engine", "")
        where = labels.get("instance") or labels.get("pod") or labels.get("job") or "?"
        return f"{where}:{labels.get('engine') or '0'}"

    def _pool(self, labels: dict[str, str], kind: str) -> str:
        label = self.pool_label or ("pool" if kind == "kvscope" else "model_name")
        return labels.get(label) or labels.get("job") or "default"

    def _columns(self, gauges: dict[str, str], counters: dict[str, str], grid: np.ndarray,
                 f: _Fetch, kind: str, ids: dict[str, dict[str, str]], smooth: int = 1
                 ) -> dict[str, dict[str, np.ndarray]]:
        """Per engine, per column, one value per window: gauges as read, counters as their
        increase over the window (reset-aware, see :func:`~advisor._promframes.increases`;
        averaged over ``smooth`` windows)."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for col, expr in (*gauges.items(), *counters.items()):
            for labels, arr in self._on_grid(expr, grid, f, lead=smooth):
                eid = self._engine_id(labels, kind)
                ids.setdefault(eid, labels)
                out.setdefault(eid, {})[col] = (self._smoothed(arr, smooth) if col in counters
                                                else arr[smooth:])
        return out

    def _buckets(self, sel: str, by: str, grid: np.ndarray, f: _Fetch, kind: str = "vllm",
                 smooth: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per engine: bucket bounds and per-window cumulative counts (windows x buckets)."""
        per: dict[str, dict[float, np.ndarray]] = {}
        for labels, arr in self._on_grid(self._raw(sel, f"{by}, le"), grid, f, lead=smooth):
            le = _num(labels.get("le", "nan").replace("+Inf", "inf"))
            if not math.isnan(le):
                per.setdefault(self._engine_id(labels, kind), {})[le] = \
                    self._smoothed(arr, smooth)
        out = {}
        for eid, by_le in per.items():
            les = np.array(sorted(by_le))
            out[eid] = (les, np.stack([by_le[x] for x in les], axis=1))
        return out

    def _read_vllm(self, f: _Fetch, grid: np.ndarray) -> None:
        roles = f.vllm
        keys = [*_VLLM_KEYS, "model_name"]
        if self.pool_label and self.pool_label not in keys:
            keys.append(self.pool_label)
        by = ", ".join(keys)

        def sel(role: str, suffix: str = "") -> str:
            return self._sel(roles[role], ROLES[role].kind, suffix)

        gauges = {"snapshot": self._gauge(sel("running"), by, f),
                  "batch_max": self._gauge(sel("running"), by, f, "max")}
        if "waiting" in roles:
            gauges["waiting_mean"] = self._gauge(sel("waiting"), by, f)
        if "kv_usage" in roles:
            gauges["kv_usage_sampled"] = self._gauge(sel("kv_usage"), by, f)
            gauges["kv_usage_max"] = self._gauge(sel("kv_usage"), by, f, "max")
        counters: dict[str, str] = {col: self._raw(sel(col), by) for col in (
            "preemptions", "prompt_tokens", "generation_tokens", "prefix_queries",
            "prefix_hits") if col in roles}
        if "iterations" in roles:
            counters["n_steps"] = self._raw(sel("iterations", "_count"), by)
        for role in ("request_prompt_tokens", "request_generation_tokens"):
            if role in roles:
                counters[f"{role}:sum"] = self._raw(sel(role, "_sum"), by)
                counters[f"{role}:count"] = self._raw(sel(role, "_count"), by)
        ids: dict[str, dict[str, str]] = {}
        cols = self._columns(gauges, counters, grid, f, "vllm", ids)
        hists = {role: self._buckets(sel(role, "_bucket"), by, grid, f)
                 for role in set(HISTOGRAM_COLUMNS.values()) if role in roles}
        configs = self._vllm_configs(f.since, f.until)
        totals = {eid: np.nansum(h[1][:, -1]) for eid, h in hists.get("e2e", {}).items()}
        f.request_scale = min(1.0, self.max_requests / max(1.0, sum(totals.values())))
        frames, reqs = [], []
        for eid, c in cols.items():
            if "snapshot" not in c:
                continue
            cfg = self._identity(ids[eid], "vllm")
            cfg.update(configs.get(self._config_key(ids[eid]), {}))
            r = (self._requests(eid, c, hists, grid, f) if eid in hists.get("e2e", {})
                 else pd.DataFrame())
            w = self._vllm_windows(c, grid, f, cfg, r)
            if not len(w):
                continue
            w.insert(0, "engine_id", eid)
            frames.append(w)
            if len(r):
                reqs.append(r)
            m = infer_max_num_seqs(c["batch_max"], c.get("waiting_mean", np.zeros(len(grid))),
                                   w.set_index("ts_s")["kv_usage_mean"].reindex(
                                       (grid - f.step_s).astype("int64")).to_numpy(float))
            if m is not None:
                cfg["max_num_seqs"] = m
                f.inferred[eid] = m
            cfg["last_step_unix_s"] = float(w["ts_s"].max() + f.step_s)
            f.engines[eid] = cfg
        if frames:
            f.windows = pd.concat([f.windows, *frames], ignore_index=True)
        if reqs:
            f.requests = pd.concat([f.requests, *reqs], ignore_index=True)

    @staticmethod
    def _vllm_windows(c: dict[str, np.ndarray], grid: np.ndarray, f: _Fetch,
                      cfg: dict[str, Any], requests: pd.DataFrame) -> pd.DataFrame:
        n, step = len(grid), f.step_s
        nan = np.full(n, math.nan)
        snap = c["snapshot"]
        rate = {k: c[k] / step if k in c else nan for k in (
            "n_steps", "preemptions", "prompt_tokens", "generation_tokens", "prefix_queries",
            "prefix_hits")}
        gen, steps = rate["generation_tokens"], rate["n_steps"]
        with np.errstate(invalid="ignore", divide="ignore"):
            if "n_steps" not in c:  # no iteration histogram: one token per sequence per step
                steps = gen / np.where(snap > 0, snap, math.nan)
                batch = snap
            else:  # tokens per step: the batch averaged over every step, not one snapshot
                batch = np.where((steps >= 1) & np.isfinite(gen),
                                 gen / np.where(steps >= 1, steps, 1.0), snap)
            kv_tokens = _num(cfg.get("num_gpu_blocks")) * _num(cfg.get("block_size"))
            est = np.minimum(1.0, batch * footprint_tokens(requests, _num(cfg.get("block_size")))
                             / kv_tokens) if len(requests) and kv_tokens > 0 else nan
        sampled = c.get("kv_usage_sampled", nan)
        kv = np.fmax(sampled, est)
        w = pd.DataFrame({
            "ts_s": (grid - step).astype("int64"),
            "n_steps": steps, "batch_mean": batch, "batch_p50": batch,
            "batch_p90": c["batch_max"], "batch_max": c["batch_max"],
            "batch_sum": batch * steps,
            "waiting_mean": c.get("waiting_mean", np.zeros(n)), "deferred_mean": np.zeros(n),
            "kv_usage_mean": kv, "kv_usage_max": np.fmax(c.get("kv_usage_max", nan), kv),
            "kv_usage_sampled": sampled, "kv_usage_estimated": est,
            **{k: rate[k] for k in ("preemptions", "prompt_tokens", "generation_tokens",
                                    "prefix_queries", "prefix_hits")},
            "first_step_unix_s": nan, "last_step_unix_s": nan,
        })
        return w[np.isfinite(snap)].reset_index(drop=True)

    def _requests(self, eid: str, c: dict[str, np.ndarray],
                  hists: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]],
                  grid: np.ndarray, f: _Fetch) -> pd.DataFrame:
        buckets = {role: h[eid] for role, h in hists.items() if eid in h}
        counts = buckets["e2e"][1][:, -1]
        nan = np.full(len(grid), math.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = {"request_generation_tokens": c.get("request_generation_tokens:sum", nan)
                     / c.get("request_generation_tokens:count", nan)}
            prompt = (c.get("request_prompt_tokens:sum", nan)
                      / c.get("request_prompt_tokens:count", nan))
        fallback = float(np.nanmean(prompt)) if np.isfinite(prompt).any() else math.nan
        prompt = np.where(np.isfinite(prompt), prompt, fallback)
        q = float(np.nansum(c.get("prefix_queries", np.zeros(1))))
        hit = float(np.nansum(c.get("prefix_hits", np.zeros(1))))
        share = min(1.0, hit / q) if q > 0 else 0.0
        return pseudo_requests(eid, grid - f.step_s, counts, buckets, means,
                               scale=f.request_scale, prompt_tokens=prompt, cached_share=share)

    def _read_kvscope(self, f: _Fetch, grid: np.ndarray) -> None:
        keys = ["engine", "pool", "model"]
        if self.pool_label and self.pool_label not in keys:
            keys.append(self.pool_label)
        by = ", ".join(keys)

        def s(name: str) -> str:
            return with_matchers(_KV + name, self.inner)

        gauges = {"waiting_mean": self._gauge(s("waiting_requests"), by, f),
                  "deferred_mean": self._gauge(s("deferred_requests"), by, f)}
        counters = {col: self._raw(s(name), by) for col, name in (
            ("batch:sum", "step_batch_size_sum"), ("batch:count", "step_batch_size_count"),
            ("kv:sum", "step_kv_usage_ratio_sum"), ("kv:count", "step_kv_usage_ratio_count"),
            ("n_steps", "steps_total"), ("preemptions", "preemptions_total"),
            ("prompt_tokens", "prompt_tokens_total"),
            ("generation_tokens", "generation_tokens_total"),
            ("prefix_queries", "prefix_cache_query_tokens_total"),
            ("prefix_hits", "prefix_cache_hit_tokens_total"))}
        ids: dict[str, dict[str, str]] = {}
        # A collector's counters move once per plugin batch (about a second): at steps that
        # short a window holds zero or two batches. Counting each window's increase as the
        # mean over two steps takes the jitter out (at 1 s: a 2 s moving average).
        smooth = KVSCOPE_SMOOTH_STEPS if f.step_s < 2 * KVSCOPE_SMOOTH_STEPS else 1
        cols = self._columns(gauges, counters, grid, f, "kvscope", ids, smooth)
        batch_b = self._buckets(s("step_batch_size_bucket"), by, grid, f, "kvscope", smooth)
        kv_b = self._buckets(s("step_kv_usage_ratio_bucket"), by, grid, f, "kvscope", smooth)
        infos = {lab.get("engine", ""): lab for lab in
                 self.client.series(s("info"), f.since, f.until)}
        frames = []
        for eid, c in cols.items():
            if not eid or "batch:sum" not in c:
                continue
            n, step = len(grid), f.step_s
            nan = np.full(n, math.nan)
            with np.errstate(invalid="ignore", divide="ignore"):
                batch = c["batch:sum"] / c["batch:count"]
                kv = c.get("kv:sum", nan) / c.get("kv:count", nan)
            w = pd.DataFrame({
                "ts_s": (grid - step).astype("int64"), "batch_mean": batch, "batch_p50": batch,
                "batch_p90": (bucket_quantile(*batch_b[eid], 0.9) if eid in batch_b else nan),
                "batch_max": (bucket_quantile(*batch_b[eid], 1.0) if eid in batch_b else nan),
                "kv_usage_mean": kv,
                "kv_usage_max": (bucket_quantile(*kv_b[eid], 0.99) if eid in kv_b else nan),
                "waiting_mean": c.get("waiting_mean", np.zeros(n)),
                "deferred_mean": c.get("deferred_mean", np.zeros(n)),
                **{k: c.get(k, nan) / step for k in (
                    "n_steps", "preemptions", "prompt_tokens", "generation_tokens",
                    "prefix_queries", "prefix_hits")},
                "first_step_unix_s": nan, "last_step_unix_s": nan})
            w["batch_sum"] = w["batch_mean"] * w["n_steps"]
            w = w[np.isfinite(w["batch_mean"].to_numpy(float))].reset_index(drop=True)
            if not len(w):
                continue
            # A vLLM engine with the same id: the per-step windows replace its gauges.
            if len(f.windows) and eid in set(f.windows["engine_id"]):
                f.windows = f.windows[f.windows["engine_id"] != eid]
            w.insert(0, "engine_id", eid)
            frames.append(w)
            cfg = self._identity(ids[eid], "kvscope")
            for k, v in infos.get(eid, {}).items():
                if k in _INT_CFG or k == "gpu_memory_utilization":
                    cfg[k] = _num(v)
                elif k == "enable_prefix_caching":
                    cfg[k] = _bool(v)
                elif k in ("host", "vllm_version", "kv_cache_dtype", "kvscope_version"):
                    cfg[k] = v or None
            cfg["last_step_unix_s"] = float(w["ts_s"].max() + f.step_s)
            f.engines[eid] = {**f.engines.get(eid, {}), **cfg}
        if frames:
            f.windows = pd.concat([f.windows, *frames], ignore_index=True)

    def _identity(self, labels: dict[str, str], kind: str) -> dict[str, Any]:
        eid = self._engine_id(labels, kind)
        inst = labels.get("instance", "")
        host, _, port = inst.rpartition(":") if ":" in inst else (inst, "", "")
        return {"engine_id": eid, "pool": self._pool(labels, kind),
                "model": labels.get("model_name" if kind == "vllm" else "model") or None,
                "host": host or labels.get("pod") or None,
                "port": int(port) if port.isdigit() else None,
                "engine_index": int(labels["engine"]) if kind == "vllm"
                and labels.get("engine", "").isdigit() else None,
                "instance": inst or None, "job": labels.get("job") or None,
                "series": "kvscope" if kind == "kvscope" else "vllm"}

    @staticmethod
    def _config_key(labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(k, "") for k in _VLLM_KEYS)

    def _vllm_configs(self, since: float, until: float) -> dict[tuple[str, ...], dict[str, Any]]:
        """``vllm:cache_config_info`` labels per (instance, pod, engine)."""
        out: dict[tuple[str, ...], dict[str, Any]] = {}
        match = with_matchers("vllm:cache_config_info", self.inner)
        for lab in self.client.series(match, since, until):
            out[self._config_key(lab)] = {
                "num_gpu_blocks": _num(lab.get("num_gpu_blocks")),
                "block_size": _num(lab.get("block_size")),
                "enable_prefix_caching": _bool(lab.get("enable_prefix_caching")),
                "kv_cache_dtype": lab.get("cache_dtype") or None,
                "gpu_memory_utilization": _num(lab.get("gpu_memory_utilization")),
            }
        return out

    def prefetch(self, since: float | None = None, until: float | None = None) -> _Fetch:
        """Read everything for the range once (later calls with it are served from memory)."""
        key = (since, until)
        if key in self._fetches:
            self.last_fetch = self._fetches[key]
            return self.last_fetch
        now = self.clock()
        until = now if until is None else min(float(until), now)
        since = until - self.default_range_s if since is None else float(since)
        for f in self._fetches.values():
            if (f.since, f.until) == (since, until):
                self._fetches[key] = self.last_fetch = f
                return f
        names = self.exposed_names(since, until)
        f = _Fetch(since=since, until=until, names=names)
        if self.series != "kvscope":
            f.vllm = self._roles(names)
            if "running" not in f.vllm:
                f.vllm = {}
        f.kvscope = self.series != "vllm" and _KV_PROBE in names
        if f.vllm or f.kvscope:
            probe = (self._sel(f.vllm["running"], ROLES["running"].kind) if f.vllm
                     else with_matchers(_KV_PROBE, self.inner))
            f.scrape_s = self._scrape_interval(probe, since, until)
            f.step_s = max(math.ceil(self.step or 1), max(1, round(f.scrape_s)),
                           math.ceil((until - since) / max(1, self.max_windows)))
            f.fine = f.step_s < 1.5 * f.scrape_s
            if f.vllm:
                self._read_vllm(f, self._grid(f))
            if f.kvscope:
                f.kv_step_s = f.step_s
                self._read_kvscope(f, self._grid(f))
        self._fetches[key] = self.last_fetch = f
        return f

    # -- the Source protocol -----------------------------------------------------------

    def _discover(self, since: float, until: float) -> dict[str, dict[str, Any]]:
        """Engines and their configuration from the series API alone (no samples read)."""
        rows: dict[str, dict[str, Any]] = {}
        if self.series != "kvscope":
            configs = None
            for fam in ROLES["running"].names:
                for lab in self.client.series(with_matchers(fam, self.inner), since, until):
                    if configs is None:
                        configs = self._vllm_configs(since, until)
                    cfg = self._identity(lab, "vllm")
                    cfg.update(configs.get(self._config_key(lab), {}))
                    rows.setdefault(cfg["engine_id"], cfg)
        if self.series != "vllm":
            for lab in self.client.series(with_matchers(_KV_PROBE, self.inner), since, until):
                cfg = self._identity(lab, "kvscope")
                if cfg["engine_id"]:
                    rows[cfg["engine_id"]] = cfg
        return rows

    def engines(self) -> pd.DataFrame:
        """Engines seen in every range read so far; before any, those with series in the
        last ``lookback_s`` (found through the series API, without their configuration
        inferred from data)."""
        rows: dict[str, dict[str, Any]] = {}
        if not self._fetches:
            now = self.clock()
            rows = self._discover(now - self.lookback_s, now)
        for f in self._fetches.values():
            for eid, cfg in f.engines.items():
                old = rows.get(eid, {})
                last = max(_num(old.get("last_step_unix_s")), _num(cfg.get("last_step_unix_s")))
                rows[eid] = {**old, **cfg, "last_step_unix_s": last}
        return pd.DataFrame(list(rows.values()))

    def _ranged(self, attr: str, col: str, since: float | None, until: float | None,
                engine: str | None, pool: str | None) -> pd.DataFrame:
        f = self.prefetch(since, until)
        df: pd.DataFrame = getattr(f, attr)
        if not len(df):
            return df.copy()
        if engine is not None:
            df = df[df["engine_id"] == engine]
        if pool is not None:
            ids = {e for e, c in f.engines.items() if c.get("pool") == pool}
            df = df[df["engine_id"].isin(ids)]
        df = df[(df[col] >= f.since) & (df[col] < f.until)]
        return df.sort_values(["engine_id", col], kind="stable").reset_index(drop=True)

    def windows(self, since: float | None = None, until: float | None = None,
                engine: str | None = None, pool: str | None = None) -> pd.DataFrame:
        return self._ranged("windows", "ts_s", since, until, engine, pool)

    def requests(self, since: float | None = None, until: float | None = None,
                 engine: str | None = None, pool: str | None = None) -> pd.DataFrame:
        return self._ranged("requests", "finished_unix_s", since, until, engine, pool)

    def kv_events(self, since: float | None = None, until: float | None = None,
                  pool: str | None = None) -> pd.DataFrame:
        """Always empty: vLLM's KV-cache events do not reach Prometheus."""
        return pd.DataFrame()

    # -- what the report says about the resolution -------------------------------------

    def describe(self) -> dict[str, Any]:
        """The coverage fields :func:`annotate_report` adds (for the last range read)."""
        f = self.last_fetch
        if f is None:
            return {"source": "prometheus", "url": self.url}
        factors = {eid: confidence_factor(
            (f.kv_step_s if cfg.get("series") == "kvscope" else f.step_s) or 1,
            per_step_means=cfg.get("series") == "kvscope") for eid, cfg in f.engines.items()}
        return {
            "source": "prometheus", "url": self.url, "selector": self.selector or None,
            "resolution_s": (f.step_s if f.vllm else f.kv_step_s) or None,
            "resolution_s_kvscope_series": f.kv_step_s or None,
            "scrape_interval_s": None if math.isnan(f.scrape_s) else round(f.scrape_s, 3),
            "resolution_mode": "per scrape" if f.fine else "averaged over the step",
            "confidence_factor": min(factors.values()) if factors else None,
            "confidence_factor_by_engine": factors,
            "metric_names": {k: list(v) for k, v in f.vllm.items()},
            "kvscope_series": f.kvscope,
            "engines_from_kvscope_series": sorted(e for e, c in f.engines.items()
                                                  if c.get("series") == "kvscope"),
            "requests_from_histograms": True,
            "requests_per_row": round(1.0 / f.request_scale, 3),
            "max_num_seqs_inferred": dict(f.inferred),
            "names_tried": self.names_tried(),
        }


def annotate_report(report: Report, source: PrometheusSource) -> Report:
    """Scale each confidence by its engine's resolution factor (a pool's by the lowest of
    its engines'), add the ``scrape_resolution`` finding and the coverage fields.
    Idempotent."""
    info = source.describe()
    if report.coverage.get("source") == "prometheus" or not report.has_data:
        report.coverage.update(info)
        return report
    by_engine: dict[str, float] = info.get("confidence_factor_by_engine") or {}
    lowest = float(info.get("confidence_factor") or 1.0)
    pools: dict[str | None, float] = {}
    for v in report.engines:
        k = by_engine.get(v.engine_id, lowest)
        pools[v.pool] = min(pools.get(v.pool, 1.0), k)
        v.confidence = round(v.confidence * k, 3)

    def factor(scope: Scope) -> float:
        if scope.engine_id is not None:
            return by_engine.get(scope.engine_id, lowest)
        return pools.get(scope.pool, lowest)

    for fd in report.findings:
        fd.confidence = round(fd.confidence * factor(fd.scope), 3)
    for rec in report.recommendations:
        rec.confidence = round(rec.confidence * factor(rec.scope), 3)
    report.coverage.update(info)
    used = sorted({n for fams in (info.get("metric_names") or {}).values() for n in fams})
    per_step = info.get("engines_from_kvscope_series") or []
    parts = []
    if used:
        parts.append("vLLM's own series (the batch is generated tokens per engine step; the "
                     "queue and KV usage are gauges sampled once per scrape, KV usage raised "
                     "to batch x request footprint where the snapshot reads lower)")
    if per_step:
        parts.append(f"kvscope's per-step series for {len(per_step)} engine(s) (batch and KV "
                     "usage averaged over every step)")
    inferred = info.get("max_num_seqs_inferred") or {}
    report.findings.append(Finding(
        kind="scrape_resolution", scope=Scope(),
        severity="info" if lowest >= 0.7 else "warning", confidence=1.0,
        summary=(f"read from Prometheus ({info['url']}) at {info['resolution_s']} s resolution "
                 f"(scrape interval {info['scrape_interval_s']} s) from " + " and ".join(parts)
                 + "; latencies are histogram estimates (bucket bounds, no per-request joint "
                 f"data); confidences scaled by {lowest:.2f}"
                 + (f" (per-step engines {max(by_engine.values()):.2f})" if per_step and used
                    else "")
                 + ("; max_num_seqs inferred where the batch was pinned" if inferred else
                    "; vLLM does not export max_num_seqs or max_num_batched_tokens")),
        evidence={key: info.get(key) for key in (
            "resolution_s", "scrape_interval_s", "resolution_mode", "confidence_factor",
            "requests_per_row", "max_num_seqs_inferred", "engines_from_kvscope_series")}
        | {"metric_names": used}))
    return report


def analyze_prometheus(source: PrometheusSource, since: float | None = None,
                       until: float | None = None, pool: str | None = None,
                       **kw: Any) -> Report:
    """:func:`~advisor.analyze.analyze` over ``source`` for one range, annotated."""
    source.prefetch(since, until)
    f = source.last_fetch
    assert f is not None
    return annotate_report(analyze(source, f.since, f.until, pool, **kw), source)

