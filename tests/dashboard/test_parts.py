"""The dashboard's parts without a browser: settings, the command line, the attention
order, formatting, the chart series and the demo fleet's relabelling."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import socket
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvscope.advisor import EngineVerdict, Finding, PoolVerdict, Report, Scope
from kvscope.cli import dashboard as cli
from kvscope.dashboard._charts import (
    COUNT_FORMAT,
    bucket_seconds,
    engine_series,
    latency_chart,
    latency_series,
    step_chart,
    step_kv_chart,
    time_chart,
    time_format,
)
from kvscope.dashboard._charts_load import SERIES, hit_rate_chart, load_domain, plateau_chart
from kvscope.dashboard._format import value
from kvscope.dashboard._messages import no_data_message, window_text, window_to_pick
from kvscope.dashboard._shell import stretched_period
from kvscope.dashboard._status import (
    DOWN_S,
    LIVE_S,
    engine_state,
    engines_by_attention,
    pools_by_attention,
    recent,
)
from kvscope.dashboard._steps import every_kth, ordinal, plan_steps, steps_in
from kvscope.dashboard._views.prefix import no_hits_text
from kvscope.dashboard._views.recommendations import change_blocks
from kvscope.dashboard.demo import DEMO_FLEET, relabeled
from kvscope.dashboard.settings import (
    DashboardSettings,
    SettingsError,
    normalize_url,
    parse_settings,
    to_argv,
)
from kvscope.lab.recording import load_recording

# -- settings and command line -----------------------------------------------------------


def test_settings_round_trip_through_the_app_arguments() -> None:
    s = DashboardSettings(
        "http://c:8844", token="t", since="2h", refresh_s=7.5, timeout_s=12.0, pool="p"
    )
    argv = to_argv(s)
    assert "t" not in argv  # the token never goes on a command line
    back = parse_settings(argv, {"KVSCOPE_TOKEN": "t"})
    assert back == s


def test_settings_take_the_collector_and_token_from_the_environment() -> None:
    s = parse_settings([], {"KVSCOPE_COLLECTOR_URL": "c:8844", "KVSCOPE_TOKEN": "x"})
    assert (s.collector_url, s.token, s.since, s.refresh_s) == ("http://c:8844", "x", "30m", 10)
    assert normalize_url("https://c:1/ ") == "https://c:1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "pass --collector URL"),
        (["--collector", "c", "--since", "soon"], "--since: expected unix seconds"),
        (["--collector", "c", "--refresh", "-1"], "expected a duration such as 90s"),
        (["--collector", "c", "--timeout", "0"], "must be longer than 0"),
        (["--collector", "c", "--colour", "red"], "unknown argument(s): --colour red"),
    ],
)
def test_bad_settings_name_the_argument(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_settings(argv, {})


def _args(*argv: str) -> argparse.Namespace:
    from kvscope.cli.main import build_parser

    return build_parser().parse_args(["dashboard", *argv])


def test_the_app_runs_headless_on_loopback_without_the_token_on_its_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, object] = {}

    class FakePopen:
        def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
            seen["cmd"], seen["env"] = cmd, env

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(cli.subprocess, "Popen", FakePopen)
    assert cli.run(_args("--collector", "c:8844", "--token", "s3cret", "--port", "8600")) == 0
    cmd = seen["cmd"]
    assert isinstance(cmd, list)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == str(cli.APP)
    opts = dict(zip(cmd[5 : cmd.index("--")][::2], cmd[5 : cmd.index("--")][1::2], strict=True))
    assert opts["--server.address"] == "127.0.0.1"
    assert opts["--server.port"] == "8600"
    assert opts["--server.headless"] == "true"
    assert opts["--browser.gatherUsageStats"] == "false"
    app_argv = cmd[cmd.index("--") + 1 :]
    assert parse_settings(app_argv, {}).collector_url == "http://c:8844"
    assert "s3cret" not in " ".join(cmd)
    env = seen["env"]
    assert isinstance(env, dict) and env["KVSCOPE_TOKEN"] == "s3cret"


def test_missing_extra_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "streamlit" else real(name, *a),
    )
    assert cli.run(_args("--collector", "c:8844")) == 2
    err = capsys.readouterr().err
    assert "streamlit is not installed" in err
    assert "pip install 'kvscope[dashboard]'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "pass --collector URL"),
        (("--collector", "c", "--since", "later"), "--since: expected unix seconds"),
        (("--demo", "--collector", "c"), "--demo starts its own collector"),
        (("--collector", "c", "--port", "70000"), "is not a TCP port"),
    ],
)
def test_cli_refuses_bad_arguments(
    argv: tuple[str, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KVSCOPE_COLLECTOR_URL", raising=False)
    assert cli.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_a_busy_port_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[object] = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: started.append(a))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.run(_args("--collector", "c:8844", "--port", str(port))) == 2
    out, err = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in err
    assert "pass another --port" in err
    assert not out and not started  # no "reading collector ..." line, no app


# -- attention order and status ------------------------------------------------------------


def _verdict(
    eid: str, pool: str, bottleneck: str, saturated: bool, thrash: bool = False
) -> EngineVerdict:
    return EngineVerdict(
        engine_id=eid,
        pool=pool,
        bottleneck=bottleneck,
        saturated=saturated,
        preemption_thrash=thrash,
    )


def test_pools_needing_attention_come_first() -> None:
    engines = [
        _verdict("a:1:0", "calm", "not_saturated", False),
        _verdict("b:1:0", "capped", "max_num_seqs_bound", True),
        _verdict("c:1:0", "kv", "kv_cache_bound", True),
        _verdict("d:1:0", "kv", "not_saturated", False),
        _verdict("e:1:0", "thrash", "kv_cache_bound", True, thrash=True),
        _verdict("f:1:0", "skewed", "not_saturated", False),
        _verdict("g:1:0", "skewed", "not_saturated", False),
    ]
    pools = [
        PoolVerdict(
            pool=p, engine_ids=[v.engine_id for v in engines if v.pool == p], bottlenecks={}
        )
        for p in ("calm", "capped", "kv", "skewed", "thrash")
    ]
    imbalance = Finding(
        kind="load_imbalance", scope=Scope(pool="skewed"), summary="uneven", severity="warning"
    )
    report = Report(None, None, engines=engines, pools=pools, findings=[imbalance])
    ranked = pools_by_attention(report)
    assert [pv.pool for pv, _ in ranked] == ["thrash", "kv", "capped", "skewed", "calm"]
    assert ranked[0][1].text == "preemption thrash, saturated, KV-bound"
    assert ranked[3][1].text == "load imbalance"
    assert ranked[4][1].text == "ok"
    assert [v.engine_id for v in engines_by_attention(report)] == [
        "e:1:0",
        "c:1:0",
        "d:1:0",
        "b:1:0",
        "f:1:0",
        "g:1:0",
        "a:1:0",
    ]


def test_engine_state_live_idle_down_with_the_last_seen_time() -> None:
    t0 = 1_764_600_000.0  # 2025-12-01 14:40:00 UTC
    assert engine_state(t0, t0, t0 + LIVE_S).text == "live"
    # Heard from (a heartbeat) 10 s ago, its newest step 12 min ago: idle, not down.
    idle = engine_state(t0, t0 + 12 * 60 - 10, t0 + 12 * 60)
    assert (idle.state, idle.text) == ("idle", "idle, last step 12 min ago")
    # Not heard from for DOWN_S: DOWN, with when it was last seen.
    down = engine_state(t0, t0 + 5, t0 + 5 + DOWN_S + 1)
    assert down.state == "DOWN"
    assert down.text == "DOWN, last seen 14:40:05 UTC (61 s ago)"
    # Last seen more than a day ago: the date is given.
    old = engine_state(t0, None, t0 + 3 * 86400)
    assert old.text == "DOWN, last seen 2025-12-01 14:40:00 UTC (3.0 d ago)"
    assert engine_state(None, t0, t0 + 1).text == "no steps yet"
    assert engine_state(None, None, t0).text == "DOWN, never seen"
    assert engine_state(math.nan, t0, t0 + 1).state == "no steps yet"


def test_the_last_minute() -> None:
    w = pd.DataFrame(
        {
            "ts_s": [0, 1, 2, 100, 101, 103],
            "batch_mean": [9, 9, 9, 2, 4, 6],
            "kv_usage_mean": [1, 1, 1, 0.2, 0.4, 0.6],
            "preemptions": [5] * 6,
            "generation_tokens": [100] * 6,
            "waiting_mean": [0] * 6,
        }
    )
    r = recent(w, seconds=60)
    # The last 60 s hold seconds 100, 101 and 103: a 4-second span, 102 idle.
    assert r.seconds == 4
    assert r.batch_mean == pytest.approx(4.0)
    assert r.kv_usage_mean == pytest.approx(0.4)
    assert r.preemptions_per_s == pytest.approx(15 / 4)
    assert r.gen_tokens_per_s == pytest.approx(300 / 4)
    assert r.end_unix_s == 104.0


# -- formatting and the change to copy -------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "v", "text"),
    [
        ("plateau_tokens_per_s", 1285.4, "1,285 tok/s"),
        ("preemptions_per_s", 8.24, "8.2/s"),
        ("steps_per_s_plateau", 112.0, "112.0/s"),
        ("tokens_per_step_median", 15.3, "15.3"),
        ("p99_e2e_s", 1.584, "1.58 s"),
        ("kv_usage_median", 0.953, "95%"),
        ("throughput_fraction", 0.97, "97%"),
        ("mean_ttft_change_s", -0.25, "-250 ms"),
        ("step_ms", 12.17, "12.2 ms"),
        ("feasible", True, "yes"),
        ("p99_e2e_s", math.nan, "–"),
        ("n_windows", 31, "31"),
    ],
)
def test_values_read_like_the_terminal_view(key: str, v: object, text: str) -> None:
    assert value(key, v) == text


def test_every_part_of_a_change_becomes_a_block_to_copy() -> None:
    nginx = {
        "config": "server a:1 max_conns=8;",
        "format": "nginx",
        "scope": "replica",
        "excess": "the next one gets 502",
        "p99_e2e_s": 1.2,
        "source": "nginx.org",
    }
    vllm = {"config": "--max-num-seqs 8", "format": "bash", "scope": "replica", "excess": "503"}
    change = {
        "concurrency_cap": 8,
        "vllm_flags": ["--max-num-seqs 8", "--max-num-queued-reqs 10"],
        "gateway": {
            "vllm": vllm,
            "nginx": nginx,
            "nginx_upstream": "upstream p { least_conn; server a:1; }",
        },
        "per_engine_caps": {"a:1:0": 8, "b:1:0": 6},
        "router_policy": "prefix-aware",
        "production_stack": "--routing-logic prefixaware",
        "something_new": {"k": 1},
    }
    blocks = change_blocks(change)
    assert blocks == [
        ("vLLM flags", "--max-num-seqs 8 --max-num-queued-reqs 10", "bash"),
        ("vLLM flags: what happens to the excess", "503", "text"),
        ("nginx (replica)", "server a:1 max_conns=8;", "nginx"),
        ("nginx: what happens to the excess", "the next one gets 502", "text"),
        ("nginx upstream", "upstream p { least_conn; server a:1; }", "nginx"),
        ("cap per engine (in flight)", "a:1:0: 8\nb:1:0: 6", "yaml"),
        ("router policy", "prefix-aware", "text"),
        ("vLLM production-stack router", "--routing-logic prefixaware", "bash"),
        ("something new", '{\n  "k": 1\n}', "text"),
    ]


# -- chart series -----------------------------------------------------------------------------


def test_engine_series_bucket_long_windows_and_keep_rates_per_second() -> None:
    assert bucket_seconds(600) == 1
    assert bucket_seconds(3600) == 5
    assert bucket_seconds(7 * 86400) == 3600
    n = 3600
    w = pd.DataFrame(
        {
            "ts_s": range(n),
            "batch_mean": [4.0] * n,
            "batch_max": [6] * n,
            "kv_usage_mean": [0.5] * n,
            "kv_blocks_max": [30] * n,
            "waiting_mean": [1.0] * n,
            "waiting_max": [3] * n,
            "preemptions": [2] * n,
            "generation_tokens": [100] * n,
            "prompt_tokens": [50] * n,
            "prefix_queries": [40] * n,
            "prefix_hits": [10] * n,
        }
    )
    s = engine_series(w, num_gpu_blocks=48)
    assert len(s) == n // 5 and set(s["bucket_s"]) == {5}
    assert s["gen_tokens_per_s"].tolist() == pytest.approx([100.0] * len(s))
    assert s["preemptions_per_s"].tolist() == pytest.approx([2.0] * len(s))
    assert s["prefix_hit_rate"].tolist() == pytest.approx([0.25] * len(s))
    assert s["kv_blocks_mean"].tolist() == pytest.approx([24.0] * len(s))
    assert s["batch_max"].max() == 6


def test_windows_longer_than_a_second_hold_rates_per_second() -> None:
    """Windows read from Prometheus at 15 s resolution carry per-second rates: the series
    and the last minute keep them per second instead of dividing by the window again."""
    n = 40  # 10 minutes of 15-second windows
    w = pd.DataFrame(
        {
            "ts_s": [1000.0 + 15 * i for i in range(n)],
            "batch_mean": [4.0] * n,
            "kv_usage_mean": [0.5] * n,
            "waiting_mean": [1.0] * n,
            "preemptions": [2.0] * n,
            "generation_tokens": [100.0 + (i % 2) * 20 for i in range(n)],
            "prompt_tokens": [50.0] * n,
            "prefix_queries": [40.0] * n,
            "prefix_hits": [10.0] * n,
        }
    )
    s = engine_series(w, num_gpu_blocks=48, window_s=15)
    assert set(s["bucket_s"]) == {15} and len(s) == n
    assert s["gen_tokens_per_s"].mean() == pytest.approx(110.0)
    assert s["preemptions_per_s"].tolist() == pytest.approx([2.0] * n)
    r = recent(w, seconds=60, window_s=15)
    assert r.seconds == 60  # four windows of 15 s
    assert r.gen_tokens_per_s == pytest.approx(110.0)
    assert r.preemptions_per_s == pytest.approx(2.0)
    assert r.end_unix_s == 1000.0 + 15 * n


def test_latency_series_are_percentiles_per_bucket() -> None:
    r = pd.DataFrame(
        {
            "finished_unix_s": [0.5 + i * 0.01 for i in range(100)],
            "ttft_s": [i / 100 for i in range(100)],
            "e2e_s": [1.0] * 100,
        }
    )
    lat = latency_series(r)
    ttft = lat[lat["metric"] == "TTFT P50"]["seconds"].tolist()
    assert ttft == pytest.approx([0.495])
    assert lat[lat["metric"] == "e2e P99"]["seconds"].tolist() == pytest.approx([1.0])
    assert set(lat["n"]) == {100}


# -- demo fleet ---------------------------------------------------------------------------------


def test_demo_fleet_relabels_each_recording_as_its_own_engine() -> None:
    assert len({e.engine_id for e in DEMO_FLEET}) == len(DEMO_FLEET)
    for e in DEMO_FLEET:
        rec = load_recording(e.path)
        out = relabeled(rec, e)
        assert {b["engine_id"] for b in out.batches} == {e.engine_id}
        hellos = [b["hello"] for b in out.batches if b.get("hello")]
        assert hellos and all(
            h["engine_id"] == e.engine_id and h["pool"] == e.pool and h["port"] == e.port
            for h in hellos
        )
        # The original is untouched and every step kept.
        assert {b["engine_id"] for b in rec.batches} == {"demo-host:8000:0"}
        assert sum(len(b["steps"]["ts_unix_s"]) for b in out.batches) == sum(
            len(b["steps"]["ts_unix_s"]) for b in rec.batches
        )


def test_the_windows_plotted_are_those_analysed_one_resolution_per_engine() -> None:
    from kvscope.dashboard.data import _KeepingSource

    t0 = 1_764_600_000.0
    minute = {"n_seconds": 40, "n_steps": 2_000, "generation_tokens": 16_000, "batch_mean": 8.0}
    kept = _KeepingSource(None)  # type: ignore[arg-type]
    kept.frames["windows"] = pd.DataFrame(
        {"engine_id": ["a"] * 30 + ["b"] * 60, "ts_s": [t0 + 600 + i for i in range(90)]}
    )
    kept.frames["minute_windows"] = pd.DataFrame(
        [dict(minute, engine_id=e, ts_s=t0 + 60 * k) for e in "ab" for k in range(10)]
    )
    read = _empty_report(t0, t0 + 700, t0 + 690)
    read.coverage["engines_from_minutes"] = ["a"]
    w = kept.analysed_windows(read)
    # the advisor read engine a from its 10 minutes alone, b from its 60 seconds
    assert w.groupby("engine_id").size().to_dict() == {"a": 10, "b": 60}
    assert set(w.loc[w["engine_id"] == "a", "resolution_s"]) == {60.0}
    assert w.loc[w["engine_id"] == "a", "generation_tokens"].tolist() == [400.0] * 10
    # no engine read from minutes: the seconds read
    assert kept.analysed_windows(_empty_report(t0, t0 + 700, t0 + 690)) is kept.frames["windows"]


# -- messages in the page's terms ----------------------------------------------------------


def _empty_report(since: float | None, until: float | None, latest: float | None) -> Report:
    return Report(
        since,
        until,
        engines=[],
        pools=[],
        coverage={"n_engines_known": 1, "latest_step_unix_s": latest},
    )


def test_no_data_messages_name_the_sidebar_not_a_flag() -> None:
    now = 1_764_600_000.0
    # The newest step 37 min ago, a 30m window: the 1h window reaches it.
    text = no_data_message(
        _empty_report(now - 1800, None, now - 37 * 60), "http://c", "W", now_unix_s=now
    )
    assert text.endswith(": pick the 1h window (or longer) in the sidebar")
    assert "(37 min ago)" in text
    # Older than the longest window: a range.
    text = no_data_message(
        _empty_report(now - 1800, None, now - 30 * 86400), "http://c", "W", now_unix_s=now
    )
    assert text.endswith("set a range around it in the sidebar (Time: range)")
    # A range that ends before the newest step.
    text = no_data_message(
        _empty_report(now - 7200, now - 3600, now - 60),
        "http://c",
        "W",
        now_unix_s=now,
        ranged=True,
    )
    assert text.endswith("after the range: move its end later in the sidebar")
    # A range before the oldest 1-second window the collector holds: aged out.
    aged = _empty_report(now - 30 * 86400, now - 29 * 86400, now - 60)
    aged.coverage["oldest_window_unix_s"] = now - 15 * 86400
    text = no_data_message(aged, "http://c", "W", now_unix_s=now, ranged=True)
    assert "the collector holds 1-second windows from" in text
    assert text.endswith("in the sidebar") and "move its end later" not in text
    for t in (text,):
        assert "--" not in t
    assert window_text(now - 1800, None, "30m").endswith("to now (window 30m)")
    assert window_to_pick(8 * 60) == "15m"
    assert window_to_pick(30 * 86400) is None


def _strings(tree: ast.AST) -> list[str]:
    """The string literals of a module, its docstrings left out."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_the_pages_name_their_own_controls_not_the_time_flags() -> None:
    # What a page tells the user to do about the time names the sidebar; only the
    # restart instructions (how the dashboard is started) name a flag.
    root = Path(__file__).resolve().parents[2] / "dashboard"
    for path in [*root.glob("_*.py"), *root.glob("_views/*.py")]:
        for text in _strings(ast.parse(path.read_text())):
            for flag in ("--since", "--until", "--raw-retention-s"):
                assert flag not in text, (path.name, text)


