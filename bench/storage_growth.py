"""Storage growth of the collector's store: bytes per engine-day and a week's retention plan.

One command (about two minutes)::

    .venv/bin/python bench/storage_growth.py [--engines 100] [--duration 60]
        [--budget-gib 50] [--json out.json]

What it does
------------
A real collector process (default settings) on a fresh store; ``--engines`` simulated
engines (real plugin exporters fed from the bundled real vLLM recordings at
``--steps-per-s`` steps a second, with their finished requests; see :mod:`_fleet`)
report for ``--duration`` seconds. The collector is stopped (its shutdown
checkpoints the store). Each table is then measured on its own: its rows are copied,
in order, into a fresh DuckDB file and repeated under other engine ids until it holds
300,000 rows (DuckDB's 256 KiB blocks are too coarse for the small tables of a short
run), the file is checkpointed, and its growth over the empty table (indexes
included) is divided by the rows.

Before the measurement the store's complete minutes are rolled up into the
downsampled tiers (``windows_1m`` and ``requests_1m``, what the collector's retention
task does every minute; see :mod:`kvscope.collector._rollup` and
:mod:`kvscope.collector._request_rollup`).

From the measured bytes per row and the rows an engine writes per second of
reporting (steps, ledger entries and 1-second windows per second; finished requests
at the recordings' rate; one minute window and one request minute per minute), it derives the store of a
fleet running around the clock: every growing table stops growing at its retention
(defaults: ``steps`` and the ledger one day, ``windows_1s`` and ``requests`` 15 days,
``windows_1m`` 400 days, ``requests_1m`` 90 days); the configuration tables are kept. The baseline in the same
run is the whole file: its size over the steps stored (what ``collector_ingest.py``
reports as bytes per step) next to the sum of the tables.

Then: the size of a 100-engine week under the default retention, the raw-step
retention that keeps it under ``--budget-gib``, and the store a fleet settles at
under the default lifecycle, next to a year of it with 1-second windows and requests
kept forever (the store before the lifecycle).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _fleet import dump_json, run_workers
from tqdm import tqdm

from kvscope.collector.process import CollectorProcess
from kvscope.collector.settings import Settings

DAY_S = 86_400.0
WEEK_DAYS = 7
FLEET_ARGS = ["--max-new-engines-per-minute", "1000000"]
RETAINED = {
    "steps": "raw_step_retention_s",
    "ingested_batches": "ledger_retention_s",
    "windows_1s": "window_retention_s",
    "requests": "request_retention_s",
    "windows_1m": "rollup_retention_s",
    "requests_1m": "request_rollup_retention_s",
}
"""Tables with a retention setting (the rest are kept)."""
GROWING = ("steps", "ingested_batches", "windows_1s", "requests", "windows_1m", "requests_1m")
MINUTE_ROWS_PER_ENGINE_DAY = DAY_S / 60
"""``windows_1m``: one row per minute an engine steps (a short run spans partial
minutes, so its own rows per second would overstate this)."""


def table_bytes(
    path: Path, work: Path, min_rows: int = 300_000, max_copies: int = 300
) -> tuple[dict[str, int], dict[str, float]]:
    """Rows per table, and bytes on disk per row of each table.

    DuckDB allocates 256 KiB blocks, too coarse for the small tables of a short run,
    so each table is measured on its own: its rows are copied into a fresh file, in
    order and repeated (each copy under other engine ids, so ids stay distinct) until
    it holds ``min_rows`` rows, the file is checkpointed, and its growth over the same
    file with the empty table is divided by the rows.
    """
    import duckdb

    src = duckdb.connect(str(path), read_only=True)
    try:
        tables = [
            r[0]
            for r in src.execute(
                "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'"
            ).fetchall()
        ]
        rows = {t: int(src.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]) for t in tables}
        ddl = {
            t: src.execute("SELECT sql FROM duckdb_tables() WHERE table_name = ?", [t]).fetchone()[
                0
            ]
            for t in tables
        }
        cols = {
            t: [
                r[0]
                for r in src.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE table_name = ? "
                    "ORDER BY column_index",
                    [t],
                ).fetchall()
            ]
            for t in tables
        }
    finally:
        src.close()
    per_row: dict[str, float] = {}
    for t in tables:
        if rows[t] == 0 or "engine_id" not in cols[t]:
            continue
        copies = max(1, min(max_copies, -(-min_rows // rows[t])))
        sizes = []
        for n_copies in (0, copies):
            f = work / f"measure-{t}-{n_copies}.duckdb"
            con = duckdb.connect(str(f))
            try:
                con.execute(ddl[t])
                con.execute(f"ATTACH '{path}' AS src (READ_ONLY)")
                select = ", ".join(
                    "engine_id || '#{k}'" if c == "engine_id" else f'"{c}"' for c in cols[t]
                )
                for k in range(n_copies):
                    con.execute(f'INSERT INTO "{t}" SELECT {select.format(k=k)} FROM src."{t}"')
                con.execute("DETACH src")
                con.execute("CHECKPOINT")
            finally:
                con.close()
            sizes.append(f.stat().st_size)
        per_row[t] = (sizes[1] - sizes[0]) / (rows[t] * copies)
    return rows, per_row


def _span(seconds: float) -> str:
    """``36 h``, ``15 d``: a retention in the unit that reads best."""
    return f"{seconds / DAY_S:g} d" if seconds >= 2 * DAY_S else f"{seconds / 3600:g} h"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for the method."
    )
    parser.add_argument(
        "--engines", type=int, default=100, help="simulated engines reporting (default: 100)"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds they report (default: 60)"
    )
    parser.add_argument(
        "--steps-per-s",
        type=float,
        default=50.0,
        help="engine steps per second per engine (default: 50)",
    )
    parser.add_argument(
        "--fleet", type=int, default=100, help="fleet size of the weekly projection (default: 100)"
    )
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=50.0,
        help="store size the retention plan must stay under (default: 50 GiB)",
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.engines < 1 or args.duration < 10:
        parser.error("need --engines >= 1 and --duration >= 10")

    defaults = Settings()
    with tempfile.TemporaryDirectory(prefix="kvscope-storage-") as tmp:
        store = Path(tmp) / "growth.duckdb"
        collector = CollectorProcess(store, extra_args=FLEET_ARGS).start()
        try:
            print(f"{args.engines} engines reporting for {args.duration:g} s ...", file=sys.stderr)
            with tqdm(total=1, desc="fleet", unit="run", file=sys.stderr) as bar:
                fleet = run_workers(
                    collector.url, args.engines, args.duration, steps_per_s=args.steps_per_s
                )
                bar.update(1)
            time.sleep(1.0)
        finally:
            collector.stop()
        from kvscope.collector.store import Store

        rolled = Store(str(store))  # every minute of the run complete: roll all of them up
        try:
            rolled.roll_up_now(now_unix_s=time.time() + 600.0)
        finally:
            rolled.close()
        file_bytes = store.stat().st_size
        rows, bytes_per_row = table_bytes(store, Path(tmp))

    engine_s = args.engines * args.duration
    steps_sent = fleet.stats.get("steps_sent", 0)
    if rows.get("steps", 0) < 0.9 * steps_sent or steps_sent == 0:
        raise SystemExit(
            f"the store holds {rows.get('steps', 0)} steps of {steps_sent} sent; "
            f"the collector did not keep up (see its log)"
        )
    per_day: dict[str, dict[str, Any]] = {}
    for t in sorted(bytes_per_row, key=lambda t: -bytes_per_row[t] * rows[t]):
        b_row = bytes_per_row[t]
        rows_per_engine_day = rows[t] / engine_s * DAY_S
        if t in ("windows_1m", "requests_1m"):  # a busy engine finishes requests every minute
            rows_per_engine_day = MINUTE_ROWS_PER_ENGINE_DAY
        retention_s = getattr(defaults, RETAINED[t]) if t in RETAINED else 0.0
        per_day[t] = {
            "rows": rows[t],
            "bytes": rows[t] * b_row,
            "bytes_per_row": b_row,
            "rows_per_engine_day": rows_per_engine_day,
            "bytes_per_engine_day": rows_per_engine_day * b_row,
            "retention_s": retention_s,
        }
    # Tables whose rows come once per engine or boot (engines, engine_configs, ...) are
    # counted by what they hold now, per engine; they do not grow with time.
    growing = {t for t in per_day if t in GROWING}

    def week_bytes(
        raw_retention_s: float, n_engines: int, days: float = WEEK_DAYS, **ret_of: float
    ) -> float:
        """The store after ``days`` of ``n_engines`` reporting, with the default
        retentions but ``raw_retention_s`` for steps and ``ret_of[table]`` (0: kept)."""
        total = 0.0
        for t, d in per_day.items():
            if t not in growing:
                total += d["bytes"] / args.engines * n_engines
                continue
            kept_s = days * DAY_S
            ret = raw_retention_s if t == "steps" else ret_of.get(t, d["retention_s"])
            if ret > 0:
                kept_s = min(kept_s, ret)
            total += d["bytes_per_engine_day"] * kept_s / DAY_S * n_engines
        return total

    print()
    print(
        f"{args.engines} engines x {args.duration:g} s at {args.steps_per_s:g} steps/s "
        f"({steps_sent:,} steps, {fleet.stats.get('requests_sent', 0):,} finished requests "
        f"acknowledged)"
    )
    print()
    header = (
        f"{'table':<20} {'rows':>9} {'on disk':>10} {'B/row':>7} {'rows/engine-day':>16} "
        f"{'per engine-day':>15} {'retention':>10}"
    )
    print(header)
    print("-" * len(header))
    for t, d in per_day.items():
        ret = (
            (_span(d["retention_s"]) if d["retention_s"] else "kept")
            if t in growing
            else "per engine"
        )  # one row per engine or boot: no growth
        if t in growing:
            per_engine = (
                f"{d['rows_per_engine_day']:>16,.0f} {fmt_bytes(d['bytes_per_engine_day']):>15}"
            )
        else:
            per_engine = f"{'':>16} {fmt_bytes(d['bytes'] / args.engines):>15}"
        print(
            f"{t:<20} {d['rows']:>9,} {fmt_bytes(d['bytes']):>10} {d['bytes_per_row']:>7.1f} "
            f"{per_engine} {ret:>10}"
        )
    tables_total = sum(d["bytes"] for d in per_day.values())
    print(
        f"{'all tables':<20} {'':>9} {fmt_bytes(tables_total):>10}   the store's file "
        f"{fmt_bytes(file_bytes)} = {file_bytes / max(1, rows.get('steps', 1)):.1f} B per "
        f"step stored"
    )
    day = sum(d["bytes_per_engine_day"] for t, d in per_day.items() if t in growing)
    print()
    print(
        f"one engine, one day of reporting: {fmt_bytes(day)} written "
        f"(steps {fmt_bytes(per_day['steps']['bytes_per_engine_day'])})"
    )
    default_week = week_bytes(defaults.raw_step_retention_s, args.fleet)
    print(
        f"{args.fleet}-engine week of engines reporting around the clock, default retention (raw steps "
        f"{defaults.raw_step_retention_s / 3600:g} h, ledger "
        f"{defaults.ledger_retention_s / 3600:g} h, 1-second windows and requests "
        f"{_span(defaults.window_retention_s)}, minute windows {_span(defaults.rollup_retention_s)}, request minutes "
        f"{_span(defaults.request_rollup_retention_s)}): "
        f"{fmt_bytes(default_week)}"
    )
    settled_days = max(d["retention_s"] for d in per_day.values()) / DAY_S
    settled = week_bytes(defaults.raw_step_retention_s, args.fleet, days=settled_days)
    year_before = week_bytes(
        defaults.raw_step_retention_s,
        args.fleet,
        days=365.0,
        windows_1s=0.0,
        requests=0.0,
        windows_1m=1e-9,
        requests_1m=1e-9,
    )
    year_now = week_bytes(defaults.raw_step_retention_s, args.fleet, days=365.0)
    print(
        f"{args.fleet} engines, a year: {fmt_bytes(year_now)} under the default lifecycle "
        f"(settles at {fmt_bytes(settled)} after {settled_days:g} days), "
        f"{fmt_bytes(year_before)} with 1-second windows and requests kept forever "
        f"({year_before / max(year_now, 1.0):.1f}x)"
    )
    budget = args.budget_gib * 2**30
    options = [0.0, 7 * DAY_S, 3 * DAY_S, DAY_S, 12 * 3600.0, 6 * 3600.0, 3600.0]
    print()
    print(f"{'--raw-retention-s':>18} {args.fleet}-engine week")
    fitting = None
    for r in options:
        size = week_bytes(r, args.fleet)
        label = "0 (keep)" if r == 0 else f"{r:g} ({r / 3600:g} h)"
        print(f"{label:>18} {fmt_bytes(size):>14}{'  <= budget' if size <= budget else ''}")
        if fitting is None and size <= budget:
            fitting = r
    floor = week_bytes(1e-9, args.fleet)
    if fitting is None:
        print(
            f"no raw-step retention keeps a {args.fleet}-engine week under "
            f"{args.budget_gib:g} GiB: windows and requests alone take {fmt_bytes(floor)}"
        )
    else:
        print(
            f"to keep a {args.fleet}-engine week under {args.budget_gib:g} GiB: "
            f"--raw-retention-s {fitting:g} (and the default ledger retention); the "
            f"windows and requests of the week take {fmt_bytes(floor)} of it"
        )
    dump_json(
        args.json,
        {
            "tables": per_day,
            "file_bytes": file_bytes,
            "week_default_bytes": default_week,
            "settled_bytes": settled,
            "settled_days": settled_days,
            "year_bytes": year_now,
            "year_bytes_windows_kept": year_before,
            "fitting_raw_retention_s": fitting,
            "args": vars(args),
        },
    )
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
