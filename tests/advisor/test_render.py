"""The terminal rendering, plain text and Markdown, the text plot, the messages, and the
pool-level cap."""

from __future__ import annotations

import io

import pandas as pd
from rich.console import Console

from kvscope.advisor import FrameSource, Report, SourceError, analyze
from kvscope.advisor.datasets import make_engine
from kvscope.advisor.render import (
    _change_rows,
    no_data_message,
    render_report,
    source_error_message,
)
from kvscope.advisor.render_text import markdown_report, print_report, text_report
from kvscope.advisor.textplot import CAP, KNEE, POINT, throughput_plot


def _text(report: Report) -> str:
    buf = io.StringIO()
    render_report(
        report,
        Console(file=buf, width=100, color_system=None),
        source="test",
        window="the test window",
    )
    return buf.getvalue()


def _pool_of_two() -> Report:
    a = make_engine("kv_cache_bound", seed=0, engine_id="h1:8000:0", pool="p")
    b = make_engine("max_num_seqs_bound", seed=1, engine_id="h2:8000:0", pool="p")
    cat = [
        pd.concat([x, y], ignore_index=True)
        for x, y in ((a.engines, b.engines), (a.windows, b.windows), (a.requests, b.requests))
    ]
    return analyze(FrameSource(*cat))


def test_verdict_comes_first_then_plot_recommendations_findings() -> None:
    s = make_engine("kv_cache_bound", seed=0)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests))
    v = rep.engines[0]
    text = _text(rep)
    lines = text.splitlines()
    assert lines[0].startswith("pool synth: kv_cache_bound (1 engine)")
    assert f"recommended cap {v.recommended_concurrency_cap} in flight" in lines[0]
    assert lines[1].strip() == "synth:8000:0: kv_cache_bound, saturated"
    assert (
        text.index("from test, the test window")
        < text.index("Recommendations: ")
        < text.index("Findings")
    )
    assert f"{KNEE} knee" in text and f"{CAP} cap {v.recommended_concurrency_cap}" in text
    assert (
        f"--max-num-queued-reqs {v.recommended_concurrency_cap + -(-v.recommended_concurrency_cap // 4)}"
        in text
    )


def test_pool_cap_sums_engines_with_per_replica_gateway_limits() -> None:
    rep = _pool_of_two()
    (pool,) = rep.pools
    caps = {v.engine_id: v.recommended_concurrency_cap for v in rep.engines}
    assert None not in caps.values()
    assert pool.recommended_concurrency_cap == sum(caps.values())  # type: ignore[arg-type]
    rec = next(r for r in rep.recommendations if r.kind == "pool_concurrency_cap")
    assert rec.scope.pool == "p" and rec.scope.engine_id is None
    assert rec.change["concurrency_cap"] == pool.recommended_concurrency_cap
    upstream = rec.change["gateway"]["nginx"]["config"]
    assert f"server h1:8000 max_conns={caps['h1:8000:0']};" in upstream
    assert f"server h2:8000 max_conns={caps['h2:8000:0']};" in upstream
    assert f"limit_conn vllm_p_inflight {pool.recommended_concurrency_cap};" in upstream
    assert 0 < rec.expected_effect["throughput_fraction"] <= 1
    text = _text(rep)
    assert text.startswith("pool p: ")
    assert "(summed over engines)" in text[: text.index("h1:8000:0")]


def test_engines_without_data_in_the_window_are_left_out() -> None:
    a = make_engine("kv_cache_bound", seed=0, engine_id="live:8000:0", pool="p")
    b = make_engine("kv_cache_bound", seed=0, engine_id="gone:8000:0", pool="p")
    rep = analyze(
        FrameSource(pd.concat([a.engines, b.engines], ignore_index=True), a.windows, a.requests)
    )
    assert [v.engine_id for v in rep.engines] == ["live:8000:0"]
    assert rep.coverage["n_engines_known"] == 2 and rep.coverage["n_engines_analyzed"] == 1
    assert Report.from_json(rep.to_json()).coverage == rep.coverage


def test_plot_marks_points_knee_and_cap() -> None:
    lines = throughput_plot(
        [1, 2, 4, 8, 16, 32],
        [100, 200, 380, 600, 640, 630],
        [100, 200, 380, 600, 635, 635],
        knee=7.0,
        cap=8.0,
    )
    body = "\n".join(lines[:-1])
    assert body.count(POINT) == 6 and KNEE in body and CAP in body
    assert "knee 7.0" in lines[-1] and "cap 8" in lines[-1]
    assert lines[-2].split() == ["1", "2", "4", "8", "16", "32"]
    assert throughput_plot([4], [10], None) == []


def test_no_data_messages() -> None:
    s = make_engine("kv_cache_bound", seed=0)
    last = float(s.windows["ts_s"].max())
    later = analyze(
        FrameSource(s.engines.assign(last_step_unix_s=last), s.windows, s.requests),
        since=last + 7200,
        until=None,
    )
    assert not later.has_data
    msg = no_data_message(later, "http://c", "W", now_unix_s=last + 7200 + 60)
    assert msg.startswith("no data in the window W at http://c") and msg.endswith("--since 3h")
    earlier = analyze(
        FrameSource(s.engines.assign(last_step_unix_s=last), s.windows, s.requests),
        since=last - 10_000,
        until=last - 9_000,
    )
    assert "move --until later" in no_data_message(earlier, "http://c", "W")
    # the window lies before the oldest 1-second window the source holds: it aged out
    earlier.coverage["oldest_window_unix_s"] = last - 5_000
    msg = no_data_message(earlier, "http://c", "W")
    assert "1-second windows are held from" in msg and "--window-retention" in msg
    assert msg.endswith("move the window after " + msg.rsplit("move the window after ", 1)[1])
    assert "move --until later" not in msg
    empty = analyze(FrameSource(pd.DataFrame(), pd.DataFrame()))
    assert "knows no engines yet" in no_data_message(empty, "http://c", "W")
    other = analyze(FrameSource(s.engines, s.windows, s.requests), pool="nope")
    assert no_data_message(other, "http://c", "W") == (
        "no engines in pool 'nope' at http://c; pools known: synth"
    )


