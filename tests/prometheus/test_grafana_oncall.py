"""The dashboard and the alert rules as on-call surfaces, read as files (no servers).

Every panel that shows a number has a unit; the alert thresholds drawn on the panels are
the rules' numbers; every query filters on the cluster and namespace selectors in a way
that still matches series without those labels; the rows below the fleet overview are
collapsed; the data links open pages and a query parameter the kvscope app has; every
alert links to its runbook page; only data loss and a fast burn of an SLO's error budget
page.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvscope.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvscope-alerts.yml"
RUNBOOKS = ROOT / "docs" / "runbooks"
APP = ROOT / "dashboard"

#: Data loss pages: the collector cannot store batches.
DATA_LOSS = {"KvscopeCollectorStoreFailing"}
#: A fast burn of a latency SLO's error budget pages (users are affected now); its slow
#: burn is a ticket.
FAST_SLO_BURN = {"KvscopeTtftSloFastBurn", "KvscopeItlSloFastBurn"}
#: The alerts that page, and no other.
CRITICAL = DATA_LOSS | FAST_SLO_BURN
SLO_ATTAINMENT = "SLO attainment (TTFT <= 2 s, ITL <= 100 ms)"
SCOPE_VARS = ("cluster", "namespace")
RUNBOOK_SECTIONS = ("## What it means", "## Confirm", "## What to change", "## When to escalate")
#: A collector metric, or a recorded series (``level:kvscope_...:operations``).
_SELECTOR = re.compile(
    r"(?<![\w\"])((?:[a-z_]+:)?kvscope_[A-Za-z0-9_]+(?::[A-Za-z0-9_]+)?)(\{[^}]*\})?"
)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    """The alerting rules by name."""
    data = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r for g in data["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def records() -> dict[str, str]:
    """The recording rules' expressions by recorded name."""
    data = yaml.safe_load(ALERTS.read_text())
    return {r["record"]: r["expr"] for g in data["groups"] for r in g["rules"] if "record" in r}


def _data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out += list(p.get("panels", [])) if p["type"] == "row" else [p]
    return out


def _panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    (p,) = [p for p in _data_panels(dashboard) if p["title"] == title]
    return p


def _threshold_values(panel: dict[str, Any]) -> set[float]:
    defaults = panel["fieldConfig"]["defaults"]
    return {s["value"] for s in defaults["thresholds"]["steps"] if s["value"] is not None}


# -- units ------------------------------------------------------------------------------


def test_every_panel_has_a_unit(dashboard: dict[str, Any]) -> None:
    missing = []
    for p in _data_panels(dashboard):
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        if not defaults.get("unit"):
            missing.append(p["title"])
        if p["type"] == "heatmap":
            assert p["options"]["yAxis"].get("unit"), p["title"]
            assert p["options"]["cellValues"].get("unit"), p["title"]
    assert not missing, f"panels without a unit: {missing}"


def test_units_fit_what_the_panels_show(dashboard: dict[str, Any]) -> None:
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in _data_panels(dashboard)}
    assert "short" not in units.values(), "'short' says nothing about what is counted"
    for title, unit in units.items():
        if "tokens/s" in title:
            assert unit == "count:tok/s", title
    assert units["Preemptions/s"] == units["Preemptions and finished requests (/s)"] == "reqps"
    assert units["KV-cache usage"] == units["Prefix-cache hit ratio"] == "percentunit"
    assert units["Seconds since each engine's last batch"] == "s"
    assert units[SLO_ATTAINMENT] == "percentunit"
    for title in (
        "Time to first token: p50 / p90 / p99",
        "Inter-token latency: p50 / p90 / p99",
        "End-to-end time and its phases: p99",
    ):
        assert units[title] == "s", title
    assert units["Finished requests by reason (/s)"] == "reqps"
    # A burn rate is a plain multiple of the sustainable rate.
    assert units["TTFT error-budget burn rate"] == units["ITL error-budget burn rate"] == "none"
    # Counts of requests, engines, blocks and tokens are shown as integers.
    for title in (
        "Engines reporting",
        "Engines past their knee",
        "Requests waiting",
        "Waiting and deferred requests",
        "KV blocks in use vs capacity",
        "Blocks held per engine and distinct in the pool",
        "Pool recommended caps (requests in flight)",
        "Prompt length per request: p50 / p90 / p99",
        "Output length per request: p50 / p90 / p99",
    ):
        defaults = _panel(dashboard, title)["fieldConfig"]["defaults"]
        assert defaults["unit"] == "none" and defaults["decimals"] == 0, title


