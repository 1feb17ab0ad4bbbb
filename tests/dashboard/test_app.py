"""The dashboard's pages under Streamlit's AppTest, reading a real collector process that
holds the demo fleet (three real vLLM recordings replayed over HTTP).

Every number a page shows is checked against what :func:`kvscope.advisor.analyze` answers on
the same collector, formatted as ``kvscope advise`` formats it, and the raw numbers
of the overview against the collector's own rows."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from _fleet import AMPLE, KV_STARVED, SEQ_CAPPED, expected_report
from streamlit.testing.v1 import AppTest

from kvscope.advisor import FrameSource, Report, analyze
from kvscope.advisor.datasets import make_prefix_pool
from kvscope.advisor.prefix import KV_EVENTS_FLAG
from kvscope.collector.process import CollectorProcess, free_port
from kvscope.dashboard._status import DOWN_S, LIVE_S

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def run_app(
    monkeypatch: pytest.MonkeyPatch, url: str, *extra: str, page: str | None = None
) -> AppTest:
    """The app as ``streamlit run dashboard/app.py -- --collector URL ...`` runs it."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--collector", url, "--refresh", "0", *extra])
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def metric_list(at: AppTest, label: str) -> list[str]:
    return [m.value for m in at.metric if m.label == label]


def codes(at: AppTest) -> list[str]:
    return [c.value for c in at.code]


def texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption]
    parts += [w.value for w in at.warning] + [i.value for i in at.info]
    return "\n".join(parts)


def chart_data(at: AppTest) -> list[list[pd.DataFrame]]:
    """The data sets of every Vega-Lite chart on the page, in order."""
    out = []
    for el in at.get("vega_lite_chart"):
        out.append(
            [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in el.proto.datasets]
        )
    return out


def chart_specs(at: AppTest) -> list[dict[str, Any]]:
    """The Vega-Lite spec of every chart on the page, in order."""
    return [json.loads(el.proto.spec) for el in at.get("vega_lite_chart")]


def no_problem_shown(at: AppTest) -> None:
    assert not at.error, [e.value for e in at.error]
    assert "No data" not in texts(at)


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


# -- fleet overview ------------------------------------------------------------------


def test_overview_ranks_the_kv_starved_pool_first_with_the_advisors_numbers(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url)
    no_problem_shown(at)
    assert at.title[0].value == "Fleet overview"
    m = metrics(at)
    saturated = sum(v.saturated for v in expected.engines)
    assert m["engines analyzed"] == "3"
    assert m["saturated"] == f"{saturated} of 3"
    assert m["recommendations"] == str(len(expected.recommendations))

    kv = expected.engine(KV_STARVED)
    callout = at.warning[0].value
    assert callout.startswith("**pool demo: saturated, KV-bound")
    assert (
        f"`{KV_STARVED}` kv_cache_bound, saturated, knee {kv.knee_concurrency:.1f}, "
        f"cap {kv.recommended_concurrency_cap} in flight" in callout
    )

    pools, engines = (t.value for t in at.table[:2])
    assert list(pools.index) == ["demo", "demo-ample"]
    demo = next(p for p in expected.pools if p.pool == "demo")
    assert pools.loc["demo", "recommended cap"] == f"{demo.recommended_concurrency_cap} in flight"
    assert pools.loc["demo", "plateau"] == f"{demo.plateau_tokens_per_s:,.0f} tok/s"
    # The ample-KV engine grew about 12% over its last doubling of load: past the knee by
    # the saturation margin's width, so either answer is the advisor's to give.
    ample = expected.engine(AMPLE)
    assert pools.loc["demo-ample", "needs attention"] == ("saturated" if ample.saturated else "ok")

    assert list(engines.index) == [KV_STARVED, SEQ_CAPPED, AMPLE]
    for eid in engines.index:
        v, row = expected.engine(eid), engines.loc[eid]
        assert row["verdict"].startswith(
            f"{v.bottleneck}, {'saturated' if v.saturated else 'headroom'}"
        )
        # No knee is published for an engine whose load never went past one.
        assert (v.knee_concurrency is None) == (not v.saturated)
        assert row["knee (in flight)"] == (
            "–" if v.knee_concurrency is None else f"{v.knee_concurrency:.1f}"
        )
        assert row["plateau"] == f"{v.plateau_tokens_per_s:,.0f} tok/s"
        assert row["prefix hit rate"] == pct(v.prefix_hit_rate)
        assert row["cap"] == (
            str(v.recommended_concurrency_cap) if v.recommended_concurrency_cap is not None else "–"
        )
        # The replay is over: live until LIVE_S after its last step, idle while the
        # collector heard from it in the last DOWN_S, DOWN (with when) after that.
        known = next(r for r in demo_fleet.get_json("/v1/engines")["rows"] if r["engine_id"] == eid)
        now = time.time()
        step_age = now - float(known["last_step_unix_s"])
        seen_age = now - max(float(known["last_seen_unix_s"]), float(known["last_step_unix_s"]))
        if seen_age > DOWN_S + 3:
            assert row["status"].startswith("DOWN, last seen "), (row["status"], seen_age)
        elif step_age > LIVE_S + 3 and seen_age < DOWN_S - 3:
            assert row["status"].startswith("idle, last step "), (row["status"], step_age)
        elif step_age < LIVE_S - 3:
            assert row["status"] == "live", (row["status"], step_age)
    assert engines.loc[KV_STARVED, "batch / max_num_seqs"].endswith(" / 256")
    assert engines.loc[SEQ_CAPPED, "batch / max_num_seqs"].endswith(" / 6")


