"""In-memory fleet metrics and their Prometheus exposition (``GET /metrics``).

:class:`FleetState` is updated by the writer thread after each commit (so a sample
never shows data that is not stored) and rendered fresh on every scrape; it holds
plain numbers per engine, no prometheus_client objects. :meth:`FleetState.snapshot`
gives the per-engine families as labelled values, to push elsewhere
(:mod:`kvscope.collector.otlp`).

Per engine (labels ``engine``, ``pool``, ``model`` from the latest hello):

* gauges of the latest step (``kvscope_engine_batch_size``, ``..._kv_usage_ratio``...);
* counters of steps, tokens, preemptions, prefix lookups, finished requests, the queue
  summed over steps, and the plugin's ``kvscope_exporter_<field>_total``;
* histograms of per-step batch size and KV usage, and of request latency (the
  definitions of :mod:`kvscope.advisor.request_latency`; buckets at the usual SLO
  targets, so a good-request ratio is one bucket over the count);
* ``kvscope_engine_info`` and the configuration's numbers as gauges, for PromQL.

Besides: ``kvscope_collector_*`` and the advisor's verdicts (``kvscope_advisor_*``,
:mod:`kvscope.collector.verdicts`). Counters stay monotonic across restarts (rebuilt
from the store); histograms are saved at a clean shutdown and restored.

Every family and the restart rules: docs/collector.md#metrics
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.prefill import request_ttft_s
from kvscope.advisor.request_latency import request_itl_s
from kvscope.collector._exposition import (
    CONTENT_TYPE,
    TextWriter,
    bound_strs,
    label_str,
    label_value,
)
from kvscope.collector._ingest import DUPLICATE, STORED, IngestResult
from kvscope.collector._request_rollup import (
    FINISH_REASONS,
    ITL_SECONDS_BUCKETS,
    ITL_SQL,
    REQUEST_SECONDS_BUCKETS,
    REQUEST_TOKEN_BUCKETS,
    TTFT_SQL,
)
from kvscope.collector.batch import PreparedBatch
from kvscope.engine_plugins.schema import BOOL, EXPORTER_FIELDS, FLOAT, HELLO_FIELDS, INT

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "CONTENT_TYPE",
    "ENGINE_FAMILIES",
    "HISTOGRAM_BOUNDS",
    "KV_USAGE_BUCKETS",
    "FleetState",
    "Snapshot",
]

BATCH_SIZE_BUCKETS: tuple[float, ...] = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
)
KV_USAGE_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
ACK_SECONDS_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class RequestHistogram:
    """A per-engine histogram of one measure of the finished requests."""

    name: str
    bounds: tuple[float, ...]
    help: str
    sql: str
    """The measure as an SQL expression over the ``requests`` table (NULL: no value)."""

    @property
    def les(self) -> list[str]:
        return bound_strs(self.bounds)


REQUEST_HISTOGRAMS: tuple[RequestHistogram, ...] = (
    RequestHistogram(
        "kvscope_request_ttft_seconds",
        REQUEST_SECONDS_BUCKETS,
        "Time to first token per finished request (vLLM's, else queue + prefill time).",
        TTFT_SQL,
    ),
    RequestHistogram(
        "kvscope_request_inter_token_latency_seconds",
        ITL_SECONDS_BUCKETS,
        "Mean inter-token latency per finished request with at least 2 output tokens: "
        "decode time / (output tokens - 1).",
        ITL_SQL,
    ),
    RequestHistogram(
        "kvscope_request_e2e_seconds",
        REQUEST_SECONDS_BUCKETS,
        "End-to-end latency per finished request, arrival to last token.",
        "e2e_s",
    ),
    RequestHistogram(
        "kvscope_request_queue_seconds",
        REQUEST_SECONDS_BUCKETS,
        "Time in the engine's waiting queue per finished request.",
        "queue_s",
    ),
    RequestHistogram(
        "kvscope_request_prefill_seconds",
        REQUEST_SECONDS_BUCKETS,
        "Prefill time per finished request: from its first scheduling to its first token.",
        "prefill_s",
    ),
    RequestHistogram(
        "kvscope_request_decode_seconds",
        REQUEST_SECONDS_BUCKETS,
        "Decode time per finished request: from its first token to its last.",
        "decode_s",
    ),
    RequestHistogram(
        "kvscope_request_prompt_tokens",
        REQUEST_TOKEN_BUCKETS,
        "Prompt length per finished request, in tokens.",
        "prompt_tokens",
    ),
    RequestHistogram(
        "kvscope_request_generation_tokens",
        REQUEST_TOKEN_BUCKETS,
        "Output length per finished request, in tokens.",
        "generation_tokens",
    ),
)
_FINISH_HELP = "Finished requests by finish reason (stop, length, abort, error, other)."
_FINISH_FAMILY = "kvscope_request_finished_by_reason_total"


def request_measures(cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each :data:`REQUEST_HISTOGRAMS` measure of a batch's request columns (NaN: no
    value), as the histograms' ``sql`` computes it from the stored rows."""
    n = len(cols["e2e_s"])

    def col(name: str) -> np.ndarray:
        return np.asarray(cols[name], dtype=np.float64) if name in cols else np.full(n, np.nan)

    frame = pd.DataFrame(
        {k: col(k) for k in ("ttft_s", "queue_s", "prefill_s", "decode_s", "generation_tokens")}
    )
    return {
        "kvscope_request_ttft_seconds": np.asarray(request_ttft_s(frame), dtype=np.float64),
        "kvscope_request_inter_token_latency_seconds": request_itl_s(frame),
        "kvscope_request_e2e_seconds": col("e2e_s"),
        "kvscope_request_queue_seconds": col("queue_s"),
        "kvscope_request_prefill_seconds": col("prefill_s"),
        "kvscope_request_decode_seconds": col("decode_s"),
        "kvscope_request_prompt_tokens": col("prompt_tokens"),
        "kvscope_request_generation_tokens": col("generation_tokens"),
    }


