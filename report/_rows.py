"""The tables of the report: per engine and per pool, last week against this week. Rows
are read from the :class:`~kvscope.report.model.WeeklyReport` (verdicts, findings and their
evidence, usage, configuration); nothing is derived beyond picking and formatting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.advisor.findings import EngineVerdict, Finding, PoolVerdict
from kvscope.advisor.weekly import CONFIG_FIELDS
from kvscope.report._svg import duration
from kvscope.report._view import (
    count,
    delta,
    finding,
    missing,
    num,
    pct,
    pool_verdict,
    sec,
    tok,
    verdict,
)
from kvscope.report.model import WeeklyReport

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


THRASH_LABEL = "preemption thrash (throughput falls past its peak while preempting)"


def _bottleneck_finding(findings: list[Finding], engine_id: str) -> Finding | None:
    return finding(findings, "bottleneck", engine_id)


def _drop(wr: WeeklyReport, week: str) -> float | None:
    """The ``thrash_drop`` threshold the week's advisor ran with."""
    report = wr.current if week == "current" else wr.previous
    v = (report.parameters.get("bottleneck") or {}).get("thrash_drop")
    return None if v is None or missing(v) else float(v)


def _thrash(v: EngineVerdict | None, bn: Finding | None, drop: float | None) -> str:
    """The verdict with the numbers it was decided on, so that a "no" next to a high
    preemption rate says why: thrash is throughput falling past its peak (more than
    ``thrash_drop``) while vLLM preempts, not preempting as such."""
    if v is None:
        return "–"
    ev = bn.evidence if bn is not None else {}
    rate = ev.get("preemptions_per_s")
    fall = ev.get("drop_past_peak_ratio")
    rate_text = "no preemptions" if not rate else f"{num(rate)} preemptions/s"
    if v.preemption_thrash:
        return f"yes: throughput falls {pct(fall)} past its peak at {rate_text}"
    if missing(rate) and missing(fall):
        return "no"
    if not rate and not missing(rate):
        return "no (no preemptions)"
    if not v.saturated:
        return f"no ({rate_text}; not saturated: no peak to fall from)"
    limit = f"; thrash is a fall of more than {pct(drop)}" if drop is not None else ""
    if fall is None or missing(fall):
        return f"no ({rate_text}, throughput holds{limit})"
    if drop is None or fall <= drop:
        return (
            f"no ({rate_text}, throughput holds: {pct(fall)} below its peak at the "
            f"highest load{limit})"
        )
    return f"no (throughput {pct(fall)} below its peak, but {rate_text}: too few to cause it)"


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
            THRASH_LABEL,
            _thrash(
                before, _bottleneck_finding(wr.previous.findings, engine_id), _drop(wr, "previous")
            ),
            _thrash(
                after, _bottleneck_finding(wr.current.findings, engine_id), _drop(wr, "current")
            ),
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
