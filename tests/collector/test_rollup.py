"""The store's lifecycle: 1-minute windows rolled up from the 1-second ones, retention of
1-second windows, requests and minutes; the minute tier over HTTP.

Expected values are computed here from the steps sent, not from the rollup's SQL."""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import duckdb
import pytest
from _collector_helpers import batch, get_json, hello, http, post_batch, requests, steps

from kvscope.collector._rollup import ROLLED_UNTIL_KEY
from kvscope.collector.batch import prepare_batch
from kvscope.collector.store import Store

T0 = 1_700_000_040.0  # a minute start
NOW = T0 + 3600.0
EID = "host-a:8000:0"  # the engine batch() sends for


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(str(tmp_path / "s.duckdb"))
    yield s
    s.close()


def _send(store: Store, ts: list[float], seq: int, engine: str = "e1", **cols: Any) -> dict:
    st = steps(ts, **cols)
    b = batch(engine_id=engine, seq=seq, steps=st, with_hello=seq == 0)
    if seq == 0:
        b["hello"] = hello(engine, "boot-1", pool="p")
    store.ingest_one(prepare_batch(b, ts[-1]))
    return st


def _expected_minutes(st: dict[str, list[Any]]) -> dict[int, dict[str, float]]:
    """Per minute: tokens, steps, seconds, max batch, and the per-second load (running +
    waiting, averaged over each second's steps) as mean and max, from the raw steps."""
    per_second: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(st["ts_unix_s"]):
        per_second[math.floor(t)].append(i)
    out: dict[int, dict[str, Any]] = {}
    for sec, idx in sorted(per_second.items()):
        m = out.setdefault(
            sec // 60 * 60,
            {"generation_tokens": 0, "n_steps": 0, "n_seconds": 0, "batch_max": 0, "loads": []},
        )
        m["generation_tokens"] += sum(st["generation_tokens"][i] for i in idx)
        m["n_steps"] += len(idx)
        m["n_seconds"] += 1
        m["batch_max"] = max(m["batch_max"], *(st["batch_size"][i] for i in idx))
        m["loads"].append(
            statistics.mean(st["batch_size"][i] + st["waiting"][i] + st["deferred"][i] for i in idx)
        )
    for m in out.values():
        loads = m.pop("loads")
        m["load_mean"], m["load_max"] = statistics.mean(loads), max(loads)
    return out


def test_minutes_hold_the_sums_extremes_and_load_of_their_seconds(store: Store) -> None:
    # 3 minutes and a bit, 3 steps a second, in two batches that split a second
    ts = [T0 + 0.3 * i for i in range(650)]
    st = _send(store, ts[:400], 0)
    st2 = _send(store, ts[400:], 1)
    full = {k: st[k] + st2[k] for k in st}
    written = store.roll_up_now(now_unix_s=NOW)
    got = store.minute_windows().set_index("ts_s")
    want = _expected_minutes(full)
    assert written == len(want) == len(got)
    for minute, w in want.items():
        row = got.loc[minute]
        assert row["pool"] == "p"
        for k in ("generation_tokens", "n_steps", "n_seconds", "batch_max"):
            assert row[k] == w[k], (minute, k)
        assert row["load_mean"] == pytest.approx(w["load_mean"])
        assert row["load_max"] == pytest.approx(w["load_max"])


def test_rolling_up_again_changes_nothing_and_late_seconds_join_their_minute(
    store: Store,
) -> None:
    _send(store, [T0 + i for i in range(120)], 0)  # two full minutes
    store.roll_up_now(now_unix_s=NOW)
    before = store.minute_windows()
    store.roll_up_now(now_unix_s=NOW + 60)
    after = store.minute_windows()
    assert before.drop(columns=["pool", "model"]).equals(after.drop(columns=["pool", "model"]))
    # A late batch for the first minute (long before the lookback) updates it.
    late = _send(store, [T0 + 30.5], 1, generation_tokens=[1000])
    store.roll_up_now(now_unix_s=NOW + 120)
    m = store.minute_windows().set_index("ts_s")
    assert (
        m.loc[int(T0), "generation_tokens"]
        == before.set_index("ts_s").loc[int(T0), "generation_tokens"] + late["generation_tokens"][0]
    )
    assert m.loc[int(T0), "n_steps"] == 61


