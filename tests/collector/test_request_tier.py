"""The request tier: finished requests rolled up per engine and minute into histograms,
deleted only once rolled up, and read back (over HTTP and from the store file) as rows
standing for the requests, so SLO attainment and percentiles cover a range longer than
the request retention.

Expected values are computed here with NumPy from the requests sent, not from the
rollup's SQL or the advisor's code."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _collector_helpers import batch, post_batch, requests

from kvscope.advisor import analyze
from kvscope.advisor.sources import CollectorSource
from kvscope.collector.batch import prepare_batch
from kvscope.collector.store import Store

DAY = 86400.0
T0 = 1_700_000_040.0  # a minute start


def _ttft(r: dict[str, list[Any]]) -> np.ndarray:
    ttft = np.array([math.nan if v is None else v for v in r["ttft_s"]], float)
    fallback = np.array(r["queue_s"], float) + np.array(r["prefill_s"], float)
    return np.where(np.isfinite(ttft), ttft, fallback)


def _itl(r: dict[str, list[Any]]) -> np.ndarray:
    gen = np.array(r["generation_tokens"], float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(gen >= 2, np.array(r["decode_s"], float) / (gen - 1), math.nan)


def _random_requests(rng: np.random.Generator, finished: np.ndarray) -> dict[str, list[Any]]:
    n = len(finished)
    return requests(
        finished.tolist(),
        e2e_s=rng.lognormal(0.5, 0.8, n).tolist(),
        queue_s=rng.exponential(0.3, n).tolist(),
        prefill_s=rng.exponential(0.15, n).tolist(),
        decode_s=rng.gamma(2.0, 1.0, n).tolist(),
        ttft_s=[None if i % 5 == 0 else float(v) for i, v in enumerate(rng.lognormal(-1, 0.9, n))],
        prompt_tokens=rng.integers(20, 4000, n).tolist(),
        generation_tokens=rng.integers(1, 600, n).tolist(),
        cached_tokens=rng.integers(0, 20, n).tolist(),
        preemptions=(rng.random(n) < 0.1).astype(int).tolist(),
        finish_reason=rng.choice(["stop", "length", "abort", "error", "cancelled"], n).tolist(),
    )


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(str(tmp_path / "s.duckdb"))
    yield s
    s.close()


def test_a_minute_counts_its_requests_at_every_bound(store: Store) -> None:
    rng = np.random.default_rng(3)
    finished = T0 + np.sort(rng.uniform(0, 180, 400))  # three minutes
    r = _random_requests(rng, finished)
    store.ingest_one(prepare_batch(batch(seq=0, with_hello=True, requests=r), T0 + 200))
    store.apply_lifecycle(
        window_retention_s=0, request_retention_s=0, rollup_retention_s=0, now_unix_s=T0 + 900
    )
    got = store.request_minutes().set_index("ts_s")
    minute = np.floor(finished / 60) * 60
    assert sorted(got.index) == sorted({int(m) for m in minute})
    ttft, itl, e2e = _ttft(r), _itl(r), np.array(r["e2e_s"])
    reason = np.array(r["finish_reason"])
    for m, row in got.iterrows():
        sel = minute == m
        assert row["n_requests"] == sel.sum()
        assert row["ttft_s{le=0.5}"] == (ttft[sel] <= 0.5).sum()
        assert row["ttft_s{le=2}"] == (ttft[sel] <= 2).sum()
        assert row["itl_s{le=0.01}"] == (itl[sel] <= 0.01).sum()
        assert row["itl_s{le=+Inf}"] == np.isfinite(itl[sel]).sum()
        assert row["e2e_s{le=5}"] == (e2e[sel] <= 5).sum()
        assert row["e2e_s_sum"] == pytest.approx(e2e[sel].sum())
        assert row["n_abort"] == (reason[sel] == "abort").sum()
        assert row["n_other"] == (reason[sel] == "cancelled").sum()
        assert row["preemptions_sum"] == sum(np.array(r["preemptions"])[sel])
    # summed over a step: the same counts per engine
    day = store.request_minutes(step_s=3600)
    assert day["n_requests"].sum() == 400 and set(day["step_s"]) == {3600}


def test_requests_are_deleted_in_whole_minutes_once_rolled_up(store: Store) -> None:
    old = [T0 + 5, T0 + 30, T0 + 65]
    new = [T0 + 20 * DAY + 5]
    store.ingest_one(prepare_batch(batch(seq=0, with_hello=True, req_ts=old + new), T0))
    assert store.requests_kept_from() is None
    assert store.request_minutes(deleted_only=True).empty
    out = store.apply_lifecycle(
        window_retention_s=15 * DAY,
        request_retention_s=15 * DAY,
        rollup_retention_s=0,
        now_unix_s=time.time(),
    )
    assert out["requests"] == 3 and out["requests_1m_written"] == 3
    assert store.requests()["finished_unix_s"].tolist() == new
    kept_from = store.requests_kept_from()
    assert kept_from is not None and kept_from % 60 == 0 and T0 + 65 < kept_from <= new[0]
    gone = store.request_minutes(deleted_only=True)
    assert gone["ts_s"].tolist() == [int(T0), int(T0 + 60)]
    assert gone["n_requests"].tolist() == [2, 1]
    assert store.request_minutes()["n_requests"].sum() == 4  # the tier keeps the new one too
    out = store.apply_lifecycle(
        window_retention_s=15 * DAY,
        request_retention_s=15 * DAY,
        rollup_retention_s=400 * DAY,
        request_rollup_retention_s=10 * DAY,
        now_unix_s=time.time(),
    )
    assert out["requests_1m"] == 2 and out.get("windows_1m") == 0
    assert store.request_minutes()["n_requests"].tolist() == [1]


def test_a_store_from_before_the_tier_is_rolled_up_before_requests_are_deleted(
    store: Store,
) -> None:
    store.ingest_one(prepare_batch(batch(seq=0, with_hello=True, req_ts=[T0 + 1, T0 + DAY]), T0))
    store._con.execute("DELETE FROM meta WHERE key = 'requests_1m_until'")
    store._con.execute("DELETE FROM requests_1m")
    store.apply_lifecycle(
        window_retention_s=0,
        request_retention_s=0.5 * DAY,
        rollup_retention_s=0,
        now_unix_s=time.time(),
    )
    assert store.requests()["finished_unix_s"].tolist() == [T0 + DAY]
    assert store.request_minutes()["n_requests"].tolist() == [1, 1]


def test_late_requests_behind_the_retention_fill_the_tier_but_never_replace_a_row(
    store: Store,
) -> None:
    kw = {"window_retention_s": 0, "request_retention_s": 15 * DAY, "rollup_retention_s": 0}
    now = T0 + 20 * DAY + 600
    store.ingest_one(
        prepare_batch(batch(seq=0, with_hello=True, req_ts=[T0 + 5, T0 + 20 * DAY]), T0)
    )
    store.apply_lifecycle(**kw, now_unix_s=now)
    assert store.request_minutes()["n_requests"].tolist() == [1, 1]
    # an import of old traffic: one more request of that rolled-up minute, one of a new one
    store.ingest_one(prepare_batch(batch(seq=1, req_ts=[T0 + 6, T0 + DAY + 7]), T0))
    out = store.apply_lifecycle(**kw, now_unix_s=now)
    assert out["requests"] == 2 and out["requests_1m_written"] == 1
    got = store.request_minutes().set_index("ts_s")["n_requests"]
    assert got.to_dict() == {int(T0): 1, int(T0 + DAY): 1, int(T0 + 20 * DAY): 1}


def _truth(all_r: dict[str, list[Any]]) -> dict[str, float]:
    ttft, e2e = _ttft(all_r), np.array(all_r["e2e_s"])
    return {
        "n": len(ttft),
        "ttft_share": float((ttft <= 0.5).mean()),
        "e2e_share": float((e2e <= 5.0).mean()),
        "e2e_p50": float(np.quantile(e2e, 0.5)),
        "e2e_p99": float(np.quantile(e2e, 0.99)),
    }


def _wait_rolled_up(src: CollectorSource, since: float, until: float, n: int) -> None:
    """Wait (at most 30 s) until the collector's request tier holds ``n`` requests in
    ``[since, until)``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if src.request_minutes(since, until)["n_requests"].sum() == n:
            return
        time.sleep(0.2)


