"""``kvscope report`` end to end, on two generated weeks of real vLLM recordings.

The weeks (see :mod:`_week`) carry known answers: chat-a restarted with
``max_num_seqs`` 6 -> 256 on the first day of this week (its plateau moves up and its
knee is gone: this week it never saturated; last week's ``max_num_seqs_bound`` is gone); chat-b's traffic grew past its knee
(``not_saturated`` -> ``kv_cache_bound``); batch-a did the same both weeks.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import pytest
from _runs import Browser, Session
from _week import BATCH_A, CHAT_A, CHAT_B, WEEK_S

from kvscope.advisor import Report
from kvscope.report.model import REPORT_KIND, REPORT_SCHEMA_VERSION, WeeklyReport


def _changes(report: dict[str, Any], kind: str, engine_id: str | None = None) -> list[dict]:
    return [
        c
        for c in report["comparison"]["changes"]
        if c["kind"] == kind and (engine_id is None or c["scope"]["engine_id"] == engine_id)
    ]


def _verdict(report: dict[str, Any], week: str, engine_id: str) -> dict[str, Any]:
    return next(v for v in report[week]["engines"] if v["engine_id"] == engine_id)


def test_writes_three_files_and_no_progress_bar_into_a_pipe(session: Session) -> None:
    for run in (session.via_collector, session.via_store):
        assert run.returncode == 0, run.stderr
        for name in ("report.html", "report.md", "report.json"):
            assert (run.out / name).stat().st_size > 1000, name
        assert run.stderr == ""  # the progress bar is drawn only on a terminal
        assert "report.html" in run.stdout
    print(
        f"report via collector: {session.via_collector.seconds:.1f} s, via store: "
        f"{session.via_store.seconds:.1f} s"
    )


def test_json_is_versioned_and_round_trips(session: Session) -> None:
    d = session.via_collector.json
    assert d["kind"] == REPORT_KIND and d["schema_version"] == REPORT_SCHEMA_VERSION
    wr = WeeklyReport.from_dict(d)
    assert wr.to_dict()["current"] == d["current"]
    assert d["window"]["until_unix_s"] - d["window"]["since_unix_s"] == WEEK_S
    assert d["previous_window"]["until_unix_s"] == d["window"]["since_unix_s"]


def test_json_follows_its_schema_and_says_which_kvscope_wrote_it(session: Session) -> None:
    """report.json against the schema kvscope ships (kvscope/report/report.schema.json),
    each week's advise report against the advisor's, for both sources."""
    from importlib.resources import files

    import jsonschema

    from kvscope import __version__

    schema = json.loads(files("kvscope.report").joinpath("report.schema.json").read_text())
    advise = json.loads(files("kvscope.advisor").joinpath("advise.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for run in (session.via_collector, session.via_store):
        d = run.json
        jsonschema.validate(d, schema)
        assert d["kvscope_version"] == __version__
        for week in ("current", "previous"):
            jsonschema.validate(d[week], advise)
        assert [a["recommendation_id"] for a in d["actions"]]
    bad = {**session.via_collector.json, "kind": "something-else"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_verdicts_are_the_advisors(session: Session) -> None:
    """Per-engine verdicts equal kvscope.advisor.analyze's for the same window and source; the
    two sources agree up to the read API's JSON rounding (10 decimal digits)."""
    got = session.via_collector.json["current"]["engines"]
    assert got == session.advisor_engines
    offline = session.via_store.json["current"]["engines"]
    assert offline == session.store_advisor_engines
    assert len(offline) == len(got)
    for a, b in zip(offline, got, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert _close(a[k], b[k]), (a["engine_id"], k, a[k], b[k])
    verdicts = {v["engine_id"]: v["bottleneck"] for v in got}
    # The ample-KV run grows about 12% over its last doubling of load: it sits at the
    # saturation margin, and either side of it is right as long as compute is named.
    assert verdicts.pop(CHAT_A) in ("not_saturated", "compute_bound")
    assert verdicts == {BATCH_A: "max_num_seqs_bound", CHAT_B: "kv_cache_bound"}


def _close(a: Any, b: Any) -> bool:
    """Equal, floats up to the read API's rounding, nested blocks (latency) included."""
    if isinstance(a, float) and isinstance(b, float):
        return bool(a == pytest.approx(b, rel=1e-8))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_last_week_is_judged_by_last_weeks_configuration(session: Session) -> None:
    d = session.via_store.json
    assert _verdict(d, "previous", CHAT_A)["bottleneck"] == "max_num_seqs_bound"
    assert d["week_configs"]["previous"][CHAT_A]["max_num_seqs"] == 6
    assert d["week_configs"]["current"][CHAT_A]["max_num_seqs"] == 256
    assert _verdict(d, "previous", CHAT_B)["bottleneck"] == "not_saturated"


def test_what_changed(session: Session) -> None:
    d = session.via_collector.json
    (cfg,) = _changes(d, "config_change")
    assert cfg["scope"]["engine_id"] == CHAT_A
    assert cfg["before"] == {"max_num_seqs": 6} and cfg["after"] == {"max_num_seqs": 256}
    first_ample = min(
        r.end_unix_s
        for r in session.week.runs
        if r.engine_id == CHAT_A and r.recording == "ample_kv"
    )
    assert d["window"]["since_unix_s"] <= cfg["at_unix_s"] < first_ample
    plateau = _changes(d, "plateau_move", CHAT_A)
    assert plateau and plateau[0]["after"] > 1.5 * plateau[0]["before"]
    # A knee is published only for a saturated engine: unsaturated this week, chat-a has
    # none, so no knee moved (the bottleneck change below says what happened).
    if _verdict(d, "current", CHAT_A)["bottleneck"] == "not_saturated":
        assert not _changes(d, "knee_move", CHAT_A)
    (worse,) = _changes(d, "bottleneck_change", CHAT_B)
    assert (worse["before"], worse["after"], worse["direction"]) == (
        "not_saturated",
        "kv_cache_bound",
        "worse",
    )
    (better,) = _changes(d, "bottleneck_change", CHAT_A)
    assert better["before"] == "max_num_seqs_bound"
    # Unsaturated now: better; compute-bound: a different limit (the plateau move above
    # says the throughput rose).
    assert better["direction"] == ("better" if better["after"] == "not_saturated" else "neutral")
    assert plateau[0]["direction"] == "better"
    resolved = {c["evidence"]["kind"] for c in _changes(d, "resolved_recommendation", CHAT_A)}
    assert "raise_max_num_seqs" in resolved
    assert not [c for c in d["comparison"]["changes"] if c["scope"]["engine_id"] == BATCH_A]
    md, html = session.via_collector.md, session.via_collector.html
    assert "max_num_seqs 6 → 256" in md and "max_num_seqs 6 → 256" in html
    assert "not_saturated → kv_cache_bound" in html


def test_recommendations_grouped_by_kind_and_ranked_within(session: Session) -> None:
    d = session.via_collector.json
    recs = d["current"]["recommendations"]
    assert len(recs) >= 3
    # The report's recommendations come grouped by the kind of their gain, ranked within it.
    order = ("throughput", "latency", "cost", "unquantified")
    rec_kinds = [r["gain_kind"] for r in recs]
    assert rec_kinds == sorted(rec_kinds, key=order.index)
    for kind in set(rec_kinds):
        within = [r["expected_gain"] for r in recs if r["gain_kind"] == kind]
        assert within == sorted(within, reverse=True), kind
    # The action list holds each of this week's recommendations once, grouped by the kind
    # of its effect (never ranked across kinds) and by expected gain within a kind.
    actions = [a for a in d["actions"] if a["status"] in ("new", "open")]
    assert sorted(a["recommendation_id"] for a in actions) == sorted(r["id"] for r in recs)
    kinds = [a["gain_kind"] for a in actions]
    assert kinds == sorted(kinds, key=order.index)
    for kind in set(kinds):
        within = [a["expected_gain"] for a in actions if a["gain_kind"] == kind]
        assert within == sorted(within, key=lambda g: -(g or 0.0))
    by_id = {r["id"]: r for r in recs}
    ordered = [by_id[a["recommendation_id"]] for a in actions]
    status = dict(
        zip(
            [(r["kind"], r["scope"]["engine_id"]) for r in recs],
            d["comparison"]["recommendation_status"],
            strict=True,
        )
    )
    assert status[("raise_max_num_seqs", BATCH_A)] == "open"
    assert status[("concurrency_cap", CHAT_B)] == "new"
    assert {(a["kind"], a["scope"]["engine_id"]): a["status"] for a in actions} == status
    html = session.via_collector.html
    heads = re.findall(r'<div class="head">(.*?)</div>', html)
    assert heads[: len(recs)] == [_escaped(r["summary"]) for r in ordered]
    cap_b = next(
        r for r in recs if (r["kind"], r["scope"]["engine_id"]) == ("concurrency_cap", CHAT_B)
    )
    flags = cap_b["change"]["vllm_flags"]
    assert len(flags) == 2 and flags[0].startswith("--max-num-seqs ")
    # At most the 10-13 sequences the KV-starved engine's cache holds, and past its knee.
    assert 6 <= int(flags[0].split()[1]) <= 13
    assert " ".join(flags) in html  # the change to copy


def _escaped(text: str) -> str:
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#x27;")
    )