def finish_reason_label(reason: Any) -> str:
    """The ``reason`` label of a stored finish reason (:data:`FINISH_REASONS`)."""
    r = str(reason).lower() if reason is not None else ""
    return r if r in FINISH_REASONS else "other"


_BATCH_BOUNDS = np.array(BATCH_SIZE_BUCKETS, dtype=np.float64)
_KV_BOUNDS = np.array(KV_USAGE_BUCKETS, dtype=np.float64)
_BATCH_LES = bound_strs(BATCH_SIZE_BUCKETS)
_KV_LES = bound_strs(KV_USAGE_BUCKETS)
_ACK_LES = bound_strs(ACK_SECONDS_BUCKETS)

#: Hello fields shown as labels of kvscope_engine_info (beside engine, pool, model).
INFO_KEYS: tuple[str, ...] = tuple(
    f.name
    for f in HELLO_FIELDS
    if f.name
    not in (
        "engine_id",
        "boot_id",
        "pool",
        "model",
        "pid",
        "port",
        "engine_index",
        "started_unix_s",
    )
)
_SAVED_KEY = "metrics.histograms.v1"

#: Reasons of ``kvscope_collector_rejected_batches_total``, exported at 0 from the start.
REJECT_REASONS: tuple[str, ...] = (
    "bad_encoding",
    "bad_json",
    "boot_limit",
    "engine_limit",
    "forbidden",
    "overloaded",
    "schema",
    "shutting_down",
    "timeout",
    "too_large",
    "unauthorized",
    "unsupported_encoding",
)
#: Reasons of ``kvscope_collector_rejected_reads_total`` (read API and /metrics).
READ_REJECT_REASONS: tuple[str, ...] = ("bad_params", "forbidden", "unauthorized")
#: Tables of ``kvscope_collector_retention_deleted_rows_total``, exported at 0 from the start.
RETAINED_TABLES: tuple[str, ...] = (
    "steps",
    "ingested_batches",
    "kv_event_windows",
    "windows_1s",
    "requests",
    "windows_1m",
    "requests_1m",
)