def test_slo_attainment_over_30_days_reads_the_tier_past_the_request_retention(
    make_collector: Any, store_path: str
) -> None:
    """30 days of requests, 15 kept as rows: over HTTP and from the store file, the
    advisor's SLO attainment and percentiles over the 30 days are those of every request
    sent, not of the last 15 days'."""
    from kvscope.report.sources import StoreSource, open_store

    rng = np.random.default_rng(11)
    end = math.floor(time.time() / 60) * 60 - 600
    start = end - 30 * DAY
    # the first 15 days slower than the last 15: a range cut at the retention shows it
    first = np.sort(rng.uniform(start, start + 15 * DAY, 3000))
    last = np.sort(rng.uniform(start + 15.5 * DAY, end, 3000))
    r_first, r_last = _random_requests(rng, first), _random_requests(rng, last)
    r_first["e2e_s"] = [3 * v for v in r_first["e2e_s"]]
    lc = make_collector(retention_interval_s=0.2, request_retention_s=15 * DAY)
    src = CollectorSource(lc.url)
    # As in service: the first half arrives (and is rolled up) before the second.
    assert post_batch(lc.url, batch(seq=0, with_hello=True, requests=r_first))[0] == 200
    _wait_rolled_up(src, start - 60, end + 60, 3000)
    assert post_batch(lc.url, batch(seq=1, requests=r_last))[0] == 200
    # a minute of steps, so the engine is analysed
    b = batch(seq=2, step_ts=[end - 120 + 0.5 * i for i in range(120)])
    assert post_batch(lc.url, b)[0] == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        raw = src._ranged("/v1/requests", "finished_unix_s", start - 60, end + 60, None, None)
        if len(raw) == 3000:
            break
        time.sleep(0.2)
    assert len(raw) == 3000  # the first 15 days' rows are gone
    all_r = {k: r_first[k] + r_last[k] for k in r_first}
    want = _truth(all_r)
    kept = _truth(r_last)
    assert abs(want["e2e_share"] - kept["e2e_share"]) > 0.1  # the cut would show

    def check(latency: Any) -> None:
        assert latency.n_requests == want["n"]
        assert latency.weighted  # said to be estimated
        assert latency.slo["ttft"].share == pytest.approx(want["ttft_share"], abs=1e-9)
        assert latency.slo["e2e"].share == pytest.approx(want["e2e_share"], abs=1e-9)
        # within a bucket the values are linear: the bucket bounds around the truth
        assert latency.e2e_s.p50 == pytest.approx(want["e2e_p50"], rel=0.15)
        assert latency.e2e_s.p99 == pytest.approx(want["e2e_p99"], rel=0.25)

    report = analyze(src, start - 60, end + 60, slo_ttft_s=0.5, slo_e2e_s=5.0)
    (pool,) = report.pools
    check(pool.latency)
    lc.stop()
    offline = StoreSource(open_store(store_path))
    try:
        check(
            analyze(offline, start - 60, end + 60, slo_ttft_s=0.5, slo_e2e_s=5.0).pools[0].latency
        )
    finally:
        offline.close()


