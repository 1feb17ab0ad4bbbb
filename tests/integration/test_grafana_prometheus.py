"""The Grafana dashboard and the alert rules against the real vLLM engine.

A real Prometheus scrapes the overload run's collector every second, with the alert
rules evaluated every second, while the session's KV-starved engine (48 blocks of 32
tokens) is driven once more at 32 clients for 20 s. At the end of that overload:

* every dashboard query returns data (a finite value), for all engines and for the
  engine selected, except the panels that need vLLM's KV-cache events or a pool of two
  engines or more (this engine runs without ``--kv-events-config``, alone in its pool):
  those must return nothing here (``tests/deploy`` shows them with data);
* every series selector of every rule returns data, with the same exception;
* the overload alerts (KV cache saturated, preemption storm, load past the knee) are
  active: their expressions hold for the engine and Prometheus lists them pending
  (their ``for:`` is minutes long); the data-path alerts stay quiet.

The extra load changes vLLM's counters: the run's ``vllm_after`` is read again once
the collector agrees with vLLM, so the tests that compare totals still compare two
readings of the same moment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.lab.sweep import SweepConfig, run_sweep
from tests.deploy._prom import (
    ALERTS,
    MULTI_ENGINE_KV_EVENT_METRICS,
    OVERLOAD_ALERTS,
    Prometheus,
    dashboard_queries,
    describe,
    finite,
    load_dashboard,
    metric_names,
    rule_queries,
    selectors,
)

from .conftest import MODEL_NAME, POOL, OverloadRun, collector_totals, vllm_totals, wait_until_equal

pytestmark = pytest.mark.engine

QUIET_ALERTS = (
    "KvscopeEngineNotReporting",
    "KvscopeExporterDroppingData",
    "KvscopePluginRecordErrors",
    "KvscopeCollectorRejectingBatches",
    "KvscopeCollectorStoreFailing",
    "KvscopeAdvisorRunsFailing",
    "KvscopeCollectorAbsent",
)


def _verdict_ready(run: OverloadRun) -> str:
    """The engine id, once the collector's advisor has a saturated verdict for it."""
    deadline = time.monotonic() + 90  # the advisor runs every 10 s (overload_run)
    while True:
        text = run.collector.get_text("/metrics")
        caps = [
            ln
            for ln in text.splitlines()
            if ln.startswith("kvscope_advisor_recommended_concurrency_cap{")
        ]
        if caps:
            engines = run.collector.get_json("/v1/engines")["rows"]
            return str(engines[0]["engine_id"])
        assert time.monotonic() < deadline, (
            "the collector's advisor gave no cap for the overloaded engine; its series:\n"
            + "\n".join(ln for ln in text.splitlines() if ln.startswith("kvscope_advisor"))
            + "\nthe overload run:\n"
            + run.diagnosis()
        )
        time.sleep(2)


def _log_errors(path: Path, last: int = 12) -> str:
    """The last ERROR lines of a log, for a failure message."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    errors = [ln for ln in lines if "ERROR" in ln or "Traceback" in ln]
    return "\n".join(errors[-last:]) or "none logged"


class Live:
    def __init__(self, prometheus: Prometheus, engine_id: str, at: float) -> None:
        self.prometheus, self.engine_id, self.at = prometheus, engine_id, at


@pytest.fixture(scope="module")
def live(overload_run: OverloadRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    engine_id = _verdict_ready(overload_run)
    collector, server = overload_run.collector, overload_run.server
    prom = Prometheus(
        tmp_path_factory.mktemp("grafana-prom"),
        targets=[f"{collector.host}:{collector.port}"],
        rule_files=[ALERTS],
    )
    prom.start()
    try:
        prom.wait_for('up{job="kvscope"} == 1', "the first scrape of the collector", 30)
        sweep = run_sweep(
            SweepConfig(
                url=server.url,
                model=MODEL_NAME,
                concurrency=[32],
                duration_s=20.0,
                warmup_s=1.0,
                cooldown_s=0.5,
                prompt_words=(8, 40),
                output_tokens=(96, 128),
                shared_prefix_words=64,
                prefix_groups=4,
                seed=11,
                progress=False,
            )
        )
        at = time.time() - 1.0  # the overload's last second (the sweep has cancelled since)
        after, stored = wait_until_equal(
            lambda: vllm_totals(server.metrics_text()), lambda: collector_totals(collector)
        )
        assert after == stored, f"vLLM {after} != kvscope {stored} after the extra load"
        overload_run.vllm_after = after
        (level,) = sweep.levels
        assert level.error_count == 0 and level.requests_completed > 0, (
            f"the extra load: {level.requests_completed} completed, errors {level.errors} "
            f"({level.error_examples}); "
            f"the engine's errors: {_log_errors(overload_run.workdir / 'vllm.log')}\n"
            + overload_run.diagnosis()
        )
        time.sleep(2)  # scrapes and rule evaluations past `at`
        yield Live(prom, engine_id, at)
    finally:
        prom.stop()


def _needs_kv_events(expr: str) -> bool:
    return bool(metric_names(expr) & MULTI_ENGINE_KV_EVENT_METRICS)


@pytest.mark.parametrize("all_engines", [True, False], ids=["all engines", "one engine"])
def test_every_dashboard_query_returns_data(live: Live, all_engines: bool) -> None:
    engine = ".*" if all_engines else live.engine_id
    problems = []
    n_data = 0
    for q in dashboard_queries(load_dashboard(), pool=POOL, engine=engine, rate_interval="30s"):
        res = live.prometheus.query(q.expr, live.at)
        if _needs_kv_events(q.expr):
            if res:
                problems.append(f"{q.where}: data without KV events? {describe(res)}")
        elif finite(res):
            n_data += 1
        else:
            problems.append(f"{q.where}: {q.expr} -> {describe(res)}")
    assert not problems, "\n".join(problems)
    assert n_data >= 50


def test_every_rule_selector_returns_data(live: Live) -> None:
    problems = []
    for q in rule_queries():
        for sel in selectors(q.expr):
            res = live.prometheus.query(sel, live.at)
            if _needs_kv_events(sel):
                if res:
                    problems.append(f"{q.where}: {sel} has data without KV events?")
            elif not res:
                problems.append(f"{q.where}: {sel} -> no series")
    assert not problems, "\n".join(problems)


def test_overload_alerts_are_active(live: Live) -> None:
    p = live.prometheus
    exprs = {q.where: q.expr for q in rule_queries()}
    for name in OVERLOAD_ALERTS:
        res = p.query(exprs[name], live.at)
        assert live.engine_id in {s["metric"].get("engine") for s in res}, (
            f"{name}: {describe(res)}"
        )
        alerts = p.query(f'ALERTS{{alertname="{name}", engine="{live.engine_id}"}}', live.at)
        assert {s["metric"]["alertstate"] for s in alerts} & {"pending", "firing"}, (
            f"{name}: {describe(alerts)}"
        )
    bad = [(n, h, e) for n, h, e in p.rule_health() if h != "ok"]
    assert not bad, bad


def test_data_path_alerts_stay_quiet(live: Live) -> None:
    exprs = {q.where: q.expr for q in rule_queries()}
    for name in QUIET_ALERTS:
        res: list[dict[str, Any]] = live.prometheus.query(exprs[name], live.at)
        assert not res, f"{name}: {describe(res)}"
