"""The advisor over a range whose 1-second windows the collector deleted: read from the
1-minute tier, on real data.

Two real runs of the lab's KV-starved vLLM CPU engine (48 blocks of 32 tokens), as a
collector stored them (its engine row, 1-second windows and finished requests) (see the fixtures' README): ``minute_tier_slow_day.json.gz``, a slow
day of closed-loop load (1 to 32 clients and back, 100 s a level;
``bench/minute_tier_knees.py``), and ``minute_tier_fast_sweep.json.gz``, a sweep of the
regimes bench whose levels lasted 30-90 s (long outputs, the thrash regime). Each is loaded
into a store, analysed, then rolled up and deleted by the store's own lifecycle (a window
retention of one second) and analysed again over the same range. The ground truth is the
analysis of the seconds: on the fast sweep its verdict and cap are the ones the regime's
control and capped runs held (docs/advise.md)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pytest

from bench.minute_tier_knees import delete_seconds
from kvscope.advisor import Report, analyze
from kvscope.collector.store import Store
from kvscope.report.sources import StoreSource, open_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KNEE_REL = 0.25
"""The minutes' knee within this share of the seconds' on the slow day (measured: 1.12x)."""


def _load(name: str, into: Path) -> dict[str, Any]:
    data = json.loads(gzip.decompress((FIXTURES / name).read_bytes()))
    path = into / "store.duckdb"
    Store(str(path)).close()  # the schema
    con = duckdb.connect(str(path))
    try:
        for table in ("engines", "windows_1s", "requests"):
            con.register("rows", pd.DataFrame(data[table]))
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM rows")
            con.unregister("rows")
    finally:
        con.close()
    return {"path": path, **data["run"]}


def _analyse(run: dict[str, Any]) -> Report:
    src = StoreSource(open_store(run["path"]))
    try:
        return analyze(src, run["since"], run["until"], run["pool"])
    finally:
        src.close()


def _seconds_then_minutes(run: dict[str, Any]) -> tuple[Report, Report]:
    seconds = _analyse(run)
    assert "engines_from_minutes" not in seconds.coverage
    out = delete_seconds(run["path"], run["until"])
    n = seconds.coverage["n_windows"]
    assert out["windows_1s"] >= n - 1  # every second but the newest: deleted
    minutes = _analyse(run)
    (s,) = seconds.engines
    assert minutes.coverage["engines_from_minutes"] == [s.engine_id]
    assert abs(minutes.coverage["n_minute_windows"] - n / 60) <= 2
    return seconds, minutes


def test_the_knee_from_minutes_is_the_knee_from_seconds_on_a_slow_day(tmp_path: Path) -> None:
    seconds, minutes = _seconds_then_minutes(_load("minute_tier_slow_day.json.gz", tmp_path))
    (s,), (m,) = seconds.engines, minutes.engines
    assert s.bottleneck == "kv_cache_bound" and s.saturated
    assert m.bottleneck == s.bottleneck and m.saturated
    assert m.knee_concurrency == pytest.approx(s.knee_concurrency, rel=KNEE_REL)
    assert m.plateau_tokens_per_s == pytest.approx(s.plateau_tokens_per_s, rel=0.05)
    assert "1-minute windows" not in m.headroom
    # the cap follows the knee (measured: 15 for 13)
    assert s.recommended_concurrency_cap is not None and m.recommended_concurrency_cap is not None
    assert m.recommended_concurrency_cap == pytest.approx(
        s.recommended_concurrency_cap, rel=KNEE_REL
    )


def test_minutes_that_mix_the_levels_of_a_fast_sweep_give_no_cap(tmp_path: Path) -> None:
    """Levels of 30-90 s: one mixed minute below the knee, whose fit puts the knee at more
    than twice the seconds' (4.0; 13.7 from the minutes, with a cap of 14 without the
    steadiness rule): the knee is said to be unresolved, at most the nearest steady load
    above it, and no cap is recommended from it."""
    seconds, minutes = _seconds_then_minutes(_load("minute_tier_fast_sweep.json.gz", tmp_path))
    (s,), (m,) = seconds.engines, minutes.engines
    assert s.bottleneck == "kv_cache_bound" and s.recommended_concurrency_cap is not None
    assert m.bottleneck == s.bottleneck and m.saturated
    assert m.recommended_concurrency_cap is None
    assert not [r for r in minutes.recommendations if r.kind == "concurrency_cap"]
    assert "too few of which held their load steady around the knee" in m.headroom
    hi = float(m.headroom.split("may lie anywhere up to ")[1].split(",")[0])
    assert s.knee_concurrency <= hi
    assert m.confidence <= 0.5