def test_a_range_whose_requests_are_all_kept_reads_no_tier_rows(
    make_collector: Any, store_path: str
) -> None:
    """Nothing of the range was deleted: the sources return the request rows alone, also
    for a range starting inside a rolled-up minute (its requests once came back twice, as
    rows and as rows standing for the tier's, and every request's latency was then read
    as estimated from histograms)."""
    from kvscope.report.sources import StoreSource, open_store

    rng = np.random.default_rng(5)
    start = math.floor(time.time() / 60) * 60 - 900  # minutes long rolled up
    finished = np.sort(rng.uniform(start, start + 300, 200))
    lc = make_collector(retention_interval_s=0.2, request_retention_s=15 * DAY)
    src = CollectorSource(lc.url)
    r = _random_requests(rng, finished)
    assert post_batch(lc.url, batch(seq=0, with_hello=True, requests=r))[0] == 200
    _wait_rolled_up(src, start - 60, start + 360, 200)
    since, until = start + 90.5, start + 250.0  # inside a minute, and another
    want = int(((finished >= since) & (finished < until)).sum())
    got = src.requests(since, until)
    assert len(got) == want
    assert "weight" not in got and "estimated" not in got
    lc.stop()
    offline = StoreSource(open_store(store_path))
    try:
        got = offline.requests(since, until)
        assert len(got) == want and "weight" not in got
    finally:
        offline.close()


def test_the_tier_endpoint_checks_its_parameters(make_collector: Any) -> None:
    from _collector_helpers import get_json

    lc = make_collector()
    for query, says in (
        ("step=90", "whole number of minutes"),
        ("step=soon", "step"),
        ("deleted_only=maybe", "deleted_only: expected true or false"),
    ):
        status, body = get_json(lc.url, f"/v1/requests_1m?{query}")
        assert status == 400 and says in body["error"], (query, body)
    status, body = get_json(lc.url, "/v1/requests_1m?step=1h&deleted_only=true")
    assert status == 200 and body["rows"] == []