# -- charts: height, ticks, time, legends -------------------------------------------------


def _layers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    out = [spec]
    for child in spec.get("layer", []):
        out += _layers(child)
    return out


def _windows(n: int = 120) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "ts_s": [1_764_600_000 + i for i in range(n)],
            "batch_mean": [3.0] * n,
            "batch_max": [4.0] * n,
            "kv_usage_mean": [0.5] * n,
            "waiting_mean": [1.0] * n,
            "waiting_max": [2.0] * n,
            "preemptions": [0] * n,
            "generation_tokens": [100] * n,
            "prompt_tokens": [10] * n,
            "prefix_queries": [50] * n,
            "prefix_hits": [0] * n,
        }
    )


def test_time_charts_are_tall_in_utc_on_a_24_hour_clock_with_integer_counts() -> None:
    s = engine_series(_windows(), 48)
    chart = time_chart(
        s,
        {"batch_mean": "batch (mean)", "batch_max": "batch (max)"},
        "Batch",
        "running requests",
        [(6, "max_num_seqs 6")],
        y_format=COUNT_FORMAT,
    ).to_dict()
    assert chart["height"] >= 250
    assert chart["autosize"] == {"type": "fit-x", "contains": "padding"}
    lines = next(lyr for lyr in _layers(chart) if lyr.get("mark", {}).get("type") == "line")
    x, y = lines["encoding"]["x"], lines["encoding"]["y"]
    assert x["scale"]["type"] == "utc" and x["title"] == "time (UTC)"
    assert x["axis"]["format"] == "%H:%M:%S"  # 24-hour
    assert y["axis"] == {"format": ",d", "tickMinStep": 1}
    assert "legend" in lines["encoding"]["color"]
    assert time_format(3 * 86400) == "%d %b %H:%M"
    lat = latency_chart(
        latency_series(pd.DataFrame({"finished_unix_s": [1.0], "e2e_s": [1.0], "ttft_s": [0.1]}))
    )
    assert lat.to_dict()["height"] >= 250