def test_an_incomplete_minute_waits(store: Store) -> None:
    _send(store, [T0 + i for i in range(90)], 0)
    store.roll_up_now(now_unix_s=T0 + 90 + 10)  # the second minute is still running
    assert store.minute_windows()["ts_s"].tolist() == []  # neither is 2 minutes old yet
    store.roll_up_now(now_unix_s=T0 + 60 + 125)
    assert store.minute_windows()["ts_s"].tolist() == [int(T0)]
    _send(store, [T0 + 90 + i for i in range(30)], 1)
    store.roll_up_now(now_unix_s=T0 + 120 + 125)
    m = store.minute_windows().set_index("ts_s")
    assert m["n_seconds"].tolist() == [60, 60]


def test_retention_counts_back_from_the_newest_data_and_spares_unrolled_minutes(
    store: Store,
) -> None:
    day = 86400.0
    old, new = T0, T0 + 20 * day
    _send(store, [old + i for i in range(60)], 0)
    b = batch(
        engine_id="e1", seq=1, step_ts=[new + i for i in range(60)], req_ts=[old + 5, new + 5]
    )
    store.ingest_one(prepare_batch(b, new + 60))
    # The wall clock is years later: retention counts from the newest window instead.
    out = store.apply_lifecycle(
        window_retention_s=15 * day,
        request_retention_s=15 * day,
        rollup_retention_s=400 * day,
        now_unix_s=time.time(),
    )
    assert out["windows_1s"] == 60 and out["requests"] == 1 and out["windows_1m"] == 0
    assert store.windows()["ts_s"].min() == int(new)
    assert store.requests()["finished_unix_s"].tolist() == [new + 5]
    assert sorted(store.minute_windows()["ts_s"]) == [int(old), int(new)]  # the tier keeps both
    out = store.apply_lifecycle(
        window_retention_s=15 * day,
        request_retention_s=15 * day,
        rollup_retention_s=10 * day,
        now_unix_s=time.time(),
    )
    assert out["windows_1m"] == 1 and store.minute_windows()["ts_s"].tolist() == [int(new)]


def test_a_second_is_not_deleted_before_its_minute_is_rolled_up(store: Store) -> None:
    _send(store, [T0 + i for i in range(60)], 0)
    # now is only 30 s after the minute: it cannot be rolled up yet, so it stays
    out = store.apply_lifecycle(
        window_retention_s=1.0,
        request_retention_s=0,
        rollup_retention_s=0,
        now_unix_s=T0 + 90,
    )
    assert out["windows_1s"] == 0 and len(store.windows()) == 60
    out = store.apply_lifecycle(
        window_retention_s=1.0,
        request_retention_s=0,
        rollup_retention_s=0,
        now_unix_s=T0 + 400,
    )
    assert out["windows_1s"] == 59 and len(store.minute_windows()) == 1


def test_a_store_from_before_the_tier_is_rolled_up_whole_on_the_first_pass(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "old.duckdb")
    s = Store(path)
    _send(s, [T0 + i for i in range(180)], 0)
    _send(s, [T0 + 86400 + i for i in range(60)], 1)
    s.close()
    con = duckdb.connect(path)  # as an older kvscope left it: no tier, no mark
    con.execute("DROP TABLE windows_1m")
    con.execute("DELETE FROM meta WHERE key = ?", [ROLLED_UNTIL_KEY])
    con.close()
    s = Store(path)
    try:
        assert s.roll_up_now(now_unix_s=NOW + 86400) == 4
        assert s.minute_windows()["n_seconds"].tolist() == [60, 60, 60, 60]
    finally:
        s.close()


