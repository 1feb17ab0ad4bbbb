"""``kvscope advise`` as a subprocess against real collectors fed a real vLLM recording.

The KV-starved run is replayed to end two minutes ago (the session fixture
``kv_starved_collector``): ``--since 30m`` covers it, ``--since 60s`` misses it. Its
stdout is a pipe, as under cron, CI or ``| less``: plain text, unwrapped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvscope import __version__
from kvscope.advisor import Recommendation, Report
from kvscope.advisor.findings import JSON_SCHEMA_PATH
from kvscope.advisor.render import RECOMMENDATIONS_HEADING, _change_rows
from kvscope.collector.process import CollectorProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "demo-host:8000:0"


def advise(*args: str, columns: str | None = "100") -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KVSCOPE_COLLECTOR_URL", "KVSCOPE_TOKEN", "COLUMNS")
    }
    if columns is not None:
        env["COLUMNS"] = columns
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
    # Throughput gains, then latency cuts (the cap's), each group by size; never mixed.
    kinds = [r["gain_kind"] for r in d["recommendations"]]
    assert rec["gain_kind"] == "latency" and kinds == sorted(
        kinds, key=("throughput", "latency", "cost").index
    )
    latency = [r for r in d["recommendations"] if r["gain_kind"] == "latency"]
    assert latency[0] == rec  # the largest latency cut of its group
    for kind in set(kinds):
        gains = [r["expected_gain"] for r in d["recommendations"] if r["gain_kind"] == kind]
        assert gains == sorted(gains, reverse=True), (kind, gains)
    assert f"--max-num-seqs {cap}" in rec["change"]["vllm_flags"]
    # vLLM's admission limit counts running and waiting requests: the cap plus a short queue.
    queued = [
        int(f.split()[1])
        for f in rec["change"]["vllm_flags"]
        if f.startswith("--max-num-queued-reqs ")
    ]
    assert len(queued) == 1 and cap < queued[0] <= cap + max(1, -(-cap // 4)), queued
    # A pool of one replica: its cap per server and for the pool, the excess rejected with 503.
    nginx = rec["change"]["gateway"]["nginx"]
    assert f"server demo-host:8000 max_conns={cap};" in nginx["config"]
    assert f"limit_conn vllm_demo_inflight {cap};" in nginx["config"]
    assert "503" in nginx["excess"] and nginx["p99_e2e_s"] == v["predicted_p99_e2e_s_at_cap"]
    assert "maxConcurrency" not in json.dumps(rec["change"])
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
        text.index("Recommendations: "),
        text.index("Findings"),
    )
    assert text.index(lines[0]) < plot < recs < table
    assert f"cap {cap}" in text[plot:recs] and "knee" in text[plot:recs]
    for change in (
        f"--max-num-seqs {cap}",
        f"limit_conn vllm_demo_inflight {cap};",
        f"--max-concurrent-requests {cap}",
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


# -- output that pipes ---------------------------------------------------------------


def test_piped_text_is_unwrapped_and_unpadded(
    kv_starved_collector: Any, kv_report: tuple[dict[str, Any], str, Path]
) -> None:
    """Piped (no COLUMNS, as under cron), every sentence, summary and snippet of the JSON
    report stands whole on one line, and no line ends in spaces."""
    d = kv_report[0]
    res = advise("--collector", kv_starved_collector.collector.url, columns=None)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) > 40
    assert [ln for ln in lines if ln != ln.rstrip()] == []
    stripped = {ln.strip() for ln in lines}
    (v,) = d["engines"]
    rec = next(r for r in d["recommendations"] if r["kind"] == "concurrency_cap")
    why = next(f for f in d["findings"] if f["kind"] == "bottleneck")
    for sentence in (v["headroom"], f"trade-off: {rec['tradeoff']}", f"why: {why['summary']}"):
        assert sentence in stripped, sentence  # the verdict's sentences: one line each
    assert len(f"why: {why['summary']}") > 100  # long enough that a wrap would split it
    findings = lines[lines.index("Findings") + 1 :]
    assert len(findings) == len(d["findings"])
    for line, f in zip(findings, d["findings"], strict=True):
        assert line.startswith(f"- {f['kind']} [") and line.endswith(f": {f['summary']}")
    n_snippets = 0
    for r in d["recommendations"]:
        for _label, text in _change_rows(Recommendation.from_dict(r).change):
            for snippet_line in str(text).splitlines():
                assert snippet_line.strip() in stripped, snippet_line  # never split
                n_snippets += 1
    assert " ".join(rec["change"]["vllm_flags"]) in stripped
    assert n_snippets > 10


def test_markdown_fences_every_snippet(kv_starved_collector: Any) -> None:
    res = advise("--collector", kv_starved_collector.collector.url, "--format", "markdown")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert text.startswith("# kvscope advise\n\n## Verdict\n\n- pool demo: kv_cache_bound")
    assert f"## {RECOMMENDATIONS_HEADING}" in text and "## Findings" in text
    assert text.count("```") % 2 == 0
    flags = re.search(r"- vLLM flags:\n\n\s+```\n\s+(--max-num-seqs \d+[^\n]*)\n\s+```", text)
    assert flags, text
    assert [ln for ln in text.splitlines() if ln != ln.rstrip()] == []


def test_json_says_when_by_what_and_from_where(
    kv_starved_collector: Any, kv_report: tuple[dict[str, Any], str, Path]
) -> None:
    d, _, out = kv_report
    schema = json.loads(JSON_SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(d, schema)
    jsonschema.validate(json.loads(out.read_text()), schema)
    assert abs(d["generated_unix_s"] - time.time()) < 300
    assert d["kvscope_version"] == __version__
    assert d["source"] == {"kind": "collector", "url": kv_starved_collector.collector.url}
    ids = [r["id"] for r in d["recommendations"]]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"rec-[0-9a-f]{12}", i) for i in ids)
    # The same advice on the same data gets the same ids in another run, by another
    # window: they come from kind, scope and change only.
    since = str(int(kv_starved_collector.end_at_unix_s - 1800))
    res = advise("--collector", kv_starved_collector.collector.url, "--since", since, "--json")
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert [r["id"] for r in again["recommendations"]] == ids
    assert again["generated_unix_s"] >= d["generated_unix_s"]


@pytest.mark.parametrize("since", ["-30m", "now-30m", "30m", "0h30m"])
def test_every_way_of_saying_thirty_minutes_ago(kv_starved_collector: Any, since: str) -> None:
    res = advise(
        "--collector", kv_starved_collector.collector.url, "--since", since, "--until", "-1m"
    )
    assert res.returncode == 0, res.stderr
    assert f"(--since {since} --until -1m)" in res.stdout


def test_an_iso_window(kv_starved_collector: Any) -> None:
    end = time.gmtime(kv_starved_collector.end_at_unix_s + 60)
    start = time.gmtime(kv_starved_collector.end_at_unix_s - 3600)
    res = advise(
        "--collector",
        kv_starved_collector.collector.url,
        "--since",
        time.strftime("%Y-%m-%dT%H:%M:%SZ", start),
        "--until",
        time.strftime("%Y-%m-%dT%H:%M:%SZ", end),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["coverage"]["n_requests"] == 454


def test_typos_get_a_suggestion_not_a_guess(kv_starved_collector: Any) -> None:
    url = kv_starved_collector.collector.url
    res = advise("--collector", url, "--sinc", "7d")  # argparse alone takes it for --since
    assert res.returncode == 2 and not res.stdout
    assert "unrecognized arguments: --sinc 7d (--sinc: did you mean --since?)" in res.stderr
    res = advise("--colector", url)
    assert res.returncode == 2 and "did you mean --collector?" in res.stderr


class _Answer(BaseHTTPRequestHandler):
    """Answers every GET with one body, as a server that is not the collector would."""

    body = b""
    content_type = "text/html"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def _streamlit_page() -> bytes:
    import streamlit

    return (Path(streamlit.__file__).parent / "static" / "index.html").read_bytes()


@pytest.fixture()
def not_a_collector(request: pytest.FixtureRequest) -> Iterator[str]:
    body, content_type = request.param
    handler = type("H", (_Answer,), {"body": body, "content_type": content_type})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("not_a_collector", "what"),
    [
        ((_streamlit_page(), "text/html"), "an HTML page: looks like the kvscope dashboard"),
        ((b'{"status":"success","data":[]}', "application/json"), "JSON, but not the collector's"),
    ],
    indirect=["not_a_collector"],
)
def test_a_url_that_is_not_a_collector_is_named(not_a_collector: str, what: str) -> None:
    """The dashboard's port (Streamlit answers every path with its page) or another JSON
    API: said as such, not as a JSON parse error."""
    res = advise("--collector", not_a_collector)
    assert res.returncode == 2 and not res.stdout
    (line,) = res.stderr.splitlines()
    assert line.startswith(
        f"kvscope advise: {not_a_collector} answered but is not a kvscope collector ({what}"
    ), line
    assert "Expecting value" not in line


def test_https_on_a_plain_collector_says_use_http(kv_starved_collector: Any) -> None:
    plain = kv_starved_collector.collector.url
    res = advise("--collector", plain.replace("http://", "https://"))
    assert res.returncode == 2 and not res.stdout
    (line,) = res.stderr.splitlines()
    assert line.startswith("kvscope advise: https:// on a plain-HTTP collector: ")
    assert f"use {plain}" in line and "SSL" not in line


def test_slo_targets_reach_the_latency_blocks(kv_starved_collector: Any) -> None:
    url = kv_starved_collector.collector.url
    res = advise("--collector", url, "--since", "30m", "--json", "--slo-ttft", "0.5")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    jsonschema.validate(d, json.loads(JSON_SCHEMA_PATH.read_text()))
    assert d["parameters"]["slo_ttft_s"] == 0.5
    (v,) = d["engines"]
    slo = v["latency"]["slo"]
    assert set(slo) == {"ttft", "all"} and slo["ttft"]["target_s"] == 0.5
    assert slo["ttft"]["n"] == v["latency"]["ttft_s"]["n"] > 0
    text = advise("--collector", url, "--since", "30m", "--slo-ttft", "0.5")
    share = f"{slo['ttft']['share']:.1%}"
    assert f"SLO attainment: TTFT <= 500 ms: {share}" in text.stdout