def test_plateau_chart_draws_the_p99_on_the_load_axis_with_a_legend_and_labels_above() -> None:
    curve = {"load": [1, 2, 4, 8, 16], "gen_tokens_per_s": [100, 200, 380, 400, 400]}
    curve["gen_fit"] = [100, 195, 370, 400, 401]
    lat = {"load": [1, 2, 4, 8, 16], "e2e_s_p99": [1, 1, 1.2, 2, 4], "ttft_s_p99": [0.1] * 5}
    spec = plateau_chart(
        curve, lat, knee=7.0, plateau=400.0, cap=8.0, domain=load_domain(curve, lat, [7, 8])
    ).to_dict()
    assert spec["height"] >= 250
    assert spec["resolve"]["scale"]["y"] == "independent"  # tok/s left, seconds right
    layers = _layers(spec)
    xs = {
        json.dumps(lyr["encoding"]["x"]["scale"])
        for lyr in layers
        if "x" in lyr.get("encoding", {}) and "scale" in lyr["encoding"]["x"]
    }
    assert len(xs) == 1  # one load axis for throughput and latency
    colors = [lyr["encoding"]["color"] for lyr in layers if "color" in lyr.get("encoding", {})]
    assert colors and all(c["scale"]["domain"] == list(SERIES) for c in colors)
    texts = [lyr for lyr in layers if lyr.get("mark", {}).get("type") == "text"]
    knee_cap = [t for t in texts if "field" in t["encoding"]["x"]]
    # The knee's and cap's labels sit above the plot (y < 0), where no point is, and
    # point away from each other.
    assert len(knee_cap) == 2
    assert all(t["encoding"]["y"]["value"] < 0 for t in knee_cap)
    assert {t["mark"]["align"] for t in knee_cap} == {"left", "right"}


