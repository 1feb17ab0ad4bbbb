"""``kvscope advise --prometheus URL``: the advisor over vLLM's own series in Prometheus.

The arguments are those of ``kvscope advise`` (see :mod:`collector.cli`) plus the
Prometheus options of :mod:`collector._promargs`; the output is the
same report (text, ``--json``, ``--out``), with the ``scrape_resolution`` finding and
confidences scaled to the resolution (:mod:`advisor.prometheus`).

Exit codes: 0 verdicts; 2 bad arguments, Prometheus unreachable or refusing the query
(its own error message is shown); 3 no vLLM series matched, or none in the window.
"""

from __future__ import annotations

import argparse
import math
import time

__all__ = ["add_arguments", "no_data_message", "run", "source_error_text"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The Prometheus options of ``kvscope advise`` (shared with report, dashboard, lint)."""
    from collector._promargs import add_prometheus_arguments

    add_prometheus_arguments(p)


def run(args: argparse.Namespace) -> int:
    from advisor.prometheus import analyze_prometheus
    from advisor.sources import SourceError
    from collector._params import ParamError
    from collector._promargs import PromArgError, prometheus_target
    from collector.cli import advise_fail, advise_window, analysis_options, write_advice

    now = time.time()
    try:
        since, until = advise_window(args, now)
        target = prometheus_target(args)
        assert target is not None
        source = target.source(timeout_s=args.timeout,
                               lookback_s=max(7 * 86400.0, now - (since or now)))
    except (ParamError, PromArgError) as exc:
        return advise_fail(str(exc), 2)
    url = target.url
    try:
        report = analyze_prometheus(source, since, until, args.pool, **analysis_options(args))
    except SourceError as exc:
        return advise_fail(source_error_text(exc, url), 2)
    return write_advice(args, report, since, until, f"Prometheus {url}",
                        lambda window: no_data_message(source, report, url, window))


def source_error_text(exc: Exception, url: str) -> str:
    """A failed Prometheus read, said for the command line."""
    from advisor.sources import SourceError

    if isinstance(exc, SourceError) and exc.status is None:
        return (f"cannot reach Prometheus at {url} ({exc.reason}): check the base URL "
                "(e.g. http://prometheus:9090, no /api path)")
    return str(exc)


def no_data_message(source: object, report: object, url: str, window: str) -> str:
    """Why a Prometheus-backed report is empty: no series at all, or none in the window."""
    from advisor.findings import Report
    from advisor.prometheus import PrometheusSource

    assert isinstance(source, PrometheusSource) and isinstance(report, Report)
    f = source.last_fetch
    sel = f" matching {source.selector}" if source.selector else ""
    if f is None or not (f.vllm or f.kvscope):
        tried = " or ".join(source.names_tried())
        return (f"no vLLM series{sel} at {url} in the window {window}: tried {tried} "
                "(and every older name of them); check --selector, --since and that "
                "Prometheus scrapes vLLM's /metrics")
    pools = report.coverage.get("pools") or []
    pool = report.parameters.get("pool")
    if pool is not None and pools:
        return f"no engines in pool {pool!r} at {url}; pools known: {', '.join(pools)}"
    latest = report.coverage.get("latest_step_unix_s")
    when = (f"; the newest sample is from {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(latest))}"
            if isinstance(latest, float) and math.isfinite(latest) else "")
    return f"vLLM series{sel} exist at {url} but hold no data in the window {window}{when}"
