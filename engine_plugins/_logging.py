"""Logging for the engine side: one logger, messages rate-limited per key.

The logger is named ``vllm.kvscope`` so that its records go through the handler
vLLM configures for its own ``vllm`` logger (vLLM sets ``propagate=False`` there,
so a logger outside that tree would print nowhere useful inside the server).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

LOGGER = logging.getLogger("vllm.kvscope")

#: Default spacing between two messages with the same key.
DEFAULT_INTERVAL_S = 60.0


class RateLimitedLog:
    """Log a message at most once per ``interval_s`` per key; count what was suppressed.

    Safe to call from any thread. ``interval_s=float("inf")`` logs a key once.
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_mono_s: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def _due(self, key: str) -> int | None:
        """Return the number of suppressed messages if ``key`` may log now, else None."""
        now = time.monotonic()
        with self._lock:
            last = self._last_mono_s.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return None
            self._last_mono_s[key] = now
            return self._suppressed.pop(key, 0)

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless ``key`` logged within the interval; return whether it did."""
        suppressed = self._due(key)
        if suppressed is None:
            return False
        if suppressed:
            msg = f"{msg} (%d similar message(s) suppressed)"
            args = (*args, suppressed)
        LOGGER.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Shorthand for :meth:`log` at WARNING level."""
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def reset(self) -> None:
        """Forget all keys (used by tests)."""
        with self._lock:
            self._last_mono_s.clear()
            self._suppressed.clear()

    def _after_fork_in_child(self) -> None:
        # The lock may have been held by another thread at fork time.
        self._lock = threading.Lock()


#: Process-wide limiter for errors (at most one message a minute per key).
ERRORS = RateLimitedLog()
#: Process-wide limiter for one-time notices.
ONCE = RateLimitedLog(interval_s=float("inf"))


def _after_fork_in_child() -> None:
    ERRORS._after_fork_in_child()
    ONCE._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
