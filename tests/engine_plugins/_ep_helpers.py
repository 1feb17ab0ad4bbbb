"""Helpers for the engine-plugin tests: unreachable collectors and real vLLM stats
(the recording HTTP server and the settings are in tests/_plugin_testkit.py)."""

from __future__ import annotations

import socket
from typing import Any

from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    PrefillStats,
    PrefixCacheStats,
    SchedulerIterationDetails,
    SchedulerStats,
)


def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Blackhole:
    """A listening socket that never accepts nor answers: requests hang until timeout."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


# -- real vLLM stats -------------------------------------------------------------------


def sched_stats(
    running: int = 4,
    waiting: int = 2,
    deferred: int = 1,
    kv: float = 0.5,
    queries: int = 100,
    hits: int = 40,
    *,
    preempted_queries: int = 0,
    connector_queries: int = 0,
    elapsed_ms: float | None = None,
) -> SchedulerStats:
    """A real SchedulerStats, with prefix-cache stats filled in through vLLM's API."""
    pcs = PrefixCacheStats()
    if queries:
        pcs.record(num_tokens=queries, num_hits=hits, preempted=False)
    if preempted_queries:
        pcs.record(num_tokens=preempted_queries, num_hits=preempted_queries // 2, preempted=True)
    connector = None
    if connector_queries:
        connector = PrefixCacheStats()
        connector.record(num_tokens=connector_queries, num_hits=connector_queries, preempted=False)
    details = None
    if elapsed_ms is not None:
        details = SchedulerIterationDetails(
            iteration_index=1,
            num_ctx_requests=1,
            num_ctx_tokens=10,
            num_generation_requests=running,
            num_generation_tokens=running,
            elapsed_ms=elapsed_ms,
        )
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=deferred,
        kv_cache_usage=kv,
        prefix_cache_stats=pcs,
        connector_prefix_cache_stats=connector,
        iteration_details=details,
    )


def finished(
    reason: FinishReason = FinishReason.LENGTH,
    *,
    queued_s: float = 0.25,
    prefill_s: float = 0.5,
    gen: int = 16,
) -> FinishedRequestStats:
    """A real FinishedRequestStats."""
    return FinishedRequestStats(
        finish_reason=reason,
        request_id="r",
        e2e_latency=2.0,
        num_prompt_tokens=30,
        num_preemptions=1,
        num_generation_tokens=gen,
        queued_time=queued_s,
        prefill_time=prefill_s,
        decode_time=1.25,
        num_cached_tokens=8,
    )


def iter_stats(
    gen: int = 4,
    prompt: int = 30,
    cached: int = 10,
    preempted: int = 0,
    fins: int = 0,
) -> IterationStats:
    """A real IterationStats, prompt tokens filled in through vLLM's PrefillStats."""
    it = IterationStats()
    it.num_generation_tokens = gen
    if prompt:
        ps = PrefillStats()
        ps.set(
            num_prompt_tokens=prompt,
            num_local_cached_tokens=min(cached, prompt),
            num_external_cached_tokens=0,
        )
        it.prompt_token_stats.update_from_output(ps)
    it.num_preempted_reqs = preempted
    for _ in range(fins):
        it.finished_requests.append(finished())
    return it


def push_steps(eng: Any, n: int, ts_unix_s: float, *, gen: int = 1) -> None:
    """Append ``n`` raw step rows the way record() does."""
    for i in range(n):
        eng.steps.append((ts_unix_s, i + 1, 4, 1, 0, 0.5, 10, 5, 0, 3, gen, 9.0))
        eng.steps_produced += 1


def column_sum(batches: list[dict[str, Any]], part: str, column: str) -> float:
    """Sum one column over batches (a batch may carry ``{}`` for no rows)."""
    return sum(sum(b[part].get(column, [])) for b in batches)
