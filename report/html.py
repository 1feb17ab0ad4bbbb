"""``report.html``: the weekly report as one self-contained page.

Inline CSS, inline SVG plots (:mod:`kvscope.report._svg`), no script and no URL
to fetch: it opens from a file, offline, and prints. Order: what the week was; the
action list (what to change, where, its expected effect by kind, its status against
last week); the figures at a glance; what changed since the week before; GPU-hours per
pool and the capacity forecast; the recommendations grouped by the kind of their effect,
each with the change to copy; per pool, its verdict and
daily traffic, then per engine the verdict against last week's, the throughput
curve of both weeks with the knee and cap, and the week's usage; the findings; what
was read. It presents the :class:`~kvscope.report.model.WeeklyReport` only.
"""

from __future__ import annotations

from html import escape

from kvscope.advisor.actions import Action
from kvscope.advisor.findings import Recommendation
from kvscope.advisor.render import tiers_text
from kvscope.report import _latency as latency
from kvscope.report import _plan as plan
from kvscope.report import _rows as tables
from kvscope.report import _view as v
from kvscope.report._svg import curve_svg, duration, short_number, stacked_bars_svg
from kvscope.report.model import WeeklyReport

CHART_W = 368
"""Width of a daily chart: three fit side by side."""

_CSS = """
:root { --ink:#0f172a; --muted:#64748b; --line:#e2e8f0; --bg:#f8fafc; --card:#fff;
  --worse:#b91c1c; --better:#15803d; --neutral:#475569; --config:#1d4ed8; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; }
main { max-width:1180px; margin:0 auto; padding:28px 24px 60px; }
h1 { font-size:26px; margin:0 0 4px; }
h2 { font-size:20px; margin:36px 0 12px; padding-bottom:6px; border-bottom:2px solid var(--line); }
h3 { font-size:16px; margin:22px 0 8px; }
.sub { color:var(--muted); margin:2px 0; }
.glance { display:grid; grid-template-columns:repeat(auto-fill,minmax(175px,1fr)); gap:10px;
  margin-top:18px; }
.fig { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 12px; }
.fig .label { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.fig .value { font-size:22px; font-weight:650; }
.fig .note { color:var(--muted); font-size:12px; }
.verdicts { margin:14px 0 0; padding:0; list-style:none; }
.verdicts li { margin:4px 0; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px;
  font-weight:600; background:#e2e8f0; color:#1e293b; white-space:nowrap; }
.b-kv_cache_bound { background:#fee2e2; color:#991b1b; }
.b-max_num_seqs_bound, .b-token_budget_bound { background:#ffedd5; color:#9a3412; }
.b-compute_bound { background:#ede9fe; color:#5b21b6; }
.b-frontend_bound { background:#dbeafe; color:#1e40af; }
.b-unexplained { background:#e0f2fe; color:#075985; }
.b-not_saturated { background:#dcfce7; color:#166534; }
.s-new { background:#dbeafe; color:#1e40af; }
.s-open { background:#f1f5f9; color:#334155; }
.s-done { background:#dcfce7; color:#166534; } .s-gone { background:#f1f5f9; color:#64748b; }
.actions td:first-child { color:var(--muted); font-weight:700; }
.changes { columns:2 440px; column-gap:14px; }
.group { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px;
  margin:0 0 14px; break-inside:avoid; }
.group h3 { margin:2px 0 6px; font-size:15px; }
.group ul { margin:0; padding-left:18px; }
.group li { margin:5px 0; }
.g-worse h3 { color:var(--worse); } .g-better h3 { color:var(--better); }
.g-config h3 { color:var(--config); } .g-neutral h3 { color:var(--neutral); }
.when { color:var(--muted); font-size:12px; }
.rec { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:12px 16px; margin:10px 0; display:grid; grid-template-columns:42px 1fr; gap:4px 12px; }
.rank { font-size:22px; font-weight:700; color:var(--muted); }
.rec .head { font-weight:600; }
.rec .meta { color:var(--muted); font-size:12px; }
.rec .gain { font-weight:700; color:var(--better); }
.rec dl { display:grid; grid-template-columns:max-content 1fr; gap:2px 12px; margin:6px 0 0; }
.rec dt { color:var(--muted); }
.rec dd { margin:0; }
pre.copy { margin:0; padding:4px 8px; background:#0f172a; color:#e2e8f0; border-radius:5px;
  font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; white-space:pre-wrap;
  word-break:break-word; }
.pool { margin-top:8px; }
.engine { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:12px 16px; margin:14px 0; }
.engine h3 { margin-top:2px; }
.cols { display:flex; flex-wrap:wrap; gap:18px; align-items:flex-start; }
.cols > * { flex:1 1 480px; min-width:0; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; font-size:12px; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
tr.changed td.after { font-weight:650; }
.charts { display:flex; flex-wrap:wrap; gap:10px; }
.charts svg, .engine svg { max-width:100%; height:auto; background:var(--card); }
.note { color:var(--muted); font-size:12.5px; margin:6px 0; }
ul.notes { margin:6px 0; padding-left:18px; }
details { margin:10px 0; }
summary { cursor:pointer; color:var(--config); }
.sev-warning { color:#b45309; font-weight:600; } .sev-critical { color:var(--worse); font-weight:700; }
footer { margin-top:40px; color:var(--muted); font-size:12px; }
@media print { body { background:#fff; } .engine, .rec, .group, .fig { break-inside:avoid; } }
"""


