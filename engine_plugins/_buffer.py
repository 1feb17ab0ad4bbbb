"""Per-engine buffers: what ``record()`` appends to and the exporter drains.

``record()`` (one thread: vLLM's event loop) appends raw rows to two bounded
deques and bumps the ``*_produced`` counters; it takes no lock. When a deque is
full, ``append`` evicts the oldest row; :meth:`EngineBuffer.refresh_buffer_drops`
counts those evictions exactly as ``produced - taken - len(deque)``.

The buffer also holds the engine's hello (identity and configuration), which the
plugin sets; what the exporter does with rows and hello once drained belongs to the
exporter's parts (:mod:`kvscope.engine_plugins.exporter`).
"""

from __future__ import annotations

from collections import deque
from typing import Any


class EngineBuffer:
    """The row buffers and the hello of one engine.

    ``record()`` writes ``steps``, ``requests``, ``*_produced`` and ``record_errors``
    (one thread: vLLM's event loop); the plugin writes the hello through
    :meth:`set_hello`; the ``*_taken`` and ``buffer_dropped_*`` counts belong to the
    exporter thread, which drains the deques.
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
        """Bumped by every :meth:`set_hello`; batches name the version they carry."""
        # Drained by the exporter thread; evictions from the full deques.
        self.steps_taken = self.requests_taken = 0
        self.buffer_dropped_steps = self.buffer_dropped_requests = 0

    def set_hello(self, hello: dict[str, Any]) -> None:
        """Replace the hello (identity and configuration); it is sent again."""
        self.hello = {**hello, "engine_id": self.engine_id, "boot_id": self.boot_id}
        self.hello_version += 1

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
