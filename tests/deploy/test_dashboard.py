"""The Grafana dashboard's JSON: its structure, its template variables, and every query
parsed by a real Prometheus and built on metrics the collector really exposes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prom import (
    Prometheus,
    PrometheusError,
    dashboard_queries,
    data_panels,
    load_dashboard,
    load_rules,
    metric_names,
    recorded_names,
    rule_queries,
)

pytestmark = pytest.mark.promtool

DS_UID = "${datasource}"
PANEL_TYPES = {"timeseries", "stat", "table", "heatmap", "bargauge", "gauge"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A Prometheus with nothing to scrape: it parses and evaluates queries."""
    p = Prometheus(tmp_path_factory.mktemp("prom-empty")).start()
    try:
        yield p
    finally:
        p.stop()


def test_dashboard_header(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 38
    assert dashboard["uid"] and dashboard["title"]
    assert "id" not in dashboard or dashboard["id"] is None  # importable anywhere


def test_template_variables(dashboard: dict[str, Any]) -> None:
    v = {x["name"]: x for x in dashboard["templating"]["list"]}
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name in ("pool", "engine"):
        assert v[name]["type"] == "query"
        assert v[name]["datasource"]["uid"] == DS_UID
        query = (
            v[name]["query"]["query"] if isinstance(v[name]["query"], dict) else v[name]["query"]
        )
        assert re.fullmatch(
            rf"label_values\(kvscope_engine_info(\{{[^}}]*\}})?, {name}\)", query
        ), query
        assert v[name]["includeAll"] and v[name]["allValue"] == ".*"
    engine_q = v["engine"]["query"]["query"]
    assert "$pool" in engine_q, "the engine list follows the pool selection"


def test_every_panel_has_queries_on_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    panels = data_panels(dashboard)
    assert len(panels) >= 30
    ids = [p["id"] for p in dashboard["panels"]] + [
        q["id"] for p in dashboard["panels"] if p["type"] == "row" for q in p["panels"]
    ]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles repeat"
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert p.get("description"), f"{p['title']}: no description"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t.get("datasource", p["datasource"])["uid"] == DS_UID, p["title"]
            if p["type"] == "heatmap":
                assert t.get("format") == "heatmap", p["title"]
            if p["type"] == "table":
                assert t.get("format") == "table" and t.get("instant"), p["title"]
            if re.search(r"\[\d+[mhd]\]", t["expr"]):
                # A fixed window only where an alert's own window is drawn, named in the legend.
                assert "last" in t.get("legendFormat", ""), f"{p['title']}: {t['expr']}"
            elif "rate(" in t["expr"] or "increase(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"], f"{p['title']}: {t['expr']}"


def test_panels_tile_the_grid(dashboard: dict[str, Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_the_dashboard_covers_what_the_collector_measures(dashboard: dict[str, Any]) -> None:
    used = set().union(
        *(metric_names(q.expr) for q in dashboard_queries(dashboard, pool=".*", engine=".*"))
    )
    for metric in (
        "kvscope_engine_batch_size",
        "kvscope_engine_max_num_seqs",
        "kvscope_engine_kv_usage_ratio",
        "kvscope_engine_waiting_requests",
        "kvscope_engine_preemptions_total",
        "kvscope_engine_generation_tokens_total",
        "kvscope_engine_prefix_cache_hit_tokens_total",
        "kvscope_engine_step_batch_size_bucket",
        "kvscope_engine_step_kv_usage_ratio_bucket",
        "kvscope_advisor_knee_concurrency",
        "kvscope_advisor_recommended_concurrency_cap",
        "kvscope_advisor_bottleneck",
        "kvscope_advisor_saturated",
        "kvscope_advisor_pool_recommended_concurrency_cap",
        "kvscope_advisor_pool_prefix_hit_ratio",
        "kvscope_advisor_pool_prefix_routing_loss_ratio",
        "kvscope_advisor_pool_predicted_prefix_hit_ratio_affine",
        "kvscope_advisor_pool_load_imbalance_ratio",
        "kvscope_kv_events_blocks_duplicated_total",
        "kvscope_kv_events_blocks_stored_total",
        "kvscope_exporter_dropped_steps_total",
        "kvscope_collector_ingest_batches_total",
        "kvscope_advisor_runs_total",
        "kvscope_request_ttft_seconds_bucket",
        "kvscope_request_inter_token_latency_seconds_bucket",
        "kvscope_request_e2e_seconds_bucket",
        "kvscope_request_queue_seconds_bucket",
        "kvscope_request_prefill_seconds_bucket",
        "kvscope_request_decode_seconds_bucket",
        "kvscope_request_prompt_tokens_bucket",
        "kvscope_request_generation_tokens_bucket",
        "kvscope_request_finished_by_reason_total",
    ):
        assert metric in used, f"no panel shows {metric}"


def test_recorded_series_come_from_the_rules(dashboard: dict[str, Any]) -> None:
    """The burn-rate panels read the SLO recording rules of the alerts file."""
    recorded = {r["record"] for r in load_rules() if "record" in r}
    used = set().union(
        *(recorded_names(q.expr) for q in dashboard_queries(dashboard, pool=".*", engine=".*"))
    )
    assert used, "no panel reads a recorded series"
    assert used <= recorded, used - recorded


def test_every_query_parses_on_a_real_prometheus(
    dashboard: dict[str, Any], prometheus: Prometheus
) -> None:
    errors = []
    for sub in ({"pool": ".*", "engine": ".*"}, {"pool": "demo", "engine": "demo-host:8000:0"}):
        for q in dashboard_queries(dashboard, **sub):
            try:
                prometheus.query(q.expr)
            except PrometheusError as e:
                errors.append(f"{q.where}: {e}")
    for q in rule_queries():
        try:
            prometheus.query(q.expr)
        except PrometheusError as e:
            errors.append(f"rule {q.where}: {e}")
    assert not errors, "\n".join(errors)
    # And the check is real: a broken expression is refused.
    with pytest.raises(PrometheusError, match="bad_data"):
        prometheus.query("sum(rate(kvscope_engine_steps_total[1m])")


def _families(metrics_text: str) -> set[str]:
    out = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out.add(name)
            if kind.strip() == "histogram":
                out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return out


def test_every_metric_queried_is_exposed_by_the_collector(
    dashboard: dict[str, Any], kv_starved_collector: Any
) -> None:
    """Names only (series come in the live tests): a typo would never return data."""
    exposed = _families(kv_starved_collector.collector.get_text("/metrics"))
    queries = dashboard_queries(dashboard, pool=".*", engine=".*") + rule_queries()
    missing = {f"{m} ({q.where})" for q in queries for m in metric_names(q.expr) - exposed}
    assert not missing, "\n".join(sorted(missing))


def test_dashboard_file_is_plain_json() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvscope.json"
    text = path.read_text()
    assert text.endswith("\n") and "\t" not in text
    assert "DS_PROMETHEUS" not in text, "datasource comes from the template variable"
