"""The dashboard over Prometheus (``--prometheus URL``) under Streamlit's AppTest, on real
Prometheus servers holding the replayed run (see conftest.py), against the same
dashboard reading the collector that stored the run through kvscope's plugin path.

Every page renders without an exception; the verdicts are the advisor's on
Prometheus (``analyze_prometheus``), and for the collector's engine the same as from
the collector; the engine page says why it has no per-step series; wrong credentials
show what to do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _promfleet import Fleet
from streamlit.testing.v1 import AppTest

from kvscope.sources.prometheus.source import PrometheusSource, analyze_prometheus

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
KVSCOPE_ENGINE = "demo-host:8000:0"
PAGES = ["_pages/engine.py", "_pages/plateau.py", "_pages/recommendations.py", "_pages/prefix.py"]


def _app(
    monkeypatch: pytest.MonkeyPatch, fleet: Fleet, *where: str, page: str | None = None
) -> AppTest:
    monkeypatch.setattr(
        sys, "argv", ["app.py", *where, "--refresh", "0", "--since", f"{fleet.since:.3f}"]
    )
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption]
    parts += [w.value for w in at.warning] + [i.value for i in at.info]
    return "\n".join(parts)


def _verdicts(at: AppTest) -> dict[str, str]:
    engines = at.table[1].value
    return {str(eid): str(engines.loc[eid, "verdict"]) for eid in engines.index}


def test_overview_from_prometheus_matches_the_advisor_and_the_store(
    monkeypatch: pytest.MonkeyPatch, fleet: Fleet
) -> None:
    url = fleet.backends["prometheus"].url
    at = _app(monkeypatch, fleet, "--prometheus", url)
    assert not at.error, [e.value for e in at.error]
    expected = analyze_prometheus(PrometheusSource(url), fleet.since, None)
    got = _verdicts(at)
    assert set(got) == {v.engine_id for v in expected.engines}
    assert len(got) == 3
    for v in expected.engines:
        assert got[v.engine_id].startswith(
            f"{v.bottleneck}, {'saturated' if v.saturated else 'headroom'}"
        ), v.engine_id
    caption = at.caption[0].value
    assert (
        f"from {url}" in caption
        and "1-second windows (Prometheus, confidences scaled" in caption
        and "(estimated from histograms)" in caption
    )
    assert f"**Prometheus** `{url}`" in "\n".join(m.value for m in at.sidebar.markdown)

    store = _verdicts(_app(monkeypatch, fleet, "--collector", fleet.collector.url))
    assert got[KVSCOPE_ENGINE].split(",")[:2] == store[KVSCOPE_ENGINE].split(",")[:2]
    assert got[KVSCOPE_ENGINE].startswith("kv_cache_bound, saturated")


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_from_prometheus(
    monkeypatch: pytest.MonkeyPatch, fleet: Fleet, page: str
) -> None:
    at = _app(monkeypatch, fleet, "--prometheus", fleet.backends["prometheus"].url, page=page)
    assert not at.error, [e.value for e in at.error]
    if page == "_pages/engine.py":
        assert "Per-step series need kvscope's plugin and a collector" in _texts(at)
        assert at.get("vega_lite_chart")  # the per-scrape series are drawn


def test_dashboard_with_basic_auth_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, fleet: Fleet
) -> None:
    b = fleet.backends["prometheus-secured"]
    where = [
        "--prometheus",
        b.url,
        "--prometheus-user",
        b.user,
        "--prometheus-ca-file",
        str(b.ca_file),
    ]
    monkeypatch.setenv("KVSCOPE_PROMETHEUS_PASSWORD", "not-the-Pa55word")
    at = _app(monkeypatch, fleet, *where)
    errors = "\n".join(e.value for e in at.error)
    assert "Prometheus refused the credentials (401)" in errors
    assert "not-the-Pa55word" not in errors + _texts(at)
    monkeypatch.setenv("KVSCOPE_PROMETHEUS_PASSWORD", b.password)
    at = _app(monkeypatch, fleet, *where, "--pool", "kvscope-demo")
    assert not at.error, [e.value for e in at.error]
    assert _verdicts(at)[fleet.engine_id(fleet.new)].startswith("kv_cache_bound, saturated")
