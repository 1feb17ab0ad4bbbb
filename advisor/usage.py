"""How a week was used, per engine and UTC day.

:func:`weekly_usage` sums one week's 1-second windows and finished requests per
engine and UTC day: seconds with engine steps (``active_s``), requests finished,
prompt and generated tokens, preemptions, prefix-cache lookups and hits, the mean
and busiest-second generation rate, and the **time spent saturated**: the seconds
whose load (requests in flight, as the advisor defines it) lay past the engine's
knee, counted only for engines the week's verdict calls saturated (for the others
the knee is not established: the plateau lies beyond the observed load).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from advisor._frames import frame_of, prepare_windows
from advisor.findings import EngineVerdict, Frame, Report, _clean

DAY_S = 86400.0
USAGE_SUMS = ("active_s", "saturated_s", "requests", "generation_tokens", "prompt_tokens",
              "preemptions", "prefix_queries", "prefix_hits")


@dataclass
class Usage:
    """One week's use per engine and day (``days``), per engine and per pool; frames."""

    since_unix_s: float
    until_unix_s: float
    days: Frame
    engines: Frame
    pools: Frame

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Usage:
        return cls(since_unix_s=d["since_unix_s"], until_unix_s=d["until_unix_s"],
                   days=d["days"], engines=d["engines"], pools=d["pools"])

    def engine(self, engine_id: str) -> dict[str, Any]:
        """The week's row of one engine (empty when it had no windows)."""
        ids = self.engines.get("engine_id", [])
        if engine_id not in ids:
            return {}
        i = ids.index(engine_id)
        return {k: v[i] for k, v in self.engines.items()}

    def pool(self, pool: str | None) -> dict[str, Any]:
        ids = self.pools.get("pool", [])
        if pool not in ids:
            return {}
        i = ids.index(pool)
        return {k: v[i] for k, v in self.pools.items()}


def weekly_usage(windows: pd.DataFrame, requests: pd.DataFrame, report: Report,
                 since: float, until: float, *, day_s: float = DAY_S) -> Usage:
    """One week's use per engine and day (see the module docstring); days are UTC
    days (``day_s`` long) overlapping ``[since, until)``, the first and last partial."""
    verdicts = {v.engine_id: v for v in report.engines}
    w = windows[windows["engine_id"].isin(verdicts)] if len(windows) else windows
    w = prepare_windows(w) if len(w) else pd.DataFrame(columns=["engine_id", "ts_s", "load"])
    w = w[(w["ts_s"] >= math.floor(since)) & (w["ts_s"] < until)]
    knee = w["engine_id"].map(lambda e: _saturation_knee(verdicts[e]))
    w = w.assign(day=_day(w["ts_s"], day_s), active_s=1,
                 saturated_s=(w["load"] > knee.astype(float)).astype(int))
    r = requests
    if len(r) and "engine_id" in r:
        r = r[r["engine_id"].isin(verdicts)]
        t = pd.to_numeric(r["finished_unix_s"], errors="coerce")
        r = r[(t >= since) & (t < until)].assign(day=_day(t, day_s), requests=1)
    first_day = _day(pd.Series([since]), day_s).iloc[0]
    day_starts = np.arange(first_day, until, day_s)
    day_rows = []
    for eid, v in sorted(verdicts.items()):
        we = w[w["engine_id"] == eid]
        re_ = r[r["engine_id"] == eid] if len(r) and "engine_id" in r else r.iloc[0:0]
        for d in day_starts:
            day_rows.append(_ratios({
                "engine_id": eid, "pool": v.pool, "day_start_unix_s": float(d),
                **_sums(we[we["day"] == d], re_[re_["day"] == d] if len(re_) else re_)}))
    days = pd.DataFrame(day_rows)
    eng_rows = []
    for eid, v in sorted(verdicts.items()):
        we = w[w["engine_id"] == eid]
        row = {"engine_id": eid, "pool": v.pool,
               **_sums(we, r[r["engine_id"] == eid] if len(r) and "engine_id" in r else r)}
        row["knee_concurrency"] = _saturation_knee(v)
        row["first_window_s"] = float(we["ts_s"].min()) if len(we) else None
        row["last_window_s"] = float(we["ts_s"].max()) if len(we) else None
        eng_rows.append(_ratios(row))
    engines = pd.DataFrame(eng_rows)
    pool_rows = []
    for _, g in (engines.groupby(engines["pool"].astype(str), sort=True)
                    if len(engines) else ()):
        row = {"pool": g["pool"].iloc[0], "n_engines": len(g),
               **{k: float(g[k].sum()) for k in USAGE_SUMS}}
        row["gen_tokens_per_s_mean"] = (row["generation_tokens"] / row["active_s"]
                                        if row["active_s"] else None)
        pool_rows.append(_ratios(row))
    return Usage(since_unix_s=float(since), until_unix_s=float(until),
                 days=frame_of(days, list(days.columns)),
                 engines=frame_of(engines, list(engines.columns)),
                 pools=frame_of(pd.DataFrame(pool_rows), list(pool_rows[0]) if pool_rows else []))


def _saturation_knee(v: EngineVerdict) -> float:
    """The load past which a second counts as saturated (inf when not saturated)."""
    if v.saturated and v.knee_concurrency is not None:
        return float(v.knee_concurrency)
    return math.inf


def _day(ts: pd.Series, day_s: float) -> pd.Series:
    return (np.floor(pd.to_numeric(ts, errors="coerce") / day_s) * day_s).astype(float)


def _sums(w: pd.DataFrame, r: pd.DataFrame) -> dict[str, Any]:
    def total(df: pd.DataFrame, col: str) -> float:
        return float(pd.to_numeric(df[col], errors="coerce").sum()) if col in df and len(df) else 0.0

    out: dict[str, Any] = {k: total(w, k) for k in USAGE_SUMS if k != "requests"}
    out["requests"] = float(len(r))
    gen = pd.to_numeric(w["gen_tokens_per_s"], errors="coerce") if len(w) else pd.Series([])
    out["gen_tokens_per_s_mean"] = out["generation_tokens"] / out["active_s"] if out["active_s"] else None
    out["gen_tokens_per_s_peak"] = float(gen.max()) if len(gen) else None
    out["load_max"] = float(w["load"].max()) if len(w) else None
    return out


def _ratios(row: dict[str, Any]) -> dict[str, Any]:
    row["saturated_share"] = row["saturated_s"] / row["active_s"] if row["active_s"] else None
    row["prefix_hit_rate"] = (row["prefix_hits"] / row["prefix_queries"]
                              if row["prefix_queries"] else None)
    return row
