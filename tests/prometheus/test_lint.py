"""``kvscope lint``: a dashboard and rules written for old vLLM names, checked against the
real vLLM 0.32 scrape (file, live URL, Prometheus); kvscope's own dashboard and alerts
checked against a real collector's /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _promfleet import Fleet

from kvscope.cli.lint import Exposure, LintError, check, load_queries
from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording, replay

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
FIXTURE = ROOT / "tests" / "fixtures" / "vllm_metrics_sample.txt"
DASHBOARD = DATA / "old_vllm_dashboard.json"
RULES = DATA / "old_vllm_rules.yml"
DEPLOY_DASHBOARD = ROOT / "deploy" / "grafana" / "kvscope.json"
DEPLOY_RULES = ROOT / "deploy" / "prometheus" / "kvscope-alerts.yml"

#: (where, kind, subject, fix contains) of every broken reference in the old dashboard.
DASHBOARD_PROBLEMS = {
    ("variable $kv_models", "renamed", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    (
        "panel 'KV cache usage' [A]",
        "renamed",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
    ),
    (
        "panel 'Token throughput' [A]",
        "missing_total",
        "vllm:prompt_tokens",
        "vllm:prompt_tokens_total",
    ),
    (
        "panel 'Prefix cache hit rate' [A]",
        "renamed",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
    ),
    (
        "panel 'Prefix cache hit rate' [A]",
        "renamed",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
    ),
    (
        "panel 'Time per output token P99' [A]",
        "renamed",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ),
    ("panel 'Swapped and running' [A]", "removed", "vllm:num_requests_swapped", "no replacement"),
    (
        "panel 'Swapped and running' [B]",
        "missing_label",
        "vllm:num_requests_running{gpu}",
        "engine, instance, job, model_name",
    ),
    ("panel 'Swapped and running' [C]", "grouping_label", "pod", "available: engine"),
    (
        "panel 'Generation throughput (old gauge)' [A]",
        "removed",
        "vllm:avg_generation_throughput_toks_per_s",
        "rate(vllm:generation_tokens_total[1m])",
    ),
    (
        "panel 'E2E latency' [A]",
        "histogram_base",
        "vllm:e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds_bucket",
    ),
}
RULES_PROBLEMS = {
    (
        "alert VllmKvCacheFull (group vllm)",
        "renamed",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
    ),
    (
        "alert VllmPreempting (group vllm)",
        "missing_total",
        "vllm:num_preemptions",
        "vllm:num_preemptions_total",
    ),
}


def _lint(path: Path, exp: Exposure) -> tuple[set[tuple[str, str, str, str]], set[str]]:
    queries, records = load_queries(path)
    problems, unchecked = check(str(path), queries, exp, records)
    return {(p.where, p.kind, p.subject, p.fix) for p in problems}, unchecked


def _matches(got: set[tuple[str, str, str, str]], want: set[tuple[str, str, str, str]]) -> None:
    assert len(got) == len(want), sorted(got)
    for where, kind, subject, fix_part in want:
        hits = [g for g in got if g[:3] == (where, kind, subject) and fix_part in g[3]]
        assert hits, (where, kind, subject, fix_part, sorted(got))


def test_old_dashboard_against_the_real_032_scrape() -> None:
    got, unchecked = _lint(DASHBOARD, Exposure.from_text(FIXTURE.read_text(), "fixture"))
    _matches(got, DASHBOARD_PROBLEMS)
    assert unchecked == {"DCGM_FI_DEV_GPU_UTIL"}


def test_relabelled_labels_can_be_declared() -> None:
    exp = Exposure.from_text(FIXTURE.read_text(), "fixture")
    exp.implicit_labels = exp.implicit_labels | {"pod"}
    got, _ = _lint(DASHBOARD, exp)
    assert not [g for g in got if g[1] == "grouping_label"]
    assert len(got) == len(DASHBOARD_PROBLEMS) - 1


def test_old_rules_against_the_real_032_scrape() -> None:
    got, _ = _lint(RULES, Exposure.from_text(FIXTURE.read_text(), "fixture"))
    _matches(got, RULES_PROBLEMS)  # the recording rule's name counts as present


def test_an_old_target_passes_the_old_dashboard_s_renamed_metrics() -> None:
    """Against vLLM 0.9.1's names the old names are right, and the new ones are not."""
    old_names = {"vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc"}
    text = FIXTURE.read_text()
    for new, old in old_names.items():
        text = text.replace(new, old)
    got, _ = _lint(DASHBOARD, Exposure.from_text(text, "old"))
    assert not [g for g in got if g[2] == "vllm:gpu_cache_usage_perc"]


