"""The weekly report over a Prometheus-compatible server (``kvscope report --prometheus``).

:class:`PromReportSource` gives :func:`~kvscope.report.build.build_weekly_report` the
advisor's :class:`~kvscope.sources.prometheus.source.PrometheusSource` plus what the report asks
besides: ``engine_configs()`` is empty (Prometheus keeps no configuration history: a
restart with new flags shows only in the series themselves) and ``close()`` does
nothing. :meth:`PromReportSource.read` reads both weeks in one range first, so the
engines carry what was inferred from their data (``max_num_seqs`` where the batch was
pinned); :func:`annotate_weeks` then states the resolution on both weeks, as
``kvscope advise --prometheus`` does (``scrape_resolution`` finding, coverage fields,
confidences scaled).
"""

from __future__ import annotations

import pandas as pd

from kvscope.report.model import WeeklyReport
from kvscope.sources.prometheus.source import PrometheusSource, annotate_report


class PromReportSource:
    """The report's source questions over one :class:`PrometheusSource`."""

    def __init__(self, source: PrometheusSource) -> None:
        self.source = source

    def read(self, since: float, until: float) -> None:
        """Read ``[since, until)`` at once (the report asks for both weeks)."""
        self.source.prefetch(since, until)

    def engines(self) -> pd.DataFrame:
        return self.source.engines()

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self.source.windows(since, until, engine, pool)

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self.source.requests(since, until, engine, pool)

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        return self.source.kv_events(since, until, pool)

    def engine_configs(self) -> pd.DataFrame:
        return pd.DataFrame()

    def close(self) -> None:
        return None


def annotate_weeks(report: WeeklyReport, source: PromReportSource) -> WeeklyReport:
    """Both weeks' reports annotated with the resolution they were read at."""
    annotate_report(report.current, source.source)
    annotate_report(report.previous, source.source)
    return report