# -- thresholds -------------------------------------------------------------------------


def test_alert_thresholds_are_drawn_with_the_rules_numbers(
    dashboard: dict[str, Any], rules: dict[str, dict[str, Any]], records: dict[str, str]
) -> None:
    # (panel, alert, value drawn, the same value in the rule's expression)
    drawn = [
        ("KV-cache usage", "KvscopeKvCacheSaturated", 0.95, r'le="0\.95"'),
        ("KV-cache usage", "KvscopeKvCacheSaturated", 0.5, r"\)\s*> 0\.5\s"),
        ("Preemptions and finished requests (/s)", "KvscopePreemptionStorm", 0.2, r"> 0\.2\s"),
        ("Seconds since each engine's last batch", "KvscopeEngineNotReporting", 90, r"> 90\s"),
        ("Store: 1-minute rollup behind", "KvscopeRollupStalled", 900, r"> 900$"),
        (SLO_ATTAINMENT, "KvscopeTtftSloFastBurn", 0.99, r"\(1 - 0\.99\)"),
        (SLO_ATTAINMENT, "KvscopeItlSloFastBurn", 0.99, r"\(1 - 0\.99\)"),
        ("TTFT error-budget burn rate", "KvscopeTtftSloFastBurn", 14.4, r"> \(14\.4 \* "),
        ("TTFT error-budget burn rate", "KvscopeTtftSloSlowBurn", 6, r"> \(6 \* "),
        ("ITL error-budget burn rate", "KvscopeItlSloFastBurn", 14.4, r"> \(14\.4 \* "),
        ("ITL error-budget burn rate", "KvscopeItlSloSlowBurn", 6, r"> \(6 \* "),
    ]
    for title, alert, value, in_rule in drawn:
        assert re.search(in_rule, rules[alert]["expr"]), (alert, in_rule)
        panel = _panel(dashboard, title)
        assert value in _threshold_values(panel), (title, value)
        style = panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"]
        assert style in ("line", "dashed", "line+area", "dashed+area"), title
    # The stat's colours and count follow the same numbers.
    assert 0.2 in _threshold_values(_panel(dashboard, "Preemptions/s"))
    (reporting,) = _panel(dashboard, "Engines reporting")["targets"]
    assert "< bool 90)" in reporting["expr"]
    # Per-engine thresholds (multiples of the advisor's gauges) are series of their own.
    exprs = [t["expr"] for t in _panel(dashboard, "Requests in flight vs knee and cap")["targets"]]
    for factor, gauge in (
        ("1.5", "kvscope_advisor_knee_concurrency"),
        ("1.25", "kvscope_advisor_recommended_concurrency_cap"),
    ):
        assert f"{factor} * {gauge}" in rules["KvscopeLoadPastKnee"]["expr"]
        assert any(e.startswith(f"{factor} * {gauge}{{") for e in exprs), (factor, gauge)
    # The prefix collapse is relative: the pool's day ratio halved is a series of its own,
    # next to the pool's 30-minute ratio the rule compares with it.
    collapse = rules["KvscopePrefixHitRateCollapse"]["expr"]
    assert re.search(r"<\s*0\.5 \* \(\s*sum by \(job, instance, pool\) \(rate\(\S+\[1d\]", collapse)
    prefix = {
        t["legendFormat"]: t["expr"]
        for t in _panel(dashboard, "Prefix-cache hit ratio per engine")["targets"]
    }
    half = [e for e in prefix.values() if e.startswith("0.5 * (")]
    assert len(half) == 1 and half[0].count("[1d]") == 2, prefix
    assert sum(e.count("[30m]") == 2 for e in prefix.values()) == 1, prefix
    # The SLO targets: the bucket of the recording rules is the line on the quantile panel
    # and the bucket the attainment panel counts; the burn rates divide by the same budget.
    attainment = [t["expr"] for t in _panel(dashboard, SLO_ATTAINMENT)["targets"]]
    for title, metric, le in (
        ("Time to first token: p50 / p90 / p99", "kvscope_request_ttft_seconds", "2.0"),
        (
            "Inter-token latency: p50 / p90 / p99",
            "kvscope_request_inter_token_latency_seconds",
            "0.1",
        ),
    ):
        recorded = [e for e in records.values() if f"{metric}_bucket" in e]
        assert len(recorded) == 4, metric
        assert all(f'{metric}_bucket{{le="{le}"}}' in e for e in recorded), metric
        assert float(le) in _threshold_values(_panel(dashboard, title)), title
        assert any(f"{metric}_bucket{{" in e and f'le="{le}"}}' in e for e in attainment), metric
    for title in ("TTFT error-budget burn rate", "ITL error-budget burn rate"):
        for t in _panel(dashboard, title)["targets"]:
            assert t["expr"].endswith(" / (1 - 0.99)"), (title, t["expr"])


