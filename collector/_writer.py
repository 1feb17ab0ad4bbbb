"""The writer thread: group commit of validated batches into the store.

HTTP handlers :meth:`~GroupCommitWriter.submit` a prepared batch and await the
returned future. The one writer thread takes everything pending (up to
``max_group_batches``), commits it in one transaction (:meth:`Store.ingest`, which
falls back to one transaction per batch if the group fails), updates the in-memory
metrics through ``on_committed`` and only then resolves the futures: a handler
answers 200 only for data that is committed and visible in ``/metrics``.

Other store writes (retention, saved state) are queued as jobs with
:meth:`~GroupCommitWriter.call`, so every write runs on this one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from kvscope.collector.batch import PreparedBatch
from kvscope.collector.store import IngestResult, Store

log = logging.getLogger(__name__)

T = TypeVar("T")
OnCommitted = Callable[[list[PreparedBatch], list["IngestResult | Exception"]], None]


class Overloaded(RuntimeError):
    """Too many batches are waiting for the writer; the sender should retry later."""


class WriterClosed(RuntimeError):
    """The writer was stopped; nothing more is accepted."""


_STOP = object()


class GroupCommitWriter:
    """One daemon thread that owns every store write."""

    def __init__(
        self,
        store: Store,
        *,
        max_group_batches: int = 512,
        max_pending_batches: int = 20_000,
        linger_s: float = 0.0,
        on_committed: OnCommitted | None = None,
    ) -> None:
        self._store = store
        self._max_group = max_group_batches
        self._max_pending = max_pending_batches
        self._linger_s = linger_s
        self._on_committed = on_committed
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self.write_error: str | None = None
        """The error of the latest group when every batch of it failed (a full disk, a
        store that cannot write); None once a group stores again."""
        self.write_error_since_unix_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="kvscope-writer", daemon=True)
        self.groups_committed = 0
        """Transactions run for batch groups (monotonic)."""
        self.last_group_size = 0
        self.last_group_s = 0.0

    def start(self) -> GroupCommitWriter:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    @property
    def pending_batches(self) -> int:
        """Batches submitted and not yet answered."""
        return self._pending

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def submit(self, batch: PreparedBatch) -> Future[IngestResult]:
        """Queue a batch; the future resolves after its commit (or raises its error)."""
        fut: Future[IngestResult] = Future()
        with self._lock:
            if self._closed:
                raise WriterClosed("collector is shutting down")
            if self._pending >= self._max_pending:
                raise Overloaded(f"{self._pending} batches waiting to be stored")
            self._pending += 1
        self._q.put((batch, fut))
        return fut

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the writer thread (between groups); return its future."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise WriterClosed("collector is shutting down")
        self._q.put((fn, fut))
        return fut

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Store everything already submitted, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._q.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("writer did not finish within %.0f s", timeout_s or 0)

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            items = [self._q.get()]
            n_batches = 1 if items[0] is not _STOP and isinstance(items[0][0], PreparedBatch) else 0
            # Linger a little after the first batch so that one transaction carries many
            # batches: the cost of a commit is mostly per transaction, not per row.
            deadline = time.monotonic() + self._linger_s if n_batches else 0.0
            while n_batches < self._max_group and items[-1] is not _STOP:
                try:
                    wait = deadline - time.monotonic()
                    item = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
                if item is not _STOP and isinstance(item[0], PreparedBatch):
                    n_batches += 1
            group: list[tuple[PreparedBatch, Future[IngestResult]]] = []
            jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
            for item in items:
                if item is _STOP:
                    stop = True
                elif isinstance(item[0], PreparedBatch):
                    group.append(item)
                else:
                    jobs.append(item)
            if group:
                self._commit_group(group)
            for fn, fut in jobs:
                self._run_job(fn, fut)
        # Anything queued after the stop marker was submitted before close() returned.
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                continue
            if isinstance(item[0], PreparedBatch):
                self._commit_group([item])
            else:
                self._run_job(*item)

    def _commit_group(self, group: list[tuple[PreparedBatch, Future[IngestResult]]]) -> None:
        batches = [b for b, _ in group]
        t0 = time.perf_counter()
        try:
            results: list[IngestResult | Exception] = self._store.ingest(batches)
        except Exception as exc:  # the store itself is unusable (e.g. closed)
            log.exception("store write failed")
            results = [exc] * len(batches)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and len(errors) == len(results):
            if self.write_error is None:
                self.write_error_since_unix_s = time.time()
            first = str(errors[0]).strip().splitlines()
            self.write_error = f"{type(errors[0]).__name__}: {first[0] if first else ''}"[:300]
        elif not errors:
            self.write_error = None
            self.write_error_since_unix_s = None
        self.last_group_s = time.perf_counter() - t0
        self.last_group_size = len(batches)
        self.groups_committed += 1
        if self._on_committed is not None:
            try:
                self._on_committed(batches, results)
            except Exception:
                log.exception("updating metrics after a commit failed")
        with self._lock:
            self._pending -= len(group)
        for (_, fut), res in zip(group, results, strict=True):
            _resolve(fut, res)

    @staticmethod
    def _run_job(fn: Callable[[], Any], fut: Future[Any]) -> None:
        try:
            res = fn()
        except Exception as exc:
            res = exc
        _resolve(fut, res)


def _resolve(fut: Future[Any], res: Any) -> None:
    """Set a future's outcome unless its waiter gave up (cancelled) meanwhile."""
    if fut.cancelled():
        return
    try:
        if isinstance(res, Exception):
            fut.set_exception(res)
        else:
            fut.set_result(res)
    except InvalidStateError:  # cancelled between the check and the set
        pass
