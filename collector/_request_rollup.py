"""The store's downsampled tier of finished requests: per engine and minute, histograms.

Request rows are kept for ``--request-retention``; an SLO is commonly judged over 28 or
30 days. ``requests_1m`` keeps, per engine and minute of finish, what latency and SLO
attainment need, in the buckets of the ``/metrics`` histograms (exact at the usual SLO
targets, which are bucket bounds):

* ``n_requests`` and the finish reasons (``n_stop`` ... ``n_other``);
* per measure (TTFT, ITL, e2e, queue, prefill, decode, prompt and output length) the
  **cumulative** count at or under each bound (``<m>_b00`` ...; the last, +Inf, counts
  the requests having the measure) and the sum (``<m>_sum``);
* the sums of cached prompt tokens and preemptions.

The retention task rolls a minute up ``ROLLUP_LAG_S`` after it ended and again when
requests of it were stored since (as :mod:`kvscope.collector._rollup`); a request row is
deleted only once its minute is rolled up. Late requests past the retention fill the
tier only where it has no row, never replacing one. :func:`select_sql` names each
bucket column after its bound as Prometheus does (``ttft_s{le=0.5}``).

Details: docs/collector.md#the-request-tier; sizes: docs/benchmarks.md#storage-per-engine-day
"""

from __future__ import annotations

import math

from kvscope.collector._rollup import MINUTE_S, Tier

REQUEST_SECONDS_BUCKETS: tuple[float, ...] = (
    0.05,
    0.1,
    0.2,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
ITL_SECONDS_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.06,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
REQUEST_TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(4, 18))
"""16 to 131,072 tokens, powers of two."""
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "other")
"""Finish reasons counted apart; any other (or none) counts as ``other``."""

TTFT_SQL = "coalesce(ttft_s, queue_s + prefill_s)"
ITL_SQL = "CASE WHEN generation_tokens >= 2 THEN decode_s / (generation_tokens - 1) END"

#: measure -> (SQL over the ``requests`` table, upper bounds of its buckets but +Inf).
MEASURES: dict[str, tuple[str, tuple[float, ...]]] = {
    "ttft_s": (TTFT_SQL, REQUEST_SECONDS_BUCKETS),
    "itl_s": (ITL_SQL, ITL_SECONDS_BUCKETS),
    "e2e_s": ("e2e_s", REQUEST_SECONDS_BUCKETS),
    "queue_s": ("queue_s", REQUEST_SECONDS_BUCKETS),
    "prefill_s": ("prefill_s", REQUEST_SECONDS_BUCKETS),
    "decode_s": ("decode_s", REQUEST_SECONDS_BUCKETS),
    "prompt_tokens": ("prompt_tokens", REQUEST_TOKEN_BUCKETS),
    "generation_tokens": ("generation_tokens", REQUEST_TOKEN_BUCKETS),
}


def _finite(sql: str) -> str:
    """The measure, NULL when it is NaN or infinite (they count in no bucket)."""
    return f"(CASE WHEN isfinite(CAST({sql} AS DOUBLE)) THEN CAST({sql} AS DOUBLE) END)"


def _bucket_col(measure: str, i: int) -> str:
    return f"{measure}_b{i:02d}"


def _le_text(b: float) -> str:
    return "+Inf" if math.isinf(b) else f"{b:g}"


def bucket_names(measure: str) -> list[str]:
    """The read-back names of ``measure``'s bucket columns: ``ttft_s{le=0.05}``, ...,
    ``ttft_s{le=+Inf}``."""
    bounds = (*MEASURES[measure][1], math.inf)
    return [f"{measure}{{le={_le_text(b)}}}" for b in bounds]


