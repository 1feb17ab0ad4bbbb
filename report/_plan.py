"""What every rendering (HTML, Markdown, the command's summary) shows of the week's plan:
the count of what changed, the action list grouped by the kind of its effect, GPU-hours
per pool and the capacity forecast. Read from the
:class:`~kvscope.report.model.WeeklyReport`; nothing is derived beyond picking, formatting
and ordering, so the renderings cannot disagree."""

from __future__ import annotations

from kvscope.advisor.actions import Action
from kvscope.advisor.findings import Recommendation
from kvscope.advisor.forecast import PoolForecast
from kvscope.advisor.usage import Usage
from kvscope.report._svg import duration
from kvscope.report._view import count, delta, num, pct, scope_text, utc
from kvscope.report.model import WeeklyReport

GAIN_TITLES = {
    "throughput": "Throughput: relative gain of the plateau (generated tok/s)",
    "latency": (
        "Latency: relative reduction (P99 for a cap, mean TTFT for prefix-aware routing, "
        "the busiest replica's for balancing)"
    ),
    "cost": "Cost: relative saving",
    "unquantified": "Effect not quantified by the advisor",
}
"""Group titles of the action list: gains are ranked only within a group."""
STATUS_TEXT = {"new": "new", "open": "still open", "done": "done", "gone": "gone"}
ACTION_HEAD = ["#", "status", "what to change", "where", "expected effect", "worth"]


# -- what changed ------------------------------------------------------------------------


def counts_text(wr: WeeklyReport) -> str:
    """The one sentence on what changed since the week before."""
    c = wr.change_counts
    config = f"{c.config} configuration change(s)"
    if not c.compared:
        return f"no data the week before: nothing to compare with; {config}"
    return f"{c.worse} worse, {c.better} better, {c.other} other, {config}"


def counts_figure(wr: WeeklyReport) -> tuple[str, str, str]:
    """The at-a-glance figure: (label, value, note)."""
    c = wr.change_counts
    if not c.compared:
        return (
            "worse / better",
            "n/a",
            f"no data the week before; {c.config} configuration change(s)",
        )
    return (
        "worse / better",
        f"{c.worse} / {c.better}",
        f"{c.other} other, {c.config} configuration change(s)",
    )


def glance(wr: WeeklyReport) -> list[tuple[str, str, str]]:
    """(label, value, note) figures for the top of the report."""

    def total(u: Usage, col: str) -> float:
        return float(sum(x or 0.0 for x in u.pools.get(col, [])))

    req, req0 = total(wr.usage, "requests"), total(wr.previous_usage, "requests")
    gen, gen0 = total(wr.usage, "generation_tokens"), total(wr.previous_usage, "generation_tokens")
    sat, act = total(wr.usage, "saturated_s"), total(wr.usage, "active_s")
    saturated = sum(1 for v in wr.current.engines if v.saturated)
    return [
        (
            "engines",
            str(len(wr.current.engines)),
            f"{len(wr.current.pools)} pool(s); {saturated} saturated",
        ),
        ("requests finished", count(req), f"{delta(req0, req) or 'n/a'} vs last week"),
        ("generated tokens", count(gen), f"{delta(gen0, gen) or 'n/a'} vs last week"),
        (
            "time past the knee",
            duration(sat),
            f"{pct(sat / act if act else None)} of active engine time",
        ),
        actions_figure(wr),
        counts_figure(wr),
    ]


def actions_figure(wr: WeeklyReport) -> tuple[str, str, str]:
    n = {s: sum(1 for a in wr.actions if a.status == s) for s in STATUS_TEXT}
    return (
        "actions",
        str(n["new"] + n["open"]),
        f"{n['new']} new, {n['open']} still open; {n['done']} done, {n['gone']} gone "
        "since last week",
    )


# -- the action list ---------------------------------------------------------------------


def action_groups(wr: WeeklyReport) -> list[tuple[str, str, list[Action]]]:
    """(key, title, actions) in the list's order; empty groups left out."""
    out: list[tuple[str, str, list[Action]]] = []
    for key, title in GAIN_TITLES.items():
        items = [a for a in wr.actions if a.to_take and a.gain_kind == key]
        if items:
            out.append((key, title, items))
    closed = [a for a in wr.actions if not a.to_take]
    if closed:
        out.append(("closed", "Done or gone since last week", closed))
    return out


def effect_text(a: Action) -> str:
    """``throughput +35%``, ``latency -61%``, or why there is no number."""
    if a.expected_gain is None:
        return "not quantified"
    if a.gain_kind == "latency":
        return f"latency −{a.expected_gain:.0%}"
    if a.gain_kind == "cost":
        return f"cost −{a.expected_gain:.0%}"
    return f"{a.gain_kind} {a.expected_gain:+.0%}"


