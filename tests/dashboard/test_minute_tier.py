"""Over a long window the engine page's time series come from the collector's 1-minute
windows: an engine that stepped one minute in each of the last eight hours, read by a real
collector process, shown under Streamlit's AppTest."""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "collector"))

from _collector_helpers import batch, hello, steps
from test_app import _app_with_url, chart_data, run_app, texts

from kvscope.collector.batch import prepare_batch
from kvscope.collector.process import CollectorProcess
from kvscope.collector.store import Store

ENGINE = "hourly:8000:0"
TOKENS_PER_STEP = 10
STEPS_PER_S = 2


@pytest.fixture(scope="module")
def hourly(tmp_path_factory: pytest.TempPathFactory) -> tuple[CollectorProcess, list[int]]:
    """A store whose engine stepped one minute in each of the last 8 hours (2 steps a
    second, 10 tokens a step: 1,200 tokens a minute), rolled up, under a collector."""
    path = tmp_path_factory.mktemp("minutes") / "hourly.duckdb"
    now = time.time()
    minutes = [math.floor((now - h * 3600) / 60) * 60 - 300 for h in range(8, 0, -1)]
    store = Store(str(path))
    try:
        for seq, m in enumerate(minutes):
            ts = [m + i / STEPS_PER_S for i in range(60 * STEPS_PER_S)]
            st = steps(ts, batch=[4] * len(ts), generation_tokens=[TOKENS_PER_STEP] * len(ts))
            b = batch(engine_id=ENGINE, seq=seq, steps=st)
            if seq == 0:
                b["hello"] = hello(ENGINE, "boot-1", pool="hourly", num_gpu_blocks=500)
            store.ingest_one(prepare_batch(b, ts[-1]))
        assert store.roll_up_now() == len(minutes)
    finally:
        store.close()
    c = CollectorProcess(path, extra_args=["--advise-interval-s", "0", "--kv-events", "off"])
    c.start()
    yield c, minutes
    c.stop()


def test_a_long_window_plots_the_minute_tier(
    monkeypatch: pytest.MonkeyPatch, hourly: tuple[CollectorProcess, list[int]]
) -> None:
    c, minutes = hourly
    at = run_app(monkeypatch, c.url, "--since", "12h", page="_pages/engine.py")
    heads = [h.value for h in at.subheader]
    head = next(h for h in heads if h.startswith("Time series"))
    found = re.search(r"per (\d+) (min|h), from 1-minute windows", head)
    assert found is not None, heads
    bucket_s = int(found.group(1)) * (60 if found.group(2) == "min" else 3600)
    series = next(
        d
        for chart in chart_data(at)
        for d in chart
        if "series" in d and "generated" in set(d["series"])
    )
    gen = series[series["series"] == "generated"].sort_values("time")["y"].tolist()
    assert len(gen) == len(minutes)  # one point per hour's active minute, none in between
    minute_tokens = 60 * STEPS_PER_S * TOKENS_PER_STEP
    # each bucket holds one active minute; the last one may be cut short at the data's end
    assert gen[:-1] == pytest.approx([minute_tokens / bucket_s] * (len(minutes) - 1))
    assert gen[-1] >= minute_tokens / bucket_s


def test_a_short_window_plots_the_seconds(
    monkeypatch: pytest.MonkeyPatch, hourly: tuple[CollectorProcess, list[int]]
) -> None:
    c, minutes = hourly
    since = minutes[-1] - 30
    at = run_app(monkeypatch, c.url, "--since", str(since), page="_pages/engine.py")
    heads = [h.value for h in at.subheader]
    assert any(h.startswith("Time series (per second)") for h in heads), [*heads, texts(at)]


def test_a_range_whose_seconds_were_deleted_is_analysed_from_its_minutes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real slow-day run (tests/fixtures/minute_tier_slow_day.json.gz) with its seconds
    deleted by the store's lifecycle, under a collector: the overview gives the engine's
    verdict and knee from its minutes and says so."""
    from test_minute_tier_knees import _load

    from bench.minute_tier_knees import delete_seconds

    run = _load("minute_tier_slow_day.json.gz", tmp_path)
    delete_seconds(run["path"], run["until"])
    c = CollectorProcess(run["path"], extra_args=["--advise-interval-s", "0", "--kv-events", "off"])
    c.start()
    utc = "%Y-%m-%dT%H:%M:%SZ"
    query = {
        "time": "range",
        "from": time.strftime(utc, time.gmtime(run["since"])),
        "to": time.strftime(utc, time.gmtime(run["until"] + 1)),
    }
    try:
        at = _app_with_url(monkeypatch, c.url, query)
        # the engine page renders from the minutes too (its series, the curve)
        page = _app_with_url(monkeypatch, c.url, query, page="_pages/engine.py")
    finally:
        c.stop()
    assert "kv_cache_bound" in texts(page) + " ".join(h.value for h in page.subheader)
    caption = at.caption[0].value
    assert re.search(r"1 of them read from \d+ one-minute windows", caption), caption
    engines = next(t.value for t in at.table if "verdict" in t.value.columns)
    assert engines["verdict"].tolist() == ["kv_cache_bound, saturated"]
    assert int(str(engines["cap"].iloc[0])) > 0  # a cap: the knee is resolved
