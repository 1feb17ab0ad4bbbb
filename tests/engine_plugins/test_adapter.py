"""The adapter reads real vLLM stats objects into raw rows, and degrades on old ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from _ep_helpers import finished, iter_stats, sched_stats
from vllm.v1.engine import FinishReason

from kvscope.engine_plugins import _adapter
from kvscope.engine_plugins._rows import RAW_REQUEST_LAYOUT, RAW_STEP_LAYOUT, ColumnBuilder


def as_dict(row: tuple[Any, ...], layout: tuple[str, ...]) -> dict[str, Any]:
    assert len(row) == len(layout)
    return dict(zip(layout, row, strict=True))


def test_step_row_maps_scheduler_and_iteration_stats() -> None:
    sched = sched_stats(
        running=5, waiting=3, deferred=2, kv=0.75, queries=96, hits=32, elapsed_ms=12.5
    )
    it = iter_stats(gen=5, prompt=40, cached=8, preempted=2)
    row = as_dict(_adapter.step_row(100.5, 7, sched, it), RAW_STEP_LAYOUT)
    assert row == {
        "ts_unix_s": 100.5,
        "step": 7,
        "running": 5,
        "waiting": 3,
        "deferred": 2,
        "kv_usage": 0.75,
        "prefix_queries": 96,
        "prefix_hits": 32,
        "preemptions": 2,
        "prompt_tokens": 40,
        "generation_tokens": 5,
        "elapsed_ms": 12.5,
    }


def test_step_row_counts_what_vllm_prometheus_counts() -> None:
    # Re-lookups of preempted requests and KV-connector lookups are not in
    # vllm:prefix_cache_queries/hits, so they must not be in ours either.
    sched = sched_stats(queries=50, hits=10, preempted_queries=70, connector_queries=30)
    row = as_dict(_adapter.step_row(1.0, 1, sched, None), RAW_STEP_LAYOUT)
    assert (row["prefix_queries"], row["prefix_hits"]) == (50, 10)
    assert (row["prompt_tokens"], row["generation_tokens"], row["preemptions"]) == (0, 0, 0)
    assert row["elapsed_ms"] is None


def test_tokens_row_has_no_gauges() -> None:
    row = as_dict(
        _adapter.tokens_row(3.0, 9, iter_stats(gen=7, prompt=11, preempted=1)), RAW_STEP_LAYOUT
    )
    assert row["running"] is None and row["kv_usage"] is None
    assert (row["generation_tokens"], row["prompt_tokens"], row["preemptions"]) == (7, 11, 1)


def test_request_row_and_columns_from_finished_request_stats() -> None:
    fr = finished(FinishReason.STOP, queued_s=0.25, prefill_s=0.5, gen=16)
    raw = _adapter.request_row(50.0, fr)
    assert as_dict(raw, RAW_REQUEST_LAYOUT)["first_token_latency_s"] is None  # not in 0.32
    cols = ColumnBuilder().requests([raw])
    assert cols == {
        "finished_unix_s": [50.0],
        "e2e_s": [2.0],
        "queue_s": [0.25],
        "prefill_s": [0.5],
        "decode_s": [1.25],
        "ttft_s": [0.75],
        "prompt_tokens": [30],
        "generation_tokens": [16],
        "cached_tokens": [8],
        "preemptions": [1],
        "finish_reason": ["stop"],
    }


def test_request_aborted_before_scheduling_has_no_ttft() -> None:
    # vLLM reports queued_time = 0 - queued_ts (negative) for a request aborted
    # while waiting; the schema needs non-negative values.
    fr = finished(FinishReason.ABORT, queued_s=-12345.0, prefill_s=0.0, gen=0)
    cols = ColumnBuilder().requests([_adapter.request_row(1.0, fr)])
    assert cols["queue_s"] == [0.0]
    assert cols["ttft_s"] == [None]
    assert cols["finish_reason"] == ["abort"]


def test_finished_requests_of_a_step() -> None:
    assert _adapter.finished_requests(iter_stats(fins=3)).__len__() == 3
    assert _adapter.finished_requests(iter_stats()) == ()


@dataclass
class OldSchedulerStats:
    """A SchedulerStats of an imagined vLLM version without some of today's fields."""

    num_running_reqs: int = 3
    num_waiting_reqs: int = 1
    kv_cache_usage: float = 0.25
    prefix_cache_stats: Any = None


def test_missing_fields_degrade_to_defaults_and_log_once(log_records: list[Any]) -> None:
    row = as_dict(_adapter.step_row(1.0, 1, OldSchedulerStats(), None), RAW_STEP_LAYOUT)
    assert (row["running"], row["waiting"], row["deferred"], row["kv_usage"]) == (3, 1, 0, 0.25)
    assert (row["prefix_queries"], row["prefix_hits"], row["elapsed_ms"]) == (0, 0, None)
    _adapter.step_row(2.0, 2, OldSchedulerStats(), None)
    notes = [r for r in log_records if "num_skipped_waiting_reqs" in r.getMessage()]
    assert len(notes) == 1


@pytest.mark.parametrize("garbage", [42, "stats", object(), [1, 2]])
def test_objects_that_are_not_stats_raise_type_error(garbage: Any) -> None:
    with pytest.raises(TypeError):
        _adapter.step_row(1.0, 1, garbage, None)
    with pytest.raises(TypeError):
        _adapter.tokens_row(1.0, 1, garbage)
    with pytest.raises(TypeError):
        _adapter.request_row(1.0, garbage)
