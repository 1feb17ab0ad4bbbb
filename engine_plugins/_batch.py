"""Encoded batches, and the in-memory queue of those not delivered yet.

A :class:`Batch` is one engine's batch exactly as it is POSTed: its gzipped body is
built once, by :class:`kvscope.engine_plugins._builder.BatchBuilder`, and never
changed, so a retry or a replay from the spool sends the same bytes under the same
idempotency key ``(engine_id, boot_id, seq)``.

:class:`BatchQueue` owns the batches waiting for delivery, oldest first, and knows
when it holds more than ``max_pending_batches`` or :data:`MAX_PENDING_BYTES`; what is
beyond those caps is for the exporter to drop or to move to the spool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

#: Most bytes of encoded batches kept waiting (besides ``max_pending_batches``).
MAX_PENDING_BYTES = 64 * 1024 * 1024


@dataclass
class Batch:
    """One encoded batch of one engine."""

    engine_id: str
    boot_id: str
    seq: int
    body: bytes
    """Gzipped JSON, sent as it is."""
    n_steps: int
    n_requests: int
    hello_version: int
    """Version of the engine hello inside, 0 for none."""
    hello_sent_ahead: bool = False
    """Whether the collector refused this batch for want of the hello and a batch
    carrying it was queued ahead (a second such refusal drops the batch)."""

    def spool_meta(self) -> dict[str, Any]:
        """What the spool stores beside the body (:mod:`kvscope.engine_plugins._spool`)."""
        return {
            "engine_id": self.engine_id,
            "boot_id": self.boot_id,
            "seq": self.seq,
            "n_steps": self.n_steps,
            "n_requests": self.n_requests,
        }


class BatchQueue:
    """Batches waiting for delivery, oldest first, with their total size."""

    def __init__(self, max_batches: int) -> None:
        self.max_batches = max_batches
        self.bytes = 0
        """Bytes of the bodies queued."""
        self._batches: deque[Batch] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def head(self) -> Batch | None:
        """The oldest batch, or None when the queue is empty."""
        return self._batches[0] if self._batches else None

    def push(self, batch: Batch) -> None:
        """Queue ``batch`` behind the others."""
        self._batches.append(batch)
        self.bytes += len(batch.body)

    def push_front(self, batch: Batch) -> None:
        """Queue ``batch`` ahead of the others (a batch the head needs delivered first)."""
        self._batches.appendleft(batch)
        self.bytes += len(batch.body)

    def pop(self) -> Batch:
        """Remove and return the oldest batch."""
        batch = self._batches.popleft()
        self.bytes -= len(batch.body)
        return batch

    def over_cap(self) -> bool:
        """Whether the queue holds more than its caps allow (it always keeps one batch)."""
        return len(self._batches) > 1 and (
            len(self._batches) > self.max_batches or self.bytes > MAX_PENDING_BYTES
        )
