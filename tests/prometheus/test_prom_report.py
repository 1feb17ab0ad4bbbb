"""``kvscope report --prometheus`` on real Prometheus servers holding the replayed run
(see conftest.py), against ``kvscope report --collector`` on the collector that stored
the same run through kvscope's plugin path.

The collector's engine (``demo-host:8000:0``) is in both: from its store, and from its
own ``/metrics`` series as Prometheus scraped them. vLLM's two replayed engines exist
only in Prometheus; the recording's verdict (KV-cache bound, saturated, knee between the
8- and 16-client levels) is theirs too. The report from Prometheus says its resolution.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _promfleet import Fleet

ROOT = Path(__file__).resolve().parents[2]
KVSCOPE_ENGINE = "demo-host:8000:0"


def _report(
    fleet: Fleet, out: Path, *where: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "report",
            *where,
            "--since",
            f"{fleet.since:.3f}",
            "--until",
            f"{fleet.until:.3f}",
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    doc = json.loads((out / "report.json").read_text()) if p.returncode == 0 else {}
    return p, doc


@pytest.fixture(scope="module")
def reports(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = {}
    for name, where in (
        ("store", ["--collector", fleet.collector.url]),
        ("prometheus", ["--prometheus", fleet.backends["prometheus"].url]),
    ):
        d = tmp_path_factory.mktemp(f"report-{name}")
        p, doc = _report(fleet, d, *where)
        assert p.returncode == 0, p.stderr
        assert "weekly report for" in p.stdout
        out[name] = (d, doc)
    return out


def _engines(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["engine_id"]: e for e in doc["current"]["engines"]}


def test_same_verdicts_as_from_the_store(
    reports: dict[str, tuple[Path, dict[str, Any]]], fleet: Fleet
) -> None:
    store = _engines(reports["store"][1])
    prom = _engines(reports["prometheus"][1])
    assert set(store) == {KVSCOPE_ENGINE}
    assert set(prom) == {KVSCOPE_ENGINE, fleet.engine_id(fleet.new), fleet.engine_id(fleet.old)}
    s = store[KVSCOPE_ENGINE]
    for eid, v in prom.items():
        assert (v["bottleneck"], v["saturated"]) == (s["bottleneck"], s["saturated"]), eid
        # The knee in requests in flight, from snapshots of the queue once a second, lands
        # within a factor of 2 of the store's (the load levels double).
        assert s["knee_concurrency"] / 2 <= v["knee_concurrency"] <= s["knee_concurrency"] * 2
        assert v["plateau_tokens_per_s"] == pytest.approx(s["plateau_tokens_per_s"], rel=0.2)
        if eid != KVSCOPE_ENGINE:  # vLLM's gauges at 1 s: scaled by 0.9
            assert 0 < v["confidence"] <= 0.9, eid
    pools = {p["pool"] for p in reports["prometheus"][1]["current"]["pools"]}
    assert pools == {"demo", "kvscope-demo", "old-model"}


def test_the_report_states_its_resolution(reports: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    out, doc = reports["prometheus"]
    cov = doc["current"]["coverage"]
    assert cov["source"] == "prometheus" and cov["resolution_s"] == 1
    assert cov["confidence_factor"] == 0.9
    assert doc["previous"]["coverage"]["source"] == "prometheus"
    assert doc["source"].startswith("Prometheus http://127.0.0.1:")
    [res] = [f for f in doc["current"]["findings"] if f["kind"] == "scrape_resolution"]
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert f"- Resolution: {res['summary']}" in md
    assert "<b>Resolution:</b> read from Prometheus" in html
    store_md = (reports["store"][0] / "report.md").read_text()
    assert "Resolution:" not in store_md


def test_report_errors_from_prometheus(fleet: Fleet, tmp_path: Path) -> None:
    url = fleet.backends["prometheus"].url
    none, _ = _report(fleet, tmp_path / "a", "--prometheus", url, "--selector", '{job="nope"}')
    assert none.returncode == 3 and "no vLLM series" in none.stderr
    down, _ = _report(fleet, tmp_path / "b", "--prometheus", "http://127.0.0.1:9", "--timeout", "2")
    assert down.returncode == 2 and "cannot reach Prometheus at http://127.0.0.1:9" in down.stderr
    both = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "report",
            "--prometheus",
            url,
            "--collector",
            fleet.collector.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_report_with_basic_auth(fleet: Fleet, tmp_path: Path) -> None:
    b = fleet.backends["prometheus-secured"]
    pw = tmp_path / "pw"
    pw.write_text(b.password)
    p, doc = _report(
        fleet,
        tmp_path / "r",
        "--prometheus",
        b.url,
        "--prometheus-user",
        b.user,
        "--prometheus-password-file",
        str(pw),
        "--prometheus-ca-file",
        str(b.ca_file),
        "--pool",
        "kvscope-demo",
    )
    assert p.returncode == 0, p.stderr
    assert [e["bottleneck"] for e in doc["current"]["engines"]] == ["kv_cache_bound"]
    assert b.password not in (tmp_path / "r" / "report.html").read_text()