def test_bad_input() -> None:
    with pytest.raises(LintError, match="cannot read"):
        load_queries(DATA / "missing.json")
    with pytest.raises(LintError, match="no samples"):
        Exposure.from_text("# just a comment\n", "empty")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope.cli.main", "lint", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    p = _cli(str(DASHBOARD), str(RULES), "--against", str(FIXTURE))
    assert p.returncode == 1, p.stderr
    assert "fix: use vllm:kv_cache_usage_perc" in p.stdout
    assert "fix: add _total: vllm:prompt_tokens_total" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("13 problem(s): 19 queries in 2 file(s)")
    doc = json.loads(_cli(str(DASHBOARD), "--against", str(FIXTURE), "--json").stdout)
    assert len(doc["problems"]) == len(DASHBOARD_PROBLEMS)
    assert doc["unchecked_metrics"] == ["DCGM_FI_DEV_GPU_UTIL"]
    clean = tmp_path / "clean.json"
    clean.write_text(
        json.dumps(
            {
                "panels": [
                    {
                        "title": "ok",
                        "targets": [
                            {
                                "refId": "A",
                                "expr": "sum by (model_name) (rate(vllm:prompt_tokens_total[5m]))",
                            }
                        ],
                    }
                ]
            }
        )
    )
    ok = _cli(str(clean), "--against", str(FIXTURE))
    assert ok.returncode == 0 and ok.stdout.startswith("clean: 1 queries"), ok.stdout
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert _cli(str(bad_json), "--against", str(FIXTURE)).returncode == 2
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    e = _cli(str(empty), "--against", str(FIXTURE))
    assert e.returncode == 2 and "no PromQL expressions" in e.stderr
    down = _cli(str(DASHBOARD), "--against", "http://127.0.0.1:9/metrics", "--timeout", "2")
    assert down.returncode == 2 and "cannot reach" in down.stderr


def test_against_a_live_metrics_url(fleet: Fleet) -> None:
    p = _cli(str(DASHBOARD), "--against", f"{fleet.new.url}/metrics", "--json")
    assert p.returncode == 1, p.stderr
    got = {
        (x["where"], x["kind"], x["subject"], x["fix"]) for x in json.loads(p.stdout)["problems"]
    }
    _matches(got, DASHBOARD_PROBLEMS)


def test_against_prometheus(fleet: Fleet) -> None:
    """What Prometheus stored for the 0.32 engine: the same references are broken."""
    url = fleet.backends["prometheus"].url
    p = _cli(
        str(DASHBOARD), "--prometheus", url, "--selector", '{model_name="kvscope-demo"}', "--json"
    )
    assert p.returncode == 1, p.stderr
    got = {
        (x["where"], x["kind"], x["subject"], x["fix"]) for x in json.loads(p.stdout)["problems"]
    }
    _matches(got, DASHBOARD_PROBLEMS)
    # The whole fleet also holds the engine still on the old names: those are not broken.
    whole = json.loads(_cli(str(DASHBOARD), "--prometheus", url, "--json").stdout)
    assert not [x for x in whole["problems"] if x["subject"] == "vllm:gpu_cache_usage_perc"]


@pytest.mark.skipif(
    not (DEPLOY_DASHBOARD.exists() and DEPLOY_RULES.exists()),
    reason="deploy/ dashboard or alert rules not present",
)
def test_kvscope_dashboard_and_alerts_lint_clean_against_a_collector(tmp_path: Path) -> None:
    collector = CollectorProcess(
        tmp_path / "store.duckdb",
        log_path=tmp_path / "collector.log",
        extra_args=["--advise-interval-s", "1"],
    )
    collector.start()
    try:
        replay(load_recording(BUNDLED_RECORDING), collector.url, progress=False)
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(collector.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            if "kvscope_advisor_knee_concurrency{" in text:
                break
            time.sleep(1)
        metrics = tmp_path / "collector_metrics.txt"
        metrics.write_text(text)
    finally:
        collector.stop()
    # The dashboard's cluster and namespace selectors match labels the scrape adds
    # (relabeling, external labels), not the collector's own.
    p = _cli(
        str(DEPLOY_DASHBOARD),
        str(DEPLOY_RULES),
        "--against",
        str(metrics),
        "--extra-labels",
        "cluster,namespace",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("clean:")
    # The dashboard's burn-rate panels read series the rules file records: known, not
    # left unchecked.
    assert "not checked" not in p.stdout, p.stdout
