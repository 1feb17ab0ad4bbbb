"""Read queries of the store; each takes a DuckDB cursor and returns a DataFrame.

Time filters are half-open, ``since <= t < until``, in unix seconds; ``None`` leaves a
side open. Windows match on their second ``ts_s`` (``floor(since) <= ts_s < until``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvscope.collector import _request_rollup
from kvscope.collector._sql import saturated
from kvscope.collector.tables import KV_EVENT_FIELDS, KV_EVENT_LAST
from kvscope.engine_plugins.schema import EXPORTER_KEYS

_PCTS = ((50, 0.5), (90, 0.9), (99, 0.99))
GROUP_BY = ("engine", "pool", "all")
TOTAL_COLUMNS = (
    "n_steps",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
    "waiting_steps",
    "deferred_steps",
)
#: Column of ``steps`` / ``windows_1s`` summed into each total (beside n_steps).
_TOTAL_OF = {
    "steps": {"waiting_steps": "waiting", "deferred_steps": "deferred"},
    "windows": {"waiting_steps": "waiting_sum", "deferred_steps": "deferred_sum"},
}


def _where(
    engine_id: str | None,
    pool: str | None,
    ts_col: str,
    since: float | None,
    until: float | None,
    *,
    alias: str = "",
) -> tuple[str, list[Any]]:
    p = f"{alias}." if alias else ""
    conds: list[str] = []
    args: list[Any] = []
    if engine_id is not None:
        conds.append(f"{p}engine_id = ?")
        args.append(engine_id)
    if pool is not None:
        conds.append(f"{p}engine_id IN (SELECT engine_id FROM engines WHERE pool = ?)")
        args.append(pool)
    if since is not None:
        conds.append(f"{p}{ts_col} >= ?")
        args.append(math.floor(since) if ts_col == "ts_s" else since)
    if until is not None:
        conds.append(f"{p}{ts_col} < ?")
        args.append(until)
    return (" WHERE " + " AND ".join(conds) if conds else ""), args


def _limit(limit: int | None) -> str:
    return f" LIMIT {int(limit)}" if limit is not None else ""


def _df(cur: Any, sql: str, args: list[Any] | None = None) -> pd.DataFrame:
    return cur.execute(sql, args or []).df()


def engines(cur: Any) -> pd.DataFrame:
    """One row per engine: identity and configuration from its latest hello, first/last seen."""
    return _df(cur, "SELECT * FROM engines ORDER BY engine_id")


def engine_configs(cur: Any, engine_id: str | None = None) -> pd.DataFrame:
    """Configuration history: one row per (engine_id, boot_id) hello, oldest first."""
    where, args = _where(engine_id, None, "received_unix_s", None, None)
    return _df(
        cur,
        f"SELECT * FROM engine_configs{where} ORDER BY engine_id, started_unix_s, received_unix_s",
        args,
    )


def _per_engine_rows(
    cur: Any,
    table: str,
    engine_id: str | None,
    pool: str | None,
    since: float | None,
    until: float | None,
    limit: int | None,
) -> pd.DataFrame:
    """Every column of a per (engine_id, ts_s) table, plus the engine's pool and model."""
    where, args = _where(engine_id, pool, "ts_s", since, until, alias="w")
    return _df(
        cur,
        f"SELECT w.*, e.pool, e.model FROM {table} w "
        f"LEFT JOIN engines e ON e.engine_id = w.engine_id{where} "
        f"ORDER BY w.ts_s, w.engine_id{_limit(limit)}",
        args,
    )