_GAUGES = (  # (metric, attribute, help)
    (
        "kvscope_engine_batch_size",
        "batch_size",
        "Running requests (the batch) in the engine's latest step.",
    ),
    (
        "kvscope_engine_waiting_requests",
        "waiting",
        "Waiting requests (not deferred) in the engine's latest step.",
    ),
    (
        "kvscope_engine_deferred_requests",
        "deferred",
        "Waiting requests deferred by transient constraints in the latest step.",
    ),
    (
        "kvscope_engine_kv_usage_ratio",
        "kv_usage_ratio",
        "Fraction of KV-cache blocks in use in the latest step.",
    ),
    (
        "kvscope_engine_kv_used_blocks",
        "kv_blocks_used",
        "KV-cache blocks in use in the latest step.",
    ),
    (
        "kvscope_engine_prefix_hit_ratio",
        "prefix_hit_ratio",
        "Prefix-cache hit tokens / query tokens over the latest batch (about 1 s) with queries.",
    ),
    (
        "kvscope_engine_last_step_timestamp_seconds",
        "last_step_unix_s",
        "Wall-clock time of the latest step (engine clock).",
    ),
    (
        "kvscope_engine_last_seen_timestamp_seconds",
        "last_seen_unix_s",
        "When the collector last stored a batch of this engine (collector clock).",
    ),
)
_COUNTERS = (  # (metric, attribute, help)
    ("kvscope_engine_steps_total", "steps", "Engine steps recorded."),
    ("kvscope_engine_prompt_tokens_total", "prompt_tokens", "Prompt tokens processed."),
    ("kvscope_engine_generation_tokens_total", "generation_tokens", "Tokens generated."),
    ("kvscope_engine_preemptions_total", "preemptions", "Requests preempted."),
    (
        "kvscope_engine_prefix_cache_query_tokens_total",
        "prefix_queries",
        "Prefix-cache lookups, in tokens.",
    ),
    (
        "kvscope_engine_prefix_cache_hit_tokens_total",
        "prefix_hits",
        "Prefix-cache hits, in tokens.",
    ),
    ("kvscope_engine_finished_requests_total", "finished_requests", "Requests finished."),
    (
        "kvscope_engine_waiting_request_steps_total",
        "waiting_steps",
        "Waiting requests summed over the engine's steps; its increase over the increase of "
        "kvscope_engine_steps_total is the mean queue per step.",
    ),
    (
        "kvscope_engine_deferred_request_steps_total",
        "deferred_steps",
        "Deferred waiting requests summed over the engine's steps (as waiting_request_steps).",
    ),
)
_CONFIG_GAUGES = (  # (metric, hello field, help)
    (
        "kvscope_engine_max_num_seqs",
        "max_num_seqs",
        "The engine's max_num_seqs: most requests one step runs (from its latest hello).",
    ),
    (
        "kvscope_engine_max_num_batched_tokens",
        "max_num_batched_tokens",
        "The engine's token budget per step, max_num_batched_tokens (from its latest hello).",
    ),
    (
        "kvscope_engine_kv_capacity_blocks",
        "num_gpu_blocks",
        "KV-cache blocks the engine has, num_gpu_blocks (from its latest hello).",
    ),
    (
        "kvscope_engine_kv_block_size_tokens",
        "block_size",
        "Tokens per KV-cache block (from its latest hello).",
    ),
    (
        "kvscope_engine_start_time_seconds",
        "started_unix_s",
        "When the engine's current process started, unix seconds (from its latest hello): "
        "it changes when the engine restarts, also under the same id.",
    ),
)
_STEP_SUMS = (
    "prompt_tokens",
    "generation_tokens",
    "preemptions",
    "prefix_queries",
    "prefix_hits",
    "waiting_steps",
    "deferred_steps",
)
#: Step column summed into each _STEP_SUMS attribute (the same name unless listed).
_STEP_COLUMN = {"waiting_steps": "waiting", "deferred_steps": "deferred"}
_BATCH_HIST_HELP = "Running requests per engine step (one observation per step)."
_KV_HIST_HELP = "KV-cache usage per engine step (one observation per step)."
_INFO_HELP = "Engine identity and configuration from its latest hello (value 1)."

HISTOGRAM_BOUNDS: dict[str, tuple[float, ...]] = {
    "kvscope_engine_step_batch_size": BATCH_SIZE_BUCKETS,
    "kvscope_engine_step_kv_usage_ratio": KV_USAGE_BUCKETS,
    **{h.name: h.bounds for h in REQUEST_HISTOGRAMS},
}
"""Upper bucket bounds (without +Inf) of the per-engine histograms."""
ENGINE_FAMILIES: tuple[tuple[str, str, str], ...] = (
    *((name, "gauge", h) for name, _, h in _GAUGES),
    *((name, "counter", h) for name, _, h in _COUNTERS),
    ("kvscope_engine_step_batch_size", "histogram", _BATCH_HIST_HELP),
    ("kvscope_engine_step_kv_usage_ratio", "histogram", _KV_HIST_HELP),
    *((h.name, "histogram", h.help) for h in REQUEST_HISTOGRAMS),
    (_FINISH_FAMILY, "counter", _FINISH_HELP),
    ("kvscope_engine_info", "gauge", _INFO_HELP),
    *((name, "gauge", h) for name, _, h in _CONFIG_GAUGES),
    *(
        (
            f"kvscope_exporter_{f.name}_total",
            "counter",
            f"Engine plugin: {f.doc} (summed over boots).",
        )
        for f in EXPORTER_FIELDS
    ),
)
"""(name, kind, help) of every per-engine family of :meth:`FleetState.snapshot`."""

