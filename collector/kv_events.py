"""Subscribing to vLLM's KV-cache events and measuring prefix duplication across a pool.

vLLM started with ``--kv-events-config`` publishes its prefix-cache changes on a ZMQ PUB
socket (data-parallel engine ``i`` on port + ``i``); the plugin advertises it in the
hello (``kv_events_endpoint``). :class:`KvEventsManager` subscribes, one SUB socket per
engine, all served by one daemon thread (``kvscope-kv-events``), so neither the aiohttp
loop nor ingest ever waits on ZMQ: the HTTP side only hands over what an ingest taught
it (:meth:`KvEventsManager.note_batch`, O(1), through a bounded queue).

* Endpoints (:func:`resolve_endpoint`): a wildcard host becomes the address the
  engine's ingest came from; ``port 0`` and ``inproc://`` cannot be reached; an
  operator's ``--kv-events-endpoint`` wins and is not checked.
* Which and how many (:class:`~kvscope.collector.kv_endpoints.EndpointPolicy`,
  :func:`~kvscope.collector.kv_endpoints.socket_budget`): an engine beyond the budget
  waits for a free slot; a refusal is logged once per engine and counted in
  ``kvscope_kv_events_refused_endpoints_total{reason}``.
* Lifecycle: a new boot or pool starts the engine afresh; a changed endpoint reconnects
  and keeps the blocks; an engine silent for ``kv_events_idle_s`` is unsubscribed.
* Accounting (:mod:`kvscope.collector._kv_registry`) within each ``pool``, in arrival
  order; each engine-second's counters reach ``kv_event_windows`` about every
  ``kv_events_flush_interval_s`` (one job on the store's writer thread).

Memory is bounded; what is dropped is counted in ``kvscope_kv_events_dropped_total``.

Details: docs/fleet.md#kv-cache-events-prefix-duplication-across-replicas
"""

from __future__ import annotations

import errno
import logging
import math
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import zmq

from kvscope.collector._exposition import TextWriter, label_str
from kvscope.collector._kv_registry import ROW_FIELDS, EngineBlocks, Pool, new_row
from kvscope.collector._kv_wire import WireError, decode
from kvscope.collector._reads import KV_EVENT_SUMS
from kvscope.collector._writer import GroupCommitWriter, WriterClosed
from kvscope.collector.kv_endpoints import (
    FD_SHARE,
    FDS_PER_SUBSCRIPTION,
    EndpointPolicy,
    parse_override,
    resolve_endpoint,
    socket_budget,
)
from kvscope.collector.settings import Settings
from kvscope.collector.store import Store
from kvscope.collector.tables import KV_EVENT_COLUMNS

__all__ = ["KvEventsManager", "parse_override", "resolve_endpoint"]

log = logging.getLogger(__name__)

NOTE_EVERY_S = 10.0
"""An ingest without news is handed to the manager at most this often per engine
(it keeps the engine from counting as silent); at most a quarter of the idle time."""
MAX_CONTROL = 10_000
MAX_PENDING_ROWS = 200_000
MAX_MESSAGES_PER_POLL = 1_000
RCVHWM = 100_000
REFUSAL_REASONS = ("not_allowed", "ipc", "socket_limit", "connect_error")
"""``reason`` labels of ``kvscope_kv_events_refused_endpoints_total`` (all exported)."""

_TOTALS = (  # (metric, column, help)
    (
        "kvscope_kv_events_blocks_stored_total",
        "stored_blocks",
        "KV-cache blocks the engine stored (computed and cached), from its KV events.",
    ),
    (
        "kvscope_kv_events_blocks_duplicated_total",
        "dup_blocks",
        "Stored blocks whose content another engine of the pool held at that moment.",
    ),
    (
        "kvscope_kv_events_blocks_reseen_total",
        "reseen_blocks",
        "Stored blocks whose content the pool had stored before (within its seen memory).",
    ),
    (
        "kvscope_kv_events_orphan_blocks_total",
        "orphan_blocks",
        "Stored blocks whose parent block was unknown (joined mid-stream or messages lost).",
    ),
    (
        "kvscope_kv_events_blocks_removed_total",
        "removed_blocks",
        "KV-cache blocks the engine evicted, from its KV events.",
    ),
    (
        "kvscope_kv_events_missed_batches_total",
        "missed_batches",
        "KV-event batches missed (gaps in the publisher's sequence numbers).",
    ),
)


