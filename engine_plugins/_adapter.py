"""The one module that reads vLLM's stats objects.

vLLM says its ``SchedulerStats`` / ``IterationStats`` are not a stable interface, so
each reader has two paths: a fast path reading vLLM 0.32's attributes directly (it runs
on vLLM's event loop once per step), and a compatible path, taken on an
``AttributeError``, that reads each field with ``getattr`` and a default, so a vLLM
lacking a field degrades (0 / null, logged once) instead of breaking. An object with
none of the fields is not stats: ``TypeError``, counted as a record error by the caller.

Rows are plain tuples in the layouts of :mod:`kvscope.engine_plugins._rows`, values
copied as they are and cleaned up later by the exporter, off the event loop.

What is counted matches vLLM 0.32's ``PrometheusStatLogger.record`` exactly, so
kvscope's totals equal vLLM's ``/metrics``: ``prefix_queries`` / ``prefix_hits`` from
``prefix_cache_stats`` (not the ``preempted_*`` re-lookups nor the KV connector's,
which vLLM does not add either), ``prompt_tokens`` (cached included),
``generation_tokens``, ``preemptions``; the gauges ``batch_size`` (running),
``waiting`` and ``deferred`` (skipped waiting; vLLM's ``num_requests_waiting`` is their
sum), ``kv_usage_ratio``; ``iteration_s`` from ``iteration_details`` when vLLM reports it.

Per finished request: vLLM's latencies, token counts, preemptions and finish reason.
TTFT is ``first_token_latency`` where a vLLM version has it, else the exporter derives
the engine-side ``queued_time + prefill_time`` (no front-end tokenisation or IPC).

The fields on the wire: docs/plugin.md#what-it-sends
"""

from __future__ import annotations

from typing import Any

from kvscope.engine_plugins._logging import ONCE

_NONE = object()

_SCHED_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "kv_cache_usage",
)
_ITER_FIELDS = ("num_prompt_tokens", "num_generation_tokens", "num_preempted_reqs")
_REQ_FIELDS = (
    "e2e_latency",
    "queued_time",
    "prefill_time",
    "decode_time",
    "num_prompt_tokens",
    "num_generation_tokens",
    "num_cached_tokens",
    "num_preemptions",
    "finish_reason",
)


def _note_missing(kind: str, obj: object, names: tuple[str, ...]) -> None:
    ONCE.warning(
        f"adapter:{kind}:{','.join(names)}",
        "kvscope: this vLLM's %s lacks %s; kvscope reports 0 or null there",
        type(obj).__name__,
        ", ".join(names),
    )


def _fields(kind: str, obj: object, names: tuple[str, ...], default: Any) -> list[Any]:
    """Read ``names`` from ``obj`` with a default; raise TypeError if none exists."""
    values = [getattr(obj, n, _NONE) for n in names]
    missing = tuple(n for n, v in zip(names, values, strict=True) if v is _NONE)
    if len(missing) == len(names):
        raise TypeError(f"kvscope: {type(obj).__name__} is not a vLLM {kind}")
    if missing:
        _note_missing(kind, obj, missing)
    return [default if v is _NONE else v for v in values]


# -- steps ---------------------------------------------------------------------------


def step_row(ts_unix_s: float, step: int, sched: Any, it: Any) -> tuple[Any, ...]:
    """Return the raw step row of one ``record()`` call that has scheduler stats.

    Layout: ``_rows.RAW_STEP_LAYOUT``; ``it`` (IterationStats) may be None.
    """
    try:
        pcs = sched.prefix_cache_stats
        details = sched.iteration_details
        if it is None:
            prompt = gen = preempted = 0
        else:
            prompt = it.num_prompt_tokens
            gen = it.num_generation_tokens
            preempted = it.num_preempted_reqs
        return (
            ts_unix_s,
            step,
            sched.num_running_reqs,
            sched.num_waiting_reqs,
            sched.num_skipped_waiting_reqs,
            sched.kv_cache_usage,
            pcs.queries,
            pcs.hits,
            preempted,
            prompt,
            gen,
            None if details is None else details.elapsed_ms,
        )
    except AttributeError:
        return _step_row_compat(ts_unix_s, step, sched, it)


