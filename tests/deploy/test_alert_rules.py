"""The Prometheus alerting rules: promtool accepts them, their unit tests pass, and
every alert is tested both firing and not firing, labelled and annotated."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from _prom import ALERT_TESTS, ALERTS, PROMTOOL, load_rules, require

pytestmark = pytest.mark.promtool

SEVERITIES = {"critical", "warning", "info"}
CAPACITY = (
    "KvscopeKvCacheSaturated",
    "KvscopePreemptionStorm",
    "KvscopeLoadPastKnee",
    "KvscopePrefixHitRateCollapse",
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
    alerts = {r["alert"] for r in load_rules()}
    assert alerts - fires == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"


def test_alerts_are_labelled_and_say_what_to_do() -> None:
    rules = load_rules()
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