def test_hit_rate_chart_labels_a_zero_rate_and_says_there_were_no_hits() -> None:
    frame = {"engine_id": ["a:1:0", "b:1:0"], "hit_rate": [0.0, 0.0]}
    frame |= {"prefix_queries": [500, 700], "prefix_hits": [0, 0]}
    spec = hit_rate_chart(frame).to_dict()
    assert spec["height"] >= 250
    data = [d for d in spec["datasets"].values() if d and "label" in d[0]]
    assert [r["label"] for r in data[0]] == ["0%", "0%"]
    assert no_hits_text(frame).startswith("No prefix-cache hits in this window: 0% on every")
    assert "1,200 prompt tokens" in no_hits_text(frame)
    frame["prefix_hits"] = [0, 10]
    assert no_hits_text(frame) == ""
    assert no_hits_text({"engine_id": ["a"], "prefix_queries": [0]}).startswith(
        "No prefix-cache lookups"
    )


# -- per-step view ---------------------------------------------------------------------------


def test_step_plan_reads_all_then_every_kth() -> None:
    # 100 s with 120 steps each: 12,000 steps.
    w = pd.DataFrame({"ts_s": [1000 + i for i in range(100)], "n_steps": [120] * 100})
    assert steps_in(w, 1000, 1100) == 12_000
    assert steps_in(w, 1050.5, 1060) == 10 * 120  # seconds 1050..1059, overlapping whole
    small = plan_steps(w, 1090, 1100)
    assert (small.n_steps, small.k, small.text) == (1200, 1, "all 1,200 steps")
    big = plan_steps(w, 1000, 1100, max_plotted=5000)
    assert big.k == 3
    assert big.text == "every 3rd step of 12,000"
    steps = pd.DataFrame({"ts_unix_s": [float(i) for i in range(10)]})
    assert every_kth(steps, 3)["ts_unix_s"].tolist() == [0.0, 3.0, 6.0, 9.0]
    assert [ordinal(k) for k in (1, 2, 3, 4, 11, 12, 13, 21, 22, 111)] == [
        "1st",
        "2nd",
        "3rd",
        "4th",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
        "111th",
    ]