def test_a_backlog_is_rolled_up_a_bounded_part_a_pass_and_deleted_only_once_rolled_up(
    store: Store,
) -> None:
    from kvscope.collector._rollup import ROLLUP_CHUNK_S

    # a minute in each of 6 consecutive chunks (hours), windows and requests
    hour = math.floor(T0 / ROLLUP_CHUNK_S) * ROLLUP_CHUNK_S
    starts = [hour + k * ROLLUP_CHUNK_S + 600 for k in range(6)]
    for k, t in enumerate(starts):
        b = batch(engine_id="e1", seq=k, with_hello=k == 0, step_ts=[t + i for i in range(60)])
        b["requests"] = requests([t + 30.0])
        store.ingest_one(prepare_batch(b, t + 60))
    now = starts[-1] + 3600.0
    kw = {"window_retention_s": 600.0, "request_retention_s": 600.0, "rollup_retention_s": 0}
    per_pass = []
    for _ in range(8):
        # a budget of 0: one chunk a pass
        out = store.apply_lifecycle(**kw, now_unix_s=now, rollup_budget_s=0.0)
        per_pass.append((out["windows_1m_written"], out["requests_1m_written"]))
        # nothing is deleted before its minute is rolled up
        rolled = store.rolled_until_s or 0.0
        w = store.windows()["ts_s"]
        assert (w >= rolled).sum() == 60 * sum(t >= rolled for t in starts)
        # every request is a row or in the tier
        minutes = set(store.requests()["finished_unix_s"] // 60 * 60)
        minutes |= set(store.request_minutes()["ts_s"])
        assert len(minutes) == 6
    assert per_pass[:6] == [(1, 1)] * 6
    assert len(store.minute_windows()) == 6
    assert store.request_minutes()["n_requests"].tolist() == [1] * 6
    # deleted once rolled up, but the retention's last 600 s (the last minute's)
    assert store.windows()["ts_s"].min() >= starts[-1] and len(store.requests()) == 1


def test_a_range_whose_seconds_aged_out_is_read_from_its_minutes(
    make_collector: Any, store_path: str
) -> None:
    from kvscope.advisor import analyze
    from kvscope.advisor.render import no_data_message
    from kvscope.advisor.render_text import text_report
    from kvscope.advisor.sources import CollectorSource
    from kvscope.report.sources import StoreSource, open_store

    lc = make_collector(retention_interval_s=0.2)
    old = [T0 + 86400 + 0.5 * i for i in range(240)]  # the engine ran then ...
    new = [T0 + 20 * 86400 + 0.5 * i for i in range(240)]
    assert post_batch(lc.url, batch(seq=0, with_hello=True, step_ts=old))[0] == 200
    assert post_batch(lc.url, batch(seq=1, step_ts=new))[0] == 200
    src = CollectorSource(lc.url)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # ... and its seconds are deleted after 15 days
        if src.windows(0, None)["ts_s"].min() >= new[0] - 1:
            break
        time.sleep(0.1)
    then = (T0 + 86400 - 60, T0 + 86400 + 600)
    assert not len(src.windows(*then))
    report = analyze(src, *then)
    # the two minutes it stepped in, each one window of per-second rates
    assert report.coverage["engines_from_minutes"] == [EID]
    assert report.coverage["n_minute_windows"] == 2 and report.coverage["n_windows"] == 0
    assert report.coverage["oldest_window_unix_s"] == math.floor(new[0])
    assert [v.engine_id for v in report.engines] == [EID]
    text = text_report(report, source=lc.url, window="W")
    assert "1 engine(s) read from 2 one-minute windows" in text
    # before the first data ever: nothing aged out, nothing read, the usual message
    before = analyze(src, T0 - 7200, T0 - 3600)
    assert not before.has_data and "engines_from_minutes" not in before.coverage
    assert "oldest_window_unix_s" not in before.coverage
    assert "1-second windows are held" not in no_data_message(before, lc.url, "W")
    # a range inside the seconds held: read from them alone
    recent = analyze(src, new[0] - 1, new[-1] + 1)
    assert "engines_from_minutes" not in recent.coverage and recent.coverage["n_windows"] == 120
    lc.stop()
    offline = StoreSource(open_store(store_path))
    try:
        stored = analyze(offline, *then)
        assert stored.coverage["engines_from_minutes"] == [EID]
        assert stored.coverage["oldest_window_unix_s"] == math.floor(new[0])
        assert "oldest_window_unix_s" not in analyze(offline, T0 - 7200, T0 - 3600).coverage
    finally:
        offline.close()


def test_the_tier_and_the_daily_peaks_over_http(make_collector: Any) -> None:
    lc = make_collector(retention_interval_s=0.2)
    now = time.time()
    start = math.floor(now / 60) * 60 - 600
    ts = [start + 0.5 * i for i in range(480)]  # 4 minutes, 2 steps a second
    st = steps(ts, batch=[3] * len(ts))
    b = batch(seq=0, with_hello=True, steps=st)
    assert post_batch(lc.url, b)[0] == 200
    deadline = time.monotonic() + 15
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        status, body = get_json(lc.url, f"/v1/windows_1m?since={start - 1}")
        assert status == 200
        rows = body["rows"]
        if len(rows) == 4:
            break
        time.sleep(0.1)
    assert [r["n_seconds"] for r in rows] == [60, 60, 60, 60]
    assert [r["ts_s"] for r in rows] == [start + 60 * i for i in range(4)]
    status, body = get_json(lc.url, f"/v1/daily_load_peaks?since={start - 86400}")
    assert status == 200 and len(body["rows"]) == 1
    want = _expected_minutes(st)
    assert body["rows"][0]["load_max"] == pytest.approx(max(m["load_max"] for m in want.values()))
    assert body["rows"][0]["active_s"] == 240
    # the lifecycle on /metrics: rows written, how far behind, rows deleted per table (the
    # counters move when the whole pass has returned, after its rows are readable)
    values: dict[str, float] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        status, _, text = http("GET", lc.url + "/metrics")
        values = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.decode().splitlines()
            if line.startswith("kvscope_collector_r")
        }
        if values["kvscope_collector_rollup_rows_total"] >= 4:
            break
        time.sleep(0.1)
    assert values["kvscope_collector_rollup_rows_total"] >= 4
    assert 120 <= values["kvscope_collector_rollup_behind_seconds"] < 240
    for table in ("windows_1s", "requests", "windows_1m", "steps"):
        assert values[f'kvscope_collector_retention_deleted_rows_total{{table="{table}"}}'] == 0


