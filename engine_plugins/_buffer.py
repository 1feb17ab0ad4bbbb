"""Per-engine buffers: what ``record()`` appends to and the exporter drains.

``record()`` (one thread: vLLM's event loop) appends raw rows to two bounded
deques and bumps the ``*_produced`` counters; it takes no lock. When a deque is
full, ``append`` evicts the oldest row; :meth:`EngineBuffer.refresh_buffer_drops`
counts those evictions exactly as ``produced - taken - len(deque)``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from kvscope.engine_plugins._rows import StepFolder


class EngineBuffer:
    """Buffers and delivery state of one engine.

    ``record()`` writes ``steps``, ``requests``, ``*_produced`` and
    ``record_errors`` (one thread: vLLM's event loop); the plugin writes the hello
    through :meth:`set_hello`; everything else belongs to the exporter thread.
    """

    def __init__(self, engine_id: str, boot_id: str, max_steps: int, max_requests: int) -> None:
        self.engine_id = engine_id
        self.boot_id = boot_id
        self.steps: deque[tuple[Any, ...]] = deque(maxlen=max_steps)
        self.requests: deque[tuple[Any, ...]] = deque(maxlen=max_requests)
        self.steps_produced = 0
        self.requests_produced = 0
        self.record_errors = 0
        self.hello: dict[str, Any] | None = None
        self.hello_version = 0
        # Exporter state.
        self.folder = StepFolder()
        self.held_steps: list[tuple[Any, ...]] = []
        self.next_seq = 0
        self.last_counters: dict[str, int] = {}
        """The counters carried by the latest batch built."""
        self.last_built_mono_s = -math.inf
        self.hello_acked_version = 0
        self.steps_taken = self.requests_taken = 0
        self.buffer_dropped_steps = self.buffer_dropped_requests = 0
        self.batch_dropped_steps = self.batch_dropped_requests = 0
        self.steps_sent = self.requests_sent = 0
        self.pending_batches = self.pending_steps = self.pending_requests = 0
        self.batches_built = self.batches_sent = self.dropped_batches = 0
        self.send_failures = self.hellos_sent = 0
        # Dropped batches by reason (each also counts in dropped_batches, except the
        # spool's drops of earlier boots' batches, which count only in dropped_full).
        self.dropped_full = self.dropped_rejected = self.dropped_exit = 0
        # The on-disk spool: this boot's batches in it now, and cumulative counts.
        self.spool_batches = self.spool_steps = self.spool_requests = 0
        self.spooled_batches = 0
        self.spool_corrupt_records = 0
        """Process-wide count, carried by the process's first engine only."""

    def set_hello(self, hello: dict[str, Any]) -> None:
        """Replace the hello (identity and configuration); it is sent again."""
        self.hello = {**hello, "engine_id": self.engine_id, "boot_id": self.boot_id}
        self.hello_version += 1

    @property
    def hello_due(self) -> bool:
        """Whether the collector has not acknowledged the current hello."""
        return self.hello is not None and self.hello_acked_version != self.hello_version

    def refresh_buffer_drops(self) -> int:
        """Update the count of rows evicted from the deques; return the steps in the deque.

        ``produced`` is read before ``len``, so a concurrent ``record()`` can only
        make the estimate low, never high; taking the maximum keeps it monotonic.
        """
        produced, n_steps = self.steps_produced, len(self.steps)
        self.buffer_dropped_steps = max(
            self.buffer_dropped_steps, produced - self.steps_taken - n_steps
        )
        produced, n_requests = self.requests_produced, len(self.requests)
        self.buffer_dropped_requests = max(
            self.buffer_dropped_requests, produced - self.requests_taken - n_requests
        )
        return n_steps

    def counters(self) -> dict[str, int]:
        """The cumulative exporter counters of the wire schema (``EXPORTER_FIELDS``)."""
        self.refresh_buffer_drops()
        return {
            "dropped_steps": self.buffer_dropped_steps + self.batch_dropped_steps,
            "dropped_requests": self.buffer_dropped_requests + self.batch_dropped_requests,
            "dropped_batches": self.dropped_batches,
            "send_failures": self.send_failures,
            "record_errors": self.record_errors,
            "dropped_batches_full": self.dropped_full,
            "dropped_batches_rejected": self.dropped_rejected,
            "spooled_batches": self.spooled_batches,
            "spool_corrupt_records": self.spool_corrupt_records,
        }
