"""The collector's HTTP service (aiohttp).

Routes:

* ``POST /v1/ingest``: one gzip (or identity) JSON batch of the wire schema; ``200
  {"status": "stored"|"duplicate", "need_hello": bool}`` only after it is committed,
  else an error status (400 naming the field, 401/403, 413, 415, 429, 503 with
  ``Retry-After``, 500 if the store fails); a rejected batch leaves the store as it was.
* ``GET /metrics`` (:mod:`kvscope.collector.metrics`, with the verdicts of
  :mod:`kvscope.collector.verdicts`; overlapping scrapes share one rendering); with
  ``otlp_endpoint`` the same is pushed over OTLP (:mod:`kvscope.collector.otlp`).
* ``GET /healthz`` and ``GET /runbooks/{alert}`` (the alerts' runbooks): no token.
* Read API (JSON): ``/v1/engines``, ``/v1/windows``, ``/v1/steps``, ``/v1/requests``,
  ``/v1/kv_events``, ``/v1/request_stats``, ``/v1/totals``... over ``engine``,
  ``pool``, ``since``, ``until``, ``limit``, ``fields``, ``format``; the answer is
  ``{"n_rows": N, "truncated": bool, "rows": [...]}`` (or ``"columns": {...}``).
  Unknown or invalid parameters get 400.

``/metrics`` and the read API write their answers within ``response_timeout_s`` or close
the connection (:class:`kvscope.collector._http_body.ResponseWriter`).

The aiohttp server must not inflate bodies itself: use :func:`create_runner` (or
``web.AppRunner(app, auto_decompress=False)``).

Every route, status and parameter: docs/collector.md#http-api; the limits behind them:
docs/reliability.md#a-hostile-or-buggy-sender
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import re
import signal
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from aiohttp import web

from kvscope.collector._guards import (
    BootGate,
    ByteBudget,
    GuardedRunner,
    Lease,
    MalformedRequestLog,
    NewEngineGate,
    Overbudget,
)
from kvscope.collector._http_body import BodyError, ResponseWriter, SharedBody, read_body
from kvscope.collector._parse_budget import parse_cost
from kvscope.collector._writer import GroupCommitWriter, Overloaded, WriterClosed
from kvscope.collector.batch import PreparedBatch, check_times, parse_body
from kvscope.collector.metrics import CONTENT_TYPE, FleetState
from kvscope.collector.params import ParamError, Query, parse_query
from kvscope.collector.settings import Settings
from kvscope.collector.store import Store
from kvscope.collector.verdicts import VerdictLoop
from kvscope.engine_plugins.schema import INGEST_PATH, SchemaError

if TYPE_CHECKING:
    from kvscope.collector.kv_events import KvEventsManager
    from kvscope.collector.otlp import OtlpExport

__all__ = [
    "Context",
    "RunningCollector",
    "context",
    "create_app",
    "create_runner",
    "is_loopback",
    "serve",
    "ssl_context",
    "start",
]

log = logging.getLogger(__name__)


@dataclass
class Context:
    """What the handlers share; :func:`context` returns it once the app has started."""

    settings: Settings
    store: Store
    writer: GroupCommitWriter
    state: FleetState
    executor: ThreadPoolExecutor
    kv_events: KvEventsManager | None = None
    """The KV-event subscriber (None with ``kv_events="off"``)."""
    inflight: ByteBudget = dataclasses.field(default_factory=lambda: ByteBudget(1))
    """Ingest bytes held at once (see :class:`kvscope.collector._guards.ByteBudget`)."""
    responses: ResponseWriter = dataclasses.field(default_factory=ResponseWriter)
    """Writes /metrics and read-API answers within ``response_timeout_s``."""
    metrics_body: SharedBody = dataclasses.field(default_factory=SharedBody)
    """The /metrics text, shared by the scrapes that overlap."""
    new_engines: NewEngineGate | None = None
    boots: BootGate | None = None


class _Slot:
    """Mutable holder: the context is created at startup, after the app is frozen."""

    ctx: Context | None = None


_SLOT: web.AppKey[_Slot] = web.AppKey("kvscope_slot", _Slot)


def context(app: web.Application) -> Context:
    """The handlers' shared context; raises if the app has not started."""
    ctx = app[_SLOT].ctx
    if ctx is None:
        raise RuntimeError("the collector app has not started")
    return ctx


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