@dataclass
class _Engine:
    """What the manager thread knows of one engine."""

    engine_id: str
    boot_id: str | None = None
    started_unix_s: float = -math.inf
    pool: str = ""
    advertised: str | None = None
    remote: str | None = None
    last_note_mono: float = 0.0
    idle: bool = False
    sock: Any = None
    endpoint: str | None = None
    """Endpoint the socket is connected to."""
    subscribed_mono: float = 0.0
    last_msg_mono: float = 0.0
    blocks: EngineBlocks | None = None
    generation: int = 0
    refused: tuple[str, str] | None = None
    """(endpoint, reason) last refused, so that a refusal is logged and counted once."""


@dataclass
class _Snapshot:
    held: list[tuple[str, str, int]] = field(default_factory=list)
    distinct: list[tuple[str, int]] = field(default_factory=list)
    subscribed: list[tuple[str, str, str, int]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)


class KvEventsManager:
    """Subscribes to the engines' KV-event publishers; see the module docstring."""

    def __init__(self, settings: Settings, store: Store, writer: GroupCommitWriter) -> None:
        self._s = settings
        self._store = store
        self._writer = writer
        self._overrides = dict(settings.kv_events_endpoints)
        self._policy = EndpointPolicy(settings.kv_events_allow, settings.kv_events_allow_ipc)
        self._max_sockets = settings.kv_events_max_sockets
        """Most subscriptions at once (the setting, lowered in :meth:`start` to fit the
        open-file limit)."""
        self._control: queue.Queue[tuple[Any, ...]] = queue.Queue(MAX_CONTROL)
        self._noted: dict[str, tuple[str | None, float]] = {}  # event-loop thread only
        self._note_every_s = min(NOTE_EVERY_S, settings.kv_events_idle_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events", daemon=True)
        # Manager thread only:
        self._engines: dict[str, _Engine] = {}
        self._pools: dict[str, Pool] = {}
        self._by_sock: dict[Any, _Engine] = {}
        self._pending: dict[tuple[str, int], list[int]] = {}
        self._waiting: dict[str, None] = {}
        """Engines refused for the socket limit, oldest first: subscribed when one closes."""
        self._gone: Counter[str] = Counter()
        self._ctx: Any = None
        self._poller: Any = None
        # Shared, under the lock:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, int]] = {}
        self._pool_of: dict[str, str] = {}
        self._dropped: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._snapshot = _Snapshot()

    # -- start, stop ------------------------------------------------------------------

    def load(self) -> KvEventsManager:
        """Read the known engines and the counter totals from the store (before start)."""
        engines = self._store.engines()
        for r in engines.to_dict("records"):
            e = self._engine(str(r["engine_id"]))
            e.boot_id = _str(r.get("boot_id"))
            e.pool = _str(r.get("pool")) or ""
            e.advertised = _str(r.get("kv_events_endpoint"))
            started = r.get("started_unix_s")
            e.started_unix_s = (
                float(started) if started is not None and started == started else -math.inf
            )
            with self._lock:
                self._pool_of[e.engine_id] = e.pool
        for r in self._store.kv_event_totals().to_dict("records"):
            self._totals[str(r["engine_id"])] = {c: int(r[c]) for c in KV_EVENT_SUMS}
        for engine_id in self._overrides:
            self._engine(engine_id)
        return self

    def start(self) -> KvEventsManager:
        """Start the subscriber thread."""
        files = _open_file_limit()
        self._max_sockets = socket_budget(self._s.kv_events_max_sockets, files)
        if self._max_sockets < self._s.kv_events_max_sockets:
            want = self._s.kv_events_max_sockets
            log.warning(
                "at most %d KV-event subscriptions (not --kv-events-max-sockets %d): the "
                "process may open %s files (ulimit -n), each subscription holds %d and "
                "they get %.0f%% of the limit; raise ulimit -n to %d for %d",
                self._max_sockets,
                want,
                files,
                FDS_PER_SUBSCRIPTION,
                100 * FD_SHARE,
                math.ceil(want * FDS_PER_SUBSCRIPTION / FD_SHARE),
                want,
            )
        self._ctx = zmq.Context()
        # ZMQ's own cap (1,023 by default) is set above ours, so ours is what refuses.
        self._ctx.set(zmq.MAX_SOCKETS, max(1023, self._max_sockets + 64))
        self._poller = zmq.Poller()
        now = time.monotonic()
        for e in self._engines.values():
            e.last_note_mono = now
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after a last flush (call before the writer closes)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- from the HTTP side ---------------------------------------------------------------

    def note_batch(
        self, engine_id: str, boot_id: str, hello: dict[str, Any] | None, remote: str | None
    ) -> None:
        """An ingest batch of ``engine_id`` came from ``remote``. O(1); never blocks."""
        now = time.monotonic()
        prev = self._noted.get(engine_id)
        if (
            hello is None
            and prev is not None
            and prev[0] == remote
            and now - prev[1] < self._note_every_s
        ):
            return
        self._noted[engine_id] = (remote, now)
        info = (
            None
            if hello is None
            else (hello.get("pool"), hello.get("kv_events_endpoint"), hello.get("started_unix_s"))
        )
        try:
            self._control.put_nowait((engine_id, boot_id, info, remote, now))
        except queue.Full:
            with self._lock:
                self._dropped["control_messages"] += 1

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self._s.kv_events_flush_interval_s
        next_flush = time.monotonic() + interval
        try:
            for e in self._engines.values():
                self._reconcile(e)
            while not self._stop.is_set():
                self._drain_control()
                self._poll(min(100, max(1, int(interval * 1000))))
                now = time.monotonic()
                if now >= next_flush:
                    self._check_idle(now)
                    self._retry_waiting()
                    self._flush()
                    self._publish()
                    next_flush = now + interval
        except Exception:
            log.exception("the KV-event subscriber failed; KV events are no longer read")
        finally:
            try:
                self._flush()
            finally:
                for e in self._engines.values():
                    self._close(e)
                self._ctx.term()

    def _engine(self, engine_id: str) -> _Engine:
        e = self._engines.get(engine_id)
        if e is None:
            e = self._engines[engine_id] = _Engine(engine_id)
        return e

    def _drain_control(self) -> None:
        for _ in range(MAX_CONTROL):
            try:
                engine_id, boot_id, info, remote, mono = self._control.get_nowait()
            except queue.Empty:
                return
            e = self._engine(engine_id)
            e.last_note_mono = max(e.last_note_mono, mono)
            changed = remote != e.remote or e.idle
            e.remote, e.idle = remote, False
            if info is not None:
                pool, advertised, started = info
                started = float(started) if started is not None else -math.inf
            if info is not None and (boot_id == e.boot_id or started >= e.started_unix_s):
                # (A late hello of an older boot is ignored.)
                if boot_id != e.boot_id or (pool or "") != e.pool:
                    self._forget(e)
                e.boot_id, e.started_unix_s, e.pool = boot_id, started, pool or ""
                e.advertised = advertised
                with self._lock:
                    self._pool_of[engine_id] = e.pool
                changed = True
            if changed:
                self._reconcile(e)

    def _reconcile(self, e: _Engine) -> None:
        """Open, move or close the engine's subscription to match what is known."""
        override = self._overrides.get(e.engine_id)
        raw = override or e.advertised
        want = None
        # An advertised endpoint waits for the engine's first ingest: its source address
        # is what the endpoint is checked against.
        if raw is not None and not e.idle and (override is not None or e.remote):
            want = resolve_endpoint(raw, e.remote)
        if e.sock is not None and want != e.endpoint:
            self._close(e)
            if e.blocks is not None:
                e.blocks.last_seq = None  # a new connection: no gap to attribute
        if want is None or e.sock is not None:
            self._waiting.pop(e.engine_id, None)
            return
        if override is None:
            refusal = self._policy.check(want, e.remote)
            if refusal is not None:
                self._waiting.pop(e.engine_id, None)
                self._refuse(e, want, refusal.reason, refusal.detail)
                return
        if len(self._by_sock) >= self._max_sockets:
            self._waiting[e.engine_id] = None
            self._refuse(
                e,
                want,
                "socket_limit",
                f"{len(self._by_sock)} subscriptions are open, the most allowed "
                "(--kv-events-max-sockets, and ulimit -n: see the start-up log); "
                "it is subscribed when another one closes",
            )
            return
        try:
            sock = self._open(want)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._waiting[e.engine_id] = None
                self._refuse(
                    e,
                    want,
                    "socket_limit",
                    f"{exc} with {len(self._by_sock)} subscriptions open (lower "
                    "--kv-events-max-sockets or raise ulimit -n); retried when one closes",
                )
            else:
                self._waiting.pop(e.engine_id, None)
                self._refuse(e, want, "connect_error", f"cannot connect: {exc}")
            return
        self._waiting.pop(e.engine_id, None)
        e.refused = None
        e.sock, e.endpoint, e.subscribed_mono = sock, want, time.monotonic()
        self._by_sock[sock] = e
        self._poller.register(sock, zmq.POLLIN)
        if e.blocks is None:
            pool = self._pools.get(e.pool)
            if pool is None:
                pool = self._pools[e.pool] = Pool(e.pool, self._s.kv_events_seen_capacity)
            e.generation += 1
            e.blocks = EngineBlocks(
                e.engine_id,
                f"{e.engine_id}|{e.boot_id}|{e.generation}",
                pool,
                self._s.kv_events_max_engine_blocks,
            )
        log.info("subscribed to the KV events of %s (pool %r) at %s", e.engine_id, e.pool, want)

    def _open(self, endpoint: str) -> Any:
        """A SUB socket connected to ``endpoint``; ZMQError (closed again) on failure."""
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            if "[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _refuse(self, e: _Engine, endpoint: str, reason: str, detail: str) -> None:
        """Log and count a refusal, once per engine, endpoint and reason."""
        if e.refused == (endpoint, reason):
            return
        e.refused = (endpoint, reason)
        with self._lock:
            self._refused[reason] += 1
        log.warning(
            "not subscribing to the KV events of %s at %s (%s): %s",
            e.engine_id,
            _printable(endpoint),
            reason,
            _printable(detail),
        )

    def _retry_waiting(self) -> None:
        """Subscribe engines refused for the socket limit while there is room."""
        while self._waiting and len(self._by_sock) < self._max_sockets:
            engine_id = next(iter(self._waiting))
            del self._waiting[engine_id]
            self._reconcile(self._engines[engine_id])
            if engine_id in self._waiting:  # failed again (ZMQ or the OS): next time
                return

    def _close(self, e: _Engine) -> None:
        if e.sock is None:
            return
        self._poller.unregister(e.sock)
        self._by_sock.pop(e.sock, None)
        e.sock.close(0)
        e.sock, e.endpoint = None, None

    def _forget(self, e: _Engine) -> None:
        """Unsubscribe and forget the engine's blocks (new boot, new pool, silent)."""
        self._close(e)
        b = e.blocks
        if b is None:
            return
        for reason, n in _engine_drops(b).items():
            self._gone[reason] += n
        b.leave()
        e.blocks = None
        if not b.pool.members:
            pool = self._pools.pop(b.pool.name, None)
            if pool is not None:
                self._gone["seen_memory"] += pool.seen.dropped + len(pool.seen)

    def _check_idle(self, now: float) -> None:
        limit = self._s.kv_events_idle_s
        for engine_id in list(self._waiting):
            e = self._engines[engine_id]
            if now - e.last_note_mono > limit:  # gone silent while waiting for a socket
                del self._waiting[engine_id]
                e.idle = True
        for e in self._engines.values():
            if e.sock is None:
                continue
            last = max(e.last_msg_mono, e.last_note_mono, e.subscribed_mono)
            if now - last > limit:
                log.info(
                    "%s sent nothing for %.0f s: unsubscribed from its KV events",
                    e.engine_id,
                    now - last,
                )
                self._forget(e)
                e.idle = True

    def _poll(self, timeout_ms: int) -> None:
        if not self._by_sock:
            # zmq's poll returns at once without sockets: wait here instead of spinning.
            self._stop.wait(timeout_ms / 1000)
            return
        for sock, _ in self._poller.poll(timeout_ms):
            e = self._by_sock.get(sock)
            if e is None:
                continue
            for _ in range(MAX_MESSAGES_PER_POLL):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_message(e, frames)

    def _on_message(self, e: _Engine, frames: list[bytes]) -> None:
        e.last_msg_mono = time.monotonic()
        if e.blocks is None:
            return
        try:
            msg = decode(frames)
        except WireError:
            self._gone["malformed_messages"] += 1
            return
        if not math.isfinite(msg.ts):
            self._gone["malformed_messages"] += 1
            return
        key = (e.engine_id, math.floor(msg.ts))
        row = self._pending.get(key)
        if row is None:
            if len(self._pending) >= MAX_PENDING_ROWS:
                self._gone["pending_rows"] += 1
                row = new_row()  # accounted in the blocks, not stored
            else:
                row = self._pending[key] = new_row()
        e.blocks.apply(msg, row)

    # -- storing and publishing -------------------------------------------------------------

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        data: dict[str, list[Any]] = {
            "engine_id": [k[0] for k in pending],
            "ts_s": [k[1] for k in pending],
        }
        for i, name in enumerate(ROW_FIELDS):
            data[name] = [r[i] for r in pending.values()]
        df = pd.DataFrame(data)
        df["block_size"] = df["block_size"].astype("Int64").mask(df["block_size"] == 0)
        df = df[list(KV_EVENT_COLUMNS)]

        def job() -> int:
            n = self._store.write_kv_event_windows(df)
            self._count_committed(df)
            return n

        try:
            fut = self._writer.call(job)
        except WriterClosed:
            self._gone["pending_rows"] += len(df)
            return
        fut.add_done_callback(lambda f: self._flush_done(f, len(df)))

    def _flush_done(self, fut: Future[int], n_rows: int) -> None:
        exc = fut.exception()
        if exc is not None:
            log.error("storing %d KV-event windows failed: %s", n_rows, exc)
            with self._lock:
                self._dropped["pending_rows"] += n_rows

    def _count_committed(self, df: pd.DataFrame) -> None:
        sums = df.groupby("engine_id")[list(KV_EVENT_SUMS)].sum()
        with self._lock:
            for engine_id, r in sums.iterrows():
                t = self._totals.setdefault(str(engine_id), dict.fromkeys(KV_EVENT_SUMS, 0))
                for c in KV_EVENT_SUMS:
                    t[c] += int(r[c])

    def _publish(self) -> None:
        snap = _Snapshot()
        drops = Counter(self._gone)
        for e in sorted(self._engines.values(), key=lambda x: x.engine_id):
            raw = self._overrides.get(e.engine_id) or e.advertised
            if raw is not None:
                snap.subscribed.append(
                    (e.engine_id, e.pool, e.endpoint or raw, int(e.sock is not None))
                )
            if e.blocks is not None:
                snap.held.append((e.engine_id, e.pool, len(e.blocks.blocks)))
                drops.update(_engine_drops(e.blocks))
        for name, pool in sorted(self._pools.items()):
            snap.distinct.append((name, pool.distinct_blocks))
            drops["seen_memory"] += pool.seen.dropped
        with self._lock:
            drops.update(self._dropped)
            snap.dropped = dict(drops)
            self._snapshot = snap

    def render(self, w: TextWriter) -> None:
        """Write the ``kvscope_kv_events_*`` families (a section of ``/metrics``)."""
        with self._lock:
            snap = self._snapshot
            totals = sorted(self._totals.items())
            pools = dict(self._pool_of)
            refused = dict(self._refused)
        for name, col, help_text in _TOTALS:
            w.family(name, "counter", help_text)
            for engine_id, t in totals:
                w.sample(
                    name,
                    label_str((("engine", engine_id), ("pool", pools.get(engine_id, "")))),
                    t.get(col, 0),
                )
        w.family(
            "kvscope_kv_events_held_blocks",
            "gauge",
            "KV-cache blocks the engine holds, as known from its KV events.",
        )
        for engine_id, pool, n in snap.held:
            w.sample(
                "kvscope_kv_events_held_blocks",
                label_str((("engine", engine_id), ("pool", pool))),
                n,
            )
        w.family(
            "kvscope_pool_kv_distinct_blocks",
            "gauge",
            "Distinct block contents held across the engines of the pool.",
        )
        for pool, n in snap.distinct:
            w.sample("kvscope_pool_kv_distinct_blocks", label_str((("pool", pool),)), n)
        w.family(
            "kvscope_kv_events_subscribed",
            "gauge",
            "1 while the collector is subscribed to the engine's KV events, else 0.",
        )
        for engine_id, pool, endpoint, v in snap.subscribed:
            w.sample(
                "kvscope_kv_events_subscribed",
                label_str((("engine", engine_id), ("pool", pool), ("endpoint", endpoint))),
                v,
            )
        w.family(
            "kvscope_kv_events_dropped_total",
            "counter",
            "What KV-event accounting dropped or could not read, by reason.",
        )
        for reason, n in sorted(snap.dropped.items()):
            w.sample("kvscope_kv_events_dropped_total", label_str((("reason", reason),)), n)
        w.family(
            "kvscope_kv_events_refused_endpoints_total",
            "counter",
            "KV-event endpoints not subscribed to, by reason: not_allowed (not the "
            "hello's source host nor --kv-events-allow), ipc (--kv-events-allow-ipc off), "
            "socket_limit (--kv-events-max-sockets or the open-file limit), connect_error; "
            "once per engine and endpoint.",
        )
        for reason in REFUSAL_REASONS:
            w.sample(
                "kvscope_kv_events_refused_endpoints_total",
                label_str((("reason", reason),)),
                refused.get(reason, 0),
            )
        w.family(
            "kvscope_kv_events_max_sockets",
            "gauge",
            "Most KV-event subscriptions open at once (--kv-events-max-sockets, lowered "
            "to fit the open-file limit).",
        )
        w.sample("kvscope_kv_events_max_sockets", "", self._max_sockets)


def _engine_drops(b: EngineBlocks) -> dict[str, int]:
    return {
        "untracked_blocks": b.untracked,
        "other_medium_blocks": b.ignored,
        "bad_events": b.bad_events,
        "publisher_restarts": b.restarts,
    }


def _open_file_limit() -> int | None:
    """The process's open-file limit (``ulimit -n``), None if unlimited or unknown."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _printable(text: str) -> str:
    """``text`` with control characters escaped (a hello's endpoint is the sender's text:
    a newline in it must not forge a log line)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _str(v: Any) -> str | None:
    if v is None or (isinstance(v, float) and v != v) or v is pd.NA:
        return None
    return str(v)
