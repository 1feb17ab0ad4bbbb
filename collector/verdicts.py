"""The advisor's verdicts on ``/metrics``: a periodic run over the collector's own data.

:class:`VerdictLoop` is one named daemon thread that runs :func:`kvscope.advisor.analyze`
over the last ``window_s`` seconds (ending :data:`SETTLE_S` before now), pool by pool,
then waits on an event (the same event is the sleep and the stop signal). It reads
through the store's read methods wrapped in an :class:`advisor.FrameSource`, never on the
event loop and never under the store's write lock, so ingest is not held up. A failed
run is counted and logged (at most once a minute), never raised; the pools that failed
keep their verdicts, every other pool's are replaced.

At scrape time :meth:`VerdictLoop.render` writes the latest verdicts: per engine
(``kvscope_advisor_knee_concurrency``, ``..._plateau_tokens_per_second``,
``..._saturated``, ``..._bottleneck``, the recommended cap and its predicted effect),
per pool (``kvscope_advisor_pool_*``) and the loop's own (``kvscope_advisor_runs_total
{result}``, last run and success timestamps, duration).

Settings: docs/advise.md#verdicts-on-metrics; every family: docs/otlp.md#what-is-exported
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvscope.advisor import EngineVerdict, FrameSource, PoolVerdict, analyze
from kvscope.collector._exposition import TextWriter, label_str, label_value
from kvscope.collector.store import Store

__all__ = ["RESULTS", "SETTLE_S", "VERDICT_FAMILIES", "VerdictLoop"]

log = logging.getLogger(__name__)

RESULTS = ("ok", "no_data", "error")
LOG_EVERY_S = 60.0
"""A failing advisor logs at most this often."""
SETTLE_S = 5.0
"""The window ends this long before now: the newest seconds are still arriving (engines
send about once a second) and would read as seconds of low throughput."""

_ENGINE_GAUGES = (  # (metric, verdict attribute, help)
    (
        "kvscope_advisor_knee_concurrency",
        "knee_concurrency",
        "Requests in flight where the engine's throughput reaches the cap fraction (default 0.9) "
        "of its plateau: the knee.",
    ),
    (
        "kvscope_advisor_plateau_tokens_per_second",
        "plateau_tokens_per_s",
        "Generated tokens per second at the engine's throughput plateau.",
    ),
    (
        "kvscope_advisor_saturated",
        "saturated",
        "1 when load went well past the knee (throughput seen not to grow), else 0.",
    ),
    (
        "kvscope_advisor_preemption_thrash",
        "preemption_thrash",
        "1 when preemptions make throughput fall past its peak, else 0.",
    ),
    (
        "kvscope_advisor_recommended_concurrency_cap",
        "recommended_concurrency_cap",
        "Recommended cap on requests in flight per engine (saturated engines only).",
    ),
    (
        "kvscope_advisor_cap_throughput_ratio",
        "predicted_throughput_fraction_at_cap",
        "Predicted share of the plateau throughput kept at the recommended cap.",
    ),
    (
        "kvscope_advisor_cap_p99_e2e_seconds",
        "predicted_p99_e2e_s_at_cap",
        "End-to-end P99 latency the engine showed at the load of the recommended cap.",
    ),
)
_POOL_GAUGES = (
    (
        "kvscope_advisor_pool_recommended_concurrency_cap",
        "recommended_concurrency_cap",
        "Recommended caps summed over the pool's saturated engines.",
    ),
    (
        "kvscope_advisor_pool_plateau_tokens_per_second",
        "plateau_tokens_per_s",
        "Plateau generated tokens per second summed over the pool's engines.",
    ),
    (
        "kvscope_advisor_pool_prefix_hit_ratio",
        "prefix_hit_rate",
        "Prefix-cache hits over lookups (tokens), summed over the pool's engines.",
    ),
    (
        "kvscope_advisor_pool_prefix_routing_loss_ratio",
        "prefix_routing_loss",
        "Share of the pool's prefix lookups that prefix-aware routing would turn into hits "
        "(blocks one replica computed while another held them; needs KV events).",
    ),
    (
        "kvscope_advisor_pool_predicted_prefix_hit_ratio_affine",
        "predicted_prefix_hit_rate_affine",
        "The pool's predicted prefix hit ratio under prefix-aware routing (needs KV events).",
    ),
    (
        "kvscope_advisor_pool_load_imbalance_ratio",
        "load_imbalance",
        "Busiest replica's mean requests in flight over the pool mean (1 = balanced).",
    ),
)
_BOTTLENECK_HELP = "The engine's bottleneck at its plateau, as the bottleneck label (value 1)."
_RUNS_HELP = "Advisor runs over the recent data, by result (ok, no_data, error)."
_LOOP_GAUGES = (  # (metric, attribute, help)
    (
        "kvscope_advisor_last_run_timestamp_seconds",
        "last_run_unix_s",
        "When the advisor last ran (unix seconds), whatever its result.",
    ),
    (
        "kvscope_advisor_last_success_timestamp_seconds",
        "last_success_unix_s",
        "When the advisor last ran without error (unix seconds).",
    ),
    (
        "kvscope_advisor_last_run_duration_seconds",
        "last_duration_s",
        "How long the advisor's latest run took.",
    ),
)
VERDICT_FAMILIES: tuple[tuple[str, str, str], ...] = (
    *((name, "gauge", h) for name, _, h in _ENGINE_GAUGES),
    ("kvscope_advisor_bottleneck", "gauge", _BOTTLENECK_HELP),
    *((name, "gauge", h) for name, _, h in _POOL_GAUGES),
    ("kvscope_advisor_runs_total", "counter", _RUNS_HELP),
    *((name, "gauge", h) for name, _, h in _LOOP_GAUGES),
)
"""(name, kind, help) of every family of :meth:`VerdictLoop.snapshot`."""


@dataclass
class _PoolVerdicts:
    """The latest verdicts of one pool, with their preformatted labels."""

    pool: PoolVerdict | None = None
    engines: list[tuple[str, dict[str, str], EngineVerdict]] = field(default_factory=list)
    """(preformatted labels, the same labels as a dict, verdict) per engine."""


def _py(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return None
    return v


class VerdictLoop:
    """Runs the advisor every ``interval_s`` over the last ``window_s`` seconds.

    ``store`` needs the read methods ``engines()``, ``windows(...)`` and
    ``requests(...)``; ``clock`` gives unix seconds (tests move it).
    """

    def __init__(
        self,
        store: Store,
        *,
        interval_s: float,
        window_s: float,
        cap_fraction: float = 0.9,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.window_s = window_s
        self.cap_fraction = cap_fraction
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pools: dict[str | None, _PoolVerdicts] = {}
        self.runs = dict.fromkeys(RESULTS, 0)
        self.last_run_unix_s: float | None = None
        self.last_success_unix_s: float | None = None
        self.last_duration_s: float | None = None
        self._last_log = -math.inf
        self._unlogged = 0

    # -- the thread ------------------------------------------------------------------

    def start(self) -> VerdictLoop:
        """Start the thread; its first run is right away."""
        self._thread = threading.Thread(target=self._loop, name="kvscope-advisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the thread to stop (a run in progress ends after its current pool)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the advisor thread did not stop within %.0f s", timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except BaseException:  # never let the thread die silently
                log.exception("advisor loop failed")
            if self._stop.wait(self.interval_s):
                return

    # -- one run ---------------------------------------------------------------------

    def run_once(self) -> str:
        """Analyse the recent data once; return the result (``ok``, ``no_data``, ``error``)."""
        t0 = time.perf_counter()
        now = self.clock()
        until = now - SETTLE_S
        since = until - self.window_s
        fresh: dict[str | None, _PoolVerdicts] = {}
        failed: list[str | None] = []
        errors: list[BaseException] = []
        try:
            engines = self.store.engines()
            groups = self._groups(engines)
        except Exception as exc:
            groups, errors = [], [exc]
        for pool, eng in groups:
            if self._stop.is_set():
                break
            try:
                fresh[pool] = self._run_pool(pool, eng, since, until)
            except Exception as exc:
                failed.append(pool)
                errors.append(exc)
        result = (
            "error" if errors else ("ok" if any(p.engines for p in fresh.values()) else "no_data")
        )
        with self._lock:
            if errors and not groups:
                fresh = dict(self._pools)  # nothing could be read: keep what was shown
            for pool in failed:
                if pool in self._pools:
                    fresh[pool] = self._pools[pool]
            self._pools = {k: v for k, v in fresh.items() if v.engines}
            self.runs[result] += 1
            self.last_run_unix_s = now
            self.last_duration_s = time.perf_counter() - t0
            if not errors:
                self.last_success_unix_s = now
        if errors:
            self._log_failure(errors[0], len(errors))
        return result

    @staticmethod
    def _groups(engines: pd.DataFrame) -> list[tuple[str | None, pd.DataFrame]]:
        if not len(engines):
            return []
        pools = engines["pool"] if "pool" in engines else pd.Series([None] * len(engines))
        keys = [_py(p) for p in pools]
        out: dict[str | None, list[int]] = {}
        for i, k in enumerate(keys):
            out.setdefault(None if k is None else str(k), []).append(i)
        return [(k, engines.iloc[idx]) for k, idx in sorted(out.items(), key=lambda kv: str(kv[0]))]

    def _run_pool(
        self, pool: str | None, engines: pd.DataFrame, since: float, until: float
    ) -> _PoolVerdicts:
        if pool is not None:
            windows = self.store.windows(pool=pool, since_unix_s=since, until_unix_s=until)
            requests = self.store.requests(pool=pool, since_unix_s=since, until_unix_s=until)
        else:  # engines without a hello yet: no pool to filter on
            ids = [str(e) for e in engines["engine_id"]]
            windows = pd.concat(
                [
                    self.store.windows(engine_id=e, since_unix_s=since, until_unix_s=until)
                    for e in ids
                ],
                ignore_index=True,
            )
            requests = pd.concat(
                [
                    self.store.requests(engine_id=e, since_unix_s=since, until_unix_s=until)
                    for e in ids
                ],
                ignore_index=True,
            )
        kv_events = self._kv_events(pool, engines, since, until)
        report = analyze(
            FrameSource(engines, windows, requests, kv_events),
            since,
            until,
            pool,
            cap_fraction=self.cap_fraction,
        )
        models = {str(r["engine_id"]): _py(r.get("model")) for r in engines.to_dict("records")}
        out = _PoolVerdicts(pool=report.pools[0] if report.pools else None)
        for v in report.engines:
            pairs = (("engine", v.engine_id), ("pool", v.pool), ("model", models.get(v.engine_id)))
            out.engines.append((label_str(pairs), {k: label_value(x) for k, x in pairs}, v))
        return out

    def _kv_events(
        self, pool: str | None, engines: pd.DataFrame, since: float, until: float
    ) -> pd.DataFrame | None:
        """The pool's KV-event seconds (``None`` for a store without them)."""
        read = getattr(self.store, "kv_event_windows", None)
        if read is None:
            return None
        if pool is not None:
            return read(pool=pool, since_unix_s=since, until_unix_s=until)
        frames = [
            read(engine_id=str(e), since_unix_s=since, until_unix_s=until)
            for e in engines["engine_id"]
        ]
        return pd.concat(frames, ignore_index=True) if frames else None

    def _log_failure(self, exc: BaseException, n: int) -> None:
        self._unlogged += n
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_S:
            return
        first = self._last_log == -math.inf
        log.error(
            "advisor run failed (%d failure(s) since the last report): %s: %s",
            self._unlogged,
            type(exc).__name__,
            exc,
            exc_info=exc if first else None,
        )
        self._last_log = now
        self._unlogged = 0

    # -- exposition ------------------------------------------------------------------

    def render(self, w: TextWriter) -> None:
        """Write the ``kvscope_advisor_*`` families from the latest verdicts."""
        with self._lock:
            pools = [self._pools[k] for k in sorted(self._pools, key=str)]
            engines = [e for p in pools for e in p.engines]
            for name, attr, help_text in _ENGINE_GAUGES:
                w.family(name, "gauge", help_text)
                for labels, _, v in engines:
                    value = getattr(v, attr)
                    if value is not None and not (
                        isinstance(value, float) and not math.isfinite(value)
                    ):
                        w.sample(name, labels, int(value) if isinstance(value, bool) else value)
            w.family("kvscope_advisor_bottleneck", "gauge", _BOTTLENECK_HELP)
            for labels, _, v in engines:
                w.sample(
                    "kvscope_advisor_bottleneck",
                    f"{labels},{label_str((('bottleneck', v.bottleneck),))}",
                    1,
                )
            for name, attr, help_text in _POOL_GAUGES:
                w.family(name, "gauge", help_text)
                for p in pools:
                    value = getattr(p.pool, attr) if p.pool is not None else None
                    if value is not None and math.isfinite(float(value)):
                        w.sample(
                            name, label_str((("pool", p.pool.pool if p.pool else None),)), value
                        )
            w.family("kvscope_advisor_runs_total", "counter", _RUNS_HELP)
            for result in RESULTS:
                w.sample(
                    "kvscope_advisor_runs_total",
                    label_str((("result", result),)),
                    self.runs[result],
                )
            for name, attr, help_text in _LOOP_GAUGES:
                w.family(name, "gauge", help_text)
                value = getattr(self, attr)
                if value is not None:
                    w.sample(name, "", value)

    def snapshot(self) -> dict[str, list[tuple[Mapping[str, str], float]]]:
        """The families of :data:`VERDICT_FAMILIES` with the samples ``/metrics`` shows:
        name -> [(labels, value)]."""
        out: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        with self._lock:
            pools = [self._pools[k] for k in sorted(self._pools, key=str)]
            engines = [e for p in pools for e in p.engines]
            for name, attr, _ in _ENGINE_GAUGES:
                out[name] = [
                    (attrs, float(value))
                    for _, attrs, v in engines
                    if (value := getattr(v, attr)) is not None and math.isfinite(float(value))
                ]
            out["kvscope_advisor_bottleneck"] = [
                ({**attrs, "bottleneck": label_value(v.bottleneck)}, 1) for _, attrs, v in engines
            ]
            for name, attr, _ in _POOL_GAUGES:
                out[name] = [
                    ({"pool": label_value(p.pool.pool)}, float(value))
                    for p in pools
                    if p.pool is not None
                    and (value := getattr(p.pool, attr)) is not None
                    and math.isfinite(float(value))
                ]
            out["kvscope_advisor_runs_total"] = [({"result": r}, self.runs[r]) for r in RESULTS]
            for name, attr, _ in _LOOP_GAUGES:
                value = getattr(self, attr)
                out[name] = [] if value is None else [({}, value)]
        return out
