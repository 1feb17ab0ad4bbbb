"""The weekly report's latency and SLO section on the seeded synthetic weeks: the same
numbers in Markdown, HTML and JSON, each the advisor's on that week's requests; SLO
columns only when targets are given."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from test_weekly import EID, T0, WEEK, _Source, fleet  # noqa: F401  (fleet: a fixture)

from kvscope.advisor.render_latency import ms_or_s
from kvscope.advisor.request_latency import SloTargets, request_latency
from kvscope.report.build import build_weekly_report
from kvscope.report.html import render_html
from kvscope.report.markdown import render_markdown
from kvscope.report.model import WeeklyReport

SINCE = T0 - 3600 + WEEK


def _week_requests(fleet: dict, since: float) -> pd.DataFrame:  # noqa: F811
    r = fleet["requests"]
    t = pd.to_numeric(r["finished_unix_s"])
    return r[(t >= since) & (t < since + WEEK)]


@pytest.fixture(scope="module")
def with_targets(fleet: dict) -> WeeklyReport:  # noqa: F811
    return build_weekly_report(
        _Source(fleet), SINCE, SINCE + WEEK, source_label="frames", slo_ttft_s=0.5, slo_itl_s=0.05
    )


def test_the_pool_block_is_the_weeks_requests(with_targets: WeeklyReport, fleet: dict) -> None:  # noqa: F811
    targets = SloTargets(ttft_s=0.5, itl_s=0.05)
    now = with_targets.current.pools[0].latency
    before = with_targets.previous.pools[0].latency
    assert now == request_latency(_week_requests(fleet, SINCE), targets)
    assert before == request_latency(_week_requests(fleet, SINCE - WEEK), targets)
    assert now is not None and set(now.slo) == {"ttft", "itl", "all"}
    assert with_targets.parameters["slo_ttft_s"] == 0.5
    again = WeeklyReport.from_json(with_targets.to_json())
    assert again.current.pools[0].latency == now
    d = json.loads(with_targets.to_json())
    assert d["current"]["pools"][0]["latency"]["slo"]["itl"]["target_s"] == 0.05


def test_markdown_and_html_show_the_same_row(with_targets: WeeklyReport) -> None:
    lat = with_targets.current.pools[0].latency
    assert lat is not None
    md, html = render_markdown(with_targets), render_html(with_targets)
    assert "Latency and SLOs:" in md and "<h3>Latency and SLOs</h3>" in html
    ttft = f"{ms_or_s(lat.ttft_s.p50)} / {ms_or_s(lat.ttft_s.p90)} / {ms_or_s(lat.ttft_s.p99)}"
    share = f"{lat.slo['ttft'].share:.1%}"
    every = f"{lat.slo['all'].share:.1%}"
    row = re.search(r"^\| pool, this week \| ([^|]+) \| ([^|]+) \|.*$", md, re.M)
    assert row is not None
    assert row.group(1).strip() == f"{lat.n_requests:,}"
    assert row.group(2).strip() == ttft
    cells = [c.strip() for c in row.group(0).strip("|").split("|")]
    head = re.search(r"^\| {2}\| requests \| TTFT \|.*$", md, re.M)
    assert head is not None
    names = [c.strip() for c in head.group(0).strip("|").split("|")]
    assert names[6:9] == ["TTFT <= 500 ms", "ITL <= 50 ms", "every target"]
    assert cells[6] == share and cells[8] == every
    html_row = re.search(r"<tr><td>pool, this week</td>(.*?)</tr>", html)
    assert html_row is not None
    assert f"<td>{ttft}</td>" in html_row.group(1) and f"<td>{share}</td>" in html_row.group(1)
    assert "<th>TTFT &lt;= 500 ms</th>" in html
    assert f"<td>{EID}</td>" in html  # the engine's own row


def test_no_targets_no_slo_columns(fleet: dict) -> None:  # noqa: F811
    wr = build_weekly_report(_Source(fleet), SINCE, SINCE + WEEK, source_label="frames")
    lat = wr.current.pools[0].latency
    assert lat is not None and lat.slo == {}
    md = render_markdown(wr)
    assert "Latency and SLOs:" in md
    assert "every target" not in md.split("Latency and SLOs:")[1].split("\n\n")[1]
    assert "&lt;=" not in render_html(wr).split("Latency and SLOs")[1].split("</table>")[0]
