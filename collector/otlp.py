"""Push the fleet metrics and the advisor's verdicts to an OTLP/HTTP endpoint.

Off unless the collector is given ``--otlp-endpoint``; only then is opentelemetry
imported (``pip install 'kvscope[otlp]'``), so the collector runs without it.

:class:`OtlpExport` runs an opentelemetry-sdk ``MeterProvider`` with a
``PeriodicExportingMetricReader`` (one daemon thread) and the OTLP/HTTP protobuf
exporter (:mod:`kvscope.collector._otlp_sdk`). Its observable instruments read what
``/metrics`` renders (:meth:`FleetState.snapshot`, :meth:`VerdictLoop.snapshot`, once
per collection), so names, attributes and values are those of ``/metrics``.

Failures never reach ingest: exports run on the reader's thread, take the state's lock
only to copy it, and a failed export is counted in
``kvscope_collector_otlp_exports_total{result}``; values are cumulative, so the next
export that gets through carries everything. The first failure of each kind is logged,
a recovery at most once a minute. At shutdown the reader exports once more, within
:data:`SHUTDOWN_TIMEOUT_S`.

The mapping of families and the resource attributes: docs/otlp.md
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvscope.collector._exposition import TextWriter, label_str
from kvscope.collector.metrics import FleetState, Snapshot
from kvscope.collector.settings import Settings
from kvscope.collector.verdicts import VerdictLoop
from kvscope.engine_plugins import __version__

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

__all__ = [
    "EXTRA",
    "SHUTDOWN_TIMEOUT_S",
    "MissingOtlpError",
    "OtlpExport",
    "metrics_url",
    "require_sdk",
]

log = logging.getLogger(__name__)

EXTRA = "otlp"
"""The pyproject extra that installs the OpenTelemetry packages."""
SDK_MODULES = ("opentelemetry.sdk.metrics", "opentelemetry.exporter.otlp.proto.http")
SERVICE_NAME = "kvscope-collector"
SHUTDOWN_TIMEOUT_S = 5.0
"""The final collection and export at shutdown ends within this."""
SNAPSHOT_MAX_AGE_S = 1.0
"""A collection reuses the snapshot its first callback took for at most this long."""
RECOVERY_LOG_EVERY_S = 60.0
RESULTS = ("success", "failure")
SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk.metrics._internal.export",
)
"""Loggers of the SDK that report failed exports; each kind passes once."""


class MissingOtlpError(RuntimeError):
    """The OTLP export was asked for but the OpenTelemetry packages are not installed."""


def require_sdk(what: str = "the OTLP export (--otlp-endpoint)") -> None:
    """Raise :class:`MissingOtlpError` naming the extra when the SDK is not importable."""
    import importlib.util

    for mod in SDK_MODULES:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            raise MissingOtlpError(
                f"{what} needs the '{EXTRA}' extra ({mod} is not installed).\n"
                f"Install it with:  pip install 'kvscope[{EXTRA}]'"
            )


def metrics_url(endpoint: str) -> str:
    """The URL to POST to: ``endpoint`` itself, or ``<endpoint>/v1/metrics`` when it has
    no path (a bare ``http://host:4318`` is the OTLP/HTTP base URL)."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urllib.parse.urlunsplit(parts._replace(path="/v1/metrics"))
    return endpoint


class _OncePerKind(logging.Filter):
    """Lets each kind of record through once: same logger, message and status codes."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, str, tuple[int, ...]]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        codes = tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))
        key = (record.name, str(record.msg), codes)
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


class OtlpExport:
    """The collector's OTLP push: build with the settings and the state, :meth:`start`,
    :meth:`shutdown` at the end. :meth:`render` adds its own counters to ``/metrics``."""

    def __init__(
        self, settings: Settings, state: FleetState, verdicts: VerdictLoop | None = None
    ) -> None:
        if settings.otlp_endpoint is None:
            raise ValueError("OtlpExport needs settings.otlp_endpoint")
        self.endpoint = metrics_url(settings.otlp_endpoint)
        self.interval_s = settings.otlp_interval_s
        self.headers = dict(settings.otlp_headers)
        self.state = state
        self.verdicts = verdicts
        self.resource_attributes: dict[str, Any] = {
            "service.name": SERVICE_NAME,
            "service.version": __version__,
            "service.instance.id": f"{socket.gethostname()}:{settings.port}",
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
        self.exports = dict.fromkeys(RESULTS, 0)
        self.last_success_unix_s: float | None = None
        self._lock = threading.Lock()
        self._snapshot: tuple[float, Snapshot, dict[str, Any]] | None = None
        self._logged_kinds: set[str] = set()
        self._failing = False
        self._last_recovery_log = -math.inf
        self._filter = _OncePerKind()
        self._provider: MeterProvider | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> OtlpExport:
        """Start the periodic export (the first one after one interval)."""
        require_sdk()
        from kvscope.collector._otlp_sdk import build_provider

        for name in SDK_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        try:
            self._provider = build_provider(self)
        except BaseException:
            self._remove_filter()
            raise
        log.info(
            "OTLP export to %s every %s",
            self.endpoint,
            f"{self.interval_s:g} s"
            if self.interval_s
            else f"{os.environ.get('OTEL_METRIC_EXPORT_INTERVAL', '60000')} ms "
            "($OTEL_METRIC_EXPORT_INTERVAL, default 60000)",
        )
        return self

    def flush(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Collect and export now, on the calling thread; True when an export succeeded
        meanwhile (this one, or a periodic one that ran at the same moment)."""
        if self._provider is None:
            raise RuntimeError("the OTLP export has not started")
        before = self.exports["success"]
        self._provider.force_flush(timeout_millis=timeout_s * 1000)
        return self.exports["success"] > before

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Collect and export once more, then stop; returns within about ``timeout_s``."""
        provider, self._provider = self._provider, None
        if provider is None:
            return
        try:
            provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # a failed flush must not fail the collector's shutdown
            log.exception("shutting down the OTLP export failed")
        finally:
            self._remove_filter()

    def _remove_filter(self) -> None:
        for name in SDK_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)

    # -- what the instruments read -----------------------------------------------------

    def snapshot(self) -> tuple[Snapshot, dict[str, Any]]:
        """The engine snapshot and the verdicts' samples for the collection under way:
        taken by the first callback, reused by the others (and by the histograms)."""
        with self._lock:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] > SNAPSHOT_MAX_AGE_S:
                verdicts = self.verdicts.snapshot() if self.verdicts is not None else {}
                self._snapshot = (now, self.state.snapshot(), verdicts)
            return self._snapshot[1], self._snapshot[2]

    def samples(self, name: str) -> list[tuple[Mapping[str, str], float]]:
        """The samples of one gauge or counter family, from :meth:`snapshot`."""
        engines, verdicts = self.snapshot()
        found = engines.samples.get(name)
        return found if found is not None else verdicts.get(name, [])

    def collection_done(self, ok: bool, error: BaseException | None = None) -> None:
        """Count one export's result (called by the exporter after each export)."""
        with self._lock:
            self._snapshot = None
            self.exports["success" if ok else "failure"] += 1
            if ok:
                self.last_success_unix_s = time.time()
            was_failing, self._failing = self._failing, not ok
            kind = "" if ok else (type(error).__name__ if error else "rejected")
            first_of_kind = not ok and kind not in self._logged_kinds
            self._logged_kinds.add(kind)
            now = time.monotonic()
            recovered = ok and was_failing and now - self._last_recovery_log >= RECOVERY_LOG_EVERY_S
            if recovered:
                self._last_recovery_log = now
            failures = self.exports["failure"]
        if first_of_kind:
            log.warning(
                "OTLP export to %s failed (%s%s); ingest and /metrics are not affected, the "
                "next export sends the cumulative values again; further failures of this "
                "kind are only counted in kvscope_collector_otlp_exports_total"
                '{result="failure"}',
                self.endpoint,
                "the endpoint did not accept the batch" if error is None else kind,
                f": {error}" if error is not None else "",
            )
        if recovered:
            log.info(
                "OTLP export to %s works again (%d failed export(s) so far)",
                self.endpoint,
                failures,
            )

    # -- /metrics ----------------------------------------------------------------------

    def render(self, w: TextWriter) -> None:
        """Write ``kvscope_collector_otlp_*``: exports by result and the last success."""
        with self._lock:
            exports = dict(self.exports)
            last = self.last_success_unix_s
        w.family(
            "kvscope_collector_otlp_exports_total",
            "counter",
            "OTLP metric exports by result (success, failure after the SDK's retries).",
        )
        for result in RESULTS:
            w.sample(
                "kvscope_collector_otlp_exports_total",
                label_str((("result", result),)),
                exports[result],
            )
        w.family(
            "kvscope_collector_otlp_last_success_timestamp_seconds",
            "gauge",
            "When an OTLP export last succeeded (unix seconds).",
        )
        if last is not None:
            w.sample("kvscope_collector_otlp_last_success_timestamp_seconds", "", last)
