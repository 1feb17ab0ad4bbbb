"""What the HTML and Markdown renderers share: formatting, and the rows and groups
they lay out. Everything is read from the :class:`~kvscope.report.model.WeeklyReport`;
nothing is derived beyond picking, formatting and ordering."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from kvscope.advisor.findings import EngineVerdict, Finding, PoolVerdict, Recommendation
from kvscope.advisor.render import EFFECT_LABELS, _change_rows, _facts
from kvscope.advisor.usage import Usage
from kvscope.advisor.weekly import Change
from kvscope.report._svg import duration, short_number
from kvscope.report.model import WeeklyReport

ARROW = "→"
CHANGE_GROUPS = (
    ("config", "Configuration changes"),
    ("worse", "Got worse"),
    ("better", "Got better"),
    ("neutral", "Other changes"),
)


# -- formatting ------------------------------------------------------------------------


def missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def num(v: Any, spec: str = ",.1f") -> str:
    return "–" if missing(v) else format(v, spec)


def notes(wr: WeeklyReport, engine_id: str) -> list[str]:
    """This week's headroom sentence and the engine's finding summaries."""
    now = verdict(wr.current.engines, engine_id)
    out = [now.headroom] if now is not None and now.headroom else []
    for kind in ("bottleneck", "preemption_thrash", "kv_capacity", "latency_vs_load"):
        f = finding(wr.current.findings, kind, engine_id)
        if f is not None:
            out.append(f"{kind.replace('_', ' ')}: {f.summary}")
    return out


def tok(v: Any) -> str:
    return "–" if missing(v) else f"{v:,.0f} tok/s"


def pct(v: Any) -> str:
    return "–" if missing(v) else f"{v:.0%}"


def sec(v: Any) -> str:
    return "–" if missing(v) else f"{v:.2f} s"


def count(v: Any) -> str:
    return "–" if missing(v) else short_number(float(v))


def utc(t: float | None, fmt: str = "%Y-%m-%d %H:%M UTC") -> str:
    return "–" if t is None else datetime.fromtimestamp(t, tz=timezone.utc).strftime(fmt)


def day_label(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%a %d")


def arrows(text: str) -> str:
    """Summaries say ``a -> b``; the report prints an arrow."""
    return text.replace(" -> ", f" {ARROW} ")


def delta(before: Any, after: Any) -> str:
    """``+12%`` from the week before (empty when either side is missing or zero)."""
    if missing(before) or missing(after) or not before:
        return ""
    return f"{after / before - 1.0:+.0%}"


def window_text(wr: WeeklyReport) -> str:
    days = (wr.until_unix_s - wr.since_unix_s) / 86400.0
    return f"{utc(wr.since_unix_s)} {ARROW} {utc(wr.until_unix_s)} ({days:.3g} days)"


def previous_window_text(wr: WeeklyReport) -> str:
    u = wr.previous_usage
    return f"{utc(u.since_unix_s)} {ARROW} {utc(u.until_unix_s)}"


# -- lookups ---------------------------------------------------------------------------


def verdict(report_engines: list[EngineVerdict], engine_id: str) -> EngineVerdict | None:
    return next((v for v in report_engines if v.engine_id == engine_id), None)


def pool_verdict(pools: list[PoolVerdict], pool: str | None) -> PoolVerdict | None:
    return next((p for p in pools if p.pool == pool), None)


def pools(wr: WeeklyReport) -> list[str | None]:
    """Pools of this week (in the advisor's order), then pools only last week had."""
    out = [p.pool for p in wr.current.pools]
    return out + [p.pool for p in wr.previous.pools if p.pool not in out]


def engines_of(wr: WeeklyReport, pool: str | None) -> list[str]:
    ids = [v.engine_id for v in wr.current.engines if v.pool == pool]
    return ids + [
        v.engine_id for v in wr.previous.engines if v.pool == pool and v.engine_id not in ids
    ]


def finding(
    findings: list[Finding], kind: str, engine_id: str | None, pool: str | None = None
) -> Finding | None:
    return next(
        (
            f
            for f in findings
            if f.kind == kind
            and f.scope.engine_id == engine_id
            and (engine_id is not None or f.scope.pool == pool)
        ),
        None,
    )


def resolution_note(wr: WeeklyReport) -> str | None:
    """What the source's resolution allows (read from Prometheus), else None."""
    f = finding(wr.current.findings, "scrape_resolution", None)
    return f.summary if f is not None else None


def pool_findings(wr: WeeklyReport, pool: str | None) -> list[Finding]:
    """This week's pool-level prefix, routing and balance findings."""
    kinds = ("prefix_cache", "prefix_routing", "kv_events_missing", "load_imbalance")
    out = [
        f
        for f in wr.current.findings
        if f.kind in kinds and f.scope.pool == pool and f.scope.engine_id is None
    ]
    out += [
        f for f in wr.current.findings if f.kind == "prefix_caching_off" and f.scope.pool == pool
    ]
    return out


# -- groups ----------------------------------------------------------------------------


def change_groups(wr: WeeklyReport) -> list[tuple[str, str, list[Change]]]:
    """(key, title, changes) in reading order, empty groups left out (the
    ``no_previous_data`` marker is not a change: the counts say it)."""
    out = []
    for key, title in CHANGE_GROUPS:
        if key == "config":
            items = [c for c in wr.comparison.changes if c.kind == "config_change"]
        else:
            items = [
                c
                for c in wr.comparison.changes
                if c.kind not in ("config_change", "no_previous_data") and c.direction == key
            ]
        if items:
            out.append((key, title, items))
    return out


def effect_text(r: Recommendation) -> str:
    return _facts(r.expected_effect, EFFECT_LABELS)


def evidence_text(r: Recommendation) -> str:
    return _facts(r.evidence)


def change_rows(r: Recommendation) -> list[tuple[str, str]]:
    return _change_rows(r.change)


def scope_text(scope: Any) -> str:
    return scope.engine_id or (f"pool {scope.pool}" if scope.pool is not None else "fleet")


def daily(
    usage: Usage, pool: str | None, column: str
) -> tuple[list[str], list[tuple[str, list[float]]]]:
    """Day labels and one series per engine of ``pool`` for a daily ``column``."""
    d = usage.days
    n = len(d.get("engine_id", []))
    starts = sorted({d["day_start_unix_s"][i] for i in range(n)})
    series: dict[str, dict[float, float]] = {}
    for i in range(n):
        if d["pool"][i] != pool:
            continue
        series.setdefault(d["engine_id"][i], {})[d["day_start_unix_s"][i]] = float(
            d[column][i] or 0.0
        )
    return (
        [day_label(t) for t in starts],
        [(eid, [vals.get(t, 0.0) for t in starts]) for eid, vals in sorted(series.items())],
    )


def day_table(usage: Usage, pool: str | None) -> tuple[list[str], list[list[str]]]:
    """Per engine and day: the head and the rows of the per-day table."""
    d = usage.days
    head = [
        "day",
        "engine",
        "requests",
        "generated tokens",
        "mean tok/s while active",
        "busiest second",
        "active",
        "past the knee",
        "preemptions",
        "prefix hit rate",
    ]
    rows = []
    order = sorted(
        range(len(d.get("engine_id", []))),
        key=lambda i: (d["day_start_unix_s"][i], d["engine_id"][i]),
    )
    for i in order:
        if d["pool"][i] != pool or not d["active_s"][i]:
            continue
        rows.append(
            [
                utc(d["day_start_unix_s"][i], "%a %Y-%m-%d"),
                d["engine_id"][i],
                count(d["requests"][i]),
                count(d["generation_tokens"][i]),
                tok(d["gen_tokens_per_s_mean"][i]),
                tok(d["gen_tokens_per_s_peak"][i]),
                duration(d["active_s"][i]),
                duration(d["saturated_s"][i]),
                count(d["preemptions"][i]),
                pct(d["prefix_hit_rate"][i]),
            ]
        )
    return head, rows