def value_text(a: Action) -> str:
    """What the change is worth a week in GPU-hours (and USD), empty where not valued."""
    if a.gpu_hours_saved is None:
        return ""
    verb = "saves" if a.gpu_hours_saved >= 0 else "costs"
    text = f"{verb} {num(abs(a.gpu_hours_saved))} GPU-h/week"
    if a.usd_saved is not None:
        text += f" (${abs(a.usd_saved):,.0f})"
    return text


def action_row(wr: WeeklyReport, i: int, a: Action) -> list[str]:
    shown = all(f in a.summary for f in a.flags)
    what = a.summary + (f" [{' '.join(a.flags)}]" if a.flags and not shown else "")
    return [
        str(i),
        STATUS_TEXT.get(a.status, a.status),
        what,
        scope_text(a.scope),
        f"{effect_text(a)} (confidence {a.confidence:.2f})",
        value_text(a),
    ]


# -- GPU-hours ---------------------------------------------------------------------------


def gpu_hours_table(wr: WeeklyReport) -> tuple[list[str], list[list[str]]]:
    """Per pool: engines, engine-hours, active hours, GPU-hours, cost, what the advice is
    worth."""
    priced = wr.gpu_hour_cost is not None
    head = ["pool", "engines", "engine-hours", "active hours", "GPU-hours"]
    head += ["cost (USD)"] if priced else []
    head += ["throughput advice worth"]
    rows = []
    for p in wr.gpu_hours:
        gpu = num(p.gpu_hours) + ("" if p.gpus_per_engine_known else " (1 GPU/engine assumed)")
        row = [str(p.pool), str(p.n_engines), num(p.engine_hours), num(p.active_hours), gpu]
        if priced:
            row.append("–" if p.cost_usd is None else f"${p.cost_usd:,.0f}")
        if p.saving_gpu_hours is None:
            row.append("no throughput advice")
        else:
            usd = f" (${p.saving_usd:,.0f})" if p.saving_usd is not None else ""
            row.append(f"{num(p.saving_gpu_hours)} GPU-h/week{usd}")
        rows.append(row)
    return head, rows


def gpu_hours_note(wr: WeeklyReport) -> str:
    price = (
        f"at ${wr.gpu_hour_cost:,.2f} per GPU-hour"
        if wr.gpu_hour_cost is not None
        else "no price given (--gpu-hour-cost)"
    )
    return (
        "Engine-hours: each engine's first to last second with steps this week; GPU-hours: "
        "times tensor x pipeline parallel size; "
        f"{price}. A throughput gain g serves the same load with 1/(1+g) of the engines: "
        "the advice is worth g/(1+g) of the engine's GPU-hours at the same load, the best "
        "change per engine summed (see docs/report.md)."
    )


# -- capacity forecast -------------------------------------------------------------------


def forecast_text(wr: WeeklyReport, f: PoolForecast) -> str:
    """One sentence per pool."""
    name = f"pool {f.pool}"
    cap = (
        f"capacity {num(f.capacity)} {f.unit} ({' + '.join(f.capacity_from)})"
        if f.capacity is not None
        else "capacity unknown (an engine without a knee or batch limit)"
    )
    h = f.history_days
    peaks = ", ".join(num(x, ".0f") for x in f.daily_peak[h:])
    if h:
        before = f.daily_peak[:h]
        peaks = (
            f"{peaks or '–'} this week, {num(min(before), '.0f')}–{num(max(before), '.0f')} "
            f"over the {h} day(s) before (1-minute windows)"
        )
    trend = (
        f"; trend {f.slope_per_day:+.2f}/day, {num(f.level_at_end)} on the last day"
        if f.slope_per_day is not None
        else ""
    )
    head = f"{name}: daily peak {peaks or '–'} {f.unit}{trend}; {cap}"
    verdicts = {
        "not_enough_days": f"not enough days ({len(f.daily_peak)} with data, {f.min_days} needed)",
        "no_capacity": "no forecast without a capacity",
        "past": "already past the capacity at the daily peak",
        "not_rising": "the daily peak is not rising: no crossing ahead",
        "not_within": f"not within {f.horizon_weeks:g} weeks",
        "crosses": (
            f"reaches it around {utc(f.crossing_unix_s, '%Y-%m-%d')} "
            f"(in {num(f.weeks_to_crossing)} weeks)"
        ),
    }
    return f"{head}: {verdicts.get(f.status, f.status)}"


def numbered(wr: WeeklyReport) -> list[tuple[str, str, list[tuple[int, Action]]]]:
    """:func:`action_groups` with each action's number in the list (one count throughout)."""
    out = []
    i = 0
    for key, title, items in action_groups(wr):
        rows = []
        for a in items:
            i += 1
            rows.append((i, a))
        out.append((key, title, rows))
    return out


def recommendation_of(wr: WeeklyReport, a: Action) -> Recommendation | None:
    """This week's recommendation behind an action (None for one of last week's only)."""
    return next((r for r in wr.current.recommendations if r.id == a.recommendation_id), None)
