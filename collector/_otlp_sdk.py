"""The opentelemetry-sdk side of :mod:`kvscope.collector.otlp` (imported only when enabled).

:func:`build_provider` registers one observable instrument per gauge and counter
family of ``/metrics`` (:data:`kvscope.collector.metrics.ENGINE_FAMILIES` and, with the
advisor running, :data:`kvscope.collector.verdicts.VERDICT_FAMILIES`). The SDK has no
observable histogram, so :class:`_Exporter` adds the per-step histograms to each
collected batch, from the snapshot the instruments read, before the OTLP/HTTP
exporter encodes and sends it; it also reports every export's result.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvscope.collector.metrics import ENGINE_FAMILIES, HISTOGRAM_BOUNDS
from kvscope.collector.verdicts import VERDICT_FAMILIES
from kvscope.engine_plugins import __version__

if TYPE_CHECKING:
    from kvscope.collector.otlp import OtlpExport

log = logging.getLogger(__name__)

SCOPE = "kvscope.collector"
CARDINALITY_FLOOR = 2_000
"""Attribute sets per instrument at least (the SDK's default); with more engines
exported (``max_exported_engines``) the limit grows so that none folds into the SDK's
overflow point, with room for label values that changed (a new bottleneck, pool)."""
_CUMULATIVE: dict[type, AggregationTemporality] = dict.fromkeys(
    (
        Counter,
        UpDownCounter,
        Histogram,
        ObservableCounter,
        ObservableUpDownCounter,
        ObservableGauge,
    ),
    AggregationTemporality.CUMULATIVE,
)
"""Always cumulative: the counters are totals kept across collector restarts."""


def build_provider(export: OtlpExport) -> MeterProvider:
    """A started MeterProvider pushing ``export``'s state to ``export.endpoint``."""
    resource = Resource.create(export.resource_attributes).merge(OTELResourceDetector().detect())
    # gzip unless the environment says otherwise: a batch is ~3.5 KB per engine as is.
    configured = any(
        os.environ.get(v)
        for v in ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")
    )
    otlp = OTLPMetricExporter(
        endpoint=export.endpoint,
        headers=export.headers or None,
        compression=None if configured else Compression.Gzip,
    )
    scope = InstrumentationScope(SCOPE, __version__)
    exporter = _Exporter(otlp, export, resource, scope)
    limit = 2 * max(CARDINALITY_FLOOR, export.state.max_exported_engines)
    reader = PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=None if export.interval_s is None else export.interval_s * 1000,
        cardinality_limits={ObservableGauge: limit, ObservableCounter: limit},
    )
    # Observations come from callbacks outside any trace: exemplars would only cost time.
    provider = MeterProvider(
        metric_readers=[reader],
        resource=resource,
        exemplar_filter=AlwaysOffExemplarFilter(),
        shutdown_on_exit=False,
    )
    meter = provider.get_meter(SCOPE, __version__)
    families = list(ENGINE_FAMILIES)
    if export.verdicts is not None:
        families += VERDICT_FAMILIES
    for name, kind, help_text in families:
        if kind == "gauge":
            meter.create_observable_gauge(name, [_callback(export, name)], description=help_text)
        elif kind == "counter":
            meter.create_observable_counter(name, [_callback(export, name)], description=help_text)
    return provider


def _callback(export: OtlpExport, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, dict(attrs)) for attrs, value in export.samples(name)]

    return observe


class _Exporter(MetricExporter):
    """Adds the histograms to each batch, sends it with the OTLP exporter, reports."""

    def __init__(
        self,
        otlp: OTLPMetricExporter,
        export: OtlpExport,
        resource: Resource,
        scope: InstrumentationScope,
    ) -> None:
        super().__init__(preferred_temporality=_CUMULATIVE)
        self._otlp = otlp
        self._export = export
        self._resource = resource
        self._scope = scope
        self._start_ns = int(export.state.start_unix_s * 1e9)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            data = self._with_histograms(metrics_data)
            result = self._otlp.export(data, timeout_millis=timeout_millis)
        except Exception as exc:  # never raise into the reader
            self._export.collection_done(False, exc)
            return MetricExportResult.FAILURE
        self._export.collection_done(result is MetricExportResult.SUCCESS)
        return result

    def _histograms(self) -> list[Metric]:
        engines, _ = self._export.snapshot()
        now_ns = time.time_ns()
        help_texts = {name: h for name, kind, h in ENGINE_FAMILIES if kind == "histogram"}
        out = []
        for name, rows in engines.histograms.items():
            bounds = [float(b) for b in HISTOGRAM_BOUNDS[name]]
            points = [
                # min and max are optional in OTLP and unknown here: left unset.
                HistogramDataPoint(
                    attributes=dict(attrs),
                    start_time_unix_nano=self._start_ns,
                    time_unix_nano=now_ns,
                    count=sum(counts),
                    sum=total,
                    bucket_counts=counts,
                    explicit_bounds=bounds,
                    min=None,  # type: ignore[arg-type]
                    max=None,  # type: ignore[arg-type]
                )
                for attrs, counts, total in rows
            ]
            if points:
                out.append(
                    Metric(
                        name=name,
                        description=help_texts[name],
                        unit="",
                        data=HistogramData(
                            data_points=points, aggregation_temporality=_CUMULATIVE[Histogram]
                        ),
                    )
                )
        return out

    def _with_histograms(self, data: MetricsData) -> MetricsData:
        extra = self._histograms()
        if not extra:
            return data
        resource_metrics = list(data.resource_metrics) or [
            ResourceMetrics(resource=self._resource, scope_metrics=[], schema_url="")
        ]
        first = resource_metrics[0]
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == SCOPE:
                scopes[i] = ScopeMetrics(
                    scope=sm.scope, metrics=[*sm.metrics, *extra], schema_url=sm.schema_url
                )
                break
        else:
            scopes.append(ScopeMetrics(scope=self._scope, metrics=extra, schema_url=""))
        resource_metrics[0] = ResourceMetrics(
            resource=first.resource, scope_metrics=scopes, schema_url=first.schema_url
        )
        return MetricsData(resource_metrics=resource_metrics)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._otlp.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._otlp.shutdown(timeout_millis=timeout_millis)
