"""Twin steps into a collector, through the real plugin.

:class:`CollectorFeed` is the twin's :class:`~kvscope.twin.sim.Sink`: the same
:class:`~kvscope.engine_plugins.plugin.KvscopeStatLogger` vLLM loads, created with the
twin's ``VllmConfig`` (so the hello carries the configuration), a clock that reads the
simulated time (so rows carry simulated timestamps) and ``simulated=True`` (so the
collector, /metrics and every surface can tell a twin from a server). Its exporter is
not a thread: the feed runs one export cycle per simulated second from the twin's loop,
so a twin running 30x faster than real time still hands over every row, and the
replay waits for the collector instead of dropping what it cannot send. The cycle runs
on a helper thread while the twin computes the next simulated second (its HTTP round
trip and the collector's commit overlap the scheduler's work), and the next cycle
waits for it: one cycle in flight at most, so nothing is dropped and an export's error
stops the replay.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvscope.engine_plugins.exporter import Exporter
from kvscope.engine_plugins.plugin import KvscopeStatLogger, Settings

#: Pool names of twins end with this, so a twin never lands in a real pool.
TWIN_POOL_SUFFIX = "-twin"


class FeedError(RuntimeError):
    """Rows the collector did not store (the message says how many and why)."""


class CollectorFeed:
    """Send a twin's steps to the collector at ``url`` as engine ``engine_id`` of ``pool``."""

    def __init__(
        self,
        url: str,
        vllm_config: Any,
        *,
        engine_id: str,
        pool: str,
        token: str | None = None,
        start_unix_s: float,
    ) -> None:
        if not pool.endswith(TWIN_POOL_SUFFIX):
            pool += TWIN_POOL_SUFFIX
        self.now = start_unix_s
        self.settings = Settings(
            collector_url=url.rstrip("/"),
            token=token,
            pool=pool,
            engine_id_override=engine_id,
            host=engine_id.partition(":")[0] or "twin",
            port=0,
        )
        self.exporter = Exporter(self.settings)
        self.logger = KvscopeStatLogger(
            vllm_config,
            0,
            settings=self.settings,
            exporter=self.exporter,
            clock=lambda: self.now,
            simulated=True,
        )
        self._next_tick = start_unix_s + 1.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-twin-feed")
        self._pending: Future[None] | None = None

    @property
    def engine_id(self) -> str:
        return self.logger.engine_id or ""

    def record(self, scheduler_stats: Any, iteration_stats: Any, now_unix_s: float) -> None:
        self.now = now_unix_s
        self.logger.record(scheduler_stats, iteration_stats)
        if now_unix_s >= self._next_tick:
            self._wait()
            self._pending = self._pool.submit(self._tick, now_unix_s)
            self._next_tick = now_unix_s + 1.0

    def _tick(self, now_unix_s: float) -> None:
        self.exporter.tick(now_unix_s=now_unix_s)

    def _wait(self) -> None:
        """Wait for the cycle in flight; its error is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, now_unix_s: float) -> None:
        """Send everything left; raise :class:`FeedError` if any row was not stored."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
        self.now = now_unix_s
        self.exporter.tick(now_unix_s=now_unix_s + 2.0, final=True)
        stats = self.exporter.stats(self.engine_id)
        lost = {
            k: v
            for k, v in stats.items()
            if k in ("steps_dropped", "requests_dropped", "batches_dropped") and v
        }
        unsent = stats["steps_produced"] - stats["steps_sent"] - stats["steps_merged"]
        if self.logger.record_errors or lost or unsent > 0:
            raise FeedError(
                f"the collector at {self.settings.collector_url} did not store the whole "
                f"replay ({lost or 'no drops'}, {unsent} steps unsent, record errors {self.logger.record_errors}); "
                "is it running and does it accept this token?"
            )
