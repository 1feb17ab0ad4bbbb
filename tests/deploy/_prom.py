"""Helpers for the deploy tests: a real Prometheus server, the dashboard's and the
alert rules' queries, and checks that each returns data.

Used by ``tests/deploy`` and by ``tests/integration/test_grafana_prometheus.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus._backends import PrometheusServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvscope.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvscope-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvscope-alerts.test.yml"
PROMTOOL = "/usr/bin/promtool"

#: Alerts a KV-starved engine driven past its knee must raise.
OVERLOAD_ALERTS = ("KvscopeKvCacheSaturated", "KvscopePreemptionStorm", "KvscopeLoadPastKnee")

#: Metrics that exist only for pools whose engines publish vLLM's KV-cache events, or
#: that have two engines or more (the advisor's routing and balance gauges).
MULTI_ENGINE_KV_EVENT_METRICS = frozenset(
    {
        "kvscope_kv_events_blocks_stored_total",
        "kvscope_kv_events_blocks_duplicated_total",
        "kvscope_kv_events_blocks_reseen_total",
        "kvscope_kv_events_orphan_blocks_total",
        "kvscope_kv_events_blocks_removed_total",
        "kvscope_kv_events_missed_batches_total",
        "kvscope_kv_events_held_blocks",
        "kvscope_pool_kv_distinct_blocks",
        "kvscope_kv_events_subscribed",
        "kvscope_advisor_pool_prefix_routing_loss_ratio",
        "kvscope_advisor_pool_predicted_prefix_hit_ratio_affine",
        "kvscope_advisor_pool_load_imbalance_ratio",
    }
)

_SELECTOR = re.compile(r"(?<![\w\":])(kvscope_[A-Za-z0-9_]+)(\{[^}]*\})?")
"""A collector metric (a recorded series, ``level:kvscope_...:operations``, is not one)."""
_RECORDED = re.compile(r"(?<![\w\":])([a-z_]+:kvscope_[A-Za-z0-9_]+:[A-Za-z0-9_]+)(\{[^}]*\})?")


def require(path: str) -> str:
    """The path of a Debian-packaged binary, or a test failure saying what to install."""
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: install the Debian 'prometheus' package (scripts/test does it)"
        )
    return path


# -- the artefacts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One query of the dashboard or of the rules."""

    where: str
    """Panel title and refId, or the alert name."""
    expr: str


def load_dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that is not a row (rows may hold collapsed panels)."""
    out = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out += list(p.get("panels", []))
        else:
            out.append(p)
    return out


def dashboard_queries(dashboard: dict[str, Any], **variables: str) -> list[Query]:
    """Every target's expression with the template variables (:func:`substitute`'s
    keywords) substituted the way Grafana does (``$cluster``/``$namespace``/``$pool``/``$engine`` are regexes in ``=~``
    matchers; ``.*`` is All, which also matches series without the label)."""
    out = []
    for p in data_panels(dashboard):
        for t in p["targets"]:
            out.append(
                Query(
                    f"{p['title']} [{t['refId']}]",
                    substitute(t["expr"], **variables),
                )
            )
    return out


def substitute(
    expr: str,
    *,
    pool: str,
    engine: str,
    rate_interval: str = "1m",
    range_: str = "5m",
    cluster: str = ".*",
    namespace: str = ".*",
) -> str:
    for name, value in (
        ("$__rate_interval", rate_interval),
        ("$__range", range_),
        ("$__interval", "15s"),
        ("${cluster}", cluster),
        ("${namespace}", namespace),
        ("${pool}", pool),
        ("${engine}", engine),
        ("$cluster", cluster),
        ("$namespace", namespace),
        ("$pool", pool),
        ("$engine", engine),
    ):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def load_rules() -> list[dict[str, Any]]:
    """Every rule of the alerts file (each a dict with ``alert``, ``expr``, ...)."""
    data = yaml.safe_load(ALERTS.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def load_alerts() -> list[dict[str, Any]]:
    """The alerting rules of the alerts file (without its recording rules)."""
    return [r for r in load_rules() if "alert" in r]


def rule_queries() -> list[Query]:
    return [Query(r.get("alert") or r.get("record"), r["expr"].strip()) for r in load_rules()]


def selectors(expr: str) -> list[str]:
    """The ``kvscope_*`` vector selectors of an expression (name and matchers)."""
    return sorted({m.group(1) + (m.group(2) or "") for m in _SELECTOR.finditer(expr)})


def metric_names(expr: str) -> set[str]:
    """The collector metrics an expression reads (not the recorded series)."""
    return {m.group(1) for m in _SELECTOR.finditer(expr)}


def recorded_names(expr: str) -> set[str]:
    """The recorded series (``level:metric:operations``) an expression reads."""
    return {m.group(1) for m in _RECORDED.finditer(expr)}


# -- a Prometheus server ----------------------------------------------------------------


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error."""


class Prometheus(PrometheusServer):
    """A real Prometheus server in a child process (stopped by :meth:`stop`), scraping
    ``targets`` as job ``kvscope`` and evaluating ``rule_files``: the tests' one
    Prometheus starter (``tests/prometheus/_backends.py``) plus query helpers."""

    def __init__(
        self,
        workdir: Path,
        *,
        targets: list[str] | None = None,
        scrape_interval_s: float = 1.0,
        rule_files: list[Path] | None = None,
        evaluation_interval_s: float = 1.0,
    ) -> None:
        super().__init__(
            workdir,
            list(targets or []),
            job="kvscope",
            scrape_interval_s=scrape_interval_s,
            rule_files=rule_files,
            evaluation_interval_s=evaluation_interval_s,
        )

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        try:
            super().start(timeout_s)
        except RuntimeError as e:
            raise PrometheusError(str(e)) from e
        return self

    def api(self, path: str, **params: Any) -> Any:
        """GET an API path; the ``data`` of a success, else :class:`PrometheusError`."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a vector's samples; a scalar as one sample)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("/api/v1/query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def wait_for(self, expr: str, what: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.query(expr)
            if res:
                return res
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} ({expr})\n{self.log_tail()}")
            time.sleep(0.5)

    def rule_health(self) -> Iterator[tuple[str, str, str]]:
        """(rule name, health, last error) of every loaded rule."""
        for g in self.api("/api/v1/rules")["groups"]:
            for r in g["rules"]:
                yield r["name"], r.get("health", ""), r.get("lastError", "")


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in result]


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(v) for v in values(result))


def describe(result: list[dict[str, Any]], n: int = 3) -> str:
    return "; ".join(f"{s['metric']} = {s['value'][1]}" for s in result[:n]) or "(no series)"