Attrs = Mapping[str, str]


@dataclass(frozen=True)
class Snapshot:
    """The per-engine families at one moment, as plain values (for pushing elsewhere)."""

    samples: dict[str, list[tuple[Attrs, float]]]
    """Gauge and counter families: name -> [(labels, value)]; a gauge without a value
    for an engine has no sample, as on ``/metrics``."""
    histograms: dict[str, list[tuple[Attrs, list[int], float]]]
    """Histogram families: name -> [(labels, counts per bucket (not cumulative, +Inf
    last), sum of the observations)]."""


class _Engine:
    """Metric values of one engine."""

    __slots__ = (
        "attrs",
        "batch_hist",
        "batch_size",
        "batch_sum",
        "config",
        "deferred",
        "deferred_steps",
        "engine_id",
        "exporter",
        "finish_reasons",
        "finished_requests",
        "gauge_boot_id",
        "gauge_boots",
        "generation_tokens",
        "hello_started",
        "info",
        "info_attrs",
        "kv_blocks_used",
        "kv_hist",
        "kv_sum",
        "kv_usage_ratio",
        "labels",
        "last_seen_unix_s",
        "last_step_unix_s",
        "preemptions",
        "prefix_hit_ratio",
        "prefix_hits",
        "prefix_queries",
        "prompt_tokens",
        "req_hist",
        "req_sum",
        "steps",
        "waiting",
        "waiting_steps",
    )

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.labels = label_str((("engine", engine_id), ("pool", ""), ("model", "")))
        self.attrs = {"engine": engine_id, "pool": "", "model": ""}
        self.info: str | None = None
        self.info_attrs: dict[str, str] | None = None
        self.config: dict[str, float] = {}
        self.hello_started = -1.0
        self.batch_size: int | None = None
        self.waiting: int | None = None
        self.deferred: int | None = None
        self.kv_blocks_used: int | None = None
        self.kv_usage_ratio: float | None = None
        self.prefix_hit_ratio: float | None = None
        self.last_step_unix_s: float | None = None
        self.last_seen_unix_s: float | None = None
        self.gauge_boot_id: str | None = None
        self.gauge_boots: set[str] = set()
        """Boots whose steps have set the gauges (an engine served by several API server
        processes sends one stream per process, each its own boot)."""
        self.steps = self.prompt_tokens = self.generation_tokens = self.preemptions = 0
        self.prefix_queries = self.prefix_hits = self.finished_requests = 0
        self.waiting_steps = self.deferred_steps = 0
        self.batch_hist = np.zeros(len(_BATCH_LES), dtype=np.int64)
        self.kv_hist = np.zeros(len(_KV_LES), dtype=np.int64)
        self.batch_sum = 0.0
        self.kv_sum = 0.0
        self.exporter: dict[str, dict[str, int]] = {}
        self.req_hist = {
            h.name: np.zeros(len(h.bounds) + 1, dtype=np.int64) for h in REQUEST_HISTOGRAMS
        }
        self.req_sum = dict.fromkeys(self.req_hist, 0.0)
        self.finish_reasons = dict.fromkeys(FINISH_REASONS, 0)

    def set_identity(self, ident: dict[str, Any], started: float, latest: float = math.inf) -> None:
        """Take ``ident`` unless the identity held is of a later start; one held that starts
        after ``latest`` (the collector's clock plus the allowed skew) is replaced anyway."""
        if started < self.hello_started <= latest:
            return
        self.hello_started = started
        base = (
            ("engine", self.engine_id),
            ("pool", ident.get("pool")),
            ("model", ident.get("model")),
        )
        self.labels = label_str(base)
        info = (*base, *((k, ident.get(k)) for k in INFO_KEYS))
        self.info = label_str(info)
        self.attrs = {k: label_value(v) for k, v in base}
        self.info_attrs = {k: label_value(v) for k, v in info}
        self.config = {
            f: float(v)
            for _, f, _ in _CONFIG_GAUGES
            if isinstance(v := ident.get(f), int | float) and not isinstance(v, bool)
        }