# -- ingest ------------------------------------------------------------------------


FLEET = "*"
"""The principal of the fleet's token (or of every request when no token is set)."""


def _principal(request: web.Request, settings: Settings) -> str | None:
    """Who the request's bearer token speaks for: :data:`FLEET` for ``settings.token`` (or
    when no token is configured), a pool's name for one of ``settings.pool_tokens``, None
    for a missing or wrong token. Every candidate is compared, in constant time."""
    if settings.token is None and not settings.pool_tokens:
        return FLEET
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    given_b = given.strip().encode()
    found: str | None = None
    if settings.token is not None and hmac.compare_digest(given_b, settings.token.encode()):
        found = FLEET
    for pool, tok in settings.pool_tokens:
        if hmac.compare_digest(given_b, tok.encode()) and found is None:
            found = pool
    return found


async def _ingest(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    ctx = context(request.app)
    s = ctx.settings

    def reject(status: int, reason: str, message: str, **headers: str) -> web.Response:
        ctx.state.record_rejection(reason)
        return _error(status, message, headers or None)

    principal = _principal(request, s)
    if principal is None:
        return reject(
            401,
            "unauthorized",
            "missing or wrong bearer token",
            **{"WWW-Authenticate": 'Bearer realm="kvscope"'},
        )
    lease = ctx.inflight.lease()
    try:
        return await _ingest_body(request, ctx, reject, lease, t0, principal)
    finally:
        lease.release()


async def _ingest_body(
    request: web.Request,
    ctx: Context,
    reject: Callable[..., web.Response],
    lease: Lease,
    t0: float,
    principal: str,
) -> web.Response:
    s = ctx.settings
    try:
        async with asyncio.timeout(s.body_timeout_s):
            body = await read_body(request, s.max_body_bytes, s.max_decompressed_bytes, lease)
    except BodyError as exc:
        extra = {"Retry-After": "1"} if exc.status == 503 else {}
        return reject(exc.status, exc.reason, exc.message, **extra)
    except TimeoutError:
        return reject(
            408,
            "timeout",
            f"body: not received within {s.body_timeout_s:g} s",
            **{"Retry-After": "1"},
        )
    received = time.time()
    loop = asyncio.get_running_loop()
    big = len(body) > s.inline_parse_bytes
    try:  # what parsing may cost, known before it costs it
        cost = (
            await loop.run_in_executor(ctx.executor, parse_cost, body) if big else parse_cost(body)
        )
    except SchemaError as exc:
        return reject(400, "schema", str(exc))
    if lease.held + cost > ctx.inflight.limit:  # would never fit, even alone
        return reject(
            413,
            "too_large",
            f"body: {lease.held:,} bytes that parsing may grow by {cost:,}: more than the "
            f"in-flight limit of {ctx.inflight.limit:,} (--max-inflight-mib); send smaller "
            "batches",
        )
    try:
        lease.take(cost)
    except Overbudget as exc:
        return reject(
            503, "overloaded", f"collector overloaded: {exc}; retry later", **{"Retry-After": "1"}
        )
    try:
        if big:
            batch: PreparedBatch = await loop.run_in_executor(
                ctx.executor, parse_body, body, received
            )
        else:
            batch = parse_body(body, received)
    except SchemaError as exc:
        msg = str(exc)
        return reject(400, "bad_json" if msg.startswith("body:") else "schema", msg)
    finally:
        lease.give_back(cost)  # the parsed objects are gone; the arrays are taken below
    try:
        check_times(batch, s.max_clock_skew_s, s.max_backfill_s)
    except SchemaError as exc:
        return reject(400, "schema", str(exc))
    if principal != FLEET:
        refusal = _out_of_scope(ctx, batch, principal)
        if refusal is not None:
            ctx.state.record_rejection("forbidden")
            return web.json_response(
                {"error": refusal, "need_hello": batch.hello is None}, status=403
            )
    try:
        lease.take(batch.nbytes)  # the arrays are held too until the commit
    except Overbudget as exc:
        return reject(
            503, "overloaded", f"collector overloaded: {exc}; retry later", **{"Retry-After": "1"}
        )
    if ctx.new_engines is not None and not ctx.new_engines.admit(batch.engine_id):
        return reject(
            429,
            "engine_limit",
            f"more than {s.max_new_engines_per_minute} new engine ids in the last "
            "minute; retry later",
            **{"Retry-After": "60"},
        )
    if ctx.boots is not None and not ctx.boots.admit(batch.engine_id, batch.boot_id):
        return reject(
            429,
            "boot_limit",
            f"more than {s.max_new_boots_per_engine_per_minute} new boot ids of engine "
            f"{batch.engine_id!r} in the last minute; retry later (importing history? raise "
            "the collector's --max-new-boots-per-engine-per-minute)",
            **{"Retry-After": "60"},
        )
    try:
        fut = ctx.writer.submit(batch)
    except Overloaded as exc:
        return reject(
            503, "overloaded", f"collector overloaded: {exc}; retry later", **{"Retry-After": "1"}
        )
    except WriterClosed as exc:
        return reject(503, "shutting_down", str(exc), **{"Retry-After": "5"})
    try:
        result = await asyncio.wrap_future(fut)
    except Exception as exc:
        log.error(
            "storing batch %s/%s/%d failed: %s", batch.engine_id, batch.boot_id, batch.seq, exc
        )
        return _error(500, f"store: the batch was not stored ({type(exc).__name__})")
    ctx.state.observe_ack(time.perf_counter() - t0)
    if ctx.kv_events is not None:
        try:
            ctx.kv_events.note_batch(batch.engine_id, batch.boot_id, batch.hello, request.remote)
        except Exception:  # KV-event subscription must never fail an ingest
            log.exception(
                "handing batch %s/%s/%d to the KV-event subscriber failed",
                batch.engine_id,
                batch.boot_id,
                batch.seq,
            )
    return web.json_response({"status": result.status, "need_hello": result.need_hello})


def _out_of_scope(ctx: Context, batch: PreparedBatch, pool: str) -> str | None:
    """Why a batch sent with ``pool``'s token may not be stored (None: it may): its hello
    names another pool, or its engine is known in another pool, or is not known in this
    one and the batch carries no hello (the sender is asked for it)."""
    if batch.hello is not None and batch.hello.get("pool") != pool:
        return (
            f"hello.pool: {batch.hello.get('pool')!r} is not {pool!r}, the pool this token "
            "may write as"
        )
    known = ctx.state.pool_of(batch.engine_id)
    if known is not None and known != pool:
        return (
            f"engine {batch.engine_id!r} belongs to pool {known!r}; this token may write "
            f"only as engines of pool {pool!r}"
        )
    if known is None and batch.hello is None:
        return f"engine {batch.engine_id!r} is not known in pool {pool!r}: send its hello first"
    return None


# -- read API ----------------------------------------------------------------------

_RANGE = ("engine", "pool", "since", "until", "limit", "format", "fields")
JSON_TYPE = "application/json; charset=utf-8"


def _frame_json(df: pd.DataFrame, fmt: str, truncated: bool) -> bytes:
    head = f'{{"n_rows": {len(df)}, "truncated": {"true" if truncated else "false"}'
    if fmt == "columns":
        cols = ",".join(
            f"{json.dumps(str(c))}:{df[c].to_json(orient='records')}" for c in df.columns
        )
        return f'{head}, "columns": {{{cols}}}}}'.encode()
    return f'{head}, "rows": {df.to_json(orient="records")}}}'.encode()


async def _read(
    request: web.Request,
    allowed: tuple[str, ...],
    default_since: str | None,
    fn: Callable[[Store, Query], pd.DataFrame],
    params: Mapping[str, str] | None = None,
) -> web.StreamResponse:
    ctx = context(request.app)
    principal = request.get(_PRINCIPAL, FLEET)
    if principal != FLEET:
        params = dict(request.query if params is None else params)
        if params.get("pool", principal) != principal:
            ctx.state.record_read_rejection("forbidden")
            return _error(403, f"pool: this token reads only pool {principal!r}")
        if "pool" in allowed:
            params["pool"] = principal
    try:
        q = parse_query(
            request.query if params is None else params,
            allowed,
            default_since=default_since,
            max_limit=ctx.settings.read_row_limit,
        )
    except ParamError as exc:
        ctx.state.record_read_rejection("bad_params")
        return _error(400, str(exc))
    limited = "limit" in allowed
    # Ask for one row more than the limit to tell whether the answer was cut.
    q_run = dataclasses.replace(q, limit=(q.limit or 0) + 1) if limited else q
    loop = asyncio.get_running_loop()
    df = await loop.run_in_executor(ctx.executor, fn, ctx.store, q_run)
    if principal != FLEET:
        df = _in_pool(ctx, df, principal)
    truncated = limited and q.limit is not None and len(df) > q.limit
    if truncated:
        df = df.iloc[: q.limit]
    if q.fields is not None:
        unknown = [f for f in q.fields if f not in df.columns]
        if unknown:
            ctx.state.record_read_rejection("bad_params")
            return _error(
                400,
                f"fields: unknown column(s) {', '.join(map(repr, unknown))}; "
                f"available: {', '.join(map(str, df.columns))}",
            )
        df = df[list(q.fields)]
    body = await loop.run_in_executor(ctx.executor, _frame_json, df, q.format, truncated)
    del df  # a slow reader holds the answer's bytes only
    return await ctx.responses.send(request, body, JSON_TYPE, ctx.settings.response_timeout_s)


def _in_pool(ctx: Context, df: pd.DataFrame, pool: str) -> pd.DataFrame:
    """The rows of ``df`` a pool's token may read: its pool's, by the ``pool`` column or,
    without one, by ``engine_id``; a frame with neither is the fleet's (left empty)."""
    if "pool" in df.columns:
        return df[df["pool"] == pool]
    if "engine_id" in df.columns:
        return df[df["engine_id"].isin(ctx.state.engines_of_pool(pool))]
    return df.iloc[:0]


async def _engines(request: web.Request) -> web.StreamResponse:
    return await _read(request, ("format", "fields"), None, lambda st, q: st.engines())


async def _configs(request: web.Request) -> web.StreamResponse:
    engine_id = request.match_info["engine_id"]
    ctx = context(request.app)
    loop = asyncio.get_running_loop()
    engines = await loop.run_in_executor(ctx.executor, ctx.store.engines)
    principal = request.get(_PRINCIPAL, FLEET)
    if engine_id not in set(engines["engine_id"]) or (
        principal != FLEET and ctx.state.pool_of(engine_id) != principal
    ):
        return _error(404, f"engine {engine_id!r} is not known")
    return await _read(request, ("format",), None, lambda st, q: st.engine_configs(engine_id))


def _range_reader(method: str) -> Callable[[Store, Query], pd.DataFrame]:
    def run(st: Store, q: Query) -> pd.DataFrame:
        return getattr(st, method)(q.engine_id, q.pool, q.since_unix_s, q.until_unix_s, q.limit)

    return run


async def _windows(request: web.Request) -> web.StreamResponse:
    return await _read(request, _RANGE, "1h", _range_reader("windows"))


async def _minute_windows(request: web.Request) -> web.StreamResponse:
    return await _read(request, _RANGE, "1d", _range_reader("minute_windows"))


async def _request_minutes(request: web.Request) -> web.StreamResponse:
    def run(st: Store, q: Query) -> pd.DataFrame:
        return st.request_minutes(
            q.engine_id,
            q.pool,
            q.since_unix_s,
            q.until_unix_s,
            q.limit,
            step_s=q.step_s,
            deleted_only=q.deleted_only,
        )

    return await _read(request, (*_RANGE, "step", "deleted_only"), "1d", run)


async def _daily_load_peaks(request: web.Request) -> web.StreamResponse:
    return await _read(
        request,
        ("pool", "since", "until", "format", "fields"),
        "28d",
        lambda st, q: st.daily_load_peaks(q.pool, q.since_unix_s, q.until_unix_s),
    )


async def _steps(request: web.Request) -> web.StreamResponse:
    def run(st: Store, q: Query) -> pd.DataFrame:
        return st.steps(q.engine_id, q.pool, q.since_unix_s, q.until_unix_s, q.limit, q.every)

    return await _read(request, (*_RANGE, "every"), "1h", run)


async def _requests(request: web.Request) -> web.StreamResponse:
    return await _read(request, _RANGE, "1h", _range_reader("requests"))


async def _kv_events(request: web.Request) -> web.StreamResponse:
    # ``engine_id`` is accepted as another name of ``engine`` here.
    params = dict(request.query)
    if "engine_id" in params:
        alias = params.pop("engine_id")
        if params.setdefault("engine", alias) != alias:
            context(request.app).state.record_read_rejection("bad_params")
            return _error(400, "engine_id and engine name different engines")
    return await _read(request, _RANGE, "1h", _range_reader("kv_event_windows"), params)


async def _request_stats(request: web.Request) -> web.StreamResponse:
    allowed = ("engine", "pool", "since", "until", "group_by", "format", "fields")
    return await _read(
        request,
        allowed,
        "1h",
        lambda st, q: st.request_stats(
            q.engine_id, q.pool, q.since_unix_s, q.until_unix_s, q.group_by
        ),
    )


async def _totals(request: web.Request) -> web.StreamResponse:
    return await _read(
        request,
        ("engine", "source", "format"),
        None,
        lambda st, q: st.totals(q.source, q.engine_id),
    )


# -- metrics and health ------------------------------------------------------------


async def _metrics(request: web.Request) -> web.StreamResponse:
    ctx = context(request.app)
    loop = asyncio.get_running_loop()

    async def render() -> bytes:
        return await loop.run_in_executor(ctx.executor, lambda: ctx.state.render().encode())

    async with ctx.metrics_body.use(render) as body:
        return await ctx.responses.send(
            request, body, CONTENT_TYPE, ctx.settings.response_timeout_s
        )


RUNBOOKS_PATH = "/runbooks/"
RUNBOOKS_DIR = Path(__file__).resolve().parent / "runbooks"
"""``docs/runbooks`` (a link in the repository, a copy in an installed package)."""
_RUNBOOK_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")


async def _runbook(request: web.Request) -> web.Response:
    """An alert's runbook as plain text; the index without a name."""
    name = (request.match_info.get("alert", "") or "README").removesuffix(".md")
    path = RUNBOOKS_DIR / f"{name}.md"
    if not _RUNBOOK_NAME.fullmatch(name) or not path.is_file():
        known = sorted(p.stem for p in RUNBOOKS_DIR.glob("Kvscope*.md"))
        return _error(404, f"no runbook {name!r}; known: {', '.join(known) or 'none installed'}")
    return web.Response(
        text=path.read_text(encoding="utf-8"), content_type="text/plain", charset="utf-8"
    )


async def _healthz(request: web.Request) -> web.Response:
    ctx = context(request.app)
    ok = ctx.writer.alive and not ctx.store.closed
    failing = ctx.writer.write_error
    status = "unavailable" if not ok else "degraded" if failing else "ok"
    return web.json_response(
        {
            "status": status,
            "reason": (
                None
                if status == "ok"
                else "the store is closed or its writer stopped"
                if not ok
                else f"every write fails since {_failing_since(ctx)}: {failing}"
            ),
            "writer_alive": ctx.writer.alive,
            "pending_batches": ctx.writer.pending_batches,
            "engines": ctx.state.n_engines,
            "store_path": ctx.settings.store_path,
        },
        status=200 if status == "ok" else 503,
    )


def _failing_since(ctx: Context) -> str:
    """When the writer's writes began to fail, as UTC text."""
    t = ctx.writer.write_error_since_unix_s
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t is not None else "?"


# -- lifecycle ---------------------------------------------------------------------


async def _retention_loop(ctx: Context) -> None:
    s = ctx.settings

    def job() -> dict[str, int]:
        return {
            **ctx.store.apply_lifecycle(
                window_retention_s=s.window_retention_s,
                request_retention_s=s.request_retention_s,
                rollup_retention_s=s.rollup_retention_s,
                request_rollup_retention_s=s.request_rollup_retention_s,
                rollup_lookback_s=s.rollup_lookback_s,
            ),
            **ctx.store.apply_retention(s.raw_step_retention_s, s.ledger_retention_s),
            **ctx.store.apply_kv_event_retention(s.raw_step_retention_s),
        }

    while True:
        try:
            deleted = await asyncio.wrap_future(ctx.writer.call(job))
            written = deleted.pop("windows_1m_written", 0)
            written_req = deleted.pop("requests_1m_written", 0)
            ctx.state.rollup_rows_written += written
            ctx.state.request_rollup_rows_written += written_req
            log.debug("rolled up %d minute windows, %d request minutes", written, written_req)
            ctx.state.record_retention(deleted)
            if any(deleted.values()):
                log.info("retention deleted %s", deleted)
        except WriterClosed:
            return
        except Exception:
            log.exception("retention failed")
        await asyncio.sleep(s.retention_interval_s)


def _lifecycle(
    settings: Settings, given: Store | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx_manager(app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if settings.otlp_endpoint is not None:
            from kvscope.collector.otlp import require_sdk

            require_sdk()  # before anything is opened
        executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvscope-read")
        store: Store | None = given
        state = FleetState(
            max_exported_engines=settings.max_exported_engines,
            max_clock_skew_s=settings.max_clock_skew_s,
        )
        try:
            if store is None:
                store = await loop.run_in_executor(
                    executor, Store, settings.store_path, settings.store_memory_limit_mib
                )
            await loop.run_in_executor(executor, state.rebuild, store)
        except BaseException:
            if store is not None and given is None:
                store.close()
            executor.shutdown(wait=False)
            raise
        writer = GroupCommitWriter(
            store,
            max_group_batches=settings.max_group_batches,
            max_pending_batches=settings.max_pending_batches,
            linger_s=settings.group_commit_linger_s,
            on_committed=state.apply,
        ).start()
        state.extra["kvscope_collector_pending_batches"] = (
            "gauge",
            "Batches received and waiting to be committed.",
            lambda: writer.pending_batches,
        )
        state.extra["kvscope_collector_commit_groups_total"] = (
            "counter",
            "Transactions (groups of batches) the writer has run.",
            lambda: writer.groups_committed,
        )
        state.extra["kvscope_collector_last_commit_duration_seconds"] = (
            "gauge",
            "Duration of the writer's latest group transaction.",
            lambda: writer.last_group_s,
        )
        state.extra["kvscope_collector_last_commit_batches"] = (
            "gauge",
            "Batches in the writer's latest group transaction.",
            lambda: writer.last_group_size,
        )
        kv_events: KvEventsManager | None = None
        if settings.kv_events != "off":
            from kvscope.collector.kv_events import KvEventsManager

            try:
                kv_events = KvEventsManager(settings, store, writer)
                await loop.run_in_executor(executor, kv_events.load)
                kv_events.start()
                state.sections.append(kv_events.render)
            except Exception:  # the collector serves on without KV events
                log.exception("the KV-event subscriber could not start")
                kv_events = None
        ctx = app[_SLOT].ctx = Context(
            settings,
            store,
            writer,
            state,
            executor,
            kv_events,
            ByteBudget(settings.max_inflight_bytes),
        )
        ctx.new_engines = NewEngineGate(settings.max_new_engines_per_minute, state.knows)
        ctx.boots = BootGate(settings.max_new_boots_per_engine_per_minute, store.has_hello)
        state.extra["kvscope_collector_store_write_failing"] = (
            "gauge",
            "1 while every write to the store fails (a full disk, a store that cannot write; "
            "/healthz says degraded with the reason), else 0.",
            lambda: 1.0 if writer.write_error else 0.0,
        )
        quarantined = store.quarantined_counts()
        state.extra["kvscope_collector_quarantined_rows"] = (
            "gauge",
            "Rows of the store outside what an engine can produce, moved to the table "
            "quarantined_rows when the store opened (see docs/reliability.md).",
            lambda: float(sum(quarantined.values())),
        )
        state.extra["kvscope_collector_inflight_ingest_bytes"] = (
            "gauge",
            "Ingest bytes (decompressed) held: being read, parsed or waiting for the writer.",
            lambda: ctx.inflight.used,
        )
        state.extra["kvscope_collector_store_memory_bytes"] = (
            "gauge",
            "Memory held by the store's buffer manager (DuckDB).",
            store.memory_bytes,
        )
        state.extra["kvscope_collector_inflight_ingest_bytes_limit"] = (
            "gauge",
            "The limit on in-flight ingest bytes; past it ingest answers 503.",
            lambda: ctx.inflight.limit,
        )
        state.extra["kvscope_collector_slow_readers_closed_total"] = (
            "counter",
            "Connections closed because a response (/metrics, the read API) was not written "
            "within response_timeout_s: a client that does not read.",
            lambda: ctx.responses.slow_readers_closed,
        )
        state.extra["kvscope_collector_rollup_behind_seconds"] = (
            "gauge",
            "Seconds from the end of the minutes rolled up into 1-minute windows to now (about "
            "3 minutes when the rollup keeps up; NaN before its first pass).",
            lambda: (
                time.time() - store.rolled_until_s if store.rolled_until_s is not None else math.nan
            ),
        )
        state.extra["kvscope_collector_rollup_rows_total"] = (
            "counter",
            "1-minute window rows the rollup has written (a minute rolled up again counts again).",
            lambda: state.rollup_rows_written,
        )
        state.extra["kvscope_collector_request_rollup_rows_total"] = (
            "counter",
            "Request-minute rows (requests_1m) the rollup has written (a minute rolled up again "
            "counts again).",
            lambda: state.request_rollup_rows_written,
        )
        state.extra["kvscope_collector_rollup_pending_minute_windows"] = (
            "gauge",
            "Minute windows (1-minute windows and request minutes) written behind the rolled-up "
            "end, late or old data, that the last rollup pass left for the next ones: a pass "
            "stops after about a second (0 when the rollup keeps up).",
            lambda: store.rollup_pending_minutes,
        )
        retention = asyncio.create_task(_retention_loop(ctx), name="kvscope-retention")
        verdicts: VerdictLoop | None = None
        if settings.advise_interval_s > 0:
            verdicts = VerdictLoop(
                store,
                interval_s=settings.advise_interval_s,
                window_s=settings.advise_window_s,
                cap_fraction=settings.advise_cap_fraction,
            )
            state.sections.append(verdicts.render)
            verdicts.start()
        otlp: OtlpExport | None = None
        try:
            if settings.otlp_endpoint is not None:
                from kvscope.collector.otlp import OtlpExport

                otlp = OtlpExport(settings, state, verdicts).start()
                state.sections.append(otlp.render)
            yield
        finally:
            if verdicts is not None:
                await loop.run_in_executor(None, verdicts.stop)
            if kv_events is not None:
                await loop.run_in_executor(None, kv_events.stop)
            retention.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retention
            await loop.run_in_executor(None, writer.close)
            if otlp is not None:  # after the writer: the last export has every batch
                await loop.run_in_executor(None, otlp.shutdown)
            executor.shutdown(wait=True)
            try:
                state.save(store)
            except Exception:
                log.exception("saving metric state failed")
            if given is None:
                store.close()

    return ctx_manager


_PRINCIPAL: web.RequestKey[str] = web.RequestKey("kvscope_principal", str)
"""Request key: who the request's token speaks for (see :func:`_principal`)."""


def _read_auth(settings: Settings) -> Callable[..., Any]:
    """Middleware: with tokens configured, every route but ``/healthz`` and the runbooks
    needs one (ingest checks it itself, before reading the body); a pool's token reads only
    its pool (the read API filters to it) and not ``/metrics`` (the fleet's series)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Any]) -> Any:
        if (
            request.method == "POST"
            or request.path == "/healthz"
            or request.path.startswith(RUNBOOKS_PATH)
        ):
            return await handler(request)
        principal = _principal(request, settings)
        ctx = request.app[_SLOT].ctx
        if principal is None:
            if ctx is not None:
                ctx.state.record_read_rejection("unauthorized")
            return _error(
                401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="kvscope"'}
            )
        if principal != FLEET and request.path == "/metrics":
            if ctx is not None:
                ctx.state.record_read_rejection("forbidden")
            return _error(
                403, "/metrics holds every pool's series: scrape it with the fleet's token"
            )
        request[_PRINCIPAL] = principal
        return await handler(request)

    return middleware


def create_app(settings: Settings, store: Store | None = None) -> web.Application:
    """Build the application. With ``store=None`` the app opens ``settings.store_path``
    at startup and closes it at cleanup; a given store stays open (the caller owns it)."""
    app = web.Application(
        client_max_size=settings.max_body_bytes, middlewares=[_read_auth(settings)]
    )
    app[_SLOT] = _Slot()
    app.cleanup_ctx.append(_lifecycle(settings, store))
    app.router.add_post(INGEST_PATH, _ingest)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get(RUNBOOKS_PATH, _runbook)
    app.router.add_get(RUNBOOKS_PATH + "{alert}", _runbook)
    app.router.add_get("/v1/engines", _engines)
    app.router.add_get("/v1/engines/{engine_id}/configs", _configs)
    app.router.add_get("/v1/windows", _windows)
    app.router.add_get("/v1/windows_1m", _minute_windows)
    app.router.add_get("/v1/requests_1m", _request_minutes)
    app.router.add_get("/v1/daily_load_peaks", _daily_load_peaks)
    app.router.add_get("/v1/steps", _steps)
    app.router.add_get("/v1/requests", _requests)
    app.router.add_get("/v1/kv_events", _kv_events)
    app.router.add_get("/v1/request_stats", _request_stats)
    app.router.add_get("/v1/totals", _totals)
    return app


def create_runner(
    app: web.Application, header_timeout_s: float = 10.0, **kwargs: Any
) -> web.AppRunner:
    """An AppRunner with the settings the ingest path relies on (no auto-decompression,
    no per-request access log, a deadline for each request head)."""
    kwargs.setdefault("access_log", None)
    kwargs.setdefault("shutdown_timeout", 10.0)
    return GuardedRunner(app, header_timeout_s=header_timeout_s, auto_decompress=False, **kwargs)


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context from ``tls_cert_file``/``tls_key_file`` (None: plain HTTP)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return ctx


@dataclass
class RunningCollector:
    """A started collector (see :func:`start`)."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int
    tls: bool = False
    malformed: MalformedRequestLog | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8844`` (``https://`` with TLS)."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ctx(self) -> Context:
        """The shared handler context (store, writer, metrics state)."""
        return context(self.app)

    async def stop(self) -> None:
        """Stop accepting, answer in-flight requests, flush the writer, close."""
        try:
            await self.runner.cleanup()
        finally:
            if self.malformed is not None:
                logging.getLogger("aiohttp.server").removeFilter(self.malformed)


async def start(settings: Settings, store: Store | None = None) -> RunningCollector:
    """Start the service on the running event loop; port 0 picks a free port."""
    tls = ssl_context(settings)
    app = create_app(settings, store)
    runner = create_runner(app, header_timeout_s=settings.header_timeout_s)
    await runner.setup()
    if isinstance(runner, GuardedRunner):
        guarded = runner
        context(app).state.extra["kvscope_collector_slow_connections_closed_total"] = (
            "counter",
            "Connections closed because a request head did not arrive within header_timeout_s.",
            lambda: guarded.slow_connections_closed,
        )
    malformed = MalformedRequestLog()
    context(app).state.extra["kvscope_collector_malformed_requests_total"] = (
        "counter",
        "Requests aiohttp answered 400 itself (a request line over 8 KiB, a bad header); "
        "logged once a minute.",
        lambda: malformed.count,
    )
    site = web.TCPSite(runner, settings.host, settings.port, ssl_context=tls)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    logging.getLogger("aiohttp.server").addFilter(malformed)
    port = runner.addresses[0][1]
    return RunningCollector(
        app, runner, settings.host, int(port), tls=tls is not None, malformed=malformed
    )


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(settings: Settings) -> None:
    """Run the collector until SIGINT or SIGTERM; then shut down gracefully."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = await start(settings)
    if settings.token is None and not is_loopback(settings.host):
        log.warning(
            "!!! kvscope collector on %s WITHOUT AUTHENTICATION: anyone who can reach "
            "it can write and read all data; set --token !!!",
            running.url,
        )
    log.info(
        "kvscope collector listening on %s (store %s, ingest %s, metrics /metrics)",
        running.url,
        settings.store_path,
        INGEST_PATH,
    )
    try:
        await stop.wait()
    finally:
        log.info("kvscope collector shutting down")
        await running.stop()
        log.info("kvscope collector stopped")
