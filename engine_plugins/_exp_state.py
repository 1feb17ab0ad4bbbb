"""The exporter's shared state and its queue of built, undelivered batches.

:class:`ExporterState` holds what the exporter's parts (batch building, delivery,
spool replay, accounting; one mixin module each, combined in
:class:`kvscope.engine_plugins.exporter.Exporter`) share: the engine buffers, the queue of
pending batches with its byte count, the locks and the backoff state. It also keeps
the queue's accounting: a batch leaving the queue undelivered is counted as dropped
with its reason (``full``, ``rejected``, ``exit``).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins._http import IngestClient
from kvscope.engine_plugins._rows import ColumnBuilder
from kvscope.engine_plugins._spool import Spool

#: Most bytes of encoded batches kept waiting (besides ``max_pending_batches``).
MAX_PENDING_BYTES = 64 * 1024 * 1024
_GZIP_LEVEL = 5


@dataclass
class Batch:
    """One encoded batch of one engine, queued for delivery."""

    eng: EngineBuffer
    seq: int
    body: bytes
    n_steps: int
    n_requests: int
    hello_version: int
    """Version of the hello inside, 0 for none."""


def encode_batch(payload: dict[str, Any]) -> bytes:
    """A batch payload as gzipped compact JSON (deterministic: no gzip timestamp)."""
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return gzip.compress(data, compresslevel=_GZIP_LEVEL, mtime=0)


class ExporterState:
    """State shared by the exporter's parts, and the pending queue's accounting."""

    def __init__(self, settings: Settings, client: IngestClient, boot_id: str | None) -> None:
        self.settings = settings
        self.boot_id = boot_id or uuid.uuid4().hex
        self.pid = os.getpid()
        self._client = client
        self._engines: dict[str, EngineBuffer] = {}
        self._pending: deque[Batch] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()  # exporter state; held briefly, never during I/O
        self._tick_lock = threading.Lock()  # one tick at a time; held during I/O
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_deadline_mono_s: float | None = None
        self._closed = False
        self._columns = ColumnBuilder()
        self._rng = random.Random()
        self._failures = 0  # consecutive failed delivery attempts
        self._next_attempt_mono_s = 0.0
        self.exporter_errors = 0
        self._spool: Spool | None = None
        self._spool_tried = False
        self.replayed_batches = 0
        """Batches of earlier boots delivered from the spool."""

    def _over_cap(self) -> bool:
        return len(self._pending) > 1 and (
            len(self._pending) > self.settings.max_pending_batches
            or self._pending_bytes > MAX_PENDING_BYTES
        )

    def _drop(self, batch: Batch, reason: str) -> None:
        eng = batch.eng
        eng.dropped_batches += 1
        if reason == "full":
            eng.dropped_full += 1
        elif reason == "rejected":
            eng.dropped_rejected += 1
        else:
            eng.dropped_exit += 1
        eng.batch_dropped_steps += batch.n_steps
        eng.batch_dropped_requests += batch.n_requests
        self._unqueue(batch)

    def _unqueue(self, batch: Batch) -> None:
        self._pending_bytes -= len(batch.body)
        eng = batch.eng
        eng.pending_batches -= 1
        eng.pending_steps -= batch.n_steps
        eng.pending_requests -= batch.n_requests
