"""The store's downsampled tier: 1-minute windows rolled up from the 1-second ones.

1-second windows are what the advisor fits knees on, but they grow with every
engine-second. ``windows_1m`` keeps, per engine and minute, what long ranges need: the
sums, the extremes, the step-weighted means, the per-second **load** (``batch_mean +
waiting_mean + deferred_mean``, as the advisor counts it) as mean, median, P90 and
maximum, the busiest second's generated tokens and ``n_seconds`` (seconds stepped), in
a sixtieth of the rows, so the tier can be kept for months.

The retention task (:meth:`kvscope.collector.store.Store.apply_lifecycle`) rolls a
minute up ``ROLLUP_LAG_S`` after it ended and again whenever windows were stored in it
since (an upsert of the whole minute, so twice gives the same row). The rolled-up end
is kept in ``meta``; a backlog is rolled up oldest first within ``ROLLUP_PASS_BUDGET_S``
a pass; the last ``lookback_s`` are rolled up again every pass as a safety net. Late
minutes go ``LATE_CHUNK_S`` of minutes per statement within the same budget, so old
data costs the writer a bounded time a pass. A 1-second window is deleted only once its
minute is rolled up.

Details: docs/collector.md#retention-and-the-1-minute-tier; the pass's cost:
docs/benchmarks.md#the-minute-rollups-pass
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.collector._sql import saturated

MINUTE_S = 60
ROLLUP_LAG_S = 120
"""A minute is rolled up once it ended this long ago (the plugin sends within seconds)."""
ROLLUP_CHUNK_S = 3600
"""A backlog is rolled up this many seconds of rows per statement (and transaction)."""
LATE_CHUNK_S = 6 * 3600
"""Late minutes (rolled up before and written again, or behind the source's retention) are
rolled up at most this many seconds of minutes (``LATE_CHUNK_S // MINUTE_S``) per statement
and transaction, named in a relation: sparse minutes cost a statement per chunk, not one
per minute (a statement's fixed cost dominates them), and a statement aggregates the rows of
6 hours at most."""
LATE_SPAN_S = 86400
"""Late minutes inside the source's retention are rolled up in statements spanning at most
this long: a statement reads the source's rows of its whole span (every engine's). Behind
the retention the source holds only rows waiting for their minute, so the span is free."""
ROLLUP_PASS_BUDGET_S = 1.0
"""A pass stops rolling up a backlog (a store from before the tier, a collector that was
stopped) or late minutes (see ``LATE_CHUNK_S``) once it has taken this long, after at least
one statement of each: ingest waits for one bounded pass at a time, the next pass goes on
(see ``bench/rollup_pass.py --backfill-days`` and ``bench/backfill_work.py``)."""
ROLLED_UNTIL_KEY = "windows_1m_until"
"""``meta`` key: the end (exclusive, unix seconds) of the minutes rolled up so far."""

_LOAD_1S = (
    "(coalesce(batch_mean, 0.0) + coalesce(waiting_mean, 0.0) + coalesce(deferred_mean, 0.0))"
)

#: ``windows_1m`` columns after (engine_id, ts_s): (name, SQL type, aggregate over the
#: minute's 1-second windows). Means are step-weighted like the 1-second ones; ``load_*``
#: are over the seconds.
MINUTE_AGGREGATES: tuple[tuple[str, str, str], ...] = (
    ("n_seconds", "BIGINT", "count(*)"),
    ("n_steps", "BIGINT", saturated("sum(n_steps)")),
    ("first_step_unix_s", "DOUBLE", "min(first_step_unix_s)"),
    ("last_step_unix_s", "DOUBLE", "max(last_step_unix_s)"),
    ("batch_sum", "BIGINT", saturated("sum(batch_sum)")),
    ("batch_mean", "DOUBLE", "sum(batch_sum) / nullif(sum(n_steps), 0)"),
    ("batch_min", "BIGINT", "min(batch_min)"),
    ("batch_max", "BIGINT", "max(batch_max)"),
    ("kv_usage_sum", "DOUBLE", "sum(kv_usage_sum)"),
    ("kv_usage_mean", "DOUBLE", "sum(kv_usage_sum) / nullif(sum(n_steps), 0)"),
    ("kv_usage_max", "DOUBLE", "max(kv_usage_max)"),
    ("kv_blocks_max", "BIGINT", "max(kv_blocks_max)"),
    ("waiting_sum", "BIGINT", saturated("sum(waiting_sum)")),
    ("waiting_mean", "DOUBLE", "sum(waiting_sum) / nullif(sum(n_steps), 0)"),
    ("waiting_max", "BIGINT", "max(waiting_max)"),
    ("deferred_sum", "BIGINT", saturated("sum(deferred_sum)")),
    ("deferred_mean", "DOUBLE", "sum(deferred_sum) / nullif(sum(n_steps), 0)"),
    ("deferred_max", "BIGINT", "max(deferred_max)"),
    ("preemptions", "BIGINT", saturated("sum(preemptions)")),
    ("prompt_tokens", "BIGINT", saturated("sum(prompt_tokens)")),
    ("generation_tokens", "BIGINT", saturated("sum(generation_tokens)")),
    ("generation_tokens_max", "BIGINT", "max(generation_tokens)"),
    ("prefix_queries", "BIGINT", saturated("sum(prefix_queries)")),
    ("prefix_hits", "BIGINT", saturated("sum(prefix_hits)")),
    ("iteration_n", "BIGINT", saturated("sum(iteration_n)")),
    ("iteration_s_sum", "DOUBLE", "sum(iteration_s_sum)"),
    ("iteration_s_max", "DOUBLE", "max(iteration_s_max)"),
    ("load_mean", "DOUBLE", f"avg({_LOAD_1S})"),
    ("load_p50", "DOUBLE", f"quantile_cont({_LOAD_1S}, 0.5)"),
    ("load_p90", "DOUBLE", f"quantile_cont({_LOAD_1S}, 0.9)"),
    ("load_max", "DOUBLE", f"max({_LOAD_1S})"),
)
MINUTE_FIELDS: tuple[tuple[str, str], ...] = tuple((c, t) for c, t, _ in MINUTE_AGGREGATES)
MINUTE_COLUMNS: tuple[str, ...] = ("engine_id", "ts_s", *(c for c, _ in MINUTE_FIELDS))

MINUTE_OF_SECOND_SQL = f"(ts_s // {MINUTE_S}) * {MINUTE_S}"
"""The minute start of a 1-second window, as ``windows_1m`` groups it."""

ROLLUP_SQL = (
    f"INSERT INTO windows_1m ({', '.join(MINUTE_COLUMNS)}) "
    f"SELECT engine_id, {MINUTE_OF_SECOND_SQL} AS minute, "
    + ", ".join(agg for _, _, agg in MINUTE_AGGREGATES)
    + " FROM windows_1s WHERE ts_s >= ? AND ts_s < ? GROUP BY engine_id, minute "
    "ON CONFLICT (engine_id, ts_s) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c, _ in MINUTE_FIELDS)
)


@dataclass(frozen=True)
class Tier:
    """One rolled-up table: its upsert (``[lo, hi)`` of the source's time column as
    arguments), the source table and time column, the ``meta`` key of its progress and
    the minute start of a source row as the upsert groups it."""

    sql: str
    source: str
    ts_col: str
    until_key: str
    minute_sql: str

    @property
    def minutes_sql(self) -> str:
        """The upsert of the minutes named in the ``_kv_minutes`` relation (column ``m``,
        minute starts) inside ``[lo, hi)``: many sparse minutes in one statement."""
        where = f"WHERE {self.ts_col} >= ? AND {self.ts_col} < ?"
        if self.sql.count(where) != 1:
            raise ValueError(f"{self.source}: the rollup has no single {where!r}")
        named = f"{where} AND {self.minute_sql} IN (SELECT m FROM _kv_minutes)"
        return self.sql.replace(where, named)

    @property
    def fill_sql(self) -> str:
        """:attr:`minutes_sql` writing only the rows the tier lacks (``ON CONFLICT DO
        NOTHING``), run for late data behind the source's retention (an import, a replay of
        old traffic): its minutes are added where the tier has none, never replacing a row
        whose rows were deleted since."""
        return self.minutes_sql.split(" ON CONFLICT ")[0] + " ON CONFLICT DO NOTHING"


WINDOWS_1M = Tier(ROLLUP_SQL, "windows_1s", "ts_s", ROLLED_UNTIL_KEY, MINUTE_OF_SECOND_SQL)


def minute_floor(t: float) -> int:
    """The start of the minute holding unix second ``t``."""
    return math.floor(t / MINUTE_S) * MINUTE_S


def rolled_until(con: Any, tier: Tier = WINDOWS_1M) -> int | None:
    """The end of the minutes rolled up so far (``None``: never rolled up)."""
    row = con.execute("SELECT value FROM meta WHERE key = ?", [tier.until_key]).fetchone()
    return int(row[0]) if row else None


def late_chunks(minutes: list[int], span_s: int | None = LATE_SPAN_S) -> list[list[int]]:
    """Sorted minute starts grouped one statement each: at most ``LATE_CHUNK_S`` of minutes,
    within ``span_s`` of the first (``None``: any span)."""
    most = LATE_CHUNK_S // MINUTE_S
    out: list[list[int]] = []
    for m in minutes:
        last = out[-1] if out else None
        if last and len(last) < most and (span_s is None or m + MINUTE_S - last[0] <= span_s):
            last.append(m)
        else:
            out.append([m])
    return out


def _run(con: Any, sql: str, a: int, b: int, chunk_s: int = ROLLUP_CHUNK_S) -> int:
    """``sql`` over ``[a, b)``, one transaction per ``chunk_s``; rows written."""
    rows = 0
    for lo in range(a, b, chunk_s):
        hi = min(lo + chunk_s, b)
        con.execute("BEGIN TRANSACTION")
        try:
            row = con.execute(sql, [lo, hi]).fetchone()
            rows += int(row[0]) if row else 0
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return rows


def _run_minutes(con: Any, sql: str, minutes: list[int]) -> int:
    """``sql`` (a tier's ``minutes_sql`` or ``fill_sql``) over the sorted ``minutes``, in one
    transaction; rows written."""
    _kv_minutes = {"m": np.asarray(minutes, dtype=np.int64)}  # read by ``sql`` (replacement scan)
    con.execute("BEGIN TRANSACTION")
    try:
        row = con.execute(sql, [minutes[0], minutes[-1] + MINUTE_S]).fetchone()
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return int(row[0]) if row else 0


def _run_late(
    con: Any, sql: str, minutes: list[int], span_s: int | None, deadline: float | None
) -> tuple[int, set[int]]:
    """``sql`` over the sorted ``minutes`` a chunk (:func:`late_chunks`) per statement,
    oldest first, until ``time.monotonic()`` passes ``deadline`` (after at least one chunk;
    ``None``: all). Returns the rows written and the minutes left."""
    rows = 0
    chunks = late_chunks(minutes, span_s)
    for i, chunk in enumerate(chunks):
        if i and deadline is not None and time.monotonic() >= deadline:
            return rows, {m for rest in chunks[i:] for m in rest}
        rows += _run_minutes(con, sql, chunk)
    return rows, set()


def fill(
    con: Any, minutes: set[int], tier: Tier, budget_s: float | None = None
) -> tuple[int, set[int]]:
    """Roll up ``minutes`` (starts) with ``tier.fill_sql``: rows only where the tier has
    none, oldest first, ``LATE_CHUNK_S`` of minutes per statement, until the call has taken
    ``budget_s`` (at least one statement; ``None``: all of them). Returns the rows written
    and the minutes left for the next pass."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    return _run_late(con, tier.fill_sql, sorted(minutes), None, deadline)


def roll_up(
    con: Any,
    now_unix_s: float,
    lookback_s: float,
    written: set[int] | None = None,
    tier: Tier = WINDOWS_1M,
    budget_s: float | None = ROLLUP_PASS_BUDGET_S,
) -> tuple[int, int, set[int]]:
    """Roll up the complete minutes not rolled up yet, the last ``lookback_s`` of those
    that were and the complete minutes of ``written`` (minute starts the writer stored
    windows in since the last pass), one transaction per range of at most
    ``ROLLUP_CHUNK_S``, and those of ``written`` before that (late) ``LATE_CHUNK_S`` of
    minutes per transaction; the caller holds the write lock. A backlog (a store written
    before the tier, a collector that was stopped), then the late minutes, are rolled up
    oldest first until the pass has taken ``budget_s`` (at least one statement of each;
    ``None``: all of it at once), so a pass holds the writer for a bounded time. Returns
    the minute rows written, the end of the rolled-up minutes and the minutes of
    ``written`` to pass again next time: those not complete yet, and the late ones the
    budget left (before the end)."""
    end = minute_floor(now_unix_s - ROLLUP_LAG_S)
    written = written or set()
    later = {m for m in written if m >= end}
    done = rolled_until(con, tier)
    late: list[int] = []
    seq: list[tuple[int, int]] = []
    if done is None:  # first pass on this store: every chunk holding a row
        chunks = con.execute(
            f"SELECT DISTINCT CAST(floor({tier.ts_col} / {ROLLUP_CHUNK_S}) AS BIGINT) "
            f"FROM {tier.source} WHERE {tier.ts_col} < ? ORDER BY 1",
            [end],
        ).fetchall()
        seq = [
            (int(c) * ROLLUP_CHUNK_S, min((int(c) + 1) * ROLLUP_CHUNK_S, end)) for (c,) in chunks
        ]
    else:
        start = min(done, minute_floor(done - lookback_s))
        late = sorted(m for m in written if m < start)
        seq = [(a, min(a + ROLLUP_CHUNK_S, end)) for a in range(start, end, ROLLUP_CHUNK_S)]
    t0 = time.monotonic()
    rows = 0
    until = end if done is None else max(done, end)
    for i, (a, b) in enumerate(seq):
        rows += _run(con, tier.sql, a, b)
        if budget_s is not None and i + 1 < len(seq) and time.monotonic() - t0 >= budget_s:
            until = b if done is None else max(done, b)
            break
    _set_until(con, until, tier)
    deadline = None if budget_s is None else t0 + budget_s
    n, left = _run_late(con, tier.minutes_sql, late, LATE_SPAN_S, deadline)
    return rows + n, until, later | left


def set_meta(con: Any, key: str, value: str) -> None:
    """Keep ``value`` under ``key`` in the store's ``meta`` table."""
    con.execute(
        "INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [key, value],
    )


def _set_until(con: Any, until: int, tier: Tier) -> None:
    set_meta(con, tier.until_key, str(int(until)))
