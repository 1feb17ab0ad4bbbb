"""kvscope.advisor.weekly and kvscope.advisor.usage on seeded synthetic engines with known answers, and the renderers on
the report built from them (including a week with nothing before it)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.datasets import make_engine
from kvscope.advisor.frames import prepare_windows
from kvscope.advisor.usage import weekly_usage
from kvscope.advisor.weekly import compare_weeks, config_as_of, config_changes
from kvscope.report.build import build_weekly_report
from kvscope.report.html import render_html
from kvscope.report.markdown import render_markdown
from kvscope.report.model import WeeklyReport

WEEK = 7 * 86400
T0 = 1_800_000_000 - 2 * WEEK + 3600  # an hour into the first week
EID = "synth:8000:0"


def _hello(engines: pd.DataFrame, boot: str, started: float) -> pd.DataFrame:
    return engines.assign(boot_id=boot, started_unix_s=started, received_unix_s=started + 1)


@pytest.fixture(scope="module")
def fleet() -> dict:
    """One engine: seq-capped in week 1, raised to max_num_seqs 256 (and so KV-rich and
    not saturated) in week 2."""
    w1 = make_engine("max_num_seqs_bound", seed=1, engine_id=EID, t0=T0)
    w2 = make_engine("not_saturated", seed=2, engine_id=EID, t0=T0 + WEEK)
    configs = pd.concat(
        [
            _hello(w1.engines, "boot-1", T0 - 60),
            _hello(w1.engines, "boot-2", T0 + 86400 - 60),  # a plain restart
            _hello(w2.engines, "boot-3", T0 + WEEK - 60),
        ],
        ignore_index=True,
    )
    return {
        "w1": w1,
        "w2": w2,
        "configs": configs,
        "engines": w2.engines,
        "windows": pd.concat([w1.windows, w2.windows], ignore_index=True),
        "requests": pd.concat([w1.requests, w2.requests], ignore_index=True),
    }


def test_config_as_of_takes_the_last_hello_before(fleet: dict) -> None:
    then = config_as_of(fleet["engines"], fleet["configs"], T0 + WEEK - 120)
    assert then["max_num_seqs"].iloc[0] == 6
    assert (
        config_as_of(fleet["engines"], fleet["configs"], T0 + WEEK)["max_num_seqs"].iloc[0] == 256
    )
    assert config_as_of(fleet["engines"], None, T0).equals(fleet["engines"])
    before_any = config_as_of(fleet["engines"], fleet["configs"], T0 - 3600)
    assert before_any["max_num_seqs"].iloc[0] == 256  # no hello then: the row stays


def test_config_changes_only_real_changes_in_the_window(fleet: dict) -> None:
    assert config_changes(fleet["configs"], T0, T0 + WEEK - 60) == []  # a restart, same flags
    (ch,) = config_changes(fleet["configs"], T0 + WEEK - 3600, T0 + 2 * WEEK)
    assert ch.at_unix_s == T0 + WEEK - 60 and ch.scope.engine_id == EID
    assert ch.before["max_num_seqs"] == 6 and ch.after["max_num_seqs"] == 256
    assert "max_num_seqs 6 -> 256" in ch.summary


def _weeks(fleet: dict) -> tuple:
    out = []
    for since in (T0 - 3600, T0 - 3600 + WEEK):
        src = FrameSource(
            config_as_of(fleet["engines"], fleet["configs"], since + WEEK),
            fleet["windows"],
            fleet["requests"],
        )
        out.append(analyze(src, since, since + WEEK))
    return tuple(out)


def test_compare_weeks_known_answers(fleet: dict) -> None:
    previous, current = _weeks(fleet)
    assert previous.engine(EID).bottleneck == fleet["w1"].truth["bottleneck"]
    assert current.engine(EID).bottleneck == fleet["w2"].truth["bottleneck"]
    cmp = compare_weeks(current, previous, fleet["configs"])
    kinds = {c.kind: c for c in cmp.changes}
    assert kinds["config_change"].after["max_num_seqs"] == 256
    bn = kinds["bottleneck_change"]
    assert (bn.before, bn.after, bn.direction) == ("max_num_seqs_bound", "not_saturated", "better")
    assert kinds["cap_change"].after is None
    resolved = {c.evidence["kind"] for c in cmp.changes if c.kind == "resolved_recommendation"}
    assert "concurrency_cap" in resolved
    assert len(cmp.recommendation_status) == len(current.recommendations)
    # the same week against itself: nothing moved, every recommendation still open
    same = compare_weeks(previous, previous)
    assert same.changes == [] and set(same.recommendation_status) <= {"open"}


def test_no_previous_week(fleet: dict) -> None:
    _, current = _weeks(fleet)
    empty = analyze(FrameSource(fleet["engines"], fleet["windows"]), 0, 1000)
    cmp = compare_weeks(current, empty, fleet["configs"])
    assert [c.kind for c in cmp.changes] == ["config_change", "no_previous_data"]
    assert set(cmp.recommendation_status) <= {"new"}


def test_weekly_usage_counts_seconds_past_the_knee(fleet: dict) -> None:
    previous, _ = _weeks(fleet)
    since = T0 - 3600
    u = weekly_usage(fleet["windows"], fleet["requests"], previous, since, since + WEEK)
    v = previous.engine(EID)
    w = prepare_windows(fleet["w1"].windows)
    row = u.engine(EID)
    assert row["active_s"] == len(w)
    assert row["saturated_s"] == int((w["load"] > v.knee_concurrency).sum()) > 0
    assert math.isclose(row["saturated_share"], row["saturated_s"] / row["active_s"])
    assert row["generation_tokens"] == w["generation_tokens"].sum()
    assert row["requests"] == len(fleet["w1"].requests)
    assert sum(u.days["active_s"]) == len(w) and len(set(u.days["day_start_unix_s"])) == 8
    assert u.pool("synth")["active_s"] == len(w)


class _Source(FrameSource):
    def __init__(self, fleet: dict) -> None:
        super().__init__(fleet["engines"], fleet["windows"], fleet["requests"])
        self._configs = fleet["configs"]

    def engine_configs(self) -> pd.DataFrame:
        return self._configs


@pytest.mark.parametrize("weeks_of_data", [2, 1])
def test_build_and_render(fleet: dict, weeks_of_data: int) -> None:
    since = T0 - 3600 + WEEK if weeks_of_data == 2 else T0 - 3600
    wr = build_weekly_report(_Source(fleet), since, since + WEEK, source_label="frames")
    again = WeeklyReport.from_json(wr.to_json())
    assert again.to_dict() == wr.to_dict()
    html, md = render_html(wr), render_markdown(wr)
    assert EID in html and EID in md and html.count("<svg") >= 2
    if weeks_of_data == 1:
        assert "no data the week before" in html and "no data the week before" in md
    else:
        assert "max_num_seqs 6 → 256" in html
