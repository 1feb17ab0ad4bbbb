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

from kvscope.advisor.findings import EngineVerdict, Frame, Report, _clean
from kvscope.advisor.frames import frame_of, prepare_windows, request_weights

DAY_S = 86400.0
USAGE_SUMS = (
    "active_s",
    "saturated_s",
    "requests",
    "generation_tokens",
    "prompt_tokens",
    "preemptions",
    "prefix_queries",
    "prefix_hits",
)


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
        return cls(
            since_unix_s=d["since_unix_s"],
            until_unix_s=d["until_unix_s"],
            days=d["days"],
            engines=d["engines"],
            pools=d["pools"],
        )

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


DAY_COLUMNS = (
    "engine_id",
    "day_start_unix_s",
    "active_s",
    "saturated_s",
    "generation_tokens",
    "prompt_tokens",
    "preemptions",
    "prefix_queries",
    "prefix_hits",
    "requests",
    "gen_tokens_per_s_peak",
    "load_max",
    "first_window_s",
    "last_window_s",
)
"""Columns of the per (engine, UTC day) sums :func:`usage_from_days` assembles: the
window sums of ``USAGE_SUMS``, finished requests, the busiest second's generated
tokens, the highest load and the first and last window; a store computes them in SQL
(``kvscope.collector._reads.usage_days``), :func:`weekly_usage` from frames."""


def weekly_usage(
    windows: pd.DataFrame,
    requests: pd.DataFrame,
    report: Report,
    since: float,
    until: float,
    *,
    day_s: float = DAY_S,
    minutes: pd.DataFrame | None = None,
) -> Usage:
    """One week's use per engine and day (see the module docstring); days are UTC
    days (``day_s`` long) overlapping ``[since, until)``, the first and last partial.
    ``minutes``: the collector's 1-minute windows, which stand for the minutes whose
    1-second windows are not in ``windows`` (deleted by the window retention)."""
    verdicts = {v.engine_id: v for v in report.engines}
    days = usage_days(windows, requests, verdicts, since, until, day_s=day_s)
    if minutes is not None and len(minutes):
        days = merge_days(days, minute_days(minutes, windows, verdicts, since, until, day_s=day_s))
    return usage_from_days(days, report, since, until, day_s=day_s)


def minute_days(
    minutes: pd.DataFrame,
    windows: pd.DataFrame,
    verdicts: dict[str, EngineVerdict],
    since: float,
    until: float,
    *,
    day_s: float = DAY_S,
) -> pd.DataFrame:
    """The :data:`DAY_COLUMNS` sums of the 1-minute windows (``windows_1m`` rows) of the
    minutes without a 1-second window in ``windows``: a minute's seconds with steps
    (``n_seconds``) are its active seconds, and count as past the knee when its median
    per-second load is (an estimate: the seconds themselves are gone). No requests: the
    request tier's rows are in the requests frame already."""
    m = minutes[minutes["engine_id"].isin(verdicts)] if "engine_id" in minutes else minutes
    if not len(m):
        return pd.DataFrame(columns=list(DAY_COLUMNS))
    ts = pd.to_numeric(m["ts_s"], errors="coerce").astype(float)
    m = m[(ts >= math.floor(since / 60.0) * 60) & (ts < until)]
    if len(windows) and "engine_id" in windows and len(m):
        w_ts = pd.to_numeric(windows["ts_s"], errors="coerce")
        near = w_ts < float(pd.to_numeric(m["ts_s"], errors="coerce").max()) + 60.0
        held = set(  # only the windows of the minutes read (a week of seconds is large)
            zip(
                windows.loc[near, "engine_id"].astype(str),
                np.floor(w_ts[near] / 60.0) * 60,
                strict=True,
            )
        )
        keep = [
            (str(e), float(t)) not in held for e, t in zip(m["engine_id"], m["ts_s"], strict=True)
        ]
        m = m[keep]
    if not len(m):
        return pd.DataFrame(columns=list(DAY_COLUMNS))

    def num(col: str) -> pd.Series:
        if col not in m:
            return pd.Series(0.0, index=m.index)
        return pd.to_numeric(m[col], errors="coerce").fillna(0.0).astype(float)

    knee = m["engine_id"].map(lambda e: _saturation_knee(verdicts[e])).astype(float)
    seconds = num("n_seconds")
    t = pd.to_numeric(m["ts_s"], errors="coerce").astype(float)
    per_minute = pd.DataFrame(
        {
            "engine_id": m["engine_id"].astype(str),
            "day_start_unix_s": _day(t, day_s),
            "active_s": seconds,
            "saturated_s": seconds.where(num("load_p50") > knee, 0.0),
            **{c: num(c) for c in USAGE_SUMS if c not in ("active_s", "saturated_s", "requests")},
            "requests": 0.0,
            "gen_tokens_per_s_peak": num("generation_tokens_max"),
            "load_max": num("load_max"),
            "first_window_s": t,
            "last_window_s": t + 59.0,
        }
    )
    return _by_day(per_minute)