def test_step_charts_show_requests_and_kv_usage_per_step() -> None:
    steps = pd.DataFrame(
        {
            "ts_unix_s": [1_764_600_000 + i / 100 for i in range(50)],
            "batch_size": [5] * 50,
            "waiting": [1] * 50,
            "kv_usage_ratio": [0.25] * 50,
            "kv_blocks_used": [12] * 50,
        }
    )
    req = step_chart(steps, 6.0, subtitle="every 2nd step of 100").to_dict()
    kv = step_kv_chart(steps).to_dict()
    assert req["height"] >= 250 and kv["height"] >= 250
    assert req["title"]["subtitle"] == "every 2nd step of 100"
    assert kv["encoding"]["y"]["scale"]["domain"] == [0, 100]
    (rows,) = [d for d in kv["datasets"].values() if d and "kv_usage_pct" in d[0]]
    assert {r["kv_usage_pct"] for r in rows} == {25.0}


@pytest.mark.parametrize(
    ("period", "read", "want"),
    [
        (5.0, 0.0, 5.0),  # no read yet
        (5.0, 0.7, 5.0),  # the demo fleet's read: well inside the refresh
        (5.0, 1.25, 5.0),  # exactly a quarter
        (5.0, 1.3, 10.0),
        (5.0, 9.0, 40.0),  # a read of 9 s: every 40 s, never busy for good
        (1680.0, 9.0, 1680.0),  # a 7-day window is read rarely anyway
    ],
)
def test_a_slow_read_stretches_the_refresh_period(period: float, read: float, want: float) -> None:
    got = stretched_period(period, read)
    assert got == want
    assert got >= 4 * read and got >= period
    # Reads of about the same length keep the period (and the cache key) still.
    assert stretched_period(period, read * 1.05) in (got, 2 * got)