def test_the_report_sources_read_the_daily_peaks(make_collector: Any, store_path: str) -> None:
    from kvscope.report.sources import HttpSource, StoreSource, open_store

    lc = make_collector(retention_interval_s=0.2)
    day = 86400.0
    base = math.floor(time.time() / day) * day - 3 * day
    for i in range(3):  # one minute on each of three days; the load on day i is 2 + i
        ts = [base + i * day + 3600 + s for s in range(60)]
        st = steps(ts, batch=[2 + i] * 60, waiting=[0] * 60, deferred=[0] * 60)
        b = batch(seq=i, with_hello=i == 0, steps=st)
        assert post_batch(lc.url, b)[0] == 200
    deadline = time.monotonic() + 15
    got = HttpSource(lc.url).daily_load_peaks(base - day, base + 3 * day)
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
        got = HttpSource(lc.url).daily_load_peaks(base - day, base + 3 * day)
    assert got["load_max"].tolist() == [2.0, 3.0, 4.0]
    assert got["day_start_unix_s"].tolist() == [base, base + day, base + 2 * day]
    assert HttpSource(lc.url).daily_load_peaks(base + day, base + 2 * day)["load_max"].tolist() == [
        3.0
    ]
    lc.stop()
    offline = StoreSource(open_store(store_path))
    try:
        assert offline.daily_load_peaks(base - day, base + 3 * day).equals(got)
    finally:
        offline.close()


def test_requests_alone_count_as_the_newest_data_too(tmp_path: Path) -> None:
    path = str(tmp_path / "r.duckdb")
    s = Store(path)
    b = batch(engine_id="e1", seq=0, with_hello=True, req_ts=[T0, T0 + 20 * 86400.0])
    s.ingest_one(prepare_batch(b, T0))
    s.close()
    s = Store(path)  # the newest request is read back at open
    try:
        out = s.apply_lifecycle(
            window_retention_s=15 * 86400.0,
            request_retention_s=15 * 86400.0,
            rollup_retention_s=0,
            now_unix_s=time.time(),
        )
        assert out["requests"] == 1
        assert s.requests()["finished_unix_s"].tolist() == [T0 + 20 * 86400.0]
    finally:
        s.close()