class FleetState:
    """Per-engine metric values plus the collector's own counters; thread-safe."""

    def __init__(self, max_exported_engines: int = 2_000, max_clock_skew_s: float = 300.0) -> None:
        self._lock = threading.Lock()
        self.max_clock_skew_s = max_clock_skew_s
        """An identity or a latest step dated more than this after the collector's clock
        does not hold off newer data (see :meth:`_apply_batch`)."""
        self._engines: dict[str, _Engine] = {}
        self.max_exported_engines = max_exported_engines
        """Engines with per-engine series on a scrape: the most recently seen ones."""
        self.start_unix_s = time.time()
        self._batches = {"stored": 0, "duplicate": 0, "rejected": 0, "failed": 0}
        self._rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._read_rejected: dict[str, int] = dict.fromkeys(READ_REJECT_REASONS, 0)
        self._retention_deleted: dict[str, int] = dict.fromkeys(RETAINED_TABLES, 0)
        self._not_exported = 0
        self._ack_hist = np.zeros(len(_ACK_LES), dtype=np.int64)
        self._ack_sum = 0.0
        self.extra: dict[str, tuple[str, str, Callable[[], float]]] = {}
        self.rollup_rows_written = 0
        """1-minute window rows the retention task's rollup has written."""
        self.request_rollup_rows_written = 0
        """Request-minute rows (``requests_1m``) the retention task's rollup has written."""
        """Collector metrics read at scrape time: name -> (gauge|counter, help, callable)."""
        self.sections: list[Callable[[TextWriter], None]] = []
        """More families written at scrape time, after the state's own (e.g. the advisor's
        verdicts); each takes its own lock."""

    def _engine(self, engine_id: str) -> _Engine:
        e = self._engines.get(engine_id)
        if e is None:
            e = self._engines[engine_id] = _Engine(engine_id)
        return e

    @property
    def n_engines(self) -> int:
        """Engines known."""
        return len(self._engines)

    def knows(self, engine_id: str) -> bool:
        """True if the engine has data in the store."""
        return engine_id in self._engines

    def pool_of(self, engine_id: str) -> str | None:
        """The pool of the engine's latest hello (None: unknown engine or no hello yet)."""
        with self._lock:
            e = self._engines.get(engine_id)
            if e is None or e.hello_started < 0:
                return None
            return e.attrs.get("pool") or ""

    def engines_of_pool(self, pool: str) -> set[str]:
        """The engines whose latest hello names ``pool``."""
        with self._lock:
            return {
                e.engine_id
                for e in self._engines.values()
                if e.hello_started >= 0 and e.attrs.get("pool") == pool
            }

    # -- updates ---------------------------------------------------------------------

    def apply(self, batches: list[PreparedBatch], results: list[IngestResult | Exception]) -> None:
        """Account a committed group (called by the writer before it answers)."""
        with self._lock:
            for b, r in zip(batches, results, strict=True):
                if isinstance(r, Exception):
                    self._batches["failed"] += 1
                elif r.status == DUPLICATE:
                    self._batches["duplicate"] += 1
                elif r.status == STORED:
                    self._batches["stored"] += 1
                    self._apply_batch(b)

    def _apply_batch(self, b: PreparedBatch) -> None:
        e = self._engine(b.engine_id)
        if e.last_seen_unix_s is None or b.received_unix_s > e.last_seen_unix_s:
            e.last_seen_unix_s = b.received_unix_s
        latest = b.received_unix_s + self.max_clock_skew_s
        if b.hello is not None:
            e.set_identity(b.hello, b.hello["started_unix_s"], latest)
        e.finished_requests += b.n_requests
        if b.n_requests:
            _observe_requests(e, b.requests)
        for k, v in b.exporter.items():
            boot = e.exporter.setdefault(b.boot_id, {})
            boot[k] = max(v, boot.get(k, 0))
        n = b.n_steps
        if not n:
            return
        s = b.steps
        e.steps += n
        for a in _STEP_SUMS:
            setattr(e, a, getattr(e, a) + int(s[_STEP_COLUMN.get(a, a)].sum()))
        ts = s["ts_unix_s"]
        i = int(ts.argmax())
        # The latest step by step time sets the gauges; a new boot takes over even if
        # its clock is behind the previous boot's. Boots seen before (the streams of an
        # engine's API server processes, which run side by side) go by step time.
        if (
            e.last_step_unix_s is None
            or ts[i] >= e.last_step_unix_s
            or b.boot_id not in e.gauge_boots
            or e.last_step_unix_s > latest  # dated ahead of the clock: not the latest
        ):
            e.last_step_unix_s = float(ts[i])
            e.gauge_boot_id = b.boot_id
            if len(e.gauge_boots) >= 64:  # restarts over a long life: keep a few
                e.gauge_boots.clear()
            e.gauge_boots.add(b.boot_id)
            for a in ("batch_size", "waiting", "deferred", "kv_blocks_used"):
                setattr(e, a, int(s[a][i]))
            e.kv_usage_ratio = float(s["kv_usage_ratio"][i])
        q = int(s["prefix_queries"].sum())
        if q > 0:
            e.prefix_hit_ratio = int(s["prefix_hits"].sum()) / q
        bs, kv = s["batch_size"], s["kv_usage_ratio"]
        e.batch_hist += np.bincount(np.searchsorted(_BATCH_BOUNDS, bs), minlength=len(_BATCH_LES))
        e.kv_hist += np.bincount(np.searchsorted(_KV_BOUNDS, kv), minlength=len(_KV_LES))
        e.batch_sum += float(bs.sum())
        e.kv_sum += float(kv.sum())

    def record_rejection(self, reason: str) -> None:
        """Count a batch answered with 4xx/503 before reaching the store."""
        with self._lock:
            self._batches["rejected"] += 1
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def record_retention(self, deleted: Mapping[str, int]) -> None:
        """Count the rows one retention pass deleted, per table."""
        with self._lock:
            for table, n in deleted.items():
                self._retention_deleted[table] = self._retention_deleted.get(table, 0) + int(n)

    def record_read_rejection(self, reason: str) -> None:
        """Count a read-API or /metrics request answered 400 or 401."""
        with self._lock:
            self._read_rejected[reason] = self._read_rejected.get(reason, 0) + 1

    def observe_ack(self, seconds: float) -> None:
        """Time from request start to the answer of an ingest that reached the store."""
        with self._lock:
            self._ack_hist[int(np.searchsorted(ACK_SECONDS_BUCKETS, seconds))] += 1
            self._ack_sum += seconds

    # -- persistence -----------------------------------------------------------------

    def rebuild(self, store: Any) -> None:
        """Load identities and counters from the store (at startup)."""
        engines = store.engines()
        totals = store.totals("windows")
        finished = store.finished_request_counts()
        request_hist = store.request_histograms(REQUEST_HISTOGRAMS)
        reasons = store.finish_reason_counts()
        exporter = store.exporter_stats()
        saved = store.take_state(_SAVED_KEY)
        with self._lock:
            for r in engines.to_dict("records"):
                e = self._engine(r["engine_id"])
                if _py(r.get("has_hello")):
                    ident = _hello_values(r)
                    e.set_identity(ident, float(ident["started_unix_s"] or 0.0))
                e.last_seen_unix_s = _py(r.get("last_seen_unix_s"))
                e.last_step_unix_s = _py(r.get("last_step_unix_s"))
            for r in totals.to_dict("records"):
                e = self._engine(r["engine_id"])
                e.steps = int(r["n_steps"])
                for a in _STEP_SUMS:
                    setattr(e, a, int(r[a]))
            for r in finished.to_dict("records"):
                self._engine(r["engine_id"]).finished_requests = int(r["n_requests"])
            for r in request_hist.to_dict("records"):
                e = self._engine(r["engine_id"])
                e.req_hist[r["family"]][int(r["bucket"])] = int(r["n"])
                e.req_sum[r["family"]] += float(r["total"])
            for r in reasons.to_dict("records"):
                e = self._engine(r["engine_id"])
                e.finish_reasons[finish_reason_label(r["finish_reason"])] += int(r["n"])
            for r in exporter.to_dict("records"):
                boot = self._engine(r["engine_id"]).exporter.setdefault(r["boot_id"], {})
                for f in EXPORTER_FIELDS:
                    v = _py(r.get(f.name))
                    if v is not None:
                        boot[f.name] = int(v)
            if saved:
                self._load_histograms(saved)

    def _load_histograms(self, text: str) -> None:
        data = json.loads(text)
        if data.get("batch_les") != _BATCH_LES or data.get("kv_les") != _KV_LES:
            return  # buckets changed: start the histograms afresh
        for eid, h in data["engines"].items():
            e = self._engine(eid)
            e.batch_hist = np.array(h["batch"], dtype=np.int64)
            e.kv_hist = np.array(h["kv"], dtype=np.int64)
            e.batch_sum, e.kv_sum = float(h["batch_sum"]), float(h["kv_sum"])

    def save(self, store: Any) -> None:
        """Save the histograms (at a clean shutdown) for :meth:`rebuild`."""
        with self._lock:
            data = {
                "batch_les": _BATCH_LES,
                "kv_les": _KV_LES,
                "engines": {
                    e.engine_id: {
                        "batch": e.batch_hist.tolist(),
                        "kv": e.kv_hist.tolist(),
                        "batch_sum": e.batch_sum,
                        "kv_sum": e.kv_sum,
                    }
                    for e in self._engines.values()
                },
            }
        store.save_state(_SAVED_KEY, json.dumps(data))

    # -- exposition ------------------------------------------------------------------

    def render(self) -> str:
        """The Prometheus text exposition of everything, built fresh."""
        w = TextWriter()
        with self._lock:
            engines = self._exported()
            for name, attr, help_text in _GAUGES:
                w.family(name, "gauge", help_text)
                for e in engines:
                    v = getattr(e, attr)
                    if v is not None:
                        w.sample(name, e.labels, v)
            for name, attr, help_text in _COUNTERS:
                w.family(name, "counter", help_text)
                for e in engines:
                    w.sample(name, e.labels, getattr(e, attr))
            w.family("kvscope_engine_step_batch_size", "histogram", _BATCH_HIST_HELP)
            for e in engines:
                w.histogram(
                    "kvscope_engine_step_batch_size",
                    e.labels,
                    _BATCH_LES,
                    e.batch_hist.tolist(),
                    e.batch_sum,
                )
            w.family("kvscope_engine_step_kv_usage_ratio", "histogram", _KV_HIST_HELP)
            for e in engines:
                w.histogram(
                    "kvscope_engine_step_kv_usage_ratio",
                    e.labels,
                    _KV_LES,
                    e.kv_hist.tolist(),
                    e.kv_sum,
                )
            for h in REQUEST_HISTOGRAMS:
                w.family(h.name, "histogram", h.help)
                les = _REQUEST_LES[h.name]
                for e in engines:
                    w.histogram(
                        h.name, e.labels, les, e.req_hist[h.name].tolist(), e.req_sum[h.name]
                    )
            w.family(_FINISH_FAMILY, "counter", _FINISH_HELP)
            for e in engines:
                for reason, n in e.finish_reasons.items():
                    w.sample(_FINISH_FAMILY, f'{e.labels},reason="{reason}"', n)
            w.family("kvscope_engine_info", "gauge", _INFO_HELP)
            for e in engines:
                if e.info is not None:
                    w.sample("kvscope_engine_info", e.info, 1)
            for name, key, help_text in _CONFIG_GAUGES:
                w.family(name, "gauge", help_text)
                for e in engines:
                    if key in e.config:
                        w.sample(name, e.labels, e.config[key])
            for f in EXPORTER_FIELDS:
                name = f"kvscope_exporter_{f.name}_total"
                w.family(name, "counter", f"Engine plugin: {f.doc} (summed over boots).")
                for e in engines:
                    w.sample(name, e.labels, sum(b.get(f.name, 0) for b in e.exporter.values()))
            self._render_collector(w, len(self._engines))
        for section in self.sections:
            section(w)
        return w.text()

    def _exported(self) -> list[_Engine]:
        """The engines shown, by id (the caller holds the lock): the most recently seen
        ``max_exported_engines``."""
        engines = list(self._engines.values())
        if len(engines) > self.max_exported_engines:
            engines.sort(key=lambda e: e.last_seen_unix_s or 0.0, reverse=True)
            engines = engines[: self.max_exported_engines]
        self._not_exported = len(self._engines) - len(engines)
        engines.sort(key=lambda e: e.engine_id)
        return engines

    def snapshot(self) -> Snapshot:
        """The per-engine families (:data:`ENGINE_FAMILIES`) with the values ``/metrics``
        shows (the same engines), read under the lock in one go."""
        samples: dict[str, list[tuple[Attrs, float]]] = {}
        with self._lock:
            engines = self._exported()
            for name, attr, _ in _GAUGES:
                samples[name] = [
                    (e.attrs, v) for e in engines if (v := getattr(e, attr)) is not None
                ]
            for name, attr, _ in _COUNTERS:
                samples[name] = [(e.attrs, getattr(e, attr)) for e in engines]
            samples["kvscope_engine_info"] = [
                (e.info_attrs, 1) for e in engines if e.info_attrs is not None
            ]
            for name, key, _ in _CONFIG_GAUGES:
                samples[name] = [(e.attrs, e.config[key]) for e in engines if key in e.config]
            for f in EXPORTER_FIELDS:
                samples[f"kvscope_exporter_{f.name}_total"] = [
                    (e.attrs, sum(b.get(f.name, 0) for b in e.exporter.values())) for e in engines
                ]
            samples[_FINISH_FAMILY] = [
                ({**e.attrs, "reason": reason}, n)
                for e in engines
                for reason, n in e.finish_reasons.items()
            ]
            histograms: dict[str, list[tuple[Attrs, list[int], float]]] = {
                "kvscope_engine_step_batch_size": [
                    (e.attrs, e.batch_hist.tolist(), e.batch_sum) for e in engines
                ],
                "kvscope_engine_step_kv_usage_ratio": [
                    (e.attrs, e.kv_hist.tolist(), e.kv_sum) for e in engines
                ],
                **{
                    h.name: [
                        (e.attrs, e.req_hist[h.name].tolist(), e.req_sum[h.name]) for e in engines
                    ]
                    for h in REQUEST_HISTOGRAMS
                },
            }
        return Snapshot(samples, histograms)

    def _render_collector(self, w: TextWriter, n_engines: int) -> None:
        w.family(
            "kvscope_collector_ingest_batches_total",
            "counter",
            "Ingest requests by outcome (stored, duplicate, rejected, failed).",
        )
        for result, n in self._batches.items():
            w.sample("kvscope_collector_ingest_batches_total", label_str((("result", result),)), n)
        w.family(
            "kvscope_collector_rejected_batches_total",
            "counter",
            "Ingest requests rejected before reaching the store, by reason.",
        )
        for reason, n in sorted(self._rejected.items()):
            w.sample(
                "kvscope_collector_rejected_batches_total", label_str((("reason", reason),)), n
            )
        w.family(
            "kvscope_collector_rejected_reads_total",
            "counter",
            "Read-API and /metrics requests answered 400 (bad_params) or 401, by reason.",
        )
        for reason, n in sorted(self._read_rejected.items()):
            w.sample("kvscope_collector_rejected_reads_total", label_str((("reason", reason),)), n)
        w.family(
            "kvscope_collector_retention_deleted_rows_total",
            "counter",
            "Store rows the retention task deleted, by table (see the collector's retention flags).",
        )
        for table, n in sorted(self._retention_deleted.items()):
            w.sample(
                "kvscope_collector_retention_deleted_rows_total", label_str((("table", table),)), n
            )
        w.family(
            "kvscope_collector_engines_not_exported",
            "gauge",
            "Known engines left out of this scrape's per-engine series "
            "(over max_exported_engines; the least recently seen go first).",
        )
        w.sample("kvscope_collector_engines_not_exported", "", self._not_exported)
        w.family(
            "kvscope_collector_ingest_ack_duration_seconds",
            "histogram",
            "Time from an ingest request's start to its answer (after commit).",
        )
        w.histogram(
            "kvscope_collector_ingest_ack_duration_seconds",
            "",
            _ACK_LES,
            self._ack_hist.tolist(),
            self._ack_sum,
        )
        w.family("kvscope_collector_engines", "gauge", "Engines known to the collector.")
        w.sample("kvscope_collector_engines", "", n_engines)
        w.family(
            "kvscope_collector_start_time_seconds",
            "gauge",
            "When this collector process started (unix seconds).",
        )
        w.sample("kvscope_collector_start_time_seconds", "", self.start_unix_s)
        for name, (kind, help_text, fn) in sorted(self.extra.items()):
            w.family(name, kind, help_text)
            w.sample(name, "", fn())


