"""The fleet at a glance: engine status (live, idle, DOWN), the last minute of each engine, and which
pools need attention first.

The verdicts (bottleneck, knee, plateau, cap, thrash, imbalance) come from the
advisor's report as they are; this module only orders them and summarises the raw
1-second windows of the last minute (batch, KV usage, preemptions, throughput).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd

from kvscope.advisor import EngineVerdict, PoolVerdict, Report

LIVE_S = 15.0
"""An engine whose newest step is at most this old is live (the plugin ships a
batch about every second)."""
DOWN_S = 60.0
"""An engine not heard from for this long is down (four of the plugin's 15-second
heartbeats missed)."""
RECENT_S = 60
"""Seconds of windows the "last minute" columns summarise."""

# Weights of the attention order: a pool's score is the sum of those that apply.
_THRASH, _KV, _SATURATED, _IMBALANCE, _ROUTING, _NO_DATA = 32, 16, 8, 4, 2, 1


@dataclass(frozen=True)
class Attention:
    """Why a pool or engine needs attention: ``score`` orders, ``reasons`` explain."""

    score: int
    reasons: tuple[str, ...]

    @property
    def text(self) -> str:
        return ", ".join(self.reasons) if self.reasons else "ok"


def engine_attention(v: EngineVerdict) -> Attention:
    """Thrash, then a full KV cache, then any other saturation; too little data last."""
    score, reasons = 0, []
    if v.preemption_thrash:
        score += _THRASH
        reasons.append("preemption thrash")
    if v.saturated:
        score += _SATURATED
        reasons.append("saturated")
        if v.bottleneck == "kv_cache_bound":
            score += _KV
            reasons.append("KV-bound")
    if v.bottleneck == "insufficient_data":
        score += _NO_DATA
        reasons.append("too little data")
    return Attention(score, tuple(reasons))


def pool_attention(report: Report, pv: PoolVerdict) -> Attention:
    """The pool's engines' attention, plus load imbalance and prefix/routing warnings."""
    score, reasons = 0, []
    for v in (report.engine(e) for e in pv.engine_ids):
        a = engine_attention(v)
        score = max(score, a.score)
        reasons += [r for r in a.reasons if r not in reasons]
    pool_findings = [
        f for f in report.findings if f.scope.pool == pv.pool and f.scope.engine_id is None
    ]
    if any(f.kind == "load_imbalance" and f.severity != "info" for f in pool_findings):
        score += _IMBALANCE
        reasons.append("load imbalance")
    routing = ("prefix_routing", "kv_events_missing")
    if any(f.kind in routing and f.severity != "info" for f in pool_findings) or any(
        f.kind == "prefix_caching_off" and f.scope.pool == pv.pool for f in report.findings
    ):
        score += _ROUTING
        reasons.append("prefix/routing")
    return Attention(score, tuple(reasons))


def pools_by_attention(report: Report) -> list[tuple[PoolVerdict, Attention]]:
    """Pools, the ones needing attention first (then by name)."""
    scored = [(pv, pool_attention(report, pv)) for pv in report.pools]
    return sorted(scored, key=lambda x: (-x[1].score, str(x[0].pool)))


def engines_by_attention(report: Report) -> list[EngineVerdict]:
    """Engines in the order of their pools' attention, then their own, then by id."""
    out: list[EngineVerdict] = []
    for pv, _ in pools_by_attention(report):
        vs = [report.engine(e) for e in pv.engine_ids]
        out += sorted(vs, key=lambda v: (-engine_attention(v).score, v.engine_id))
    return out


def ago_text(seconds: float) -> str:
    """``4 s``, ``12 min``, ``3.5 h``, ``2.0 d``."""
    if seconds < 90:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def utc_text(t: float, now_unix_s: float | None = None) -> str:
    """``19:02:11 UTC`` (24-hour clock), with the date when ``t`` is more than a day
    before ``now_unix_s``: ``2026-11-29 16:20:00 UTC``."""
    fmt = "%H:%M:%S UTC"
    if now_unix_s is not None and now_unix_s - t > 86400:
        fmt = "%Y-%m-%d %H:%M:%S UTC"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime(fmt)


@dataclass(frozen=True)
class EngineState:
    """Whether an engine is sending: ``state`` is ``live``, ``idle``, ``DOWN`` or
    ``no steps yet``; ``text`` says it with the time behind it."""

    state: str
    text: str
    last_seen_unix_s: float | None


def _time(v: object) -> float | None:
    try:
        t = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) else None


def engine_state(
    last_step_unix_s: object,
    last_seen_unix_s: object,
    now_unix_s: float,
    down_s: float = DOWN_S,
) -> EngineState:
    """``live`` (a step in the last ``LIVE_S`` seconds); ``idle`` (no recent step, but
    the engine was heard from in the last ``down_s`` seconds: the plugin sends a
    heartbeat every 15 s); ``DOWN`` (not heard from for ``down_s`` seconds, with the
    time it was last seen); ``no steps yet`` (heard from, never a step).

    ``last_seen_unix_s`` is when the collector last received anything from the engine;
    without it (Prometheus) the newest step stands for it."""
    step = _time(last_step_unix_s)
    seen = _time(last_seen_unix_s)
    seen = (
        max(seen, step)
        if seen is not None and step is not None
        else (seen if seen is not None else step)
    )
    if seen is None:
        return EngineState("DOWN", "DOWN, never seen", None)
    if now_unix_s - seen > down_s:
        return EngineState(
            "DOWN",
            f"DOWN, last seen {utc_text(seen, now_unix_s)} ({ago_text(now_unix_s - seen)} ago)",
            seen,
        )
    if step is None:
        return EngineState("no steps yet", "no steps yet", seen)
    age = now_unix_s - step
    if age <= LIVE_S:
        return EngineState("live", "live", seen)
    return EngineState("idle", f"idle, last step {ago_text(age)} ago", seen)


@dataclass(frozen=True)
class Recent:
    """An engine's last ``RECENT_S`` seconds with data in the window."""

    seconds: int
    batch_mean: float | None
    kv_usage_mean: float | None
    preemptions_per_s: float | None
    gen_tokens_per_s: float | None
    waiting_mean: float | None
    end_unix_s: float | None


def recent(windows: pd.DataFrame, seconds: int = RECENT_S, window_s: float = 1.0) -> Recent:
    """Means (batch, KV usage, waiting) and rates (preemptions, generated tokens) over
    the engine's last ``seconds`` seconds with windows; seconds without a window
    count as idle (zero tokens, zero preemptions). ``window_s`` is the windows' length
    (1 from a collector; the resolution read from Prometheus, whose windows hold
    per-second rates)."""
    if not len(windows) or "ts_s" not in windows:
        return Recent(0, None, None, None, None, None, None)
    ts = pd.to_numeric(windows["ts_s"], errors="coerce")
    end = float(ts.max())
    w = windows[ts > end - max(seconds, window_s)]
    span = int(min(max(seconds, window_s), end - float(pd.to_numeric(w["ts_s"]).min()) + window_s))

    def mean(col: str) -> float | None:
        return float(pd.to_numeric(w[col], errors="coerce").mean()) if col in w else None

    def rate(col: str) -> float | None:
        if col not in w:
            return None
        return float(pd.to_numeric(w[col], errors="coerce").sum()) * window_s / span

    return Recent(
        span,
        mean("batch_mean"),
        mean("kv_usage_mean"),
        rate("preemptions"),
        rate("generation_tokens"),
        mean("waiting_mean"),
        end + window_s,
    )