def test_a_range_older_than_the_window_retention_gets_its_latency_from_the_tier(
    make_collector: Any, store_path: str
) -> None:
    """A week 25 days back: its 1-second windows and its request rows are deleted (15
    days), its request minutes kept. `advise` gives the engine's latency and SLO
    attainment over that week (those of every request sent then), reads its windows
    from the 1-minute tier, says where the seconds start, and exits 0."""
    import subprocess
    import sys

    from kvscope.advisor.render_text import text_report
    from kvscope.report.sources import StoreSource, open_store

    rng = np.random.default_rng(5)
    now = math.floor(time.time() / 60) * 60 - 600
    old_lo, old_hi = now - 25 * DAY, now - 18 * DAY
    finished = np.sort(rng.uniform(old_lo, old_hi, 2000))
    r_old = _random_requests(rng, finished)
    lc = make_collector(retention_interval_s=0.2)
    src = CollectorSource(lc.url)
    old_steps = [old_lo + 30 + 0.5 * i for i in range(240)]  # the engine ran then
    b = batch(seq=0, with_hello=True, step_ts=old_steps, requests=r_old)
    assert post_batch(lc.url, b)[0] == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # rolled up (both tiers) before the new data lands
        minutes = src.request_minutes(old_lo - 60, old_hi + 60)
        if len(minutes) and minutes["n_requests"].sum() == 2000 and len(src.minute_windows()):
            break
        time.sleep(0.2)
    new_steps = [now - 120 + 0.5 * i for i in range(120)]
    assert post_batch(lc.url, batch(seq=1, step_ts=new_steps))[0] == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the retention deletes the old rows
        if not len(src.windows(old_lo - 60, old_hi + 60)) and not len(
            src._ranged("/v1/requests", "finished_unix_s", old_lo - 60, old_hi + 60, None, None)
        ):
            break
        time.sleep(0.2)
    assert not len(src.windows(old_lo - 60, old_hi + 60))
    ttft, e2e = _ttft(r_old), np.array(r_old["e2e_s"])
    n_minutes = len({math.floor(t) // 60 for t in old_steps})

    def check(report: Any) -> None:
        assert report.has_data
        # its minutes of steps: read from the minute tier, too few for a knee
        assert report.coverage["n_engines_analyzed"] == 1
        assert report.coverage["n_engines_latency_only"] == 0
        assert report.coverage["engines_from_minutes"] == [v.engine_id for v in report.engines]
        assert report.coverage["n_minute_windows"] == n_minutes
        assert report.coverage["n_requests"] == 2000
        assert report.coverage["oldest_window_unix_s"] == math.floor(new_steps[0])
        (v,) = report.engines
        assert v.bottleneck == "insufficient_data" and v.knee_concurrency is None
        assert v.latency.n_requests == 2000 and v.latency.weighted
        assert v.latency.slo["ttft"].share == pytest.approx(float((ttft <= 0.5).mean()), abs=1e-9)
        assert v.latency.slo["e2e"].share == pytest.approx(float((e2e <= 5.0).mean()), abs=1e-9)
        assert not report.recommendations
        (pool,) = report.pools
        assert pool.latency.n_requests == 2000

    report = analyze(src, old_lo - 60, old_hi + 60, slo_ttft_s=0.5, slo_e2e_s=5.0)
    check(report)
    text = text_report(report, source=lc.url, window="W")
    assert f"1 engine(s) read from {n_minutes} one-minute windows" in text
    assert "SLO attainment" in text
    # the command a user runs: exit 0, the attainment printed
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "advise",
            "--collector",
            lc.url,
            "--since",
            "26d",
            "--until",
            "17d",
            "--slo-e2e",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "one-minute windows" in out.stdout and "SLO attainment" in out.stdout
    # the weekly report of that week, over HTTP and from the store file: its usage from
    # the minute tiers (the seconds and request rows are gone), its latency from the tier
    want_gen = float(sum(b["steps"]["generation_tokens"]))
    want_active = len({math.floor(t) for t in old_steps})

    args = ["--since", "26d", "--until", "18d", "--slo-e2e", "5", "--no-progress"]

    def weekly(where: list[str], out_dir: Path) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "kvscope", "report", *where, *args, "--out", str(out_dir)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr
        usage = json.loads((out_dir / "report.json").read_text())["usage"]["engines"]
        assert usage["requests"] == [2000.0]
        assert usage["generation_tokens"] == [want_gen]
        assert usage["active_s"] == [want_active]
        md = (out_dir / "report.md").read_text()
        assert "one-minute windows" in md and "| requests finished | 2k |" in md

    weekly(["--collector", lc.url], Path(store_path).parent / "report-http")
    lc.stop()
    offline = StoreSource(open_store(store_path))
    try:
        check(analyze(offline, old_lo - 60, old_hi + 60, slo_ttft_s=0.5, slo_e2e_s=5.0))
    finally:
        offline.close()
    weekly(["--store", store_path], Path(store_path).parent / "report-store")