_REQUEST_BOUNDS = {h.name: np.array(h.bounds, dtype=np.float64) for h in REQUEST_HISTOGRAMS}
_REQUEST_LES = {h.name: h.les for h in REQUEST_HISTOGRAMS}


def _observe_requests(e: _Engine, cols: Mapping[str, np.ndarray]) -> None:
    """Add a stored batch's finished requests to the engine's request histograms."""
    for name, values in request_measures(cols).items():
        v = values[np.isfinite(values)]
        if v.size:
            bounds = _REQUEST_BOUNDS[name]
            e.req_hist[name] += np.bincount(np.searchsorted(bounds, v), minlength=len(bounds) + 1)
            e.req_sum[name] += float(v.sum())
    reasons = cols.get("finish_reason")
    if reasons is not None:
        for r in reasons:
            key = finish_reason_label(r)
            e.finish_reasons[key] += 1


def _py(v: Any) -> Any:
    """None for pandas/numpy missing values, plain Python scalars otherwise."""
    if v is None or (np.isscalar(v) and pd.isna(v)) or v is pd.NA:
        return None
    return v.item() if hasattr(v, "item") else v


def _hello_values(row: dict[str, Any]) -> dict[str, Any]:
    """Hello fields of a stored row, typed as they arrive on the wire."""
    out: dict[str, Any] = {}
    for f in HELLO_FIELDS:
        v = _py(row.get(f.name))
        if v is not None:
            v = {INT: int, FLOAT: float, BOOL: bool}.get(f.kind, str)(v)
        out[f.name] = v
    return out