def _e(text: object) -> str:
    return escape(str(text))


def _badge(label: str) -> str:
    return f'<span class="badge b-{_e(label)}">{_e(label)}</span>'


def _rows_table(rows: list[tables.Row], *, first: str = "") -> str:
    out = [f"<table><tr><th>{_e(first)}</th><th>last week</th><th>this week</th></tr>"]
    for label, before, after in rows:
        cls = ' class="changed"' if before != after and before != "–" else ""
        out.append(
            f"<tr{cls}><td>{_e(label)}</td><td>{_e(before)}</td>"
            f'<td class="after">{_e(after)}</td></tr>'
        )
    out.append("</table>")
    return "".join(out)


def _header(wr: WeeklyReport) -> str:
    figs = "".join(
        f'<div class="fig"><div class="label">{_e(a)}</div><div class="value">'
        f'{_e(b)}</div><div class="note">{_e(c)}</div></div>'
        for a, b, c in plan.glance(wr)
    )
    lines = []
    for p in wr.current.pools:
        kinds = " ".join(
            f"{_badge(k)}{' ×' + str(n) if len(p.engine_ids) > 1 else ''}"
            for k, n in sorted(p.bottlenecks.items(), key=lambda kv: -kv[1])
        )
        cap = (
            f"; recommended cap {p.recommended_concurrency_cap} in flight"
            if p.recommended_concurrency_cap is not None
            else "; no cap recommended"
        )
        lines.append(
            f"<li><b>pool {_e(p.pool)}</b> ({len(p.engine_ids)} engine"
            f"{'s' if len(p.engine_ids) != 1 else ''}): {kinds}; plateau "
            f"{_e(v.tok(p.plateau_tokens_per_s))}{_e(cap)}</li>"
        )
    return (
        f"<header><h1>kvscope weekly tuning report</h1>"
        f'<p class="sub"><b>This week:</b> {_e(v.window_text(wr))}</p>'
        f'<p class="sub"><b>Compared with:</b> {_e(v.previous_window_text(wr))}</p>'
        f'<p class="sub">Source: {_e(wr.source)} · generated {_e(v.utc(wr.generated_unix_s))}'
        f"</p>{_resolution(wr)}</header>"
        f"{_actions(wr)}"
        f'<section id="glance"><div class="glance">{figs}</div>'
        f'<ul class="verdicts">{"".join(lines)}</ul></section>'
    )


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    return (
        f'<table class="{cls}"><tr>'
        + "".join(f"<th>{_e(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )


def _actions(wr: WeeklyReport) -> str:
    groups = plan.numbered(wr)
    body = "".join(
        f"<h3>{_e(title)}</h3>"
        + _table(plan.ACTION_HEAD, [plan.action_row(wr, i, a) for i, a in items], "actions")
        for _, title, items in groups
    )
    return (
        '<section id="actions"><h2>Action list</h2><p class="note">What to change, where, '
        "and its expected effect; status against last week's advice (new, still open, done, "
        "gone). Gains are ranked within their kind only.</p>"
        + (body or '<p class="note">Nothing to change: no recommendation this week or last.</p>')
        + "</section>"
    )


def _plan_sections(wr: WeeklyReport) -> str:
    head, rows = plan.gpu_hours_table(wr)
    hours = (
        _table(head, rows) + f'<p class="note">{_e(plan.gpu_hours_note(wr))}</p>'
        if rows
        else '<p class="note">No engine ran this week.</p>'
    )
    forecast = "".join(f"<li>{_e(plan.forecast_text(wr, f))}</li>" for f in wr.forecast)
    return (
        f'<section id="gpu-hours"><h2>GPU-hours per pool</h2>{hours}</section>'
        '<section id="forecast"><h2>Capacity forecast</h2>'
        f'<ul class="notes">{forecast or "<li>No pool to forecast.</li>"}</ul></section>'
    )


def _resolution(wr: WeeklyReport) -> str:
    note = v.resolution_note(wr)
    return f'<p class="sub"><b>Resolution:</b> {_e(note)}</p>' if note else ""


def _changes(wr: WeeklyReport) -> str:
    groups = v.change_groups(wr)
    if not groups:
        body = (
            '<p class="note">Nothing moved beyond the thresholds: same verdicts, knees '
            "and plateaus within range, no configuration change, no new problem.</p>"
        )
    else:
        body = '<div class="changes">'
        for key, title, items in groups:
            lis = []
            for c in items:
                when = (
                    f' <span class="when">({_e(v.utc(c.at_unix_s))})</span>'
                    if c.at_unix_s is not None
                    else ""
                )
                lis.append(f"<li>{_e(v.arrows(c.summary))}{when}</li>")
            body += (
                f'<div class="group g-{key}"><h3>{_e(title)} ({len(items)})</h3>'
                f"<ul>{''.join(lis)}</ul></div>"
            )
        body += "</div>"
    counts = f'<p class="counts">{_e(plan.counts_text(wr))}.</p>'
    return (
        f'<section id="changes"><h2>What changed since the previous week</h2>{counts}{body}'
        "</section>"
    )


def _recommendation(i: int, r: Recommendation, a: Action) -> str:
    rows = "".join(
        f'<dt>{_e(label)}</dt><dd><pre class="copy">{_e(text)}</pre></dd>'
        for label, text in v.change_rows(r)
    )
    extra = ""
    effect = v.effect_text(r)
    if effect:
        extra += f"<dt>expected</dt><dd>{_e(effect)}</dd>"
    if r.tradeoff:
        extra += f"<dt>trade-off</dt><dd>{_e(r.tradeoff)}</dd>"
    evidence = v.evidence_text(r)
    if evidence:
        extra += f'<dt>evidence</dt><dd class="meta">{_e(evidence)}</dd>'
    return (
        f'<div class="rec"><div class="rank">{i}</div><div>'
        f'<div class="head">{_e(r.summary)}</div>'
        f'<div class="meta"><span class="badge s-{_e(a.status)}">'
        f"{_e(plan.STATUS_TEXT.get(a.status, a.status))}</span> "
        f"{_e(v.scope_text(r.scope))} · expected "
        f'<span class="gain">{_e(plan.effect_text(a))}</span> · confidence {r.confidence:.2f}'
        f"</div><dl>{extra}{rows}</dl></div></div>"
    )


def _recommendations(wr: WeeklyReport) -> str:
    body = ""
    for key, title, items in plan.numbered(wr):
        if key == "closed":
            continue
        recs = [(i, plan.recommendation_of(wr, a), a) for i, a in items]
        body += f"<h3>{_e(title)}</h3>" + "".join(
            _recommendation(i, r, a) for i, r, a in recs if r is not None
        )
    if not body:
        body = '<p class="note">No recommendations: nothing to change on this week\'s data.</p>'
    return (
        f'<section id="recommendations"><h2>Recommendations in detail</h2>'
        f'<p class="note">Grouped by the kind of their effect and ranked by expected gain '
        f"within a kind, never across. The change to copy is in the dark boxes.</p>{body}"
        "</section>"
    )


def _engine(wr: WeeklyReport, eid: str) -> str:
    now = v.verdict(wr.current.engines, eid)
    before = v.verdict(wr.previous.engines, eid)
    cur_curve = v.finding(wr.current.findings, "throughput_curve", eid)
    prev_curve = v.finding(wr.previous.findings, "throughput_curve", eid)
    svg = curve_svg(
        cur_curve.frame if cur_curve else None,
        prev_curve.frame if prev_curve else None,
        knee=now.knee_concurrency if now else None,
        cap=(
            float(now.recommended_concurrency_cap)
            if now and now.recommended_concurrency_cap is not None
            else None
        ),
        previous_knee=before.knee_concurrency if before else None,
        label=f"{eid}: generated tokens per second against requests in flight",
    )
    notes = "".join(f"<li>{_e(v.arrows(n))}</li>" for n in v.notes(wr, eid))
    badge = _badge(now.bottleneck) if now else _badge("no_data_this_week")
    plot = svg or '<p class="note">Too little data for a curve in either week.</p>'
    return (
        f'<div class="engine" id="engine-{_e(eid)}"><h3>{_e(eid)} {badge}</h3>'
        f'<div class="cols"><div>{_rows_table(tables.engine_rows(wr, eid))}</div>'
        f'<div>{plot}<ul class="notes note">{notes}</ul></div></div></div>'
    )


def _pool(wr: WeeklyReport, pool: str | None) -> str:
    days, tokens = v.daily(wr.usage, pool, "generation_tokens")
    _, saturated = v.daily(wr.usage, pool, "saturated_s")
    _, reqs = v.daily(wr.usage, pool, "requests")
    charts = [
        stacked_bars_svg(
            days,
            tokens,
            title="generated tokens per day (UTC)",
            value_text=short_number,
            width=CHART_W,
        ),
        stacked_bars_svg(
            days, reqs, title="requests finished per day", value_text=short_number, width=CHART_W
        ),
    ]
    if any(any(x > 0 for x in s) for _, s in saturated):
        charts.append(
            stacked_bars_svg(
                days,
                saturated,
                title="time past the knee per day",
                value_text=duration,
                width=CHART_W,
            )
        )
    else:
        charts.append('<p class="note">No engine of this pool ran past its knee this week.</p>')
    findings = "".join(
        f'<li><span class="sev-{_e(f.severity)}">{_e(f.kind.replace("_", " "))}</span>: '
        f"{_e(f.summary)}</li>"
        for f in v.pool_findings(wr, pool)
    )
    head, rows = v.day_table(wr.usage, pool)
    table = _table(head, rows)
    lat = latency.rows(wr, pool)
    slo = (
        f"<h3>{_e(latency.TITLE)}</h3>{_table(latency.head(wr), lat, 'latency')}"
        f'<p class="note">{_e(latency.NOTE)}</p>'
        if lat
        else ""
    )
    engines = "".join(_engine(wr, eid) for eid in v.engines_of(wr, pool))
    name = f"pool {pool}" if pool is not None else "engines without a pool"
    return (
        f'<section class="pool" id="pool-{_e(pool)}"><h2>{_e(name)}</h2>'
        f'<div class="cols"><div>{_rows_table(tables.pool_rows(wr, pool))}</div>'
        f'<div><h3>Prefix cache and routing</h3><ul class="notes">{findings or "<li>none</li>"}'
        f'</ul></div></div>{slo}<h3>Traffic per day</h3><div class="charts">{"".join(charts)}</div>'
        f"<details><summary>per engine and day</summary>{table}</details>"
        f"{engines}</section>"
    )


def _findings(wr: WeeklyReport) -> str:
    rows = "".join(
        f"<tr><td>{_e(f.kind)}</td><td>{_e(v.scope_text(f.scope))}</td>"
        f'<td class="sev-{_e(f.severity)}">{_e(f.severity)}</td>'
        f'<td class="num">{f.confidence:.2f}</td><td>{_e(f.summary)}</td></tr>'
        for f in wr.current.findings
    )
    return (
        f'<section id="findings"><h2>All findings this week</h2><details><summary>'
        f"{len(wr.current.findings)} findings with their summaries</summary><table><tr>"
        "<th>kind</th><th>scope</th><th>severity</th><th>conf.</th><th>summary</th></tr>"
        f"{rows}</table></details></section>"
    )


def _footer(wr: WeeklyReport) -> str:
    c, p = wr.current.coverage, wr.previous.coverage
    params = ", ".join(f"{k}={val}" for k, val in wr.current.parameters.items() if val is not None)
    return (
        f"<footer>Read: this week {c.get('n_engines_analyzed', 0)} engine(s), "
        f"{c.get('n_windows', 0):,} one-second windows, {c.get('n_requests', 0):,} finished "
        f"requests{_e(tiers_text(c))}; the week before {p.get('n_engines_analyzed', 0)} engine(s), "
        f"{p.get('n_windows', 0):,} windows, {p.get('n_requests', 0):,} requests. "
        f"Advisor parameters: {_e(params)}. Days are UTC; the first and last day of the "
        f"week can be partial. report.json (schema_version {wr.schema_version}) holds "
        "every number and the frame behind each plot.</footer>"
    )


def render_html(wr: WeeklyReport) -> str:
    """The whole page as one string."""
    title = (
        f"kvscope weekly report, {v.utc(wr.since_unix_s, '%Y-%m-%d')} to "
        f"{v.utc(wr.until_unix_s, '%Y-%m-%d')}"
    )
    body = (
        _header(wr)
        + _changes(wr)
        + _plan_sections(wr)
        + _recommendations(wr)
        + "".join(_pool(wr, p) for p in v.pools(wr))
        + _findings(wr)
        + _footer(wr)
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><main>{body}</main></body></html>\n"
    )
