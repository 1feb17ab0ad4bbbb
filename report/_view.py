"""What the HTML and Markdown renderers share: formatting, and the rows and groups
they lay out. Everything is read from the :class:`~kvscope.report.model.WeeklyReport`;
nothing is derived beyond picking, formatting and ordering."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from kvscope.advisor.findings import EngineVerdict, Finding, PoolVerdict, Recommendation
from kvscope.advisor.render import EFFECT_LABELS, _change_rows, _facts
from kvscope.advisor.usage import Usage
from kvscope.advisor.weekly import CONFIG_FIELDS, Change
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


# -- rows ------------------------------------------------------------------------------


Row = tuple[str, str, str]
"""(label, last week, this week)"""


def _bottleneck(v: EngineVerdict | None) -> str:
    if v is None:
        return "no data"
    if not v.saturated and v.approaching and v.bottleneck == "not_saturated":
        return f"not saturated (approaching {v.approaching})"
    return v.bottleneck


def _cap(v: EngineVerdict | None) -> str:
    if v is None or v.recommended_concurrency_cap is None:
        return "–"
    parts = [f"{v.recommended_concurrency_cap} in flight"]
    if not missing(v.predicted_throughput_fraction_at_cap):
        parts.append(f"keeps {pct(v.predicted_throughput_fraction_at_cap)} of peak")
    if not missing(v.predicted_p99_e2e_s_at_cap):
        parts.append(f"e2e P99 {sec(v.predicted_p99_e2e_s_at_cap)}")
    return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def _p99_at_max(v: EngineVerdict | None) -> str:
    if v is None or missing(v.p99_e2e_s_at_max_load):
        return "–"
    return f"{sec(v.p99_e2e_s_at_max_load)} at {num(v.max_load_seen)} in flight"


def _saturated_time(u: dict[str, Any]) -> str:
    if not u:
        return "–"
    if u.get("knee_concurrency") is None:
        return "none (not saturated)"
    return f"{duration(u['saturated_s'])} ({pct(u.get('saturated_share'))} of active time)"


def _usage_rows(before: dict[str, Any], after: dict[str, Any], *, pool: bool = False) -> list[Row]:
    def pair(fn: Callable[[dict[str, Any]], str]) -> tuple[str, str]:
        return (fn(before) if before else "–", fn(after) if after else "–")

    def with_delta(col: str) -> tuple[str, str]:
        b, a = pair(lambda u: count(u[col]))
        d = delta(before.get(col), after.get(col)) if before and after else ""
        return b, f"{a} ({d})" if d else a

    rows: list[Row] = [
        ("requests finished", *with_delta("requests")),
        ("generated tokens", *with_delta("generation_tokens")),
        ("active time (seconds with engine steps)", *pair(lambda u: duration(u["active_s"]))),
        ("mean generation rate while active", *pair(lambda u: tok(u["gen_tokens_per_s_mean"]))),
    ]
    if pool:
        rows.append(
            (
                "time past the knee (all engines)",
                *pair(lambda u: f"{duration(u['saturated_s'])} ({pct(u.get('saturated_share'))})"),
            )
        )
    else:
        rows.append(("busiest second", *pair(lambda u: tok(u.get("gen_tokens_per_s_peak")))))
        rows.append(("most requests in flight", *pair(lambda u: num(u.get("load_max")))))
        rows.append(("time past the knee", *pair(_saturated_time)))
    rows.append(("preemptions", *pair(lambda u: count(u["preemptions"]))))
    rows.append(("prefix-cache hit rate (tokens)", *pair(lambda u: pct(u.get("prefix_hit_rate")))))
    return rows


def _both(fn: Callable[[Any], str], before: Any, after: Any) -> tuple[str, str]:
    """``fn`` of last week's and this week's object; a dash where one is missing."""
    return (fn(before) if before is not None else "–", fn(after) if after is not None else "–")


def engine_rows(wr: WeeklyReport, engine_id: str) -> list[Row]:
    before = verdict(wr.previous.engines, engine_id)
    after = verdict(wr.current.engines, engine_id)
    rows: list[Row] = [
        ("bottleneck", _bottleneck(before), _bottleneck(after)),
        (
            "knee",
            *_both(
                lambda v: (
                    "–" if v.knee_concurrency is None else f"{num(v.knee_concurrency)} in flight"
                ),
                before,
                after,
            ),
        ),
        ("plateau (generated)", *_both(lambda v: tok(v.plateau_tokens_per_s), before, after)),
        ("recommended cap", _cap(before), _cap(after)),
        ("e2e P99 at the highest load", _p99_at_max(before), _p99_at_max(after)),
        (
            "preemption thrash",
            *_both(lambda v: "yes" if v.preemption_thrash else "no", before, after),
        ),
    ]
    cfg_b = wr.week_configs.get("previous", {}).get(engine_id, {}) if before else {}
    cfg_a = wr.week_configs.get("current", {}).get(engine_id, {}) if after else {}
    rows += _config_rows(cfg_b, cfg_a)
    return rows + _usage_rows(wr.previous_usage.engine(engine_id), wr.usage.engine(engine_id))


def _config_rows(before: dict[str, Any], after: dict[str, Any]) -> list[Row]:
    """``max_num_seqs``, the KV cache and the token budget always; the other
    configuration fields where the weeks differ."""

    def kv(c: dict[str, Any]) -> str:
        if not c or missing(c.get("num_gpu_blocks")):
            return "–"
        size = "" if missing(c.get("block_size")) else f" × {_cfg(c['block_size'])} tokens"
        return f"{c['num_gpu_blocks']:,.0f} blocks{size}"

    rows: list[Row] = [
        ("max_num_seqs", _cfg(before.get("max_num_seqs")), _cfg(after.get("max_num_seqs"))),
        ("KV cache", kv(before), kv(after)),
        (
            "max_num_batched_tokens",
            _cfg(before.get("max_num_batched_tokens")),
            _cfg(after.get("max_num_batched_tokens")),
        ),
    ]
    shown = {"max_num_seqs", "num_gpu_blocks", "block_size", "max_num_batched_tokens"}
    for key in CONFIG_FIELDS:
        if key in shown or not before or not after:
            continue
        b, a = _cfg(before.get(key)), _cfg(after.get(key))
        if b != a:
            rows.append((key, b, a))
    return rows


def _cfg(v: Any) -> str:
    if missing(v):
        return "–"
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:g}" if isinstance(v, float) else str(v)


def pool_rows(wr: WeeklyReport, pool: str | None) -> list[Row]:
    before = pool_verdict(wr.previous.pools, pool)
    after = pool_verdict(wr.current.pools, pool)

    def bn(p: PoolVerdict | None) -> str:
        if p is None:
            return "no data"
        return ", ".join(
            f"{k} ×{n}" for k, n in sorted(p.bottlenecks.items(), key=lambda kv: -kv[1])
        )

    rows: list[Row] = [
        ("engines", *_both(lambda p: str(len(p.engine_ids)), before, after)),
        ("bottlenecks", bn(before), bn(after)),
        ("summed plateau", *_both(lambda p: tok(p.plateau_tokens_per_s), before, after)),
        (
            "summed recommended cap",
            *_both(lambda p: num(p.recommended_concurrency_cap, "d"), before, after),
        ),
        (
            "load imbalance (busiest / mean)",
            *_both(
                lambda p: "–" if missing(p.load_imbalance) else f"{num(p.load_imbalance, '.2f')}×",
                before,
                after,
            ),
        ),
    ]
    if (after and after.prefix_routing_loss is not None) or (
        before and before.prefix_routing_loss is not None
    ):
        rows.append(
            ("prefix routing loss", *_both(lambda p: pct(p.prefix_routing_loss), before, after))
        )
        rows.append(
            (
                "predicted hit rate, prefix-aware routing",
                *_both(lambda p: pct(p.predicted_prefix_hit_rate_affine), before, after),
            )
        )
    return rows + _usage_rows(wr.previous_usage.pool(pool), wr.usage.pool(pool), pool=True)


# -- groups ----------------------------------------------------------------------------


def change_groups(wr: WeeklyReport) -> list[tuple[str, str, list[Change]]]:
    """(key, title, changes) in reading order, empty groups left out."""
    out = []
    for key, title in CHANGE_GROUPS:
        if key == "config":
            items = [c for c in wr.comparison.changes if c.kind == "config_change"]
        else:
            items = [
                c for c in wr.comparison.changes if c.kind != "config_change" and c.direction == key
            ]
        if items:
            out.append((key, title, items))
    return out


def glance(wr: WeeklyReport) -> list[tuple[str, str, str]]:
    """(label, value, note) figures for the top of the report."""

    def total(u: Usage, col: str) -> float:
        return float(sum(x or 0.0 for x in u.pools.get(col, [])))

    req, req0 = total(wr.usage, "requests"), total(wr.previous_usage, "requests")
    gen, gen0 = total(wr.usage, "generation_tokens"), total(wr.previous_usage, "generation_tokens")
    sat, act = total(wr.usage, "saturated_s"), total(wr.usage, "active_s")
    status = wr.comparison.recommendation_status
    worse = sum(1 for c in wr.comparison.changes if c.direction == "worse")
    better = sum(1 for c in wr.comparison.changes if c.direction == "better")
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
        (
            "recommendations",
            str(len(wr.current.recommendations)),
            f"{status.count('new')} new this week",
        ),
        (
            "worse / better",
            f"{worse} / {better}",
            f"{sum(1 for c in wr.comparison.changes if c.kind == 'config_change')} "
            "configuration change(s)",
        ),
    ]


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