# -- cluster and namespace --------------------------------------------------------------


def test_cluster_and_namespace_variables(dashboard: dict[str, Any]) -> None:
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names.index("cluster") < names.index("namespace") < names.index("pool")
    v = {x["name"]: x for x in dashboard["templating"]["list"]}
    for name in SCOPE_VARS:
        var = v[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(
            rf"label_values\(kvscope_engine_info(\{{[^}}]*\}})?, {name}\)", var["query"]["query"]
        ), var["query"]["query"]
        assert var["includeAll"] and var["multi"]
        # All is .*, which also matches an absent label (its value is the empty string).
        assert var["allValue"] == ".*"
        assert var["current"]["value"] == ["$__all"]
    assert '"$cluster"' in v["namespace"]["query"]["query"]
    for name in ("pool", "engine"):
        for scope in SCOPE_VARS:
            assert f'{scope}=~"${scope}"' in v[name]["query"]["query"], name


def _expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    out = [
        (f"{p['title']} [{t['refId']}]", t["expr"])
        for p in _data_panels(dashboard)
        for t in p["targets"]
    ]
    out += [
        (f"annotation {a['name']}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if a.get("expr")
    ]
    return out


def test_every_selector_filters_on_cluster_and_namespace(dashboard: dict[str, Any]) -> None:
    bad = []
    for where, expr in _expressions(dashboard):
        selectors = list(_SELECTOR.finditer(expr))
        assert selectors, where
        for m in selectors:
            matchers = m.group(2) or ""
            for scope in SCOPE_VARS:
                # =~ with the variable: "All" (.*) keeps series that lack the label.
                if f'{scope}=~"${scope}"' not in matchers:
                    bad.append(f"{where}: {m.group(0)}")
    assert not bad, "selectors without the cluster/namespace matchers:\n" + "\n".join(bad)


# -- rows -------------------------------------------------------------------------------


def test_lower_rows_are_collapsed_with_their_panels_inside(dashboard: dict[str, Any]) -> None:
    top = dashboard["panels"]
    rows = [p for p in top if p["type"] == "row"]
    assert rows[0] is top[0] and rows[0]["title"] == "Fleet overview"
    assert rows[0]["collapsed"] is False and rows[0]["panels"] == []
    assert len(rows) >= 4
    for row in rows[1:]:
        assert row["collapsed"] is True, row["title"]
        assert row["panels"], f"{row['title']}: a collapsed row holds its panels"
    # Below the first collapsed row, only rows sit at the top level.
    first = top.index(rows[1])
    assert all(p["type"] == "row" for p in top[first:])
    # The collapsed rows stack right under the overview, one line each.
    ys = [r["gridPos"]["y"] for r in rows[1:]]
    assert ys == list(range(ys[0], ys[0] + len(ys)))


# -- data links -------------------------------------------------------------------------


def _app_pages_and_params() -> tuple[set[str], set[str]]:
    """The kvscope app's page paths ("" is the default page) and its URL query params."""
    app = (APP / "app.py").read_text()
    pages = set(re.findall(r'url_path="([^"]+)"', app))
    default = re.search(r'url_path="([^"]+)",\s*default=True', app)
    if default:
        pages.add("")  # the default page is served at the root
    params: set[str] = set()
    for path in APP.rglob("*.py"):
        params |= set(re.findall(r"st\.query_params(?:\.get\()?\[?\"(\w+)\"", path.read_text()))
    # The sidebar's time widgets are bound to the URL under their session-state keys.
    from kvscope.dashboard._window import FROM_KEY, TIME_KEY, TO_KEY, WINDOW_KEY

    window = (APP / "_window.py").read_text()
    assert window.count('bind="query-params"') >= 4
    return pages, params | {TIME_KEY, WINDOW_KEY, FROM_KEY, TO_KEY}


def test_data_links_open_pages_and_params_the_app_has(dashboard: dict[str, Any]) -> None:
    pages, params = _app_pages_and_params()
    assert {"", "engine", "plateau"} <= pages
    assert params == {"engine", "time", "window", "from", "to"}
    assert "kvscope_url" in {v["name"] for v in dashboard["templating"]["list"]}
    links = list(dashboard["links"])
    for p in _data_panels(dashboard):
        links += p["fieldConfig"]["defaults"].get("links", [])
        for o in p["fieldConfig"].get("overrides", []):
            links += [x for prop in o["properties"] if prop["id"] == "links" for x in prop["value"]]
    assert len(links) >= 20
    linked_panels = [
        p for p in _data_panels(dashboard) if p["fieldConfig"]["defaults"].get("links")
    ]
    assert len(linked_panels) >= 20
    for link in links:
        m = re.fullmatch(r"\$\{kvscope_url\}/([a-z]*)\?(.+)", link["url"])
        assert m, link["url"]
        assert m.group(1) in pages, link["url"]
        query = dict(kv.split("=", 1) for kv in m.group(2).split("&"))
        assert set(query) <= params, link["url"]
        # Every link opens the app on Grafana's time range (unix seconds, the app's syntax).
        assert query["time"] == "range", link["url"]
        assert query["from"] == "${__from:date:seconds}", link["url"]
        assert query["to"] == "${__to:date:seconds}", link["url"]
        if "engine" in query:
            assert query["engine"].endswith(".engine:percentencode}"), link["url"]


# -- alerts -----------------------------------------------------------------------------


def test_every_alert_has_a_runbook(rules: dict[str, dict[str, Any]]) -> None:
    index = (RUNBOOKS / "README.md").read_text()
    urls = {name: rule["annotations"].get("runbook_url", "") for name, rule in rules.items()}
    for name, url in urls.items():
        if name == "KvscopeCollectorAbsent":
            # No collector answers then, and the alert has no instance: the repository page.
            assert url == f"docs/runbooks/{name}.md", url
        else:
            # The collector that exported the series serves the page (GET /runbooks/<alert>).
            assert url == f"http://{{{{ $labels.instance }}}}/runbooks/{name}", (name, url)
    for name, rule in rules.items():
        page = RUNBOOKS / f"{name}.md"
        assert page.is_file(), f"{name}: no {page.relative_to(ROOT)}"
        text = page.read_text()
        assert text.startswith(f"# {name}\n"), name
        for section in RUNBOOK_SECTIONS:
            assert section in text, (name, section)
        assert "```promql" in text, f"{name}: no PromQL to confirm it with"
        assert f"**Severity: {rule['labels']['severity']}**" in text, name
        assert f"]({name}.md)" in index, f"{name}: not in docs/runbooks/README.md"
    pages = {p.stem for p in RUNBOOKS.glob("Kvscope*.md")}
    assert pages == set(rules), "runbook pages without an alert, or alerts without one"


def test_only_data_loss_and_fast_slo_burn_page(rules: dict[str, dict[str, Any]]) -> None:
    """Data loss and a fast burn of an SLO's error budget page; the rest does not."""
    critical = {n for n, r in rules.items() if r["labels"]["severity"] == "critical"}
    assert critical == CRITICAL
    # Every SLO burn alert is either fast (pages) or slow (a ticket), in pairs.
    burns = {n for n in rules if n.endswith(("SloFastBurn", "SloSlowBurn"))}
    assert {n for n in burns if n.endswith("SloFastBurn")} == FAST_SLO_BURN
    for fast in FAST_SLO_BURN:
        slow = fast.replace("SloFastBurn", "SloSlowBurn")
        assert slow in burns and rules[slow]["labels"]["severity"] == "warning", slow
    assert rules["KvscopePreemptionStorm"]["labels"]["severity"] == "warning"
