"""kvscope.advisor.forecast on seeded synthetic weeks whose crossing is known by
construction: the daily peaks are drawn around a line chosen to meet the capacity on a
chosen day."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvscope.advisor.findings import EngineVerdict, PoolVerdict, Report
from kvscope.advisor.forecast import capacity_forecast, trend_crossing
from kvscope.advisor.usage import DAY_COLUMNS, DAY_S, usage_from_days

DAY0 = 1_800_000_000 // 86400 * 86400.0  # a UTC midnight
WEEK_S = 7 * DAY_S
UNTIL = DAY0 + WEEK_S


def _days(n: int = 7) -> list[float]:
    return [DAY0 + i * DAY_S for i in range(n)]


def test_a_noisy_rising_week_crosses_when_its_line_does() -> None:
    # Peaks around 10 + 2 per day (at each day's middle), capacity 40: the line meets it
    # 15 days after the first day's middle.
    rng = np.random.default_rng(7)
    peaks = [10 + 2 * i + float(rng.normal(0, 0.3)) for i in range(7)]
    t = trend_crossing(_days(), peaks, 40.0, until_unix_s=UNTIL)
    truth = DAY0 + DAY_S / 2 + 15 * DAY_S
    assert t.status == "crosses"
    assert t.slope_per_day == pytest.approx(2.0, abs=0.15)
    assert t.crossing_unix_s == pytest.approx(truth, abs=DAY_S)


def test_the_other_verdicts() -> None:
    rising = [10 + 2 * i for i in range(7)]
    assert trend_crossing(_days(3), rising[:3], 40.0, until_unix_s=UNTIL).status == (
        "not_enough_days"
    )
    assert trend_crossing(_days(), rising, None, until_unix_s=UNTIL).status == "no_capacity"
    # the line stands at 22 on the last day: a capacity of 20 is behind it
    assert trend_crossing(_days(), rising, 20.0, until_unix_s=UNTIL).status == "past"
    falling = [30 - i for i in range(7)]
    assert trend_crossing(_days(), falling, 40.0, until_unix_s=UNTIL).status == "not_rising"
    # +0.1 per day from 10 reaches 40 after 300 days: not within 8 weeks, within 50
    slow = [10 + 0.1 * i for i in range(7)]
    assert trend_crossing(_days(), slow, 40.0, until_unix_s=UNTIL).status == "not_within"
    assert (
        trend_crossing(_days(), slow, 40.0, until_unix_s=UNTIL, horizon_weeks=50).status
        == "crosses"
    )


def _pool_week(knees: dict[str, float | None]) -> tuple:
    """Two engines whose daily highest load is 4 + 0.5 i and 6 + 0.5 i on day i: the
    pool's daily peak is 10 + i."""
    rows = []
    for eid, base in zip(knees, (4.0, 6.0), strict=True):
        for i, day in enumerate(_days()):
            row = dict.fromkeys(DAY_COLUMNS, 0.0)
            row.update(
                engine_id=eid,
                day_start_unix_s=day,
                active_s=3600.0,
                load_max=base + 0.5 * i,
                gen_tokens_per_s_peak=None,
                first_window_s=day,
                last_window_s=day + 3599,
            )
            rows.append(row)
    report = Report(
        DAY0,
        UNTIL,
        engines=[
            EngineVerdict(e, "p", "kv_cache_bound", k is not None, knee_concurrency=k)
            for e, k in knees.items()
        ],
        pools=[PoolVerdict("p", list(knees), {})],
    )
    return usage_from_days(pd.DataFrame(rows), report, DAY0, UNTIL), report


def test_pool_forecast_sums_the_engines() -> None:
    usage, report = _pool_week({"a": 12.0, "b": 13.0})
    (f,) = capacity_forecast(usage, report)
    assert f.daily_peak == pytest.approx([10.0 + i for i in range(7)])
    assert f.capacity == 25.0 and f.capacity_from == ["knee"]
    # 10 + i = 25 at i = 15: the middle of day 15
    assert f.status == "crosses"
    assert f.crossing_unix_s == pytest.approx(DAY0 + 15 * DAY_S + DAY_S / 2, abs=1.0)
    assert f.weeks_to_crossing == pytest.approx((8 * DAY_S + DAY_S / 2) / WEEK_S, abs=1e-4)
    # an engine with neither a knee nor a batch limit: no capacity to forecast against
    usage, report = _pool_week({"a": 12.0, "b": None})
    (f,) = capacity_forecast(usage, report)
    assert f.status == "no_capacity" and f.capacity is None


def test_the_weeks_before_from_the_minute_tier_extend_the_line() -> None:
    """Three weeks before the week (as the collector's 1-minute windows give them, per
    engine and day) join the line: a week that alone looks flat is part of a rise."""
    usage, report = _pool_week({"a": 30.0, "b": 30.0})
    # the week alone rises by 1 a day; before it, the pool rose 1 a day from 10 - 21
    rows = []
    for i in range(21):
        day = DAY0 - (21 - i) * DAY_S
        for eid, share in (("a", 0.4), ("b", 0.6)):
            rows.append(
                {
                    "engine_id": eid,
                    "pool": "p",
                    "day_start_unix_s": day,
                    "load_max": share * (i - 11.0),
                }
            )
    rows.append(
        {"engine_id": "gone", "pool": "other", "day_start_unix_s": DAY0 - DAY_S, "load_max": 99.0}
    )
    (f,) = capacity_forecast(usage, report, history=pd.DataFrame(rows))
    assert f.history_days == 21 and len(f.daily_peak) == 28
    assert f.daily_peak[:21] == pytest.approx([i - 11.0 for i in range(21)])
    assert f.slope_per_day == pytest.approx(1.0, abs=1e-9)
    # a day in both (the week starting mid-day) takes each engine's higher peak
    both = pd.DataFrame(
        [{"engine_id": "a", "pool": "p", "day_start_unix_s": DAY0, "load_max": 100.0}]
    )
    (g,) = capacity_forecast(usage, report, history=both)
    assert g.history_days == 0 and g.daily_peak[0] == pytest.approx(100.0 + 6.0)
