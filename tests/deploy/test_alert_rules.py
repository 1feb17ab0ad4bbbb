"""The Prometheus alerting rules: promtool accepts them, their unit tests pass, and
every alert is tested both firing and not firing, labelled and annotated; the SLO
recording rules are named and used as the alerts expect."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from _prom import (
    ALERT_TESTS,
    ALERTS,
    PROMTOOL,
    load_alerts,
    load_rules,
    recorded_names,
    require,
)

pytestmark = pytest.mark.promtool

SEVERITIES = {"critical", "warning", "info"}
CAPACITY = (
    "KvscopeKvCacheSaturated",
    "KvscopePreemptionStorm",
    "KvscopeLoadPastKnee",
    "KvscopePrefixHitRateCollapse",
)
#: The SLO burn-rate alerts: (alert, recorded series, burn-rate factor, its two windows).
SLO_BURNS = (
    ("KvscopeTtftSloFastBurn", "pool:kvscope_ttft_slo_errors_per_request", "14.4", ("1h", "5m")),
    ("KvscopeTtftSloSlowBurn", "pool:kvscope_ttft_slo_errors_per_request", "6", ("6h", "30m")),
    ("KvscopeItlSloFastBurn", "pool:kvscope_itl_slo_errors_per_request", "14.4", ("1h", "5m")),
    ("KvscopeItlSloSlowBurn", "pool:kvscope_itl_slo_errors_per_request", "6", ("6h", "30m")),
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=ALERTS.parent
    )


def test_promtool_check_rules() -> None:
    res = _promtool("check", "rules", str(ALERTS))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in res.stdout, res.stdout


def test_promtool_unit_tests_pass() -> None:
    res = _promtool("test", "rules", str(ALERT_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and "FAILED" not in res.stdout, res.stdout


def test_unit_tests_fail_when_an_expectation_is_wrong(tmp_path) -> None:
    """The unit tests are not vacuous: a wrong expected value makes promtool fail."""
    text = ALERT_TESTS.read_text().replace("preempts 1.00 requests/s", "preempts 9.99 requests/s")
    broken = tmp_path / "broken.test.yml"
    broken.write_text(text.replace("  - kvscope-alerts.yml", f"  - {ALERTS}"))
    res = _promtool("test", "rules", str(broken))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "KvscopePreemptionStorm" in out and "FAILED" in out, out


def test_every_alert_is_tested_firing_and_quiet() -> None:
    data = yaml.safe_load(ALERT_TESTS.read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in data["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in load_alerts()}
    assert alerts - fires == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"


def test_alerts_are_labelled_and_say_what_to_do() -> None:
    rules = load_alerts()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert set(CAPACITY) <= set(names)
    for r in rules:
        name = r["alert"]
        assert re.fullmatch(r"\d+[smh]", r.get("for", "")), f"{name}: no for: duration"
        assert r["labels"]["severity"] in SEVERITIES, name
        ann = r["annotations"]
        assert ann["summary"].strip() and ann["description"].strip(), name
        # The description states the measured value (where there is one to state).
        if name not in ("KvscopeCollectorAbsent", "KvscopeKvEventsNotSubscribed"):
            assert "$value" in ann["description"], name
    for r in rules:
        if r["alert"] in CAPACITY:
            desc = r["annotations"]["description"]
            assert "kvscope advise --collector" in desc and "--pool" in desc, r["alert"]
    for name, *_ in SLO_BURNS:
        desc = next(r for r in rules if r["alert"] == name)["annotations"]["description"]
        assert "kvscope advise --collector" in desc and "--pool" in desc, name
        assert "--slo-" in desc, name


def test_slo_recording_rules_and_burn_rate_alerts() -> None:
    """Each SLO records its error ratio over 5m, 30m, 1h and 6h from one bucket of its
    histogram; each burn alert compares two of them with the same factor x the budget."""
    rules = load_rules()
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    for metric, le, slo in (
        ("kvscope_request_ttft_seconds", "2.0", "ttft"),
        ("kvscope_request_inter_token_latency_seconds", "0.1", "itl"),
    ):
        for window in ("5m", "30m", "1h", "6h"):
            expr = records[f"pool:kvscope_{slo}_slo_errors_per_request:ratio_rate{window}"]
            assert f'{metric}_bucket{{le="{le}"}}[{window}]' in expr, (slo, window)
            assert f"{metric}_count[{window}]" in expr, (slo, window)
            # An idle pool (no finished request in the window) has no ratio at all.
            assert re.search(
                rf"\(sum by \([^)]*\bpool\) \(rate\({metric}_count\[{window}\]\)\) > 0\)", expr
            )
    alerts = {r["alert"]: r for r in load_alerts()}
    for name, series, factor, windows in SLO_BURNS:
        expr = alerts[name]["expr"]
        for window in windows:
            assert f"{series}:ratio_rate{window} > ({factor} * (1 - 0.99))" in expr, (name, window)
    # Every recorded series an alert reads is recorded here.
    used = set().union(*(recorded_names(r["expr"]) for r in rules))
    assert used and used <= set(records), used - set(records)