def test_late_seconds_behind_the_retention_do_not_replace_their_minute(store: Store) -> None:
    day = 86400.0
    _send(store, [T0 + i for i in range(60)], 0)
    _send(store, [T0 + 20 * day + i for i in range(60)], 1)
    kw = {"window_retention_s": 15 * day, "request_retention_s": 0, "rollup_retention_s": 0}
    assert store.apply_lifecycle(**kw, now_unix_s=time.time())["windows_1s"] == 60
    _send(store, [T0 + 10.5], 2)  # a late second of the minute whose seconds are gone
    out = store.apply_lifecycle(**kw, now_unix_s=time.time())
    assert out["windows_1s"] == 1 and out["windows_1m_written"] == 0
    m = store.minute_windows().set_index("ts_s")
    assert m.loc[int(T0), "n_seconds"] == 60  # as rolled up before, not replaced by the one


def test_old_and_late_minutes_are_rolled_up_many_a_statement_and_a_bounded_part_a_pass(
    store: Store,
) -> None:
    from kvscope.collector._rollup import LATE_CHUNK_S, LATE_SPAN_S

    day, gap = 86400.0, 3660.0  # steps 61 minutes apart: a minute of its own each
    new = T0 + 100 * day  # the newest data: the retentions count back from it
    old = [new - 16 * day - k * gap for k in range(900)][::-1]  # behind the retention
    late = [new - 14 * day + k * gap for k in range(200)]  # inside it, behind the rolled end
    _send(store, [late[0] + 30.0], 0, engine="e2")  # a second of the first late minute ...
    _send(store, [new + i for i in range(60)], 0)
    kw = {"window_retention_s": 15 * day, "request_retention_s": 15 * day, "rollup_retention_s": 0}
    store.apply_lifecycle(**kw, now_unix_s=new + 400)  # ... rolled up alone
    b = batch(engine_id="e2", seq=1, steps=steps(old + late), req_ts=old + late)
    store.ingest_one(prepare_batch(b, new))
    minutes = {int(t) // 60 * 60 for t in old + late}
    # At a budget of 0 a pass runs one statement of each kind and tier: the old minutes
    # (only filled where the tier has none) LATE_CHUNK_S of them a statement, the late ones
    # (upserted) as many as lie within LATE_SPAN_S of the first; both tiers alike.
    per_old = LATE_CHUNK_S // 60
    per_late = min(per_old, int((LATE_SPAN_S - 60) // gap) + 1)
    want, n_old, n_late = [], len(old), len(late)
    while n_old or n_late:
        n_old, n_late = n_old - min(n_old, per_old), n_late - min(n_late, per_late)
        want.append(2 * (n_old + n_late))
    pending = []
    for _ in range(len(want)):
        store.apply_lifecycle(**kw, now_unix_s=new + 400, rollup_budget_s=0.0)
        pending.append(store.rollup_pending_minutes)
        # a minute waiting keeps its second and its request
        assert minutes <= set(store.minute_windows("e2")["ts_s"]) | set(
            store.windows("e2")["ts_s"] // 60 * 60
        )
        assert minutes <= set(store.request_minutes("e2")["ts_s"]) | set(
            store.requests("e2")["finished_unix_s"] // 60 * 60
        )
    assert pending == want and len(want) < 20  # not a statement per minute (1,100 of them)
    got = store.minute_windows("e2").set_index("ts_s")
    assert set(got.index) == minutes
    assert got.loc[int(late[0]), "n_seconds"] == 2  # upserted: the late second joined its minute
    assert (got.drop(int(late[0]))["n_seconds"] == 1).all()
    req = store.request_minutes("e2").set_index("ts_s")
    assert set(req.index) == minutes and (req["n_requests"] == 1).all()
    # once rolled up, what is behind the retention is deleted
    assert set(store.windows("e2")["ts_s"]) == {int(t) for t in [*late, late[0] + 30]}
    assert sorted(store.requests("e2")["finished_unix_s"]) == late