def _iteration_counts(it: Any) -> list[Any]:
    if it is None:
        return [0, 0, 0]
    return _fields("IterationStats", it, _ITER_FIELDS, 0)


def _step_row_compat(ts_unix_s: float, step: int, sched: Any, it: Any) -> tuple[Any, ...]:
    running, waiting, deferred, kv = _fields("SchedulerStats", sched, _SCHED_FIELDS, 0)
    pcs = getattr(sched, "prefix_cache_stats", None)
    queries, hits = (
        (0, 0) if pcs is None else _fields("PrefixCacheStats", pcs, ("queries", "hits"), 0)
    )
    details = getattr(sched, "iteration_details", None)
    elapsed_ms = None if details is None else getattr(details, "elapsed_ms", None)
    prompt, gen, preempted = _iteration_counts(it)
    return (
        ts_unix_s,
        step,
        running,
        waiting,
        deferred,
        kv,
        queries,
        hits,
        preempted,
        prompt,
        gen,
        elapsed_ms,
    )


def tokens_row(ts_unix_s: float, step: int, it: Any) -> tuple[Any, ...]:
    """Return the raw row of a ``record()`` call with iteration stats only.

    Its gauges are None: the exporter folds its counts into the engine's next step
    row (see :class:`kvscope.engine_plugins._rows.StepFolder`).
    """
    try:
        prompt = it.num_prompt_tokens
        gen = it.num_generation_tokens
        preempted = it.num_preempted_reqs
    except AttributeError:
        prompt, gen, preempted = _iteration_counts(it)
    return (ts_unix_s, step, None, None, None, None, 0, 0, preempted, prompt, gen, None)


# -- finished requests ---------------------------------------------------------------


def finished_requests(it: Any) -> Any:
    """Return the finished requests of ``it`` (IterationStats), or an empty tuple."""
    try:
        return it.finished_requests or ()
    except AttributeError:
        fins = getattr(it, "finished_requests", _NONE)
        if fins is _NONE:
            _fields("IterationStats", it, _ITER_FIELDS, 0)  # raises for non-stats
            _note_missing("IterationStats", it, ("finished_requests",))
            return ()
        return fins or ()


def _has_first_token_latency() -> bool:
    try:
        from vllm.v1.metrics.stats import FinishedRequestStats
    except Exception:  # vLLM absent or reorganised: the compatible path copes
        return False
    fields = getattr(FinishedRequestStats, "__dataclass_fields__", {})
    return "first_token_latency" in fields


_HAS_FIRST_TOKEN_LATENCY = _has_first_token_latency()


def request_row(ts_unix_s: float, fr: Any) -> tuple[Any, ...]:
    """Return the raw request row (``_rows.RAW_REQUEST_LAYOUT``) of a finished request."""
    try:
        return (
            ts_unix_s,
            fr.e2e_latency,
            fr.queued_time,
            fr.prefill_time,
            fr.decode_time,
            fr.first_token_latency if _HAS_FIRST_TOKEN_LATENCY else None,
            fr.num_prompt_tokens,
            fr.num_generation_tokens,
            fr.num_cached_tokens,
            fr.num_preemptions,
            fr.finish_reason,
        )
    except AttributeError:
        return _request_row_compat(ts_unix_s, fr)


def _request_row_compat(ts_unix_s: float, fr: Any) -> tuple[Any, ...]:
    e2e, queued, prefill, decode, prompt, gen, cached, preempted, reason = _fields(
        "FinishedRequestStats", fr, _REQ_FIELDS, 0
    )
    ftl = getattr(fr, "first_token_latency", None)
    if reason == 0 and not hasattr(fr, "finish_reason"):
        reason = "unknown"
    return (ts_unix_s, e2e, queued, prefill, decode, ftl, prompt, gen, cached, preempted, reason)
