"""``kvscope advise`` as a subprocess against real collectors fed a real vLLM recording.

The KV-starved run is replayed to end two minutes ago (the session fixture
``kv_starved_collector``): ``--since 30m`` covers it, ``--since 60s`` misses it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvscope.advisor import Report
from kvscope.collector.process import CollectorProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "demo-host:8000:0"


def advise(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("KVSCOPE_COLLECTOR_URL", "KVSCOPE_TOKEN")
    }
    env["COLUMNS"] = "100"
    return subprocess.run(
        [sys.executable, "-m", "kvscope.cli.main", "advise", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def kv_report(
    kv_starved_collector: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("out") / "advice.json"
    res = advise(
        "--collector",
        kv_starved_collector.collector.url,
        "--since",
        "30m",
        "--json",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), res.stdout, out


def test_json_verdict_kv_starved(kv_report: tuple[dict[str, Any], str, Path]) -> None:
    d, text, out = kv_report
    assert d["schema_version"] == 1
    (v,) = d["engines"]
    assert v["engine_id"] == ENGINE and v["pool"] == "demo"
    assert v["bottleneck"] == "kv_cache_bound" and v["saturated"] is True
    assert 5 <= v["knee_concurrency"] <= 16
    assert 1_100 <= v["plateau_tokens_per_s"] <= 1_400
    cap = v["recommended_concurrency_cap"]
    assert isinstance(cap, int) and 5 <= cap <= 16
    assert v["predicted_throughput_fraction_at_cap"] >= 0.85
    assert v["predicted_p99_e2e_s_at_cap"] < 0.5 * v["p99_e2e_s_at_max_load"]
    (pool,) = d["pools"]
    assert pool["pool"] == "demo" and pool["recommended_concurrency_cap"] == cap
    rec = next(r for r in d["recommendations"] if r["kind"] == "concurrency_cap")
    assert d["recommendations"][0] == rec  # the largest expected gain ranks first
    assert f"--max-num-seqs {cap}" in rec["change"]["vllm_flags"]
    # vLLM's admission limit counts running and waiting requests: the cap plus a short queue.
    queued = [
        int(f.split()[1])
        for f in rec["change"]["vllm_flags"]
        if f.startswith("--max-num-queued-reqs ")
    ]
    assert len(queued) == 1 and cap < queued[0] <= cap + max(1, -(-cap // 4)), queued
    assert f"limit_conn vllm_conn {cap};" in rec["change"]["gateway"]["nginx"]
    assert rec["change"]["gateway"]["gateway_api_maxConcurrency"] == cap
    assert rec["tradeoff"].startswith(f"cap {cap}: ")
    assert {"whatif_kv_cache_dtype_fp8"} <= {r["kind"] for r in d["recommendations"]}
    assert d["coverage"]["n_engines_analyzed"] == 1 and d["coverage"]["n_requests"] == 454
    assert d["coverage"]["n_windows"] >= 70
    # The JSON round-trips through the findings types, and --out holds the same report.
    assert Report.from_json(text).to_dict() == d
    assert json.loads(out.read_text()) == d
    assert d["parameters"]["min_routing_loss"] == 0.05
    assert d["parameters"]["imbalance_threshold"] == 1.25


def test_routing_thresholds_reach_the_report(kv_starved_collector: Any) -> None:
    res = advise(
        "--collector",
        kv_starved_collector.collector.url,
        "--since",
        "30m",
        "--json",
        "--min-routing-loss",
        "0.2",
        "--imbalance-threshold",
        "1.5",
    )
    assert res.returncode == 0, res.stderr
    params = json.loads(res.stdout)["parameters"]
    assert params["min_routing_loss"] == 0.2 and params["imbalance_threshold"] == 1.5


def test_terminal_shows_the_verdict_first(
    kv_starved_collector: Any, kv_report: tuple[dict[str, Any], str, Path]
) -> None:
    cap = kv_report[0]["engines"][0]["recommended_concurrency_cap"]
    res = advise("--collector", kv_starved_collector.collector.url)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("pool demo: kv_cache_bound (1 engine)")
    assert f"recommended cap {cap} in flight" in lines[0]
    assert lines[1].strip().startswith(f"{ENGINE}: kv_cache_bound, saturated")
    assert lines[2].strip().startswith("knee ")
    text = res.stdout
    assert f"cap {cap} in flight: " in text and "trade-off: cap" in text
    assert "KV usage" in text  # the bottleneck's evidence follows the verdict
    plot, recs, table = (
        text.index("tok/s vs requests in flight"),
        text.index("Recommendations, ranked"),
        text.index("Findings"),
    )
    assert text.index(lines[0]) < plot < recs < table
    assert f"cap {cap}" in text[plot:recs] and "knee" in text[plot:recs]
    for change in (
        f"--max-num-seqs {cap}",
        f"limit_conn vllm_conn {cap};",
        f"maxConcurrency: {cap}",
        "--kv-cache-dtype fp8",
    ):
        assert change in text[recs:table], change
    assert not res.stderr


def test_absolute_window(kv_starved_collector: Any) -> None:
    since = int(kv_starved_collector.end_at_unix_s - 3600)
    res = advise(
        "--collector", kv_starved_collector.collector.url, "--since", str(since), "--until", "now"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("pool demo: kv_cache_bound")


def test_empty_window_says_where_the_data_is(kv_starved_collector: Any) -> None:
    url = kv_starved_collector.collector.url
    res = advise("--collector", url, "--since", "60s")
    assert res.returncode == 3
    assert not res.stdout
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1
    assert msg.startswith("kvscope advise: no data in the window ")
    assert "(--since 60s)" in msg and url in msg
    m = re.search(r"try --since (\d+)m$", msg)  # a window reaching back to the data
    assert m, msg
    assert int(m.group(1)) * 60 >= time.time() - kv_starved_collector.end_at_unix_s


def test_window_before_the_data_points_at_until(kv_starved_collector: Any) -> None:
    res = advise(
        "--collector",
        kv_starved_collector.collector.url,
        "--since",
        "3h",
        "--until",
        "2h",
        "--json",
    )
    assert res.returncode == 3
    assert json.loads(res.stdout)["coverage"]["n_windows"] == 0  # --json still prints
    assert "after the window: move --until later" in res.stderr


def test_unreachable_collector_exits_2_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    res = advise("--collector", url)
    assert res.returncode == 2
    assert not res.stdout
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"kvscope advise: cannot reach the collector at {url} (")
    assert "kvscope collector" in line and "Traceback" not in res.stderr


def test_token_and_empty_collector(tmp_path: Path) -> None:
    c = CollectorProcess(
        tmp_path / "kvscope.duckdb", token="s3cret", extra_args=["--advise-interval-s", "0"]
    ).start()
    try:
        res = advise("--collector", c.url)
        assert res.returncode == 2
        assert "401" in res.stderr and "--token" in res.stderr
        res = advise("--collector", c.url, "--token", "s3cret")
        assert res.returncode == 3
        assert "knows no engines yet" in res.stderr
    finally:
        c.stop()


def test_bad_arguments_exit_2(kv_starved_collector: Any) -> None:
    for args, expect in (
        (("--since", "yesterday"), "--since: expected unix seconds"),
        (("--cap-fraction", "1.5"), "must be in (0, 1]"),
        (("--imbalance-threshold", "0.5"), "must be >= 1"),
        (("--min-routing-loss", "0"), "must be in (0, 1]"),
        (("--since", "1h", "--until", "2h"), "must be after --since"),
    ):
        res = advise("--collector", kv_starved_collector.collector.url, *args)
        assert res.returncode == 2, args
        assert expect in res.stderr, (args, res.stderr)