def merge_days(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two :data:`DAY_COLUMNS` frames of the same days summed per (engine, day)."""
    both = [x for x in (a, b) if len(x)]
    if len(both) < 2:
        return both[0] if both else a
    return _by_day(pd.concat(both, ignore_index=True))


def _by_day(f: pd.DataFrame) -> pd.DataFrame:
    """:data:`DAY_COLUMNS` rows summed per (engine, day): sums added, peaks and loads
    their maximum, first and last windows the outer ones."""
    f = f.assign(**{c: pd.to_numeric(f[c], errors="coerce").astype(float) for c in DAY_COLUMNS[2:]})
    g = f.groupby(["engine_id", "day_start_unix_s"], sort=True)
    out = g[[*USAGE_SUMS]].sum()
    out["gen_tokens_per_s_peak"] = g["gen_tokens_per_s_peak"].max()
    out["load_max"] = g["load_max"].max()
    out["first_window_s"] = g["first_window_s"].min()
    out["last_window_s"] = g["last_window_s"].max()
    return out.reset_index()[list(DAY_COLUMNS)]


def usage_days(
    windows: pd.DataFrame,
    requests: pd.DataFrame,
    verdicts: dict[str, EngineVerdict],
    since: float,
    until: float,
    *,
    day_s: float = DAY_S,
) -> pd.DataFrame:
    """The :data:`DAY_COLUMNS` sums per engine of ``verdicts`` and day with data."""
    w = windows[windows["engine_id"].isin(verdicts)] if len(windows) else windows
    w = prepare_windows(w) if len(w) else pd.DataFrame(columns=["engine_id", "ts_s", "load"])
    w = w[(w["ts_s"] >= math.floor(since)) & (w["ts_s"] < until)]
    knee = w["engine_id"].map(lambda e: _saturation_knee(verdicts[e]))
    w = w.assign(
        day=_day(w["ts_s"], day_s),
        active_s=1,
        saturated_s=(w["load"] > knee.astype(float)).astype(int),
    )
    r = requests
    if len(r) and "engine_id" in r:
        r = r[r["engine_id"].isin(verdicts)]
        t = pd.to_numeric(r["finished_unix_s"], errors="coerce")
        r = r[(t >= since) & (t < until)].assign(day=_day(t, day_s))
        n_req = request_weights(r).groupby([r["engine_id"], r["day"]]).sum()
    else:
        n_req = pd.Series(dtype=float)
    rows = []
    for (eid, d), g in w.groupby(["engine_id", "day"], sort=True) if len(w) else ():
        row: dict[str, Any] = {
            "engine_id": eid,
            "day_start_unix_s": float(d),
            **{k: _total(g, k) for k in USAGE_SUMS if k != "requests"},
        }
        row["requests"] = float(n_req.get((eid, d), 0))
        row["gen_tokens_per_s_peak"] = float(g["gen_tokens_per_s"].max())
        row["load_max"] = float(g["load"].max())
        row["first_window_s"] = float(g["ts_s"].min())
        row["last_window_s"] = float(g["ts_s"].max())
        rows.append(row)
    seen = {(r_["engine_id"], r_["day_start_unix_s"]) for r_ in rows}
    for (eid, d), n in n_req.items():
        if (eid, float(d)) not in seen:  # requests finished on a day without windows
            rows.append(
                {
                    "engine_id": eid,
                    "day_start_unix_s": float(d),
                    **{k: 0.0 for k in USAGE_SUMS if k != "requests"},
                    "requests": float(n),
                    "gen_tokens_per_s_peak": None,
                    "load_max": None,
                    "first_window_s": None,
                    "last_window_s": None,
                }
            )
    return pd.DataFrame(rows, columns=list(DAY_COLUMNS))


def _total(df: pd.DataFrame, col: str) -> float:
    return float(pd.to_numeric(df[col], errors="coerce").sum()) if col in df and len(df) else 0.0


def usage_from_days(
    days_in: pd.DataFrame, report: Report, since: float, until: float, *, day_s: float = DAY_S
) -> Usage:
    """Assemble the :class:`Usage` of ``report``'s engines from per (engine, day) sums
    (:data:`DAY_COLUMNS`; days without a row count as unused)."""
    verdicts = {v.engine_id: v for v in report.engines}
    by_key = (
        {(str(r["engine_id"]), float(r["day_start_unix_s"])): r for r in days_in.to_dict("records")}
        if len(days_in)
        else {}
    )
    first_day = _day(pd.Series([since]), day_s).iloc[0]
    day_starts = np.arange(first_day, until, day_s)
    day_rows = []
    eng_rows = []
    for eid, v in sorted(verdicts.items()):
        parts = []
        for d in day_starts:
            part = by_key.get((eid, float(d)))
            parts.append(part)
            day_rows.append(
                _ratios(
                    {
                        "engine_id": eid,
                        "pool": v.pool,
                        "day_start_unix_s": float(d),
                        **_from_parts([part]),
                    }
                )
            )
        row = {"engine_id": eid, "pool": v.pool, **_from_parts(parts)}
        row["knee_concurrency"] = _saturation_knee(v)
        firsts = [p["first_window_s"] for p in parts if p and _num(p["first_window_s"])]
        lasts = [p["last_window_s"] for p in parts if p and _num(p["last_window_s"])]
        row["first_window_s"] = float(min(firsts)) if firsts else None
        row["last_window_s"] = float(max(lasts)) if lasts else None
        eng_rows.append(_ratios(row))
    days = pd.DataFrame(day_rows)
    engines = pd.DataFrame(eng_rows)
    pool_rows = []
    for _, g in engines.groupby(engines["pool"].astype(str), sort=True) if len(engines) else ():
        prow = {
            "pool": g["pool"].iloc[0],
            "n_engines": len(g),
            **{k: float(g[k].sum()) for k in USAGE_SUMS},
        }
        prow["gen_tokens_per_s_mean"] = (
            prow["generation_tokens"] / prow["active_s"] if prow["active_s"] else None
        )
        pool_rows.append(_ratios(prow))
    return Usage(
        since_unix_s=float(since),
        until_unix_s=float(until),
        days=frame_of(days, list(days.columns)),
        engines=frame_of(engines, list(engines.columns)),
        pools=frame_of(pd.DataFrame(pool_rows), list(pool_rows[0]) if pool_rows else []),
    )


def _num(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _from_parts(parts: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Sums over days (``None``: a day without data) in the layout of a usage row."""
    have = [p for p in parts if p]
    out: dict[str, Any] = {
        k: float(sum(float(p[k]) for p in have)) for k in USAGE_SUMS if k != "requests"
    }
    out["requests"] = float(sum(float(p["requests"]) for p in have))
    out["gen_tokens_per_s_mean"] = (
        out["generation_tokens"] / out["active_s"] if out["active_s"] else None
    )
    peaks = [float(p["gen_tokens_per_s_peak"]) for p in have if _num(p["gen_tokens_per_s_peak"])]
    loads = [float(p["load_max"]) for p in have if _num(p["load_max"])]
    out["gen_tokens_per_s_peak"] = max(peaks) if peaks else None
    out["load_max"] = max(loads) if loads else None
    return out


def _saturation_knee(v: EngineVerdict) -> float:
    """The load past which a second counts as saturated (inf when not saturated)."""
    if v.saturated and v.knee_concurrency is not None:
        return float(v.knee_concurrency)
    return math.inf


def _day(ts: pd.Series, day_s: float) -> pd.Series:
    return (np.floor(pd.to_numeric(ts, errors="coerce") / day_s) * day_s).astype(float)


def _ratios(row: dict[str, Any]) -> dict[str, Any]:
    row["saturated_share"] = row["saturated_s"] / row["active_s"] if row["active_s"] else None
    row["prefix_hit_rate"] = (
        row["prefix_hits"] / row["prefix_queries"] if row["prefix_queries"] else None
    )
    return row