def windows(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """1-second windows (all ``windows_1s`` columns, plus the engine's pool and model)."""
    return _per_engine_rows(cur, "windows_1s", engine_id, pool, since, until, limit)


def minute_windows(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """1-minute windows (all ``windows_1m`` columns, plus the engine's pool and model);
    the minutes overlapping ``[since, until)``."""
    since = None if since is None else math.floor(since / 60.0) * 60
    return _per_engine_rows(cur, "windows_1m", engine_id, pool, since, until, limit)


def request_minutes(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
    step_s: int = 60,
) -> pd.DataFrame:
    """The request tier summed per engine over ``step_s`` (see
    :func:`kvscope.collector._request_rollup.select_sql`: bucket columns named
    ``ttft_s{le=0.5}``), plus the engine's pool and model; the minutes overlapping
    ``[since, until)``, oldest first."""
    since = None if since is None else math.floor(since / 60.0) * 60
    where, args = _where(engine_id, pool, "ts_s", since, until, alias="r")
    return _df(
        cur,
        f"SELECT r.engine_id, {_request_rollup.select_sql(step_s)}, "
        "any_value(e.pool) AS pool, any_value(e.model) AS model "
        f"FROM requests_1m r LEFT JOIN engines e ON e.engine_id = r.engine_id{where} "
        f"GROUP BY r.engine_id, 2 ORDER BY 2, r.engine_id{_limit(limit)}",
        args,
    )


def daily_load_peaks(
    cur: Any,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    day_s: float = 86400.0,
) -> pd.DataFrame:
    """Per engine and UTC day from the 1-minute windows: engine_id, pool,
    day_start_unix_s, load_max (the highest per-second load), active_s (seconds with
    steps), generation_tokens."""
    where, args = _where(None, pool, "ts_s", since, until, alias="w")
    day = f"floor(w.ts_s / {float(day_s)}) * {float(day_s)}"
    return _df(
        cur,
        f"SELECT w.engine_id, e.pool, {day} AS day_start_unix_s, max(w.load_max) AS load_max, "
        "CAST(sum(w.n_seconds) AS DOUBLE) AS active_s, "
        "CAST(sum(w.generation_tokens) AS DOUBLE) AS generation_tokens "
        f"FROM windows_1m w LEFT JOIN engines e ON e.engine_id = w.engine_id{where} "
        "GROUP BY w.engine_id, e.pool, day_start_unix_s ORDER BY w.engine_id, day_start_unix_s",
        args,
    )


def kv_event_windows(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Per engine-second KV-event counters (all ``kv_event_windows`` columns and the
    engine's pool), oldest first."""
    where, args = _where(engine_id, pool, "ts_s", since, until, alias="k")
    return _df(
        cur,
        "SELECT k.*, e.pool FROM kv_event_windows k "
        f"LEFT JOIN engines e ON e.engine_id = k.engine_id{where} "
        f"ORDER BY k.ts_s, k.engine_id{_limit(limit)}",
        args,
    )


KV_EVENT_SUMS: tuple[str, ...] = tuple(c for c, _ in KV_EVENT_FIELDS if c not in KV_EVENT_LAST)


def kv_event_totals(cur: Any) -> pd.DataFrame:
    """Per-engine sums of the additive KV-event counters (``KV_EVENT_SUMS``)."""
    sel = ", ".join(f"{saturated(f'coalesce(sum({c}), 0)')} AS {c}" for c in KV_EVENT_SUMS)
    return _df(
        cur, f"SELECT engine_id, {sel} FROM kv_event_windows GROUP BY engine_id ORDER BY engine_id"
    )


def steps(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
    every: int = 1,
) -> pd.DataFrame:
    """Raw steps (engine_id, boot_id and the wire STEP_FIELDS), oldest first; with
    ``every`` > 1 only the 1st, (every+1)-th, ... step of the range (a sample the size of
    a chart, read without moving the range's rows)."""
    where, args = _where(engine_id, pool, "ts_unix_s", since, until)
    order = "ORDER BY ts_unix_s, engine_id"
    if every <= 1:
        return _df(cur, f"SELECT * FROM steps{where} {order}{_limit(limit)}", args)
    return _df(
        cur,
        f"SELECT * EXCLUDE (_n) FROM (SELECT *, row_number() OVER ({order}) AS _n "
        f"FROM steps{where}) WHERE (_n - 1) % {int(every)} = 0 {order}{_limit(limit)}",
        args,
    )


def requests(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Finished requests (engine_id, boot_id and the wire REQUEST_FIELDS), oldest first."""
    where, args = _where(engine_id, pool, "finished_unix_s", since, until)
    return _df(
        cur,
        f"SELECT * FROM requests{where} ORDER BY finished_unix_s, engine_id{_limit(limit)}",
        args,
    )


def request_stats(
    cur: Any,
    engine_id: str | None = None,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    group_by: str = "engine",
) -> pd.DataFrame:
    """Latency and token statistics of finished requests, per engine, per pool or overall.

    Columns: the group key (``engine_id``, ``pool``, ``model`` for ``engine``; ``pool``
    for ``pool``; none for ``all``), ``n_requests``, ``e2e_s_mean`` and
    ``{e2e,ttft,queue}_s_p{50,90,99}``, ``prefill_s_mean``, ``decode_s_mean``,
    ``prompt_tokens_mean``, ``generation_tokens_mean``, ``prompt_tokens_sum``,
    ``generation_tokens_sum``, ``cached_tokens_sum``, ``preemptions_sum``,
    ``n_preempted``, ``first_finished_unix_s``, ``last_finished_unix_s``.
    """
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by: expected one of {', '.join(GROUP_BY)}, got {group_by!r}")
    keys = {"engine": ["r.engine_id", "e.pool", "e.model"], "pool": ["e.pool"], "all": []}[group_by]
    aggs = ["count(*) AS n_requests", "avg(r.e2e_s) AS e2e_s_mean"]
    for col in ("e2e_s", "ttft_s", "queue_s"):
        aggs += [f"quantile_cont(r.{col}, {q}) AS {col}_p{p}" for p, q in _PCTS]
    aggs += [
        "avg(r.prefill_s) AS prefill_s_mean",
        "avg(r.decode_s) AS decode_s_mean",
        "avg(r.prompt_tokens) AS prompt_tokens_mean",
        "avg(r.generation_tokens) AS generation_tokens_mean",
        f"{saturated('sum(r.prompt_tokens)')} AS prompt_tokens_sum",
        f"{saturated('sum(r.generation_tokens)')} AS generation_tokens_sum",
        f"{saturated('sum(r.cached_tokens)')} AS cached_tokens_sum",
        f"{saturated('sum(r.preemptions)')} AS preemptions_sum",
        "count(*) FILTER (WHERE r.preemptions > 0) AS n_preempted",
        "min(r.finished_unix_s) AS first_finished_unix_s",
        "max(r.finished_unix_s) AS last_finished_unix_s",
    ]
    where, args = _where(engine_id, pool, "finished_unix_s", since, until, alias="r")
    sel = ", ".join([*(f"{k} AS {k.split('.')[1]}" for k in keys), *aggs])
    group = f" GROUP BY {', '.join(keys)} ORDER BY {', '.join(keys)}" if keys else ""
    sql = (
        f"SELECT {sel} FROM requests r LEFT JOIN engines e ON e.engine_id = r.engine_id"
        f"{where}{group}"
    )
    df = _df(cur, sql, args)
    if not keys and len(df) and int(df["n_requests"].iloc[0]) == 0:
        return df.iloc[0:0]
    return df


def totals(cur: Any, source: str = "windows", engine_id: str | None = None) -> pd.DataFrame:
    """Per-engine sums from ``steps`` (raw, subject to retention) or ``windows_1s``.

    Columns: engine_id, n_steps, preemptions, prompt_tokens, generation_tokens,
    prefix_queries, prefix_hits, waiting_steps and deferred_steps (the waiting and
    deferred requests summed over the steps).
    """
    if source not in _TOTAL_OF:
        raise ValueError(f"source: expected 'steps' or 'windows', got {source!r}")
    of = _TOTAL_OF[source]
    table = "steps" if source == "steps" else "windows_1s"
    aggs = [
        "count(*)" if source == "steps" else "sum(n_steps)",
        *(f"sum({of.get(c, c)})" for c in TOTAL_COLUMNS[1:]),
    ]
    sel = ", ".join(
        f"{saturated(f'coalesce({a}, 0)')} AS {c}" for a, c in zip(aggs, TOTAL_COLUMNS, strict=True)
    )
    where, args = _where(engine_id, None, "", None, None)
    return _df(
        cur,
        f"SELECT engine_id, {sel} FROM {table}{where} GROUP BY engine_id ORDER BY engine_id",
        args,
    )


def finished_request_counts(cur: Any) -> pd.DataFrame:
    """Columns: engine_id, n_requests (all stored finished requests)."""
    return _df(
        cur,
        "SELECT engine_id, count(*) AS n_requests FROM requests "
        "GROUP BY engine_id ORDER BY engine_id",
    )


def request_histograms(cur: Any, histograms: Sequence[Any]) -> pd.DataFrame:
    """Columns: engine_id, family, bucket, n, total (see ``Store.request_histograms``).
    Bucket ``i`` holds the values in ``(bounds[i-1], bounds[i]]``, the last one those
    above every bound, as Prometheus' ``le`` buckets; NULL and NaN values are left out."""
    parts = []
    for h in histograms:
        cases = " ".join(f"WHEN v <= {float(b)!r} THEN {i}" for i, b in enumerate(h.bounds))
        parts.append(
            f"SELECT engine_id, '{h.name}' AS family, CASE {cases} ELSE {len(h.bounds)} END "
            f"AS bucket, count(*) AS n, sum(v) AS total FROM (SELECT engine_id, "
            f"CAST({h.sql} AS DOUBLE) AS v FROM requests) WHERE v IS NOT NULL AND NOT isnan(v) "
            "GROUP BY ALL"
        )
    if not parts:
        return pd.DataFrame(columns=["engine_id", "family", "bucket", "n", "total"])
    return _df(cur, " UNION ALL ".join(parts) + " ORDER BY engine_id, family, bucket")


def finish_reason_counts(cur: Any) -> pd.DataFrame:
    """Columns: engine_id, finish_reason, n (all stored finished requests)."""
    return _df(
        cur,
        "SELECT engine_id, finish_reason, count(*) AS n FROM requests "
        "GROUP BY engine_id, finish_reason ORDER BY engine_id, finish_reason",
    )


def exporter_stats(cur: Any, engine_id: str | None = None) -> pd.DataFrame:
    """Latest exporter counters per (engine_id, boot_id): EXPORTER_FIELDS, updated_unix_s."""
    where, args = _where(engine_id, None, "", None, None)
    cols = ", ".join(EXPORTER_KEYS)
    return _df(
        cur,
        f"SELECT engine_id, boot_id, {cols}, updated_unix_s FROM exporter_stats"
        f"{where} ORDER BY engine_id, boot_id",
        args,
    )


def table_counts(cur: Any, tables: tuple[str, ...]) -> dict[str, int]:
    """Row count per table."""
    return {t: int(cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in tables}


# -- fleet-scale reads: per-engine counts, a block sample of the windows, daily sums ----

SAMPLE_BLOCK_S = 300
"""Windows are sampled in whole blocks of this many seconds (see :func:`window_sample`)."""
_PPM = 1_000_000


def window_counts(
    cur: Any, pool: str | None = None, since: float | None = None, until: float | None = None
) -> pd.DataFrame:
    """Per engine with windows in the range: engine_id, n_windows, first_ts_s, last_ts_s,
    n_requests (finished requests in the range)."""
    where, args = _where(None, pool, "ts_s", since, until)
    rwhere, rargs = _where(None, pool, "finished_unix_s", since, until)
    return _df(
        cur,
        "SELECT w.*, coalesce(r.n_requests, 0) AS n_requests FROM ("
        "SELECT engine_id, count(*) AS n_windows, min(ts_s) AS first_ts_s, "
        f"max(ts_s) AS last_ts_s FROM windows_1s{where} GROUP BY engine_id) w "
        "LEFT JOIN (SELECT engine_id, count(*) AS n_requests FROM requests"
        f"{rwhere} GROUP BY engine_id) r USING (engine_id) ORDER BY engine_id",
        [*args, *rargs],
    )


ANALYSIS_COLUMNS: tuple[str, ...] = (
    "engine_id",
    "ts_s",
    "n_steps",
    "first_step_unix_s",
    "last_step_unix_s",
    "batch_sum",
    "batch_mean",
    "batch_min",
    "batch_max",
    "batch_p50",
    "batch_p90",
    "kv_usage_mean",
    "kv_usage_max",
    "waiting_mean",
    "deferred_mean",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
)
"""The ``windows_1s`` columns the advisor's analyses read (a sample reads only these)."""


def _keep(keep: pd.DataFrame, block_expr: str, alias: str) -> tuple[str, list[Any]]:
    """A condition keeping the blocks of ``keep``'s engines (one constant threshold per
    distinct share: the scan filters on ``ts_s`` alone, without a join)."""
    parts: list[str] = []
    args: list[Any] = []
    groups = keep.groupby("keep_ppm", sort=True)["engine_id"].apply(list)
    for ppm, ids in groups.items():
        cond = "" if int(ppm) >= _PPM else f"(hash({block_expr}) % {_PPM}) < {int(ppm)}"
        if len(groups) > 1 or not len(ids):
            marks = ", ".join("?" for _ in ids)
            cond = f"{alias}.engine_id IN ({marks})" + (f" AND {cond}" if cond else "")
            args.extend(str(i) for i in ids)
        parts.append(f"({cond})" if cond else "TRUE")
    return (" OR ".join(parts) if parts else "FALSE"), args


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    """Rows ordered by (ts_s, engine_id), as :func:`windows` returns them; sorted in
    numpy (a DuckDB ORDER BY of millions of rows holds them all in its memory)."""
    if not len(df):
        return df
    codes, _ = pd.factorize(df["engine_id"], sort=True)
    order = np.lexsort((codes, df["ts_s"].to_numpy()))
    return df.take(order).reset_index(drop=True)


def _and(where: str, cond: str) -> str:
    return f"{where} AND ({cond})" if where else f" WHERE ({cond})"


def window_sample(
    cur: Any,
    keep: pd.DataFrame,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    block_s: int = SAMPLE_BLOCK_S,
) -> dict[str, pd.DataFrame]:
    """Windows (:data:`ANALYSIS_COLUMNS`, pool and model), finished requests and
    KV-event windows of whole time blocks.

    ``keep`` has engine_id and keep_ppm: the share of ``block_s``-second blocks kept per
    engine, in millionths; engines not in ``keep`` are left out. A block is kept when a
    hash of its index falls below that share, so engines with the same share keep the
    same blocks (a pool's replicas are seen at the same moments) and a larger share
    keeps a superset. A request belongs to the block it finished in.
    """
    keep = keep[["engine_id", "keep_ppm"]]
    cols = ", ".join(f"w.{c}" for c in ANALYSIS_COLUMNS)
    where, args = _where(None, pool, "ts_s", since, until, alias="w")
    cond, cargs = _keep(keep, f"w.ts_s // {int(block_s)}", "w")
    windows_df = _sorted(
        _df(cur, f"SELECT {cols} FROM windows_1s w{_and(where, cond)}", [*args, *cargs])
    )
    # pool and model from the engines table, joined here rather than once per row in SQL
    names = _df(cur, "SELECT engine_id, pool, model FROM engines").set_index("engine_id")
    windows_df["pool"] = windows_df["engine_id"].map(names["pool"])
    windows_df["model"] = windows_df["engine_id"].map(names["model"])
    where, args = _where(None, pool, "finished_unix_s", since, until, alias="r")
    cond, cargs = _keep(keep, f"CAST(floor(r.finished_unix_s / {int(block_s)}) AS BIGINT)", "r")
    requests_df = _df(
        cur,
        f"SELECT r.* FROM requests r{_and(where, cond)} ORDER BY r.finished_unix_s, r.engine_id",
        [*args, *cargs],
    )
    kv_df = pd.DataFrame()
    if cur.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'kv_event_windows'"
    ).fetchone()[0]:
        where, args = _where(None, pool, "ts_s", since, until, alias="x")
        cond, cargs = _keep(keep, f"x.ts_s // {int(block_s)}", "x")
        kv_df = _df(
            cur,
            "SELECT x.*, e.pool FROM kv_event_windows x "
            f"LEFT JOIN engines e ON e.engine_id = x.engine_id{_and(where, cond)} "
            "ORDER BY x.ts_s, x.engine_id",
            [*args, *cargs],
        )
    return {"windows": windows_df, "requests": requests_df, "kv_events": kv_df}


def usage_days(
    cur: Any,
    knees: pd.DataFrame,
    since: float,
    until: float,
    day_s: float = 86400.0,
    *,
    minutes: bool = False,
    requests_kept_from: float | None = None,
) -> pd.DataFrame:
    """Per engine of ``knees`` (engine_id, knee: the load past which a second counts as
    saturated, null for none) and UTC day: the ``kvscope.advisor.usage.DAY_COLUMNS`` sums of the
    1-second windows in ``[since, until)`` and the requests finished then, in one scan.

    ``minutes``: the 1-minute windows of minutes without a 1-second window (deleted by
    the window retention) count too, as in :func:`kvscope.advisor.usage.minute_days`;
    ``requests_kept_from``: the request tier's minutes before it (where request rows were
    deleted) count their requests."""
    _knees = knees[["engine_id", "knee"]].astype({"knee": "float64"})
    cur.register("_knees", _knees)
    sum_cols = (
        "generation_tokens",
        "prompt_tokens",
        "preemptions",
        "prefix_queries",
        "prefix_hits",
    )
    try:
        load = (
            "(coalesce(w.batch_mean, 0.0) + coalesce(w.waiting_mean, 0.0) "
            "+ coalesce(w.deferred_mean, 0.0))"
        )
        sums = ", ".join(f"CAST(coalesce(sum(w.{c}), 0) AS DOUBLE) AS {c}" for c in sum_cols)
        day = f"floor(w.ts_s / {float(day_s)}) * {float(day_s)}"
        rday = f"floor(r.t / {float(day_s)}) * {float(day_s)}"
        args: list[Any] = [math.floor(since), until]
        per_second = (
            f"SELECT w.engine_id, {day} AS day_start_unix_s, CAST(count(*) AS DOUBLE) AS active_s, "
            f"CAST(count(*) FILTER (WHERE {load} > k.knee) AS DOUBLE) AS saturated_s, {sums}, "
            "CAST(max(coalesce(w.generation_tokens, 0)) AS DOUBLE) AS gen_tokens_per_s_peak, "
            f"max({load}) AS load_max, CAST(min(w.ts_s) AS DOUBLE) AS first_window_s, "
            "CAST(max(w.ts_s) AS DOUBLE) AS last_window_s "
            "FROM windows_1s w JOIN _knees k ON k.engine_id = w.engine_id "
            "WHERE w.ts_s >= ? AND w.ts_s < ? GROUP BY 1, 2"
        )
        if minutes:
            per_minute = (
                f"SELECT w.engine_id, {day} AS day_start_unix_s, "
                "CAST(sum(w.n_seconds) AS DOUBLE) AS active_s, "
                "CAST(coalesce(sum(w.n_seconds) FILTER (WHERE w.load_p50 > k.knee), 0) "
                f"AS DOUBLE) AS saturated_s, {sums}, "
                "CAST(max(w.generation_tokens_max) AS DOUBLE) AS gen_tokens_per_s_peak, "
                "max(w.load_max) AS load_max, CAST(min(w.ts_s) AS DOUBLE) AS first_window_s, "
                "CAST(max(w.ts_s) + 59 AS DOUBLE) AS last_window_s "
                "FROM windows_1m w JOIN _knees k ON k.engine_id = w.engine_id "
                "WHERE w.ts_s >= ? AND w.ts_s < ? AND NOT EXISTS (SELECT 1 FROM windows_1s s "
                "WHERE s.engine_id = w.engine_id AND s.ts_s >= w.ts_s AND s.ts_s < w.ts_s + 60) "
                "GROUP BY 1, 2"
            )
            args += [math.floor(since / 60.0) * 60, until]
            both = f"{per_second} UNION ALL {per_minute}"
            per_second = (
                "SELECT engine_id, day_start_unix_s, "
                + ", ".join(f"sum({c}) AS {c}" for c in ("active_s", "saturated_s", *sum_cols))
                + ", max(gen_tokens_per_s_peak) AS gen_tokens_per_s_peak, "
                "max(load_max) AS load_max, min(first_window_s) AS first_window_s, "
                f"max(last_window_s) AS last_window_s FROM ({both}) GROUP BY 1, 2"
            )
        finished = "SELECT engine_id, finished_unix_s AS t, 1 AS n FROM requests"
        if requests_kept_from is not None:
            finished += (
                " UNION ALL SELECT engine_id, ts_s AS t, n_requests AS n FROM requests_1m "
                "WHERE ts_s < ?"
            )
            args.append(requests_kept_from)
        args += [since, until]
        sql = (
            f"WITH wd AS ({per_second}), "
            f"rd AS (SELECT r.engine_id, {rday} AS day_start_unix_s, "
            f"CAST(sum(r.n) AS DOUBLE) AS requests FROM ({finished}) r "
            "JOIN _knees k ON k.engine_id = r.engine_id "
            "WHERE r.t >= ? AND r.t < ? GROUP BY 1, 2) "
            "SELECT engine_id, day_start_unix_s, coalesce(active_s, 0) AS active_s, "
            "coalesce(saturated_s, 0) AS saturated_s, "
            + ", ".join(f"coalesce({c}, 0) AS {c}" for c in sum_cols)
            + ", coalesce(rd.requests, 0) AS requests, gen_tokens_per_s_peak, load_max, "
            "first_window_s, last_window_s "
            "FROM wd FULL OUTER JOIN rd USING (engine_id, day_start_unix_s) "
            "ORDER BY engine_id, day_start_unix_s"
        )
        return _df(cur, sql, args)
    finally:
        cur.unregister("_knees")


def sample(
    cur: Any,
    max_windows_per_engine: int,
    pool: str | None = None,
    since: float | None = None,
    until: float | None = None,
    block_s: int = SAMPLE_BLOCK_S,
) -> dict[str, pd.DataFrame]:
    """:func:`window_sample` keeping about ``max_windows_per_engine`` windows per engine
    (all of an engine that has fewer), plus ``counts``: :func:`window_counts` with
    ``keep_ratio``, the share of blocks kept (1.0: every window read)."""
    counts = window_counts(cur, pool, since, until)
    n = counts["n_windows"].to_numpy(float)
    ratio = [min(1.0, max_windows_per_engine / v) if v > 0 else 1.0 for v in n]
    counts = counts.assign(keep_ratio=ratio)
    keep = counts.assign(
        keep_ppm=[_PPM if r >= 1.0 else max(1, math.ceil(r * _PPM)) for r in ratio]
    )
    return {**window_sample(cur, keep, pool, since, until, block_s), "counts": counts}