def _aggregates() -> tuple[tuple[str, str, str, str], ...]:
    """(column, SQL type, aggregate, name read back) of every ``requests_1m`` column."""
    reason = "coalesce(finish_reason, '')"
    out: list[tuple[str, str, str, str]] = [("n_requests", "BIGINT", "count(*)", "n_requests")]
    for r in FINISH_REASONS[:-1]:
        out.append((f"n_{r}", "BIGINT", f"count_if({reason} = '{r}')", f"n_{r}"))
    named = ", ".join(f"'{r}'" for r in FINISH_REASONS[:-1])
    out.append(("n_other", "BIGINT", f"count_if({reason} NOT IN ({named}))", "n_other"))
    for m, (sql, bounds) in MEASURES.items():
        v = _finite(sql)
        names = bucket_names(m)
        for i, b in enumerate(bounds):
            out.append((_bucket_col(m, i), "BIGINT", f"count_if({v} <= {b!r})", names[i]))
        out.append((_bucket_col(m, len(bounds)), "BIGINT", f"count({v})", names[-1]))
        out.append((f"{m}_sum", "DOUBLE", f"coalesce(sum({v}), 0.0)", f"{m}_sum"))
    for m in ("cached_tokens", "preemptions"):
        out.append((f"{m}_sum", "DOUBLE", f"coalesce(sum({_finite(m)}), 0.0)", f"{m}_sum"))
    return tuple(out)


#: ``requests_1m`` columns after (engine_id, ts_s): (name, SQL type, aggregate).
REQUEST_MINUTE_AGGREGATES: tuple[tuple[str, str, str, str], ...] = _aggregates()
REQUEST_MINUTE_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (c, t) for c, t, _, _ in REQUEST_MINUTE_AGGREGATES
)
REQUEST_MINUTE_COLUMNS: tuple[str, ...] = (
    "engine_id",
    "ts_s",
    *(c for c, _ in REQUEST_MINUTE_FIELDS),
)
REQUESTS_ROLLED_UNTIL_KEY = "requests_1m_until"
"""``meta`` key: the end (exclusive, unix seconds) of the request minutes rolled up."""
REQUESTS_KEPT_FROM_KEY = "requests_kept_from"
"""``meta`` key: request rows finished before this (unix seconds, a minute start) were
deleted by the retention; the tier alone holds them."""

MINUTE_OF_FINISH_SQL = f"CAST(floor(finished_unix_s / {MINUTE_S}) AS BIGINT) * {MINUTE_S}"
"""The minute start of a finished request, as ``requests_1m`` groups it."""

REQUEST_ROLLUP_SQL = (
    f"INSERT INTO requests_1m ({', '.join(REQUEST_MINUTE_COLUMNS)}) "
    f"SELECT engine_id, {MINUTE_OF_FINISH_SQL} AS minute, "
    + ", ".join(agg for _, _, agg, _ in REQUEST_MINUTE_AGGREGATES)
    + " FROM requests WHERE finished_unix_s >= ? AND finished_unix_s < ? "
    "GROUP BY engine_id, minute ON CONFLICT (engine_id, ts_s) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c, _ in REQUEST_MINUTE_FIELDS)
)
REQUESTS_1M = Tier(
    REQUEST_ROLLUP_SQL,
    "requests",
    "finished_unix_s",
    REQUESTS_ROLLED_UNTIL_KEY,
    MINUTE_OF_FINISH_SQL,
)


def select_sql(step_s: int) -> str:
    """The tier summed over ``step_s`` (a multiple of 60) per engine, bucket columns
    named by :func:`bucket_names`; ``first_minute_s`` and ``end_minute_s`` bound the
    minutes a row sums (inside the caller's range); ``WHERE`` and ``ORDER`` are the
    caller's."""
    step = max(MINUTE_S, int(step_s) // MINUTE_S * MINUTE_S)
    parts = [
        f"(r.ts_s // {step}) * {step} AS ts_s",
        f"{step} AS step_s",
        "min(r.ts_s) AS first_minute_s",
        f"max(r.ts_s) + {MINUTE_S} AS end_minute_s",
    ]
    for c, t, _, name in REQUEST_MINUTE_AGGREGATES:
        parts.append(f'CAST(sum(r.{c}) AS {t}) AS "{name}"')
    return ", ".join(parts)
