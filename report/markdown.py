"""``report.md``: the weekly report as Markdown (for a wiki page, a ticket, a diff).

The same sections as the HTML page, with the throughput curves as text plots
(:mod:`kvscope.advisor.textplot`) in code blocks. Presents the
:class:`~kvscope.report.model.WeeklyReport` only.
"""

from __future__ import annotations

from kvscope.advisor.render import tiers_text
from kvscope.advisor.textplot import throughput_plot
from kvscope.report import _latency as latency
from kvscope.report import _plan as plan
from kvscope.report import _rows as tables
from kvscope.report import _view as v
from kvscope.report.model import WeeklyReport


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[str]] | list[tables.Row]) -> list[str]:
    out = [
        "| " + " | ".join(_cell(h) for h in head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return [*out, ""]


def _engine(wr: WeeklyReport, eid: str) -> list[str]:
    now = v.verdict(wr.current.engines, eid)
    out = [f"### {eid}: {now.bottleneck if now else 'no data this week'}", ""]
    out += _table(["", "last week", "this week"], tables.engine_rows(wr, eid))
    curve = v.finding(wr.current.findings, "throughput_curve", eid)
    if now is not None and curve is not None and curve.frame:
        f = curve.frame
        lines = throughput_plot(
            f.get("load", []),
            f.get("gen_tokens_per_s", []),
            f.get("gen_fit"),
            knee=now.knee_concurrency,
            cap=(
                float(now.recommended_concurrency_cap)
                if now.recommended_concurrency_cap is not None
                else None
            ),
        )
        if lines:
            out += [
                "Generated tok/s against requests in flight, this week:",
                "",
                "```",
                *lines,
                "```",
                "",
            ]
    out += [f"- {n}" for n in v.notes(wr, eid)]
    return [*out, ""]


def _actions(wr: WeeklyReport) -> list[str]:
    out = [
        "## Action list",
        "",
        "What to change, where, and its expected effect; status against last week's advice "
        "(new, still open, done, gone). Gains are ranked within their kind only.",
        "",
    ]
    groups = plan.numbered(wr)
    if not groups:
        return [*out, "Nothing to change: no recommendation this week or last.", ""]
    for _, title, items in groups:
        out += [f"**{title}**", ""]
        out += _table(plan.ACTION_HEAD, [plan.action_row(wr, i, a) for i, a in items])
    return out


def _gpu_hours(wr: WeeklyReport) -> list[str]:
    head, rows = plan.gpu_hours_table(wr)
    out = ["## GPU-hours per pool", ""]
    if not rows:
        return [*out, "No engine ran this week.", ""]
    return [*out, *_table(head, rows), plan.gpu_hours_note(wr), ""]


def _forecast(wr: WeeklyReport) -> list[str]:
    out = ["## Capacity forecast", ""]
    if not wr.forecast:
        return [*out, "No pool to forecast.", ""]
    return [*out, *(f"- {plan.forecast_text(wr, f)}" for f in wr.forecast), ""]


def _recommendations(wr: WeeklyReport) -> list[str]:
    out = ["## Recommendations in detail", ""]
    groups = [g for g in plan.numbered(wr) if g[0] != "closed"]
    if not groups:
        return [*out, "No recommendations: nothing to change on this week's data.", ""]
    for _, title, items in groups:
        out += [f"### {title}", ""]
        for i, a in items:
            r = plan.recommendation_of(wr, a)
            if r is None:
                continue
            out += [
                f"{i}. **{r.summary}**  ",
                f"   {v.scope_text(r.scope)}; expected {plan.effect_text(a)}; confidence "
                f"{r.confidence:.2f}; {plan.STATUS_TEXT[a.status]}",
            ]
            effect = v.effect_text(r)
            if effect:
                out.append(f"   - expected: {effect}")
            if r.tradeoff:
                out.append(f"   - trade-off: {r.tradeoff}")
            rows = v.change_rows(r)
            if rows:
                out += ["   - change:", "", "     ```"]
                for label, text in rows:  # a multi-line rendering stays inside the list item
                    out += [f"     # {label}", *(f"     {line}" for line in text.splitlines())]
                out += ["     ```"]
            out.append("")
    return out


def render_markdown(wr: WeeklyReport) -> str:
    """The whole report as Markdown text."""
    out = [
        "# kvscope weekly tuning report",
        "",
        f"- **This week:** {v.window_text(wr)}",
        f"- **Compared with:** {v.previous_window_text(wr)}",
        f"- Source: {wr.source}; generated {v.utc(wr.generated_unix_s)}",
        "",
    ]
    note = v.resolution_note(wr)
    if note:
        out[-1:] = [f"- Resolution: {note}", ""]
    out += _actions(wr)
    out += _table(["at a glance", "this week", ""], [list(x) for x in plan.glance(wr)])
    for p in wr.current.pools:
        kinds = ", ".join(
            f"{k} ×{n}" for k, n in sorted(p.bottlenecks.items(), key=lambda kv: -kv[1])
        )
        cap = (
            f"recommended cap {p.recommended_concurrency_cap} in flight"
            if p.recommended_concurrency_cap is not None
            else "no cap recommended"
        )
        n = len(p.engine_ids)
        out.append(
            f"- **pool {p.pool}** ({n} engine{'s' if n != 1 else ''}): {kinds}; plateau "
            f"{v.tok(p.plateau_tokens_per_s)}; {cap}"
        )
    out += ["", "## What changed since the previous week", "", plan.counts_text(wr) + ".", ""]
    groups = v.change_groups(wr)
    if not groups:
        out += ["Nothing moved beyond the thresholds.", ""]
    for _, title, items in groups:
        out += [f"**{title}**", ""]
        for c in items:
            when = f" ({v.utc(c.at_unix_s)})" if c.at_unix_s is not None else ""
            out.append(f"- {v.arrows(c.summary)}{when}")
        out.append("")
    out += _gpu_hours(wr) + _forecast(wr) + _recommendations(wr)
    for pool in v.pools(wr):
        out += [f"## pool {pool}" if pool is not None else "## engines without a pool", ""]
        out += _table(["", "last week", "this week"], tables.pool_rows(wr, pool))
        findings = v.pool_findings(wr, pool)
        if findings:
            out += ["Prefix cache and routing:", ""]
            out += [f"- {f.kind.replace('_', ' ')} ({f.severity}): {f.summary}" for f in findings]
            out.append("")
        lat = latency.rows(wr, pool)
        if lat:
            out += [f"{latency.TITLE}:", ""]
            out += _table(latency.head(wr), lat)
            out += [latency.NOTE, ""]
        head, rows_ = v.day_table(wr.usage, pool)
        if rows_:
            out += ["Per engine and day (UTC):", ""]
            out += _table(head, rows_)
        for eid in v.engines_of(wr, pool):
            out += _engine(wr, eid)
    cov = wr.current.coverage
    out += [
        "---",
        "",
        f"Read this week: {cov.get('n_engines_analyzed', 0)} engine(s), "
        f"{cov.get('n_windows', 0):,} one-second windows, {cov.get('n_requests', 0):,} finished "
        f"requests{tiers_text(cov)}. report.json (schema_version {wr.schema_version}) holds every number.",
        "",
    ]
    return "\n".join(out)