def test_usage_and_time_past_the_knee(session: Session) -> None:
    d = session.via_collector.json
    rep = Report.from_dict(d["current"])
    eng = {e: i for i, e in enumerate(d["usage"]["engines"]["engine_id"])}
    col = d["usage"]["engines"]
    for eid in (CHAT_B, BATCH_A):
        share = col["saturated_share"][eng[eid]]
        assert rep.engine(eid).saturated and 0.1 < share < 0.9, (eid, share)
    if not rep.engine(CHAT_A).saturated:
        assert col["saturated_s"][eng[CHAT_A]] == 0  # not saturated: no time past a knee
    days = d["usage"]["days"]
    busy = {
        days["day_start_unix_s"][i]
        for i, e in enumerate(days["engine_id"])
        if e == BATCH_A and days["active_s"][i] > 0
    }
    assert len(busy) == 7  # one run a day
    assert sum(col["requests"]) == d["current"]["coverage"]["n_requests"]


def test_html_is_self_contained(session: Session) -> None:
    html = session.via_collector.html
    assert not re.search(r"""(?:src|href|xlink:href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(?:https?:)?//", html, re.I)
    assert "<script" not in html.lower() and "<link" not in html.lower()
    assert "@import" not in html
    # plots embedded inline: a curve per engine and daily charts per pool
    assert html.count("<svg") >= 3 + 2 * 2
    assert html.count("<polyline") >= 3


def test_store_locked_by_a_running_collector(session: Session) -> None:
    run = session.locked
    assert run.returncode == 2
    assert "in use by another process" in run.stderr and "--collector" in run.stderr
    assert not (run.out / "report.html").exists()


def test_no_data_in_the_window(session: Session) -> None:
    run = session.no_data
    assert run.returncode == 3, run.stderr
    assert "no data in the window" in run.stderr


def _png_size(path: Any) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_renders_in_chromium(session: Session, browser: Browser) -> None:
    assert browser.returncode == 0, browser.stderr[-2000:]
    assert _png_size(browser.screenshot) == (1300, 2000)
    assert browser.screenshot.stat().st_size > 60_000  # a page with charts, not a blank one
    dom = browser.dom
    assert "kvscope weekly tuning report" in dom
    d = session.via_collector.json
    chat_b = _verdict(d, "current", CHAT_B)
    for text in (
        f"{chat_b['knee_concurrency']:.1f} in flight",
        f"{chat_b['plateau_tokens_per_s']:,.0f} tok/s",
        f"{chat_b['recommended_concurrency_cap']} in flight",
        "max_num_seqs 6 → 256",
        "What changed since the previous week",
        "Action list",
        "Recommendations in detail",
        "time past the knee per day",
    ):
        assert text in dom, text
    assert dom.count("<svg") >= 7 and dom.count("<circle") > 20
    print(f"\nreport screenshot: {browser.screenshot}")
