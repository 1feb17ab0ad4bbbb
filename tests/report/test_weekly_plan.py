"""The weekly report's plan on seeded synthetic weeks: one count of what changed in every
rendering, the action list first and grouped by the kind of its effect, and the
preemption-thrash row that says why."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from test_weekly import EID, T0, WEEK, _Source, fleet  # noqa: F401  (fleet: a fixture)

from kvscope.advisor.findings import EngineVerdict, Finding, Scope
from kvscope.report import _rows
from kvscope.report.build import build_weekly_report
from kvscope.report.html import render_html
from kvscope.report.markdown import render_markdown
from kvscope.report.model import WeeklyReport
from kvscope.report.text import render_summary

COUNTS = re.compile(r"(\d+) worse, (\d+) better, (\d+) other, (\d+) configuration change")


@pytest.fixture(scope="module")
def reports(fleet: dict) -> dict[int, WeeklyReport]:  # noqa: F811
    """The same fleet read as two weeks of data (a comparison) and as one (none before)."""
    out = {}
    for weeks, since in ((2, T0 - 3600 + WEEK), (1, T0 - 3600)):
        out[weeks] = build_weekly_report(
            _Source(fleet), since, since + WEEK, source_label="frames", gpu_hour_cost=2.0
        )
    return out


@pytest.mark.parametrize("weeks", [2, 1])
def test_every_rendering_shows_the_same_counts(reports: dict, weeks: int) -> None:
    wr = reports[weeks]
    counts = json.loads(wr.to_json())["change_counts"]
    md, html, cli = render_markdown(wr), render_html(wr), render_summary(wr)
    glance_md = re.search(r"\| worse / better \| ([^|]+) \| ([^|]+) \|", md)
    glance_html = re.search(
        r'worse / better</div><div class="value">([^<]+)</div><div class="note">([^<]+)<', html
    )
    assert glance_md is not None and glance_html is not None
    if weeks == 1:
        assert counts == {
            "compared": False,
            "worse": 0,
            "better": 0,
            "other": 0,
            "config": 0,
            "total": 0,
        }
        for text in (md, html, cli):
            assert "no data the week before: nothing to compare with; 0 configuration" in text
            assert COUNTS.search(text) is None
        assert glance_md.group(1).strip() == glance_html.group(1) == "n/a"
        assert "change(s) since the week before" not in cli
        return
    assert counts["compared"] and counts["total"] > 0
    want = (counts["worse"], counts["better"], counts["other"], counts["config"])
    for name, text in (("markdown", md), ("html", html), ("cli", cli)):
        found = COUNTS.search(text)
        assert found is not None, name
        assert tuple(int(x) for x in found.groups()) == want, name
    for m in (glance_md, glance_html):
        assert m.group(1).strip() == f"{counts['worse']} / {counts['better']}"
        assert f"{counts['other']} other, {counts['config']} configuration" in m.group(2)
    # and the counts are those of the listed changes
    listed = wr.comparison.changes
    assert counts["config"] == sum(c.kind == "config_change" for c in listed)
    assert counts["worse"] == sum(c.direction == "worse" for c in listed)


@pytest.mark.parametrize("weeks", [2, 1])
def test_action_list_comes_first_and_round_trips(reports: dict, weeks: int) -> None:
    wr = reports[weeks]
    md, html = render_markdown(wr), render_html(wr)
    assert md.index("## Action list") < md.index("| at a glance") < md.index("## What changed")
    assert html.index('id="actions"') < html.index('id="glance"') < html.index('id="changes"')
    assert "## GPU-hours per pool" in md and "## Capacity forecast" in md
    assert 'id="gpu-hours"' in html and 'id="forecast"' in html
    again = WeeklyReport.from_json(wr.to_json())
    assert again.to_dict() == wr.to_dict()
    assert [a.status for a in again.actions] == [a.status for a in wr.actions]
    d = json.loads(wr.to_json())
    assert all(
        a["gain_kind"] in ("throughput", "latency", "cost", "unquantified") for a in d["actions"]
    )
    assert d["gpu_hour_cost"] == 2.0 and d["gpu_hours"][0]["cost_usd"] is not None
    assert d["forecast"][0]["pool"] == "synth"
    if weeks == 1:  # everything is new; the seq-capped engine gets a throughput and a latency item
        assert {a.status for a in wr.actions} == {"new"}
        kinds = [a.gain_kind for a in wr.actions]
        assert kinds == sorted(kinds, key=("throughput", "latency", "cost", "unquantified").index)
    else:  # max_num_seqs 6 -> 256 did what last week's --max-num-seqs advice asked
        status = {a.kind: a.status for a in wr.actions}
        assert status["raise_max_num_seqs"] == "done"
        assert status["concurrency_cap"] == "gone"


def test_no_unlike_gains_ranked_on_one_scale(reports: dict) -> None:
    wr = reports[1]
    md = render_markdown(wr)
    section = md[md.index("## Action list") : md.index("| at a glance")]
    groups = re.split(r"\n\*\*(Throughput|Latency|Cost|Effect not quantified)[^\n]*\*\*\n", section)
    seen = dict(zip(groups[1::2], groups[2::2], strict=True))
    assert set(seen) == {"Throughput", "Latency"}
    assert "latency −" not in seen["Throughput"] and "throughput +" in seen["Throughput"]
    assert "throughput +" not in seen["Latency"] and "latency −" in seen["Latency"]
    assert "expected gain" not in md  # no unlabelled gain anywhere
    assert "Gains are ranked within their kind only" in md


def _verdict(**kw: object) -> EngineVerdict:
    base: dict = {"engine_id": EID, "pool": "p", "bottleneck": "kv_cache_bound", "saturated": True}
    return EngineVerdict(**{**base, **kw})


def _bottleneck(rate: float, fall: float) -> Finding:
    ev = {"preemptions_per_s": rate, "drop_past_peak_ratio": fall}
    return Finding("bottleneck", Scope(EID, "p"), "", evidence=ev)


def test_thrash_row_never_contradicts_its_numbers() -> None:
    holds = _rows._thrash(_verdict(), _bottleneck(7.8, 0.03), 0.1)
    assert holds.startswith("no (") and "7.8 preemptions/s" in holds
    assert "throughput holds: 3% below its peak" in holds and "more than 10%" in holds
    yes = _rows._thrash(_verdict(preemption_thrash=True), _bottleneck(7.8, 0.23), 0.1)
    assert yes == "yes: throughput falls 23% past its peak at 7.8 preemptions/s"
    few = _rows._thrash(_verdict(), _bottleneck(0.2, 0.15), 0.1)
    assert few.startswith("no (throughput 15% below its peak") and "0.2 preemptions/s" in few
    cold = _rows._thrash(_verdict(saturated=False), _bottleneck(7.8, 0.0), 0.1)
    assert "not saturated" in cold and "7.8 preemptions/s" in cold
    assert _rows._thrash(_verdict(), _bottleneck(0.0, 0.0), 0.1) == "no (no preemptions)"
    assert "throughput falls past its peak while preempting" in _rows.THRASH_LABEL


def test_thrash_rows_of_a_report(reports: dict) -> None:
    for wr in reports.values():
        (row,) = [r for r in _rows.engine_rows(wr, EID) if r[0] == _rows.THRASH_LABEL]
        for cell in row[1:]:
            assert cell in ("–", "no") or "(" in cell or cell.startswith("yes:"), cell
            if "preemptions/s" in cell and cell.startswith("no"):
                assert "holds" in cell or "below its peak" in cell or "not saturated" in cell


class _WithHistory(_Source):
    """The frames plus the collector's daily peaks of the weeks before (``daily_load_peaks``)."""

    def __init__(self, frames: dict, peaks: pd.DataFrame) -> None:
        super().__init__(frames)
        self.peaks = peaks
        self.asked: list[tuple[float | None, float | None, str | None]] = []

    def daily_load_peaks(
        self, since: float | None = None, until: float | None = None, *, pool: str | None = None
    ) -> pd.DataFrame:
        self.asked.append((since, until, pool))
        p = self.peaks
        return p[(p["day_start_unix_s"] >= (since or 0) - 86400) & (p["day_start_unix_s"] < until)]


def test_the_forecast_runs_through_the_weeks_before(fleet: dict) -> None:  # noqa: F811
    since = T0 - 3600 + WEEK
    day0 = since // 86400 * 86400
    peaks = pd.DataFrame(
        [
            {
                "engine_id": EID,
                "pool": "synth",
                "day_start_unix_s": day0 - d * 86400.0,
                "load_max": 2.0,
            }
            for d in range(1, 15)
        ]
    )
    src = _WithHistory(fleet, peaks)
    wr = build_weekly_report(
        src, since, since + WEEK, source_label="frames", forecast_history_weeks=2
    )
    assert src.asked == [(since - 2 * WEEK, since, None)]
    (f,) = wr.forecast
    assert f.history_days == 14 and f.daily_peak[:14] == [2.0] * 14
    md, cli = render_markdown(wr), render_summary(wr)
    for text in (md, cli):
        assert "over the 14 day(s) before (1-minute windows)" in text
    assert WeeklyReport.from_json(wr.to_json()).forecast[0].history_days == 14
    none = build_weekly_report(
        src, since, since + WEEK, source_label="frames", forecast_history_weeks=0
    )
    assert none.forecast[0].history_days == 0 and len(src.asked) == 1
