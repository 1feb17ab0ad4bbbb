"""The collector's settings: one typed, validated object.

The CLI (``kvscope collector ...``) builds a :class:`Settings` from its flags; tests
build one directly. Nothing else reads the environment or the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvscope.collector.kv_endpoints import parse_allow

MIB = 1024 * 1024
HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


@dataclass(frozen=True)
class Settings:
    """Everything the collector service needs to know at start."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8844
    """TCP port to listen on (0 picks a free port; the chosen one is logged)."""
    store_path: str = "kvscope.duckdb"
    """DuckDB file of the store (created if missing); ``:memory:`` for a throwaway store."""
    token: str | None = None
    """When set, every route but ``/healthz`` requires ``Authorization: Bearer <token>``
    (compared in constant time; never logged or printed)."""
    tls_cert_file: str | None = None
    """PEM certificate (chain) to serve HTTPS with; needs ``tls_key_file``."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    raw_step_retention_s: float = DAY_S
    """Raw step rows older than this (by their ``ts_unix_s``) are deleted; 0 keeps them.
    A step takes about 18 bytes on disk: 1,000 engines at 50 steps/s fill ~78 GB a day."""
    ledger_retention_s: float = DAY_S
    """Idempotency-ledger rows older than this are deleted; 0 keeps them. A batch resent
    after its ledger row is gone would be stored again, so keep this far above any
    sender's retry horizon (the plugin resends within seconds to minutes)."""
    window_retention_s: float = 15 * DAY_S
    """1-second windows older than this are deleted once rolled up into 1-minute windows;
    0 keeps them. The advisor fits knees on 1-second windows: the default covers the
    weekly report's week and the week before it."""
    request_retention_s: float = 15 * DAY_S
    """Finished requests older than this (by ``finished_unix_s``) are deleted once rolled up
    into the request tier; 0 keeps them."""
    rollup_retention_s: float = 400 * DAY_S
    """1-minute windows (the downsampled tier read for long ranges) older than this are
    deleted; 0 keeps them."""
    request_rollup_retention_s: float = 90 * DAY_S
    """Request minutes (``requests_1m``: per-minute latency histograms, what SLO attainment
    past the request retention reads) older than this are deleted; 0 keeps them. A quarter:
    SLOs are judged over 28 or 30 days, a quarter's review reads 90."""
    rollup_lookback_s: float = 120.0
    """Each retention pass rolls up this much of the already rolled-up minutes again
    (besides every minute late data landed in): a minute's late seconds join it."""
    retention_interval_s: float = 60.0
    """How often the retention task (rollup, then deletes) runs."""
    max_body_bytes: int = 8 * MIB
    """Largest accepted request body as sent (compressed); larger gets 413."""
    max_decompressed_bytes: int = 64 * MIB
    """Largest accepted body after decompression; larger gets 413 (bomb protection)."""
    max_group_batches: int = 512
    """Most batches the writer commits in one transaction (group commit)."""
    group_commit_linger_s: float = 0.02
    """After the first waiting batch, the writer waits this long for more before it
    commits: fewer, larger transactions (each costs milliseconds) for a little latency."""
    max_pending_batches: int = 20_000
    """Validated batches waiting for the writer; beyond this ingest answers 503."""
    max_inflight_bytes: int = 256 * MIB
    """Ingest bodies (decompressed) being read, parsed or waiting for the writer, summed;
    a request that would go past it is answered 503 with ``Retry-After`` (reason
    ``overloaded``). This bounds the memory the ingest path holds under overload."""
    store_memory_limit_mib: int = 2_048
    """DuckDB's memory limit (its buffer manager: cached table data, query state); larger
    queries spill to a temporary directory beside the store file."""
    header_timeout_s: float = 10.0
    """A connection must complete a request's head (request line and headers) within this
    many seconds of its first byte (or of connecting); otherwise it is closed (slow clients)."""
    body_timeout_s: float = 30.0
    """An ingest body must arrive within this many seconds; otherwise 408."""
    max_exported_engines: int = 2_000
    """Most engines with per-engine series on ``/metrics`` (the most recently seen); the
    rest are left out and counted (``kvscope_collector_engines_not_exported``)."""
    max_new_engines_per_minute: int = 600
    """New engine ids accepted per minute; a batch of a new engine beyond it gets 429
    (reason ``engine_limit``), so a flood of ids cannot grow the store without bound."""
    inline_parse_bytes: int = 256 * 1024
    """Bodies up to this size (decompressed) are parsed on the event loop; larger ones
    in a worker thread, so one big batch does not stall the loop."""
    read_row_limit: int = 1_000_000
    """Upper bound on rows a single read-API call returns."""
    advise_interval_s: float = 60.0
    """How often the advisor runs over the recent data to publish its verdicts on
    ``/metrics`` (``kvscope_advisor_*``); 0 disables it."""
    advise_window_s: float = 1800.0
    """Seconds of recent data (up to now) each advisor run reads."""
    advise_cap_fraction: float = 0.9
    """Share of the plateau the published concurrency cap keeps (``kvscope advise
    --cap-fraction``)."""
    kv_events: str = "auto"
    """``auto``: subscribe to the KV-cache events of every engine whose hello advertises
    a ZMQ endpoint (or that has an override); ``off``: never (see
    :mod:`kvscope.collector.kv_events`)."""
    kv_events_endpoints: tuple[tuple[str, str], ...] = ()
    """Operator overrides, (engine_id, endpoint): subscribe there instead of the
    advertised endpoint."""
    kv_events_seen_capacity: int = 2_000_000
    """Canonical block ids each pool remembers for ``reseen_blocks`` (oldest forgotten
    first, counted); about 70 bytes each."""
    kv_events_max_engine_blocks: int = 2_000_000
    """Most blocks tracked per engine; blocks stored beyond are counted, not tracked."""
    kv_events_idle_s: float = 600.0
    """An engine neither sending batches nor KV events for this long is unsubscribed
    and its blocks forgotten; it is subscribed afresh when it sends again."""
    kv_events_flush_interval_s: float = 1.0
    """How often the per engine-second KV-event counters are written to the store."""
    max_clock_skew_s: float = 300.0
    """Times a sender gives (step and request times, ``sent_unix_s``, a hello's
    ``started_unix_s``) may be at most this far ahead of the collector's clock; later
    ones get 400 naming the field (a step dated next year would freeze the engine's
    gauges). Keep the engines' clocks synchronised (NTP)."""
    max_backfill_s: float = 15 * DAY_S
    """Times may be at most this far behind the collector's clock (a plugin's spool
    replayed after an outage is well inside the default); older get 400. 0 accepts any
    age (an import of old recordings)."""
    pool_tokens: tuple[tuple[str, str], ...] = ()
    """(pool, token) pairs: a pool's token ingests only as engines of that pool (a hello
    naming another pool, or an engine known in another pool, gets 403) and reads only that
    pool's engines; ``/metrics`` needs ``token``. ``token`` itself is the fleet's (every
    pool)."""
    max_new_boots_per_engine_per_minute: int = 10
    """New boot ids (process starts) accepted per engine per sliding minute; beyond, 429
    (reason ``boot_limit``). A real engine restarts far less often; every boot adds rows."""
    response_timeout_s: float = 30.0
    """A response (``/metrics``, the read API) must be written to the client within this
    many seconds, else the connection is closed and counted (a reader that never reads
    would otherwise hold the response's memory)."""
    kv_events_allow: tuple[str, ...] = ()
    """Hosts or networks (``10.0.0.0/8``, ``vllm-0.prod``) a hello may advertise a KV-events
    endpoint on, besides the address the hello came from (always allowed)."""
    kv_events_allow_ipc: bool = False
    """Whether a hello may advertise an ``ipc://`` (local socket path) endpoint."""
    kv_events_max_sockets: int = 512
    """Most KV-event subscriptions at once; engines beyond are refused (logged, counted)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP metrics URL (e.g. ``http://otel-collector:4318/v1/metrics``) to push the
    fleet metrics and verdicts to (see :mod:`kvscope.collector.otlp`); None: no OTLP export."""
    otlp_interval_s: float | None = None
    """Seconds between OTLP exports; None: ``$OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds)
    or 60 s, as the OpenTelemetry SDK does."""
    otlp_headers: tuple[tuple[str, str], ...] = ()
    """Extra HTTP headers on every OTLP export (e.g. authorization), on top of
    ``$OTEL_EXPORTER_OTLP_(METRICS_)HEADERS``."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        if not self.store_path:
            raise ValueError("store_path: must not be empty")
        if self.token is not None and not self.token.strip():
            raise ValueError("token: must not be blank (leave it unset for no auth)")
        for name in (
            "raw_step_retention_s",
            "ledger_retention_s",
            "window_retention_s",
            "request_retention_s",
            "rollup_retention_s",
            "request_rollup_retention_s",
            "rollup_lookback_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0 keeps forever)")
        if self.retention_interval_s <= 0:
            raise ValueError("retention_interval_s: must be > 0")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        positive = (
            "max_body_bytes",
            "max_decompressed_bytes",
            "max_group_batches",
            "max_pending_batches",
            "read_row_limit",
            "max_inflight_bytes",
            "header_timeout_s",
            "body_timeout_s",
            "max_exported_engines",
            "max_new_engines_per_minute",
            "store_memory_limit_mib",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if not 0 <= self.group_commit_linger_s <= 1:
            raise ValueError("group_commit_linger_s: must be in 0..1")
        if self.inline_parse_bytes < 0:
            raise ValueError("inline_parse_bytes: must be >= 0")
        if not self.advise_interval_s >= 0:
            raise ValueError("advise_interval_s: must be >= 0 (0 disables the advisor)")
        if not self.advise_window_s > 0:
            raise ValueError("advise_window_s: must be > 0")
        if not 0 < self.advise_cap_fraction <= 1:
            raise ValueError("advise_cap_fraction: must be in (0, 1]")
        if self.kv_events not in ("auto", "off"):
            raise ValueError(f"kv_events: expected auto or off, got {self.kv_events!r}")
        for engine_id, endpoint in self.kv_events_endpoints:
            if not engine_id or "://" not in endpoint:
                raise ValueError(
                    f"kv_events_endpoints: expected (engine_id, "
                    f"tcp://host:port), got ({engine_id!r}, {endpoint!r})"
                )
        for name in ("kv_events_seen_capacity", "kv_events_max_engine_blocks"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: must be >= 2")
        if not self.kv_events_idle_s > 0:
            raise ValueError("kv_events_idle_s: must be > 0")
        if not 0 < self.kv_events_flush_interval_s <= 60:
            raise ValueError("kv_events_flush_interval_s: must be in (0, 60]")
        if not self.max_clock_skew_s >= 0:
            raise ValueError("max_clock_skew_s: must be >= 0")
        if not self.max_backfill_s >= 0:
            raise ValueError("max_backfill_s: must be >= 0 (0 accepts any age)")
        if self.pool_tokens and self.token is None:
            raise ValueError(
                "pool_tokens: need the fleet's token too (token), else a request without "
                "any token would read and write every pool"
            )
        seen_tokens: set[str] = set()
        for pool, tok in self.pool_tokens:
            if not pool or not tok.strip():
                raise ValueError("pool_tokens: expected (pool, token) with neither empty")
            if tok == self.token or tok in seen_tokens:
                raise ValueError(f"pool_tokens: the token of pool {pool!r} is used twice")
            seen_tokens.add(tok)
        for entry in self.kv_events_allow:
            try:
                parse_allow(entry)
            except ValueError as exc:
                raise ValueError(f"kv_events_allow: {exc}") from None
        for name in ("max_new_boots_per_engine_per_minute", "kv_events_max_sockets"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not self.response_timeout_s > 0:
            raise ValueError("response_timeout_s: must be > 0")
        if self.otlp_endpoint is not None:
            scheme, sep, rest = self.otlp_endpoint.partition("://")
            if scheme not in ("http", "https") or not sep or not rest.strip("/"):
                raise ValueError(
                    f"otlp_endpoint: expected an http(s) URL such as "
                    f"http://otel-collector:4318/v1/metrics, got "
                    f"{self.otlp_endpoint!r}"
                )
        if self.otlp_interval_s is not None and not self.otlp_interval_s > 0:
            raise ValueError("otlp_interval_s: must be > 0")
        for key, _ in self.otlp_headers:
            if not key.strip() or any(c in key for c in " :\r\n"):
                raise ValueError(f"otlp_headers: {key!r} is not a header name")

    def replace(self, **changes: object) -> Settings:
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        # Never print the token or header values (they often carry credentials).
        def shown(name: str) -> object:
            if name == "token" and self.token:
                return "***"
            if name == "pool_tokens":
                return tuple((pool, "***") for pool, _ in self.pool_tokens)
            if name == "otlp_headers":
                return tuple((k, "***") for k, _ in self.otlp_headers)
            return getattr(self, name)

        fields = ", ".join(f"{f.name}={shown(f.name)!r}" for f in dataclasses.fields(self))
        return f"Settings({fields})"
