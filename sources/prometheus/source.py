"""The advisor over a Prometheus-compatible query API: vLLM's own ``/metrics``, scraped.

:class:`PrometheusSource` implements :class:`~kvscope.advisor.sources.Source` over the HTTP
API of Prometheus, Thanos, Mimir or VictoriaMetrics, so the same analyses run on the series
a fleet already stores, with nothing installed in the engines. It reads vLLM's series and
kvscope collectors' own (``kvscope_engine_*``), so several collectors behind one Prometheus
form one fleet.

* Engines are ``(instance, pod, engine)`` label combinations, id ``instance:engine``; the
  pool is ``pool_label`` (default ``model_name``).
* Each quantity reads every known name of it present in the range
  (:data:`kvscope.sources.prometheus.vllm_metrics.ROLES`), so a fleet mid-upgrade reads whole.
* Windows are one scrape interval long (coarser past ``max_windows``), with rates per second
  as the analyses expect of 1-second windows; the busy share is estimated from the step count.
* vLLM exports only histograms of requests, so each window gets pseudo-requests spread over
  its histograms (percentiles are bucket estimates; column ``weight`` past ``max_requests``).

:func:`annotate_report` (called by :func:`analyze_prometheus`) scales every confidence by the
resolution's :func:`~kvscope.sources.prometheus.frames.confidence_factor` and adds a
``scrape_resolution`` finding and ``coverage`` fields. ``max_num_seqs`` is inferred where the
batch was pinned; ``max_num_batched_tokens`` is unknown.

See docs/prometheus.md#how-the-series-become-windows-and-requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from kvscope.advisor.analyze import analyze
from kvscope.advisor.findings import Finding, Report, Scope
from kvscope.advisor.sources import SourceError
from kvscope.sources.prometheus.auth import PromAuth
from kvscope.sources.prometheus.client import PromClient
from kvscope.sources.prometheus.frames import confidence_factor
from kvscope.sources.prometheus.promql import matchers_of_selector, with_matchers
from kvscope.sources.prometheus.read import KV_PREFIX, KV_PROBE, Fetch, Reader, num
from kvscope.sources.prometheus.vllm_metrics import HISTOGRAM, ROLES, wire_names

__all__ = [
    "PrometheusSource",
    "analyze_prometheus",
    "annotate_report",
    "no_data_message",
    "source_error_text",
]


class PrometheusSource:
    """A :class:`~kvscope.advisor.sources.Source` reading vLLM's (and kvscope's) series from a
    Prometheus-compatible query API (see the module docstring).

    ``selector`` (``{namespace="prod"}``) is added to every query; ``pool_label`` names
    the label that groups replicas into pools; ``step`` forces the resolution in
    seconds; ``auth`` holds credentials and TLS options; ``lookback_s`` is how far back :meth:`engines` looks when no time range
    was read yet; ``default_range_s`` the range when ``since`` is None.
    """

    def __init__(
        self,
        url: str,
        selector: str | None = None,
        pool_label: str | None = None,
        step: float | None = None,
        *,
        timeout_s: float = 30.0,
        lookback_s: float = 7 * 86400.0,
        default_range_s: float = 1800.0,
        series: str = "auto",
        max_windows: int = 20_000,
        max_requests: int = 200_000,
        headers: dict[str, str] | None = None,
        auth: PromAuth | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
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
        self.client = PromClient(self.url, timeout_s=timeout_s, headers=headers, auth=auth)
        self.reader = Reader(self.client, self.inner, pool_label, max_requests)
        self._fetches: dict[tuple[float | None, float | None], Fetch] = {}
        self.last_fetch: Fetch | None = None

    # -- what the fleet exposes --------------------------------------------------------

    def names_tried(self) -> list[str]:
        """The names whose presence makes an engine (for error messages)."""
        out = [] if self.series == "kvscope" else list(ROLES["running"].names)
        return out + ([] if self.series == "vllm" else [KV_PROBE])

    def exposed_names(self, since: float, until: float) -> set[str]:
        """``vllm:*`` and ``kvscope_engine_*`` sample names stored over the range."""
        match = with_matchers("", self.inner, f'__name__=~"vllm:.+|{KV_PREFIX}.+"')
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
            fams = [
                f
                for f in role.names
                if (
                    wire_names(f, role.kind)[-1]
                    if role.kind == HISTOGRAM
                    else wire_names(f, role.kind)[0]
                )
                in names
            ]
            if fams:
                out[role.key] = fams
        return out

    def prefetch(self, since: float | None = None, until: float | None = None) -> Fetch:
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
        f = Fetch(since=since, until=until, names=names)
        if self.series != "kvscope":
            f.vllm = self._roles(names)
            if "running" not in f.vllm:
                f.vllm = {}
        f.kvscope = self.series != "vllm" and KV_PROBE in names
        if f.vllm or f.kvscope:
            probe = (
                self.reader.sel(f.vllm["running"], ROLES["running"].kind)
                if f.vllm
                else with_matchers(KV_PROBE, self.inner)
            )
            f.scrape_s = self.reader.scrape_interval(probe, since, until)
            f.step_s = max(
                math.ceil(self.step or 1),
                max(1, round(f.scrape_s)),
                math.ceil((until - since) / max(1, self.max_windows)),
            )
            f.fine = f.step_s < 1.5 * f.scrape_s
            if f.vllm:
                self.reader.read_vllm(f, self.reader.grid(f))
            if f.kvscope:
                f.kv_step_s = f.step_s
                self.reader.read_kvscope(f, self.reader.grid(f))
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
                        configs = self.reader.vllm_configs(since, until)
                    cfg = self.reader.identity(lab, "vllm")
                    cfg.update(configs.get(self.reader.config_key(lab), {}))
                    rows.setdefault(cfg["engine_id"], cfg)
        if self.series != "vllm":
            for lab in self.client.series(with_matchers(KV_PROBE, self.inner), since, until):
                cfg = self.reader.identity(lab, "kvscope")
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
                last = max(num(old.get("last_step_unix_s")), num(cfg.get("last_step_unix_s")))
                rows[eid] = {**old, **cfg, "last_step_unix_s": last}
        return pd.DataFrame(list(rows.values()))

    def _ranged(
        self,
        attr: str,
        col: str,
        since: float | None,
        until: float | None,
        engine: str | None,
        pool: str | None,
    ) -> pd.DataFrame:
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

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self._ranged("windows", "ts_s", since, until, engine, pool)

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self._ranged("requests", "finished_unix_s", since, until, engine, pool)

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        """Always empty: vLLM's KV-cache events do not reach Prometheus."""
        return pd.DataFrame()

    # -- what the report says about the resolution -------------------------------------

    def describe(self) -> dict[str, Any]:
        """The coverage fields :func:`annotate_report` adds (for the last range read)."""
        f = self.last_fetch
        if f is None:
            return {"source": "prometheus", "url": self.url}
        factors = {
            eid: confidence_factor(
                (f.kv_step_s if cfg.get("series") == "kvscope" else f.step_s) or 1,
                per_step_means=cfg.get("series") == "kvscope",
            )
            for eid, cfg in f.engines.items()
        }
        return {
            "source": "prometheus",
            "url": self.url,
            "selector": self.selector or None,
            "resolution_s": (f.step_s if f.vllm else f.kv_step_s) or None,
            "resolution_s_kvscope_series": f.kv_step_s or None,
            "scrape_interval_s": None if math.isnan(f.scrape_s) else round(f.scrape_s, 3),
            "resolution_mode": "per scrape" if f.fine else "averaged over the step",
            "confidence_factor": min(factors.values()) if factors else None,
            "confidence_factor_by_engine": factors,
            "metric_names": {k: list(v) for k, v in f.vllm.items()},
            "kvscope_series": f.kvscope,
            "engines_from_kvscope_series": sorted(
                e for e, c in f.engines.items() if c.get("series") == "kvscope"
            ),
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
        parts.append(
            "vLLM's own series (the batch is decode tokens per engine step; the "
            "queue and KV usage are vLLM's gauges sampled once per scrape: a cache full "
            "between samples shows in the preemptions)"
        )
    if per_step:
        parts.append(
            f"kvscope's per-step series for {len(per_step)} engine(s) (batch and KV "
            "usage averaged over every step)"
        )
    inferred = info.get("max_num_seqs_inferred") or {}
    report.findings.append(
        Finding(
            kind="scrape_resolution",
            scope=Scope(),
            severity="info" if lowest >= 0.7 else "warning",
            confidence=1.0,
            summary=(
                f"read from Prometheus ({info['url']}) at {info['resolution_s']} s resolution "
                f"(scrape interval {info['scrape_interval_s']} s) from "
                + " and ".join(parts)
                + "; latencies are histogram estimates (bucket bounds, no per-request joint "
                f"data); confidences scaled by {lowest:.2f}"
                + (
                    f" (per-step engines {max(by_engine.values()):.2f})"
                    if per_step and used
                    else ""
                )
                + (
                    "; max_num_seqs inferred where the batch was pinned"
                    if inferred
                    else "; vLLM does not export max_num_seqs or max_num_batched_tokens"
                )
            ),
            evidence={
                key: info.get(key)
                for key in (
                    "resolution_s",
                    "scrape_interval_s",
                    "resolution_mode",
                    "confidence_factor",
                    "requests_per_row",
                    "max_num_seqs_inferred",
                    "engines_from_kvscope_series",
                )
            }
            | {"metric_names": used},
        )
    )
    return report


def analyze_prometheus(
    source: PrometheusSource,
    since: float | None = None,
    until: float | None = None,
    pool: str | None = None,
    **kw: Any,
) -> Report:
    """:func:`~kvscope.advisor.analyze.analyze` over ``source`` for one range, annotated."""
    source.prefetch(since, until)
    f = source.last_fetch
    assert f is not None
    return annotate_report(analyze(source, f.since, f.until, pool, **kw), source)


def source_error_text(exc: Exception, url: str) -> str:
    """A failed Prometheus read, said for a person (the command line, the dashboard)."""
    if isinstance(exc, SourceError) and exc.status is None:
        return (
            f"cannot reach Prometheus at {url} ({exc.reason}): check the base URL "
            "(e.g. http://prometheus:9090, no /api path)"
        )
    return str(exc)


def no_data_message(source: PrometheusSource, report: Report, url: str, window: str) -> str:
    """Why a Prometheus-backed report is empty: no series at all, or none in the window."""
    f = source.last_fetch
    sel = f" matching {source.selector}" if source.selector else ""
    if f is None or not (f.vllm or f.kvscope):
        tried = " or ".join(source.names_tried())
        return (
            f"no vLLM series{sel} at {url} in the window {window}: tried {tried} "
            "(and every older name of them); check --selector, --since and that "
            "Prometheus scrapes vLLM's /metrics"
        )
    pools = report.coverage.get("pools") or []
    pool = report.parameters.get("pool")
    if pool is not None and pools:
        return f"no engines in pool {pool!r} at {url}; pools known: {', '.join(pools)}"
    latest = report.coverage.get("latest_step_unix_s")
    when = (
        f"; the newest sample is from {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(latest))}"
        if isinstance(latest, float) and math.isfinite(latest)
        else ""
    )
    return f"vLLM series{sel} exist at {url} but hold no data in the window {window}{when}"
