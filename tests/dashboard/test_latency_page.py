"""The Latency page under Streamlit's AppTest, on two seeded synthetic engines of one pool:
every number is the advisor's latency block (or the same analysis for a target changed on
the page), every chart at least 250 px tall, time axes in UTC."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.advisor import FrameSource, Report, analyze
from kvscope.advisor.datasets import make_engine
from kvscope.advisor.render_latency import ms_or_s, p50_p90_p99
from kvscope.advisor.request_latency import SloTargets, latency_over_time, request_latency

A, B = "h1:8000:0", "h2:8000:0"


@pytest.fixture(scope="module")
def pool() -> dict[str, Any]:
    a = make_engine("kv_cache_bound", seed=0, engine_id=A, pool="p")
    b = make_engine("not_saturated", seed=1, engine_id=B, pool="p")
    engines, windows, requests = (
        pd.concat([x, y], ignore_index=True)
        for x, y in ((a.engines, b.engines), (a.windows, b.windows), (a.requests, b.requests))
    )
    report = analyze(FrameSource(engines, windows, requests), slo_ttft_s=0.5)
    return {"report": report, "requests": requests, "engines": engines}


def _latency_page(report_json: str, requests_json: str, engines_json: str) -> None:
    import io

    import pandas as pd

    from kvscope.advisor import Report
    from kvscope.dashboard._views.latency import render
    from kvscope.dashboard.data import Snapshot
    from kvscope.dashboard.settings import DashboardSettings

    render(
        Snapshot(
            settings=DashboardSettings("http://127.0.0.1:9", slo_ttft_s=0.5),
            since_text="all",
            since_unix_s=None,
            until_unix_s=None,
            fetched_unix_s=0.0,
            report=Report.from_json(report_json),
            requests=pd.read_json(io.StringIO(requests_json), orient="records"),
            engines=pd.read_json(io.StringIO(engines_json), orient="records"),
        )
    )


def _app(pool: dict[str, Any]) -> AppTest:
    at = AppTest.from_function(
        _latency_page,
        kwargs={
            "report_json": pool["report"].to_json(),
            "requests_json": pool["requests"].to_json(orient="records", double_precision=15),
            "engines_json": pool["engines"].to_json(orient="records"),
        },
        default_timeout=60,
    ).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _specs(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(el.proto.spec) for el in at.get("vega_lite_chart")]


def _datasets(at: AppTest) -> list[list[pd.DataFrame]]:
    return [
        [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in el.proto.datasets]
        for el in at.get("vega_lite_chart")
    ]


def test_tables_are_the_advisors_latency_blocks(pool: dict[str, Any]) -> None:
    report: Report = pool["report"]
    lat = report.pools[0].latency
    assert lat is not None
    at = _app(pool)
    assert [n.value for n in at.number_input] == [0.5, 0.0, 0.0]  # the settings' targets
    measures, slo, engines = (t.value for t in at.table[:3])
    assert measures.loc["TTFT", "P50"] == ms_or_s(lat.ttft_s.p50)
    assert measures.loc["ITL", "P99"] == ms_or_s(lat.itl_s.p99)
    assert measures.loc["e2e", "requests"] == f"{lat.e2e_s.n:,}"
    assert slo.loc["TTFT <= 500 ms", "share"] == f"{lat.slo['ttft'].share:.1%}"
    assert slo.loc["every target", "met"] == f"{lat.slo['all'].n_met:,}"
    for eid in (A, B):
        v = report.engine(eid).latency
        assert v is not None
        assert engines.loc[eid, "TTFT P50 / P90 / P99"] == p50_p90_p99(v.ttft_s)
        assert engines.loc[eid, "TTFT met"] == f"{v.slo['ttft'].share:.1%}"


def test_a_target_changed_on_the_page_is_judged_by_the_same_analysis(
    pool: dict[str, Any],
) -> None:
    at = _app(pool)
    at.number_input(key="latency_slo_e2e").set_value(2.0).run()
    assert not at.exception, [e.value for e in at.exception]
    want = request_latency(pool["requests"], SloTargets(ttft_s=0.5, e2e_s=2.0))
    slo = at.table[1].value
    assert slo.loc["e2e <= 2.00 s", "share"] == f"{want.slo['e2e'].share:.1%}"
    assert slo.loc["every target", "share"] == f"{want.slo['all'].share:.1%}"


def test_charts_are_tall_enough_in_utc_and_plot_the_percentiles(pool: dict[str, Any]) -> None:
    at = _app(pool)
    specs = _specs(at)
    assert len(specs) >= 7  # breakdown, reasons, three percentile charts, two histograms
    assert all(s["height"] >= 250 for s in specs)
    timed = [
        s for s in specs if "layer" in s and s["layer"][0]["encoding"]["x"]["type"] == "temporal"
    ]
    assert len(timed) == 3
    for s in timed:
        x = s["layer"][0]["encoding"]["x"]
        assert x["title"] == "time (UTC)" and x["scale"]["type"] == "utc"
        assert "%I" not in x["axis"]["format"] and "%p" not in x["axis"]["format"]
    picked = at.selectbox(key="latency_engine").value
    assert picked in (A, B)
    want = latency_over_time(pool["requests"][pool["requests"]["engine_id"] == picked])
    ttft = want[want["measure"] == "ttft_s"]
    plotted = next(
        d for ds in _datasets(at) for d in ds if "percentile" in d and len(d) == 3 * len(ttft)
    )
    p50 = plotted[plotted["percentile"] == "P50"]["seconds"].to_numpy()
    assert p50 == pytest.approx(ttft["p50"].to_numpy())


def test_slo_settings_round_trip_through_the_app_arguments() -> None:
    from kvscope.dashboard.settings import SettingsError, parse_settings, to_argv

    s = parse_settings(["--collector", "c:8844", "--slo-ttft", "0.5", "--slo-itl", "0.04"], {})
    assert (s.slo_ttft_s, s.slo_itl_s, s.slo_e2e_s) == (0.5, 0.04, None)
    assert parse_settings(to_argv(s), {}) == s
    assert parse_settings(["--collector", "c:8844"], {}).slo_ttft_s is None
    with pytest.raises(SettingsError):
        parse_settings(["--collector", "c:8844", "--slo-e2e", "-1"], {})