def test_overview_last_minute_columns_match_the_collectors_windows(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    at = run_app(monkeypatch, demo_fleet.url)
    engines = at.table[1].value
    w = pd.DataFrame(
        demo_fleet.get_json(
            "/v1/windows", params={"engine": KV_STARVED, "since": "0", "format": "columns"}
        )["columns"]
    )
    last = w[w["ts_s"] > w["ts_s"].max() - 60]
    span = int(last["ts_s"].max() - last["ts_s"].min() + 1)
    row = engines.loc[KV_STARVED]
    assert row["batch / max_num_seqs"] == f"{last['batch_mean'].mean():,.1f} / 256"
    assert row["KV used"] == f"{last['kv_usage_mean'].mean():.0%}"
    assert row["preemptions/s"] == f"{last['preemptions'].sum() / span:,.1f}"
    assert row["generated"] == f"{last['generation_tokens'].sum() / span:,.0f} tok/s"


def test_sidebar_window_changes_what_is_read(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    at = run_app(monkeypatch, demo_fleet.url)
    assert "(window 30m)" in at.caption[0].value
    assert at.sidebar.selectbox[0].value == "30m"
    at.sidebar.selectbox[0].set_value("5m").run()
    assert not at.exception
    assert "(window 5m)" in at.caption[0].value
    assert "--since" not in texts(at)


# -- engine detail -------------------------------------------------------------------


def test_engine_detail_shows_the_kv_starved_engine_against_its_limits(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/engine.py")
    no_problem_shown(at)
    assert at.selectbox[0].value == KV_STARVED  # the engine needing attention most
    body = texts(at)
    assert "KV cache 48 blocks x 32 tokens = 1,536 tokens" in body
    assert "max_num_seqs 256, max_num_batched_tokens 2048" in body
    assert ":red-background[kv_cache_bound] saturated" in body
    kv = expected.engine(KV_STARVED)
    m = metrics(at)
    assert m["knee (in flight)"] == f"{kv.knee_concurrency:.1f}"
    assert m["recommended cap"] == str(kv.recommended_concurrency_cap)

    charts = chart_data(at)
    # five charts of per-second series (running and waiting share one) and the latency
    # percentiles; the per-step view is behind its switch
    assert len(charts) == 6
    # KV blocks in use against num_gpu_blocks 48: the rule carries the total.
    rules = [d for c in charts for d in c if "label" in d]
    assert any(d["label"].iloc[0] == "num_gpu_blocks 48" and d["v"].iloc[0] == 48 for d in rules)
    # Per-second series: the blocks in use never exceed the total, and reach it.
    series = next(
        d for c in charts for d in c if "series" in d and "blocks in use (max)" in set(d["series"])
    )
    blocks = series[series["series"] == "blocks in use (max)"]["y"]
    assert blocks.max() == 48
    # The raw steps, once switched on: the per-step charts hold the last 30 s of steps of
    # this engine, each one (fewer than the plotting limit), its KV usage included.
    at.toggle(key="kvscope_steps_show").set_value(True).run()
    no_problem_shown(at)
    charts = chart_data(at)
    assert len(charts) == 8
    steps = charts[-2][0]
    assert set(steps["series"]) == {"batch (running)", "waiting"}
    assert len(steps) > 1000
    kv_steps = charts[-1][0]
    assert len(kv_steps) == len(steps) // 2
    assert kv_steps["kv_usage_pct"].max() <= 100.0 and kv_steps["kv_usage_pct"].max() > 90.0
    assert f"all {len(kv_steps):,} steps." in texts(at)


def test_engine_detail_switches_to_the_sequence_capped_engine(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/engine.py")
    at.selectbox[0].set_value(SEQ_CAPPED).run()
    assert not at.exception
    assert "max_num_seqs 6," in texts(at)
    assert ":orange-background[max_num_seqs_bound]" in texts(at)
    v = expected.engine(SEQ_CAPPED)
    assert metrics(at)["recommended cap"] == str(v.recommended_concurrency_cap)
    rules = [d for c in chart_data(at) for d in c if "label" in d]
    assert any(d["label"].iloc[0] == "max_num_seqs 6" for d in rules)


# -- plateau --------------------------------------------------------------------------


def test_plateau_presents_the_advisors_curve_knee_and_cap(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/plateau.py")
    no_problem_shown(at)
    kv = expected.engine(KV_STARVED)
    m = metrics(at)
    assert m["knee (in flight)"] == f"{kv.knee_concurrency:.1f}"
    assert m["plateau (generated)"] == f"{kv.plateau_tokens_per_s:,.0f} tok/s"
    assert m["recommended cap (in flight)"] == str(kv.recommended_concurrency_cap)
    assert m["share of peak at the cap"] == f"{kv.predicted_throughput_fraction_at_cap:.0%}"
    assert m["e2e P99 at the cap"] == f"{kv.predicted_p99_e2e_s_at_cap:.2f} s"
    body = texts(at)
    assert ":red-background[kv_cache_bound] saturated" in body
    why = expected.findings_of("bottleneck", KV_STARVED)[0]
    assert f"**{why.summary}**" in body
    evidence = at.table[0].value
    assert evidence.loc["kv usage median", "value"] == f"{why.evidence['kv_usage_median']:.0%}"
    assert evidence.loc["max num seqs", "value"] == "256"

    # One chart: throughput (left axis) and P99 latency (right axis) on one load axis.
    (chart,) = chart_data(at)
    curve = expected.findings_of("throughput_curve", KV_STARVED)[0].frame
    assert curve is not None
    points = next(d for d in chart if "series" in d and set(d["series"]) == {"measured"})
    assert points["load"].tolist() == pytest.approx(curve["load"])
    assert points["measured"].tolist() == pytest.approx(curve["gen_tokens_per_s"])
    labels = {d["label"].iloc[0]: d["v"].iloc[0] for d in chart if "label" in d}
    assert labels[f"knee {kv.knee_concurrency:.1f}"] == pytest.approx(kv.knee_concurrency)
    assert labels[f"cap {kv.recommended_concurrency_cap}"] == kv.recommended_concurrency_cap
    assert labels[f"plateau {kv.plateau_tokens_per_s:,.0f} tok/s"] == pytest.approx(
        kv.plateau_tokens_per_s
    )
    lat = expected.findings_of("latency_vs_load", KV_STARVED)[0].frame
    assert lat is not None
    p99_lines = next(d for d in chart if "seconds" in d)
    e2e = p99_lines[p99_lines["series"] == "e2e P99"]
    assert e2e["load"].tolist() == pytest.approx(lat["load"])
    assert e2e["seconds"].tolist() == pytest.approx(lat["e2e_s_p99"])
    (spec,) = chart_specs(at)
    assert spec["resolve"]["scale"]["y"] == "independent"
    assert spec["height"] >= 250 and spec["autosize"]["type"] == "fit-x"


@pytest.mark.parametrize("engine", [KV_STARVED, SEQ_CAPPED, AMPLE])
def test_plateau_page_shows_the_cap_or_the_headroom(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report, engine: str
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/plateau.py")
    at.selectbox[0].set_value(engine).run()
    assert not at.exception
    v = expected.engine(engine)
    shown = metrics(at)["recommended cap (in flight)"]
    if v.saturated:
        assert v.recommended_concurrency_cap is not None
        assert shown == str(v.recommended_concurrency_cap)
        assert f"{v.bottleneck}] saturated" in texts(at)
    else:
        assert v.recommended_concurrency_cap is None and shown == "–"
        assert f"headroom, approaching {v.approaching}" in texts(at)


# -- recommendations ---------------------------------------------------------------------


def test_recommendations_are_ranked_with_the_change_to_copy(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/recommendations.py")
    no_problem_shown(at)
    heads = [m.value for m in at.markdown if m.value.startswith("#### ")]
    assert heads == [
        f"#### {i}. {r.summary}" for i, r in enumerate(expected.recommendations, start=1)
    ]
    cap_rec = next(
        r
        for r in expected.recommendations
        if r.kind == "concurrency_cap" and r.scope.engine_id == KV_STARVED
    )
    cap = expected.engine(KV_STARVED).recommended_concurrency_cap
    flags = " ".join(cap_rec.change["vllm_flags"])
    assert flags.startswith(f"--max-num-seqs {cap} ")
    c = codes(at)
    assert flags in c
    # Per replica its own max_conns; the pool's limit is in the pool's recommendation.
    assert f"server demo-host:8000 max_conns={cap};" in c
    assert not [t for t in c if "limit_conn " in t and f" {cap};" in t]
    raise_seqs = next(r for r in expected.recommendations if r.kind == "raise_max_num_seqs")
    assert raise_seqs.scope.engine_id == SEQ_CAPPED
    assert raise_seqs.change["vllm_flags"][0] in c
    pool_cap = next(r for r in expected.recommendations if r.kind == "pool_concurrency_cap")
    assert pool_cap.change["gateway"]["nginx"]["config"] in c
    total = pool_cap.change["concurrency_cap"]
    assert (
        f"limit_conn vllm_demo_inflight {total};" in pool_cap.change["gateway"]["nginx"]["config"]
    )


# -- prefix and routing ------------------------------------------------------------------


def test_prefix_page_shows_hit_rates_per_replica_and_the_missing_kv_events(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/prefix.py")
    no_problem_shown(at)
    by_pool = {p.pool: p for p in expected.pools}
    assert metric_list(at, "prefix-cache hit rate") == [
        pct(by_pool["demo"].prefix_hit_rate),
        pct(by_pool["demo-ample"].prefix_hit_rate),
    ]
    assert metric_list(at, "load imbalance")[0] == f"{by_pool['demo'].load_imbalance:.2f}x"
    replicas = at.table[0].value
    for eid in (KV_STARVED, SEQ_CAPPED):
        assert replicas.loc[eid, "hit rate"] == pct(expected.engine(eid).prefix_hit_rate)
    cache = next(
        f for f in expected.findings if f.kind == "prefix_cache" and f.scope.pool == "demo"
    )
    ttft = at.table[1].value
    assert ttft.loc["with cached tokens", "n"] == f"{cache.evidence['ttft_cached']['n']:,}"
    assert (
        ttft.loc["without cached tokens", "TTFT P50"]
        == f"{cache.evidence['ttft_uncached']['p50_s']:.2f} s"
    )
    assert KV_EVENTS_FLAG.split(" ", 1)[1] in " ".join(codes(at))
    assert "cannot be measured on these 2 replicas" in texts(at)


def _prefix_page(report_json: str) -> None:
    from kvscope.advisor import Report
    from kvscope.dashboard._views.prefix import render
    from kvscope.dashboard.data import Snapshot
    from kvscope.dashboard.settings import DashboardSettings

    render(
        Snapshot(
            settings=DashboardSettings("http://127.0.0.1:9"),
            since_text="all",
            since_unix_s=None,
            until_unix_s=None,
            fetched_unix_s=0.0,
            report=Report.from_json(report_json),
        )
    )


def test_prefix_page_with_kv_events_shows_duplication_and_the_routing_change() -> None:
    pool = make_prefix_pool(seed=3)
    report = analyze(FrameSource(pool.engines, pool.windows, pool.requests, pool.kv_events))
    pv = report.pools[0]
    assert pv.prefix_routing_loss is not None  # the synthetic pool has KV events
    at = AppTest.from_function(
        _prefix_page, kwargs={"report_json": report.to_json()}, default_timeout=30
    ).run()
    assert not at.exception, [e.value for e in at.exception]
    m = metrics(at)
    routing = next(f for f in report.findings if f.kind == "prefix_routing")
    assert m["routing loss"] == pct(pv.prefix_routing_loss)
    assert m["prefix-affine (predicted)"] == pct(pv.predicted_prefix_hit_rate_affine)
    assert m["reuse available"] == pct(routing.evidence["available"])
    assert m["cache duplicated across replicas"] == pct(routing.evidence["duplicated_cache_ratio"])
    rec = next(r for r in report.recommendations if r.kind == "prefix_aware_routing")
    assert rec.change["production_stack"] in codes(at)
    heads = [x.value for x in at.markdown if x.value.startswith("#### ")]
    rank = report.recommendations.index(rec) + 1
    assert f"#### {rank}. {rec.summary}" in heads


# -- what the dashboard says when it cannot show anything ------------------------------


def test_unreachable_collector_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    at = run_app(monkeypatch, url)
    assert "Collector unreachable" in at.error[0].value
    assert url in at.error[0].value
    assert "kvscope collector" in at.info[0].value
    assert not at.table


@pytest.fixture(scope="module")
def token_collector(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with CollectorProcess(
        tmp_path_factory.mktemp("token") / "kvscope.duckdb",
        token="s3cret",
        extra_args=["--advise-interval-s", "0"],
    ) as c:
        yield c


def test_wrong_token_gets_the_401_explained(
    monkeypatch: pytest.MonkeyPatch, token_collector: CollectorProcess
) -> None:
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = run_app(monkeypatch, token_collector.url)
    assert "Not authorized (401)" in at.error[0].value
    assert "--token" in at.info[0].value
    at = run_app(monkeypatch, token_collector.url, "--token", "wrong")
    assert "Not authorized (401)" in at.error[0].value


def test_token_from_the_environment_reaches_an_empty_collector(
    monkeypatch: pytest.MonkeyPatch, token_collector: CollectorProcess
) -> None:
    monkeypatch.setenv("KVSCOPE_TOKEN", "s3cret")
    at = run_app(monkeypatch, token_collector.url)
    assert not at.error
    assert "knows no engines yet" in at.warning[0].value
    assert "kvscope demo" in at.warning[0].value


def test_no_data_in_the_window_names_a_window_that_has_it(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, "--since", "5s", page="_pages/plateau.py")
    assert not at.error
    text = at.warning[0].value
    assert text.startswith("**No data.** no data in ")
    # The page names its own control, never a command-line flag.
    assert "window (or longer) in the sidebar" in text or "range around it" in text
    assert "--" not in texts(at)
    assert not at.metric


def test_bad_arguments_stop_the_app_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCOPE_COLLECTOR_URL", raising=False)
    monkeypatch.setattr(sys, "argv", ["app.py"])
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.exception
    assert "pass --collector URL" in at.error[0].value
    monkeypatch.setattr(sys, "argv", ["app.py", "--collector", "x:1", "--since", "yesterday"])
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert "--since: expected unix seconds" in at.error[0].value


def test_expected_report_is_stable_across_reads(
    demo_fleet: CollectorProcess, expected: Report
) -> None:
    # The pages are compared with a report made at another moment: that only holds
    # because the replayed data lies wholly inside the window.
    again = expected_report(demo_fleet.url)
    assert [v.to_dict() for v in again.engines] == [v.to_dict() for v in expected.engines]


# -- engines without data, the URL, any range of steps --------------------------------


def _app_with_url(
    monkeypatch: pytest.MonkeyPatch, url: str, query: dict[str, str], page: str | None = None
) -> AppTest:
    monkeypatch.setattr(sys, "argv", ["app.py", "--collector", url, "--refresh", "0"])
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params.update(query)
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_range_without_data_still_lists_every_engine_the_collector_knows(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    # A range a day long, years before the replayed data: nothing in it, but the
    # collector knows three engines, and the overview lists them with their status.
    query = {"time": "range", "from": "2020-01-01T00:00Z", "to": "2020-01-02T00:00Z"}
    at = _app_with_url(monkeypatch, demo_fleet.url, query)
    assert at.sidebar.radio[0].value == "range"
    assert [t.value for t in at.sidebar.text_input] == [query["from"], query["to"]]
    caption = at.caption[0].value
    assert "2020-01-01 00:00:00 UTC to 2020-01-02 00:00:00 UTC (range)" in caption
    assert "3 engine(s) known" in caption and "0 with data in the window" in caption
    text = at.warning[0].value
    assert text.startswith("**No data.**")
    assert text.endswith("after the range: move its end later in the sidebar.")
    assert metrics(at)["engines known"] == "3"
    engines = at.table[0].value
    assert sorted(engines.index) == sorted([KV_STARVED, SEQ_CAPPED, AMPLE])
    assert set(engines["verdict"]) == {"no data in the window"}
    assert all(s.split(",")[0] in ("live", "idle", "DOWN") for s in engines["status"])


def _overview_page(engines_json: str, report_json: str, now: float) -> None:
    import io

    import pandas as pd

    from kvscope.advisor import Report
    from kvscope.dashboard._views.overview import render
    from kvscope.dashboard.data import Snapshot
    from kvscope.dashboard.settings import DashboardSettings

    render(
        Snapshot(
            settings=DashboardSettings("http://127.0.0.1:9"),
            since_text="30m",
            since_unix_s=now - 1800,
            until_unix_s=None,
            fetched_unix_s=now,
            report=Report.from_json(report_json),
            engines=pd.read_json(io.StringIO(engines_json), orient="records"),
        )
    )


def test_an_engine_gone_silent_is_listed_down_with_when_it_was_last_seen() -> None:
    t0 = 1_764_600_000.0  # 14:40:00 UTC
    engines = pd.DataFrame(
        [
            {
                "engine_id": "gone:8000:0",
                "pool": "p",
                "max_num_seqs": 8,
                "last_step_unix_s": t0 - 5,
                "last_seen_unix_s": t0,
            }
        ]
    )
    report = Report(
        t0 + 3600 - 1800,
        None,
        engines=[],
        pools=[],
        coverage={"n_engines_known": 1, "latest_step_unix_s": t0 - 5},
    )
    at = AppTest.from_function(
        _overview_page,
        kwargs={
            "engines_json": engines.to_json(orient="records"),
            "report_json": report.to_json(),
            "now": t0 + 3600,
        },
        default_timeout=30,
    ).run()
    assert not at.exception, [e.value for e in at.exception]
    m = metrics(at)
    assert (m["engines known"], m["engines DOWN"], m["engines analyzed"]) == ("1", "1", "0")
    row = at.table[0].value.loc["gone:8000:0"]
    assert row["status"] == "DOWN, last seen 14:40:00 UTC (60 min ago)"
    assert row["verdict"] == "no data in the window"
    assert row["batch / max_num_seqs"] == "– / 8"


def test_the_window_and_the_engine_come_from_the_url(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    at = _app_with_url(monkeypatch, demo_fleet.url, {"window": "1h"})
    assert at.sidebar.selectbox[0].value == "1h"
    assert "(window 1h)" in at.caption[0].value
    at.switch_page("_pages/engine.py")
    at.query_params["engine"] = SEQ_CAPPED
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox[0].value == SEQ_CAPPED
    assert "max_num_seqs 6," in texts(at)


def test_engine_steps_of_the_whole_window_are_sampled_and_say_so(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess
) -> None:
    at = run_app(monkeypatch, demo_fleet.url, page="_pages/engine.py")
    # The per-step view is behind its switch, off on a first load.
    assert "kvscope_steps_span" not in [r.key for r in at.radio]
    at.toggle(key="kvscope_steps_show").set_value(True).run()
    assert at.query_params["steps"] == "1"
    at.radio(key="kvscope_steps_span").set_value("the whole window").run()
    assert not at.exception, [e.value for e in at.exception]
    w = pd.DataFrame(
        demo_fleet.get_json(
            "/v1/windows", params={"engine": KV_STARVED, "since": "0", "format": "columns"}
        )["columns"]
    )
    n = int(w["n_steps"].sum())
    k = -(-n // 5000)
    assert k > 1  # the replayed run has more steps than a chart draws
    body = texts(at)
    assert f"every {k}" in body and f"step of {n:,}" in body
    charts = chart_data(at)
    kv_steps = charts[-1][0]
    assert len(kv_steps) == -(-n // k)
    assert "kv_usage_pct" in kv_steps


def test_latency_page_shows_the_advisors_latency_per_pool(
    monkeypatch: pytest.MonkeyPatch, demo_fleet: CollectorProcess, expected: Report
) -> None:
    from kvscope.advisor.render_latency import ms_or_s

    at = run_app(monkeypatch, demo_fleet.url, "--slo-ttft", "0.5", page="_pages/latency.py")
    no_problem_shown(at)
    assert at.title[0].value == "Latency"
    demo = next(p for p in expected.pools if p.pool == "demo")
    assert demo.latency is not None and demo.latency.n_requests > 0
    measures = at.table[0].value
    assert measures.loc["TTFT", "requests"] == f"{demo.latency.ttft_s.n:,}"
    assert measures.loc["TTFT", "P50"] == ms_or_s(demo.latency.ttft_s.p50)
    assert "TTFT <= 500 ms" in at.table[1].value.index
    specs = chart_specs(at)
    assert specs and all(s["height"] >= 250 for s in specs)