def test_a_drag_across_the_time_axis_is_a_range_to_zoom_to() -> None:
    from kvscope.dashboard._window import utc_iso, zoom_range

    t0 = 1_764_590_400.0  # 2025-12-01 12:00:00 UTC
    ms = {"zoom": {"time": [(t0 + 90) * 1000, t0 * 1000]}}  # Vega's epoch milliseconds
    assert zoom_range(ms) == (t0, t0 + 90)
    iso = {"zoom": {"time": ["2025-12-01T12:00:00.000Z", "2025-12-01T12:01:30.000Z"]}}
    assert zoom_range(iso) == (t0, t0 + 90)
    assert zoom_range({"zoom": {"time": [t0 * 1000, t0 * 1000 + 500]}}) is None  # a click
    for nothing in (None, {}, {"zoom": {}}, {"zoom": {"time": [1.0]}}, {"zoom": {"x": [1, 2]}}):
        assert zoom_range(nothing) is None
    assert utc_iso(t0 + 5.7) == "2025-12-01T12:00:05Z"


def test_time_charts_carry_the_zoom_interval_only_when_asked() -> None:
    s = pd.DataFrame(
        {"time": pd.to_datetime([1_764_590_400 + i for i in range(5)], unit="s", utc=True)}
    ).assign(a=[1.0, 2.0, 3.0, 4.0, 5.0])
    spec = time_chart(s, {"a": "a"}, "A", "x", zoom=True).to_dict()
    params = [p for layer in spec.get("layer", [spec]) for p in layer.get("params", [])]
    params += spec.get("params", [])
    zoom = [p for p in params if p.get("name") == "zoom"]
    assert zoom and zoom[0]["select"] == {"type": "interval", "encodings": ["x"]}
    plain = time_chart(s, {"a": "a"}, "A", "x").to_dict()
    assert "zoom" not in str(plain.get("params", "")) + str(plain.get("layer", ""))