def test_source_error_messages() -> None:
    down = SourceError("x", url="http://c", path="/v1/engines", reason="Connection refused")
    assert source_error_message(down, "http://c").startswith(
        "cannot reach the collector at http://c (Connection refused): check"
    )
    auth = SourceError("x", url="http://c", path="/v1/engines", status=401)
    assert "--token" in source_error_message(auth, "http://c")
    boom = SourceError("x", url="http://c", path="/v1/windows", status=500, reason="store")
    assert source_error_message(boom, "http://c") == (
        "the collector at http://c answered 500 on /v1/windows: store"
    )


def test_prefix_and_routing_section_per_pool() -> None:
    from kvscope.advisor.datasets import make_prefix_pool

    s = make_prefix_pool(seed=0)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests, s.kv_events))
    text = _text(rep)
    start, recs = text.index("Prefix cache and routing"), text.index("Recommendations: ")
    assert text.index("from test, the test window") < start < recs
    section = " ".join(text[start:recs].split())
    assert "pool px: prefix-cache hit rate 30% (px0:8000:0 40%, px1:8000:0 20%)" in section
    assert (
        "reuse available 55%, captured by routing 35%, delivered 30% (routing loss 20%, "
        "eviction loss 5%)"
    ) in section
    assert "TTFT P50/P90 with cached tokens" in section and "per computed prompt token" in section
    assert "busiest / mean 1.6" in section
    rank = next(
        i for i, r in enumerate(rep.recommendations, start=1) if r.kind == "prefix_aware_routing"
    )
    assert f"predicted hit rate 30% -> 50%, mean TTFT -20 ms (recommendation {rank})" in section
    assert "router policy prefix-aware" in " ".join(text[recs:].split())


def test_prefix_section_without_events_names_the_flag() -> None:
    from kvscope.advisor.datasets import make_prefix_pool
    from kvscope.advisor.prefix import KV_EVENTS_FLAG

    s = make_prefix_pool(with_events=False)
    text = " ".join(_text(analyze(FrameSource(s.engines, s.windows, s.requests))).split())
    section = text[text.index("Prefix cache and routing") : text.index("Recommendations")]
    assert KV_EVENTS_FLAG in section and "reuse available" not in section


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_text_keeps_every_line_whole_and_every_snippet_apart() -> None:
    rep = _pool_of_two()
    text = text_report(rep, source="test", window="the test window")
    lines = text.splitlines()
    assert [ln for ln in lines if ln != ln.rstrip()] == []
    wrapped = _text(rep).splitlines()[0]  # the terminal's first line, wrapped at 100 columns
    assert len(lines[0]) > 100 and lines[0].startswith(wrapped.rstrip())
    assert "from test, the test window: 2 engine(s)" in text
    listed = lines[lines.index("Findings") + 1 :]  # the findings as a list, each summary whole
    for line, f in zip(listed, rep.findings, strict=True):
        scope = f.scope.engine_id or f"pool {f.scope.pool}"
        assert line.startswith(f"- {f.kind} [{scope}] ") and line.endswith(f.summary)
    stripped = [ln.strip() for ln in lines]
    for i, r in enumerate(rep.recommendations, start=1):
        head = next(n for n, ln in enumerate(lines) if ln.startswith(f"{i}. {r.summary}  ["))
        assert r.id in lines[head]
        for label, snippet in _change_rows(r.change):
            at = stripped.index(f"{label}:", head)  # the label, then the snippet under it
            body = snippet.splitlines()
            assert stripped[at + 1 : at + 1 + len(body)] == [b.strip() for b in body]


def test_markdown_lists_and_fences() -> None:
    rep = _pool_of_two()
    md = markdown_report(rep, source="test", window="W")
    assert md.startswith("# kvscope advise\n\n## Verdict\n\n- pool p: ")
    assert "\n  - h1:8000:0: " in md  # an engine nested under its pool
    assert md.count("```") % 2 == 0 and "## Findings" in md
    for r in rep.recommendations:
        for _label, snippet in _change_rows(r.change):
            for line in snippet.splitlines():
                assert f"     {line}".rstrip() in md.splitlines()  # inside the item's fence


def test_print_report_is_the_terminal_layout_only_on_a_terminal() -> None:
    rep = _pool_of_two()
    tty, pipe = _Terminal(), io.StringIO()
    print_report(rep, tty, source="test", window="W")
    print_report(rep, pipe, source="test", window="W")
    assert "╭" in tty.getvalue()  # the plot's panel
    assert "╭" not in pipe.getvalue() and pipe.getvalue() == text_report(
        rep, source="test", window="W"
    )


def test_connection_messages_name_the_mix_up() -> None:
    url = "https://c:8844"
    tls = SourceError("x", url=url, reason="WRONG_VERSION_NUMBER", kind="tls_mismatch")
    assert source_error_message(tls, url).startswith(
        "https:// on a plain-HTTP collector: https://c:8844 does not speak TLS; use http://c:8844"
    )
    page = "an HTML page: looks like the kvscope dashboard, which reads a collector"
    other = SourceError("x", url=url, status=200, reason=page, kind="not_collector")
    assert source_error_message(other, url).startswith(
        f"{url} answered but is not a kvscope collector ({page})"
    )
    closed = SourceError("x", url="http://c:1", reason="closed", kind="closed")
    assert "use https://c:1" in source_error_message(closed, "http://c:1")
