"""The advisor from the 1-minute tier against the 1-second windows, on one real run.

A collector deletes 1-second windows after ``--window-retention`` (15 days by default)
and keeps the 1-minute windows it rolled them up into (400 days). An analysis of a range
whose seconds were deleted reads the minutes (:func:`kvscope.advisor.minute_windows`).
This bench measures what that costs on real data: one real vLLM engine under a slow
"day" of load, analysed twice over the same range, once from its 1-second windows and
once from a copy of the store whose seconds the collector's own lifecycle deleted.

One command (about 35 minutes on a 2-core machine, one engine start)::

    .venv/bin/python bench/minute_tier_knees.py [--workdir DIR] [--level-s 100] [--json F]
    .venv/bin/python bench/minute_tier_knees.py --store DIR/store.duckdb   # analyse again
    .venv/bin/python bench/minute_tier_knees.py --store STORE --pool POOL  # any kept run

The run: the lab's KV-starved engine (48 KV blocks; on the closed-loop sweep it saturates
at about 7 requests in flight), closed-loop clients climbing from 1 to 32 and back down to
1, each level held ``--level-s`` seconds: load changes by the minute or slower, as a day's
traffic does, and a minute that straddles two levels mixes them, as a minute of real
traffic does. ``--open-loop``: the same engine under Poisson arrivals from vLLM's own
benchmark client, 1 to 8 requests/s and back, each rate held ``--level-s`` seconds.
``--store STORE --pool POOL`` compares the tiers on any kept run's engine
(its whole range), e.g. a regimes run whose levels last 30-90 s. ``--export FILE`` writes
the run's engine row, 1-second windows and finished requests as a fixture (gzipped JSON).

The table: per tier, the windows the fit read, the verdict, the knee, the cap, the
plateau, the highest load and the confidence, and the minutes' figures as ratios of the
seconds'.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.advisor_scenarios import MODEL_NAME, AdvisorLab
from kvscope.advisor import Report, analyze
from kvscope.collector.store import Store
from kvscope.lab.engine import REGIMES
from kvscope.lab.openloop import run_rates
from kvscope.report.sources import StoreSource, open_store

POOL = "slow-day"
UP = (1, 2, 4, 6, 8, 12, 16, 24, 32)
"""The climb; the way down repeats it in reverse from the level below the top."""


def levels() -> list[int]:
    return [*UP, *reversed(UP[:-1])]


def record(workdir: Path, level_s: float, *, progress: bool) -> dict[str, Any]:
    """Run the slow day on a real engine; the store is ``workdir/store.duckdb`` and the
    run's range and pool are written beside it (``run.json``)."""
    cfg = REGIMES["kv-starved"]
    with (
        AdvisorLab(workdir, log=print, progress=progress) as lab,
        lab.engine(
            POOL, num_gpu_blocks=cfg["num_gpu_blocks"], max_num_seqs=cfg["max_num_seqs"]
        ) as server,
    ):
        lab._warm(server)
        since = time.time()
        lab._sweep(server, levels(), duration_s=level_s, warmup_s=0.0, seed=lab.seed)
        until = time.time()
        time.sleep(3.0)  # the plugin's last flush
    run = {"pool": POOL, "since": since, "until": until, "level_s": level_s, "levels": levels()}
    (workdir / "run.json").write_text(json.dumps(run, indent=2))
    return run


def delete_seconds(store: Path, until: float) -> dict[str, int]:
    """Delete ``store``'s 1-second windows with the store's own lifecycle once rolled up
    (a window retention of one second, applied an hour after ``until``: every minute
    complete), as a collector's retention leaves a range weeks later. Requests are kept:
    the comparison is of the windows alone. Returns the lifecycle's counts."""
    s = Store(str(store))
    try:
        return s.apply_lifecycle(
            window_retention_s=1.0,
            request_retention_s=0.0,
            rollup_retention_s=0.0,
            now_unix_s=until + 3600.0,
            rollup_budget_s=None,
        )
    finally:
        s.close()


def minutes_only(store: Path, into: Path, until: float) -> Path:
    """A copy of ``store`` whose 1-second windows were deleted (:func:`delete_seconds`)."""
    copy = into / "minutes-only.duckdb"
    shutil.copyfile(store, copy)
    delete_seconds(copy, until)
    return copy


def analyse(store: Path, since: float | None, until: float | None, pool: str | None) -> Report:
    src = StoreSource(open_store(store))
    try:
        return analyze(src, since, until, pool)
    finally:
        src.close()


def row(name: str, report: Report) -> dict[str, Any]:
    cov = report.coverage
    out: dict[str, Any] = {
        "tier": name,
        "windows": cov.get("n_minute_windows") or cov.get("n_windows"),
        "engines_from_minutes": cov.get("engines_from_minutes", []),
    }
    if report.engines:
        v = report.engines[0]
        out.update(
            engine_id=v.engine_id,
            verdict=v.bottleneck,
            saturated=v.saturated,
            knee=v.knee_concurrency,
            cap=v.recommended_concurrency_cap,
            plateau_tokens_per_s=v.plateau_tokens_per_s,
            max_load=v.max_load_seen,
            confidence=v.confidence,
        )
    return out


