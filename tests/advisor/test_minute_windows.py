"""The analyses' windows from the 1-minute tier: one minute row as one window of rates per
second stepped, and which engines of a range are read from their minutes.

Expected values are worked out by hand from the rows written here."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest

from kvscope.advisor.balance import LoadBalance
from kvscope.advisor.minute_windows import (
    append_minute_windows,
    knee_gap,
    read_from_minutes,
    windows_from_minutes,
)
from kvscope.advisor.prefix import PrefixRouting
from kvscope.advisor.sources import SourceError

MINUTE = {
    "engine_id": "e1",
    "ts_s": 1_800_000_000,
    "pool": "p",
    "n_seconds": 40,  # stepped in 40 of its 60 seconds
    "n_steps": 2_000,
    "batch_sum": 16_000,
    "batch_mean": 8.0,
    "batch_min": 2,
    "batch_max": 12,
    "kv_usage_sum": 1_800.0,
    "kv_usage_mean": 0.9,
    "kv_usage_max": 1.0,
    "waiting_sum": 6_000,
    "waiting_mean": 3.0,
    "deferred_sum": 0,
    "deferred_mean": 0.0,
    "preemptions": 8,
    "prompt_tokens": 4_000,
    "generation_tokens": 16_000,
    "prefix_queries": 4_000,
    "prefix_hits": 400,
    "iteration_n": 2_000,
    "iteration_s_sum": 36.0,
    "iteration_s_max": 0.05,
}


def test_a_minute_reads_as_one_window_of_rates_per_second_stepped() -> None:
    idle = dict(MINUTE, ts_s=MINUTE["ts_s"] + 60, n_seconds=0, n_steps=0)
    w = windows_from_minutes(pd.DataFrame([MINUTE, idle]))
    assert len(w) == 1  # a minute without a stepped second is no window
    r = w.iloc[0]
    # sums over the 40 seconds it stepped in, per second
    assert r["n_steps"] == 50 and r["generation_tokens"] == 400 and r["prompt_tokens"] == 100
    assert r["batch_sum"] == 400 and r["preemptions"] == 0.2 and r["prefix_hits"] == 10
    assert r["iteration_s_sum"] == pytest.approx(0.9)
    assert r["iteration_s_mean"] == pytest.approx(0.018)
    # step-weighted means and extremes as they are
    assert (r["batch_mean"], r["kv_usage_mean"], r["waiting_mean"]) == (8.0, 0.9, 3.0)
    assert (r["batch_min"], r["batch_max"], r["batch_p99"]) == (2, 12, 12)
    assert r["batch_p90"] == 8.0
    # busy share unknown: the curve estimates it from the step count
    assert math.isnan(r["first_step_unix_s"]) and math.isnan(r["last_step_unix_s"])
    assert r["resolution_s"] == 60 and r["ts_s"] == MINUTE["ts_s"]


class _Tiered:
    """A source holding 1-second windows from ``oldest`` on and minutes of every engine."""

    def __init__(self, minutes: pd.DataFrame, oldest: float | None, fail: int = 0) -> None:
        self.minutes, self.oldest, self.fail, self.reads = minutes, oldest, fail, 0

    def seconds_aged_out(self, since: float | None, until: float | None) -> float | None:
        return self.oldest

    def minute_windows(self, since: Any = None, until: Any = None, **kw: Any) -> pd.DataFrame:
        self.reads += 1
        if self.fail:
            raise SourceError("no tier", status=self.fail)
        return self.minutes


def _seconds(engine: str, n: int, t0: float) -> pd.DataFrame:
    return pd.DataFrame({"engine_id": engine, "ts_s": [t0 + i for i in range(n)], "n_steps": 50})


def test_engines_whose_seconds_aged_out_are_read_from_minutes_and_the_rest_from_seconds() -> None:
    t0 = MINUTE["ts_s"]
    # e1 and e2 stepped 40 seconds a minute for 20 minutes; e3 has no minute in the range;
    # the source keeps seconds from t0 + 300 on
    minutes = pd.DataFrame(
        [dict(MINUTE, engine_id=e, ts_s=t0 + 60 * k) for e in ("e1", "e2") for k in range(20)]
    )
    engines = pd.DataFrame({"engine_id": ["e1", "e2", "e3"], "pool": ["p", "p", "p"]})
    # e1 kept 30 seconds (of 800 stepped): minutes; e2 kept 900: seconds; e3 kept 5: seconds
    seconds = pd.concat(
        [
            _seconds("e1", 30, t0 + 1170),
            _seconds("e2", 900, t0 + 300),
            _seconds("e3", 5, t0 + 600),
        ]
    )
    since, until = t0, t0 + 1200
    out = append_minute_windows(_Tiered(minutes, t0 + 300), engines, seconds, since, until, "p")
    per = out.groupby("engine_id")["ts_s"].count().to_dict()
    assert per == {"e1": 20, "e2": 900, "e3": 5}
    assert set(out.loc[out["resolution_s"].eq(60), "engine_id"]) == {"e1"}
    # counts of a sample (its true number of seconds) decide, not the rows sampled
    held = pd.Series({"e1": 30, "e2": 350})
    out = append_minute_windows(
        _Tiered(minutes, t0 + 300), engines, seconds, since, until, "p", held, t0 + 300.0
    )
    assert set(out.loc[out["resolution_s"].eq(60), "engine_id"]) == {"e1", "e2"}
    # a range whose first second is at its start, or a source that says none aged out:
    # nothing more is read
    for src, start in ((_Tiered(minutes, t0 + 300), t0 + 300), (_Tiered(minutes, None), t0)):
        assert append_minute_windows(src, engines, seconds, start, until, "p") is seconds
        assert src.reads == 0
    # a collector from before the tier (404): the seconds; any other failure is raised
    old = _Tiered(minutes, t0 + 300, fail=404)
    assert append_minute_windows(old, engines, seconds, since, until, "p") is seconds
    with pytest.raises(SourceError):
        append_minute_windows(_Tiered(minutes, t0 + 300, 500), engines, seconds, since, until, "p")


def test_an_engine_read_from_its_minutes_keeps_none_of_its_seconds() -> None:
    t0 = MINUTE["ts_s"]
    minutes = pd.DataFrame(
        [dict(MINUTE, engine_id=e, ts_s=t0 + 60 * k) for e in "ab" for k in range(3)]
    )
    seconds = pd.concat([_seconds("a", 30, t0 + 150), _seconds("b", 90, t0 + 90)])
    out = read_from_minutes(seconds, minutes, {"a"})
    res = out.groupby("engine_id")["resolution_s"].agg(lambda r: set(r.fillna(1)))
    assert res.to_dict() == {"a": {60}, "b": {1}}
    assert out.groupby("engine_id").size().to_dict() == {"a": 3, "b": 90}
    # only minutes: the minutes; nothing to swap: the seconds as they were
    assert len(read_from_minutes(pd.DataFrame(), minutes, {"a", "b"})) == 6
    assert read_from_minutes(seconds, minutes, set()) is seconds
    assert read_from_minutes(seconds, pd.DataFrame(), {"a"}) is seconds


def _minutes(rows: list[tuple[float, float, float]]) -> pd.DataFrame:
    """Windows of (mean load, median second's load, P90 second's load)."""
    return pd.DataFrame(rows, columns=["load", "load_p50", "load_p90"])


def test_a_knee_is_resolved_only_between_steady_minutes_near_it() -> None:
    steady_climb = [(x, x, x + 0.5) for x in (1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)]
    assert knee_gap(_minutes(steady_climb), 10.0) is None
    # the knee on a minute's own load counts that minute above it, not below
    assert knee_gap(_minutes(steady_climb), 8.0) is None
    # a minute whose P90 second held more than 1.5x its median (+1) mixed two levels:
    # 12 is not seen steadily, so the nearest steady loads are 8 and 16 (resolved) ...
    mixed12 = [r if r[0] != 12.0 else (12.0, 8.0, 16.0) for r in steady_climb]
    assert knee_gap(_minutes(mixed12), 10.0) is None
    # ... but with 6 and 8 mixed too, 4 to 12: more than 2x apart
    mixed = [(6.0, 4.0, 9.0), (8.0, 4.0, 16.0)]
    rows = [r for r in steady_climb if r[0] not in (6.0, 8.0)] + mixed
    assert knee_gap(_minutes(rows), 10.0) == (4.0, 12.0)
    # a fast sweep: one minute below the knee (its P90 4 = 1.5 x 2 + 1: steady), the next
    # mixed, and 13.4 more than 2x above it
    fast = [(2.3, 2.0, 4.0), (9.6, 8.0, 16.0), (13.4, 16.0, 16.0), (25.0, 32.0, 32.0)]
    assert knee_gap(_minutes(fast), 9.6) == (2.3, 13.4)
    # steady minutes close on both sides, but fewer than three below the knee
    assert knee_gap(_minutes([(6.0, 6.0, 6.0), (8.0, 8.0, 8.0), (12.0, 12.0, 12.0)]), 10.0) == (
        8.0,
        12.0,
    )
    # no steady minute at or above the knee: up to the highest load seen
    top_mixed = [(x, x, x) for x in (1.0, 2.0, 3.0)] + [(20.0, 10.0, 40.0)]
    assert knee_gap(_minutes(top_mixed), 4.0) == (3.0, 20.0)


def _pool_minute(engine: str, minute: int, n_seconds: int, batch: float) -> dict[str, Any]:
    """A minute of one replica: ``batch`` in flight over the ``n_seconds`` it stepped in,
    100 prompt tokens looked up and 25 found per second stepped."""
    return dict(
        MINUTE,
        engine_id=engine,
        ts_s=MINUTE["ts_s"] + 60 * minute,
        n_seconds=n_seconds,
        n_steps=50 * n_seconds,
        batch_sum=50 * n_seconds * batch,
        batch_mean=batch,
        waiting_sum=0,
        waiting_mean=0.0,
        prefix_queries=100 * n_seconds,
        prefix_hits=25 * n_seconds,
    )


def test_the_balance_and_prefix_reuse_of_a_pool_read_from_minutes_count_its_seconds() -> None:
    # Ten minutes: replica a steps every second with 6 in flight, replica b half of each
    # minute with 2. Over the 600 s, a carries 6 and b 1 (idle seconds count as idle): the
    # pool mean is 3.5 and a carries 6 / 3.5 = 1.71x it. The pool looked up 100 tokens per
    # second stepped (60 + 30 seconds a minute for ten minutes), 90,000 in all, and found
    # a quarter.
    rows = [_pool_minute("a", i, 60, 6.0) for i in range(10)]
    rows += [_pool_minute("b", i, 30, 2.0) for i in range(10)]
    w = windows_from_minutes(pd.DataFrame(rows))
    lb = LoadBalance().fit(w, pd.DataFrame(), ["a", "b"])
    assert lb.span_s_ == 600
    assert lb.mean_load_ == pytest.approx({"a": 6.0, "b": 1.0})
    assert lb.imbalance_ == pytest.approx(6 / 3.5)
    assert lb.flagged_ and lb.busiest_ == "a"
    configs = [{"engine_id": e, "block_size": 16, "enable_prefix_caching": True} for e in "ab"]
    pr = PrefixRouting().fit(configs, w, pd.DataFrame())
    assert pr.queries_ == 90_000 and pr.hits_ == 22_500
    assert pr.hit_rate_ == pytest.approx(0.25)
