"""Week over week: what changed between two weeks.

Pure functions for the weekly tuning report; none re-derives a verdict, they take them from
the two weeks' :class:`~kvscope.advisor.findings.Report` objects.

* :func:`config_as_of`: the engines frame with each engine's configuration as it was at a
  moment, from the hello history (``engine_configs``). A past week must be analysed with the
  configuration it ran with: a ``max_num_seqs`` raised since would turn last week's
  ``max_num_seqs_bound`` into ``compute_bound``.
* :func:`compare_weeks`: lines the reports up by engine, pool, finding and recommendation
  (the same across weeks when kind and scope are) and lists each :class:`Change`:
  configuration, engines and pools that came or went, bottlenecks, knee, plateau, cap, hit
  rate and imbalance moves beyond their thresholds (``knee_move``, ``plateau_move``,
  ``hit_rate_move``, ``imbalance_move``), problems new or resolved, recommendations ``new``,
  ``open`` or no longer made. Without the week before: one ``no_previous_data`` change.

See docs/report.md#what-it-contains.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.findings import EngineVerdict, Finding, Report, Scope, _clean
from kvscope.advisor.usage import Usage

#: Hello fields compared between two configurations of an engine.
CONFIG_FIELDS = (
    "model",
    "num_gpu_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "vllm_version",
)
_SEVERITY = {"info": 0, "warning": 1, "critical": 2}
_VERDICT_KINDS = ("throughput_curve", "bottleneck")
"""Finding kinds whose moves the verdict comparison reports already."""


@dataclass
class Change:
    """One thing that differs between the previous week and this one.

    ``direction`` is ``better``, ``worse`` or ``neutral``; ``before`` / ``after`` the
    values compared (``None`` where absent); ``at_unix_s`` when it happened, where
    known (configuration changes).
    """

    kind: str
    scope: Scope
    summary: str
    direction: str = "neutral"
    before: Any = None
    after: Any = None
    at_unix_s: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Change:
        return cls(
            kind=d["kind"],
            scope=Scope(**d["scope"]),
            summary=d["summary"],
            direction=d.get("direction", "neutral"),
            before=d.get("before"),
            after=d.get("after"),
            at_unix_s=d.get("at_unix_s"),
            evidence=dict(d.get("evidence") or {}),
        )


@dataclass
class Comparison:
    """The changes, and the status of each current recommendation (same order)."""

    changes: list[Change] = field(default_factory=list)
    recommendation_status: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": [c.to_dict() for c in self.changes],
            "recommendation_status": list(self.recommendation_status),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Comparison:
        return cls(
            changes=[Change.from_dict(x) for x in d.get("changes", [])],
            recommendation_status=list(d.get("recommendation_status", [])),
        )


# -- configuration history ---------------------------------------------------------------


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return bool(a == b)


def _config_times(configs: pd.DataFrame) -> pd.Series:
    started = (
        pd.to_numeric(configs["started_unix_s"], errors="coerce")
        if "started_unix_s" in configs
        else pd.Series(np.nan, index=configs.index)
    )
    received = (
        pd.to_numeric(configs["received_unix_s"], errors="coerce")
        if "received_unix_s" in configs
        else pd.Series(np.nan, index=configs.index)
    )
    return started.fillna(received)


def config_as_of(
    engines: pd.DataFrame, configs: pd.DataFrame | None, at_unix_s: float | None
) -> pd.DataFrame:
    """The engines frame with each engine's :data:`CONFIG_FIELDS` from its last hello
    started before ``at_unix_s`` (engines without such a hello keep their row)."""
    if (
        configs is None
        or not len(configs)
        or at_unix_s is None
        or not len(engines)
        or "engine_id" not in configs
    ):
        return engines
    c = configs.assign(_t=_config_times(configs))
    c = c[c["_t"] < at_unix_s].sort_values(["engine_id", "_t"], kind="stable")
    last = c.groupby("engine_id").tail(1).set_index("engine_id")
    cols = [f for f in CONFIG_FIELDS if f in engines and f in last]
    rows = []
    for rec in engines.to_dict("records"):
        eid = rec.get("engine_id")
        if eid in last.index:
            rec.update({f: _plain(last.at[eid, f]) for f in cols})
        rows.append(rec)
    return pd.DataFrame(rows, columns=engines.columns)


def config_changes(configs: pd.DataFrame | None, since: float, until: float) -> list[Change]:
    """Each hello in ``[since, until)`` whose configuration differs from the one before."""
    out: list[Change] = []
    if configs is None or not len(configs) or "engine_id" not in configs:
        return out
    c = configs.assign(_t=_config_times(configs)).sort_values(["engine_id", "_t"], kind="stable")
    for eid, g in c.groupby("engine_id", sort=True):
        rows = g.to_dict("records")
        for prev, cur in itertools.pairwise(rows):
            t = _plain(cur["_t"])
            if t is None or not since <= t < until:
                continue
            diff = {
                f: [_plain(prev.get(f)), _plain(cur.get(f))]
                for f in CONFIG_FIELDS
                if f in cur and not _same(prev.get(f), cur.get(f))
            }
            if not diff:
                continue
            text = ", ".join(f"{k} {_txt(a)} -> {_txt(b)}" for k, (a, b) in diff.items())
            out.append(
                Change(
                    kind="config_change",
                    scope=Scope(engine_id=str(eid), pool=_plain(cur.get("pool"))),
                    summary=f"{eid} restarted with {text}",
                    before={k: v[0] for k, v in diff.items()},
                    after={k: v[1] for k, v in diff.items()},
                    at_unix_s=float(t),
                    evidence={
                        "boot_id": _plain(cur.get("boot_id")),
                        "previous_boot_id": _plain(prev.get("boot_id")),
                    },
                )
            )
    return out


def _txt(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


# -- the comparison ----------------------------------------------------------------------


def _key(scope: Scope, kind: str) -> tuple[str, str | None, str | None]:
    return kind, scope.engine_id, scope.pool


def _rel(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or not before:
        return None
    return after / before - 1.0


def _who(scope: Scope) -> str:
    return scope.engine_id or (f"pool {scope.pool}" if scope.pool is not None else "fleet")


def compare_weeks(
    current: Report,
    previous: Report,
    configs: pd.DataFrame | None = None,
    *,
    usage: Usage | None = None,
    knee_move: float = 0.2,
    plateau_move: float = 0.1,
    hit_rate_move: float = 0.05,
    imbalance_move: float = 0.25,
) -> Comparison:
    """What changed from ``previous`` to ``current`` (see the module docstring).

    ``configs`` is the configuration history; ``usage`` this week's, to say when a
    configuration change split the week (the verdict then mixes both).
    """
    out = Comparison()
    since = current.since_unix_s if current.since_unix_s is not None else -math.inf
    until = current.until_unix_s if current.until_unix_s is not None else math.inf
    for ch in config_changes(configs, since, until):
        first = usage.engine(str(ch.scope.engine_id)).get("first_window_s") if usage else None
        if first is not None and ch.at_unix_s is not None and first < ch.at_unix_s:
            ch.summary += "; this week's verdict mixes both configurations"
            ch.evidence["mixed_week"] = True
        out.changes.append(ch)
    if not previous.has_data:
        out.changes.append(
            Change("no_previous_data", Scope(), "no data the week before: nothing to compare with")
        )
        out.recommendation_status = ["new"] * len(current.recommendations)
        return out
    prev = {v.engine_id: v for v in previous.engines}
    cur = {v.engine_id: v for v in current.engines}
    for eid in sorted(set(prev) | set(cur)):
        out.changes.extend(
            _engine_changes(
                prev.get(eid),
                cur.get(eid),
                knee_move=knee_move,
                plateau_move=plateau_move,
                hit_rate_move=hit_rate_move,
            )
        )
    pprev = {p.pool: p for p in previous.pools}
    for pv in current.pools:
        scope = Scope(pool=pv.pool)
        before = pprev.get(pv.pool)
        if before is None:
            out.changes.append(Change("new_pool", scope, f"pool {pv.pool} is new this week"))
            continue
        out.changes.extend(
            _moves(
                scope,
                "plateau_tokens_per_s",
                before.plateau_tokens_per_s,
                pv.plateau_tokens_per_s,
                plateau_move,
                "plateau_move",
                "summed plateau",
                " generated tok/s",
                "{:,.0f}",
            )
        )
        if before.recommended_concurrency_cap != pv.recommended_concurrency_cap:
            out.changes.append(
                _cap_change(
                    scope, before.recommended_concurrency_cap, pv.recommended_concurrency_cap
                )
            )
        out.changes.extend(
            _hit_rate(scope, before.prefix_hit_rate, pv.prefix_hit_rate, hit_rate_move)
        )
        a, b = before.load_imbalance, pv.load_imbalance
        if a is not None and b is not None and abs(b - a) >= imbalance_move:
            out.changes.append(
                Change(
                    "load_imbalance_move",
                    scope,
                    f"pool {pv.pool}: load imbalance (busiest / mean) {a:.2f}x -> {b:.2f}x",
                    "better" if b < a else "worse",
                    a,
                    b,
                )
            )
    out.changes.extend(_finding_changes(previous, current, set(cur)))
    prev_recs = {_key(r.scope, r.kind): r for r in previous.recommendations}
    cur_keys = {_key(r.scope, r.kind) for r in current.recommendations}
    out.recommendation_status = [
        "open" if _key(r.scope, r.kind) in prev_recs else "new" for r in current.recommendations
    ]
    for key, r in prev_recs.items():
        if key not in cur_keys and _present(r.scope, cur, current):
            out.changes.append(
                Change(
                    "resolved_recommendation",
                    r.scope,
                    f"{_who(r.scope)}: no longer recommended: {r.summary}",
                    "better",
                    r.summary,
                    None,
                    evidence={"kind": r.kind},
                )
            )
    return out


def _present(scope: Scope, engines: dict[str, EngineVerdict], report: Report) -> bool:
    if scope.engine_id is not None:
        return scope.engine_id in engines
    return any(p.pool == scope.pool for p in report.pools)


def _moves(
    scope: Scope,
    name: str,
    before: float | None,
    after: float | None,
    threshold: float,
    kind: str,
    label: str,
    unit: str,
    fmt: str,
    note: str = "",
) -> list[Change]:
    rel = _rel(before, after)
    if rel is None or abs(rel) < threshold:
        return []
    text = (
        f"{_who(scope)}: {label} {fmt.format(before)} -> {fmt.format(after)}{unit} "
        f"({rel:+.0%}){note}"
    )
    direction = "neutral" if note else "better" if rel > 0 else "worse"
    return [
        Change(
            kind,
            scope,
            text,
            direction,
            before,
            after,
            evidence={"relative_change": rel, "field": name},
        )
    ]


def _cap_change(scope: Scope, before: int | None, after: int | None) -> Change:
    def t(v: int | None) -> str:
        return "none" if v is None else str(v)

    return Change(
        "cap_change",
        scope,
        f"{_who(scope)}: recommended cap {t(before)} -> {t(after)} in flight",
        "neutral",
        before,
        after,
    )


def _hit_rate(
    scope: Scope, before: float | None, after: float | None, threshold: float
) -> list[Change]:
    if before is None or after is None or abs(after - before) < threshold:
        return []
    return [
        Change(
            "prefix_hit_rate_move",
            scope,
            f"{_who(scope)}: prefix-cache hit rate {before:.0%} -> {after:.0%}",
            "better" if after > before else "worse",
            before,
            after,
        )
    ]


def _engine_changes(
    before: EngineVerdict | None,
    after: EngineVerdict | None,
    *,
    knee_move: float,
    plateau_move: float,
    hit_rate_move: float,
) -> list[Change]:
    if after is None and before is not None:
        return [
            Change(
                "engine_gone",
                Scope(before.engine_id, before.pool),
                f"{before.engine_id} sent no data this week (last week: {before.bottleneck})",
                "neutral",
                before.bottleneck,
                None,
            )
        ]
    if after is None:
        return []
    scope = Scope(after.engine_id, after.pool)
    if before is None:
        return [
            Change(
                "new_engine",
                scope,
                f"{after.engine_id} is new this week: {after.bottleneck}",
                "neutral",
                None,
                after.bottleneck,
            )
        ]
    out: list[Change] = []
    if before.bottleneck != after.bottleneck:
        worse = before.bottleneck == "not_saturated" and after.saturated
        better = after.bottleneck == "not_saturated" and before.saturated
        why = (
            " (saturated now: load went past the knee)"
            if worse
            else " (no plateau reached this week)"
            if better
            else ""
        )
        out.append(
            Change(
                "bottleneck_change",
                scope,
                f"{after.engine_id}: {before.bottleneck} -> {after.bottleneck}{why}",
                "worse" if worse else "better" if better else "neutral",
                before.bottleneck,
                after.bottleneck,
            )
        )
    unsat = [w for w, v in (("last week", before), ("this week", after)) if not v.saturated]
    note = f" (not saturated {' and '.join(unsat)}: a lower bound)" if unsat else ""
    out += _moves(
        scope,
        "knee_concurrency",
        before.knee_concurrency,
        after.knee_concurrency,
        knee_move,
        "knee_move",
        "knee",
        " requests in flight",
        "{:.1f}",
        note,
    )
    out += _moves(
        scope,
        "plateau_tokens_per_s",
        before.plateau_tokens_per_s,
        after.plateau_tokens_per_s,
        plateau_move,
        "plateau_move",
        "plateau",
        " generated tok/s",
        "{:,.0f}",
        note,
    )
    if before.recommended_concurrency_cap != after.recommended_concurrency_cap:
        out.append(
            _cap_change(
                scope, before.recommended_concurrency_cap, after.recommended_concurrency_cap
            )
        )
    out += _hit_rate(scope, before.prefix_hit_rate, after.prefix_hit_rate, hit_rate_move)
    return out


def _problems(report: Report) -> dict[tuple[str, str | None, str | None], Finding]:
    return {
        _key(f.scope, f.kind): f
        for f in report.findings
        if _SEVERITY.get(f.severity, 0) >= 1 and f.kind not in _VERDICT_KINDS
    }


def _finding_changes(previous: Report, current: Report, engines_now: set[str]) -> list[Change]:
    out: list[Change] = []
    before, after = _problems(previous), _problems(current)
    for key, f in after.items():
        old = before.get(key)
        if old is None or _SEVERITY[f.severity] > _SEVERITY.get(old.severity, 0):
            out.append(
                Change(
                    "new_problem",
                    f.scope,
                    f"{_who(f.scope)}: {f.kind} ({f.severity}): {f.summary}",
                    "worse",
                    None if old is None else old.severity,
                    f.severity,
                    evidence={"finding_kind": f.kind},
                )
            )
    pools_now = {p.pool for p in current.pools}
    for key, f in before.items():
        gone = (
            f.scope.engine_id not in engines_now
            if f.scope.engine_id is not None
            else f.scope.pool not in pools_now
        )
        if key not in after and not gone:
            out.append(
                Change(
                    "resolved_problem",
                    f.scope,
                    f"{_who(f.scope)}: {f.kind} no longer seen (last week: {f.summary})",
                    "better",
                    f.severity,
                    None,
                    evidence={"finding_kind": f.kind},
                )
            )
    return out