def _ratio(a: Any, b: Any) -> str:
    return (
        f"{a / b:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and b else "-"
    )


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        "tier",
        "windows",
        "verdict",
        "saturated",
        "knee",
        "cap",
        "plateau_tokens_per_s",
        "max_load",
        "confidence",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(_fmt(r.get(c)) for c in cols) for r in rows]
    if len(rows) == 2:
        sec, mins = rows
        lines.append(
            "minutes / seconds | - | "
            + ("same" if sec.get("verdict") == mins.get("verdict") else "differs")
            + " | - | "
            + " | ".join(_ratio(mins.get(c), sec.get(c)) for c in cols[4:])
        )
    return "\n".join(lines)


def export(store: Path, run: dict[str, Any], out: Path) -> None:
    """The run's rows of the store's ``engines``, ``windows_1s`` and ``requests`` tables, as
    a gzipped JSON fixture (the tests load them into a store and roll them up with the
    collector's SQL)."""
    con = duckdb.connect(str(store), read_only=True)
    try:
        pool = run.get("pool")
        engines = con.execute("SELECT * FROM engines WHERE pool = ?", [pool]).df()
        ids = list(engines["engine_id"])
        windows = con.execute(
            "SELECT * FROM windows_1s WHERE engine_id IN (SELECT unnest(?)) ORDER BY ts_s", [ids]
        ).df()
        requests = con.execute(
            "SELECT * FROM requests WHERE engine_id IN (SELECT unnest(?)) ORDER BY finished_unix_s",
            [ids],
        ).df()
    finally:
        con.close()
    data = {
        "run": run,
        "engines": json.loads(engines.to_json(orient="records")),
        "windows_1s": json.loads(windows.to_json(orient="records")),
        "requests": json.loads(requests.to_json(orient="records", double_precision=6)),
    }
    with gzip.open(out, "wt") as f:
        json.dump(data, f, separators=(",", ":"))


def _range_of(store: Path, pool: str | None) -> dict[str, float]:
    """The first and last 1-second window (exclusive end) of ``pool``'s engines."""
    con = duckdb.connect(str(store), read_only=True)
    try:
        lo, hi = con.execute(
            "SELECT min(ts_s), max(ts_s) + 1 FROM windows_1s WHERE engine_id IN "
            "(SELECT engine_id FROM engines WHERE ? IS NULL OR pool = ?)",
            [pool, pool],
        ).fetchone()
    finally:
        con.close()
    return {"since": float(lo), "until": float(hi)}


OPEN_LOOP_UP = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
"""Poisson request rates (requests/s) of ``--open-loop``: up to about the engine's
capacity (the slow day's plateau, ~960 tok/s, is ~7.5 requests/s of 128 tokens), and back
down from the rate below the top."""


def open_loop_rates() -> list[float]:
    return [*OPEN_LOOP_UP, *reversed(OPEN_LOOP_UP[:-1])]


def record_open_loop(workdir: Path, level_s: float) -> dict[str, Any]:
    """The slow day with open-loop Poisson arrivals from vLLM's own benchmark client
    (30-token prompts, 128 output tokens), each rate held ``level_s`` seconds."""
    cfg = REGIMES["kv-starved"]
    pool = f"{POOL}-open-loop"
    with (
        AdvisorLab(workdir, log=print) as lab,
        lab.engine(
            pool, num_gpu_blocks=cfg["num_gpu_blocks"], max_num_seqs=cfg["max_num_seqs"]
        ) as server,
    ):
        lab._warm(server)
        since = time.time()
        run_rates(
            server.url,
            MODEL_NAME,
            lab.model_dir or "",
            open_loop_rates(),
            seconds=level_s,
            input_len=30,
            output_len=128,
            seed=lab.seed,
            workdir=workdir / "openloop",
            log=print,
        )
        until = time.time()
        time.sleep(3.0)  # the plugin's last flush
    run = {
        "pool": pool,
        "since": since,
        "until": until,
        "level_s": level_s,
        "rates": open_loop_rates(),
    }
    (workdir / "run.json").write_text(json.dumps(run, indent=2))
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="where the store and logs go")
    ap.add_argument("--store", default=None, help="analyse this kept store (no engine run)")
    ap.add_argument(
        "--pool", default=None, help="with --store: the engine's pool (default: the run's)"
    )
    ap.add_argument("--level-s", type=float, default=100.0, help="seconds per load level")
    ap.add_argument("--json", default=None, help="write the comparison here")
    ap.add_argument("--export", default=None, help="write both tiers as a fixture here")
    ap.add_argument(
        "--open-loop",
        action="store_true",
        help="Poisson arrivals at 1 to 8 requests/s and back (vLLM's benchmark client) "
        "instead of closed-loop clients",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.store:
        store = Path(args.store)
        meta = store.parent / "run.json"
        run = json.loads(meta.read_text()) if meta.exists() and not args.pool else {}
        if not run:  # a store of another run: the pool's whole range
            run = {"pool": args.pool, **_range_of(store, args.pool)}
    else:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvscope-minute-tier-"))
        run = (
            record_open_loop(workdir, args.level_s)
            if args.open_loop
            else record(workdir, args.level_s, progress=not args.no_progress)
        )
        store = workdir / "store.duckdb"
    since, until, pool = run.get("since"), run.get("until"), run.get("pool")
    with tempfile.TemporaryDirectory(prefix="kvscope-minutes-") as tmp:
        minutes = minutes_only(store, Path(tmp), until if until is not None else time.time())
        rows = [
            row("1-second windows", analyse(store, since, until, pool)),
            row("1-minute windows", analyse(minutes, since, until, pool)),
        ]
        if args.export:
            export(store, run, Path(args.export))
    print(f"store {store}, pool {pool}, levels of {run.get('level_s')} s: {run.get('levels')}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
