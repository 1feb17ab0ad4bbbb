"""The advisor and the weekly report at fleet scale: 100 engines, a week of 1-second windows.

One command (the first run generates the store, about 6 minutes; later runs reuse it)::

    .venv/bin/python bench/advisor_scale.py [--store /tmp/kvscope-advisor-scale.duckdb]
        [--engines 100] [--days 7] [--runs 3] [--json out.json]

What it does
------------
1. **The store** (:mod:`kvscope.lab.fleetgen`): the bundled real vLLM recordings, each
   ingested through the collector's own write path, replayed per engine in DuckDB SQL,
   re-timed (a random phase per engine) and jittered (a speed factor per engine, +-5%
   per window on the token counts): ``--engines`` engines in 4 pools, ``--days`` days of
   1-second windows (100 x 7 x 86,400 = 60.5 million rows, minus the seconds the
   recordings had no window), engines and hello rows, and the finished requests of one
   replay in 50 (about 2% of the rate the recordings finished them at; documented in
   the module). Kept at ``--store``; a later run with the same path skips this step.
2. In the same run, each in its own process (wall time, and the child's own peak RSS
   from ``os.wait4``), every DuckDB connection set to 2 threads:

   * **floor**: one plain DuckDB aggregate scan of ``windows_1s``: a GROUP BY engine
     over every column the analyses and the usage sums read;
   * **report**: ``kvscope report --store PATH --since S --until U`` end to end (the
     week analysed, usage per day, the three files written; the week before holds no
     data in the generated store, so it adds only its queries);
   * **advise**: :func:`kvscope.advisor.analyze` over the store for the whole fleet and week.

   The floor runs ``--runs`` times (median), the others ``--runs`` times too.
3. A table: median wall seconds, ratio against the floor, peak RSS, against the
   targets (60 s and 6 GB on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_S = 60.0
TARGET_RSS_GB = 6.0
THREADS = 2
FLOOR_COLUMNS = (
    "n_steps",
    "batch_mean",
    "batch_p50",
    "batch_p90",
    "batch_max",
    "batch_sum",
    "waiting_mean",
    "deferred_mean",
    "kv_usage_mean",
    "kv_usage_max",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
    "first_step_unix_s",
    "last_step_unix_s",
    "iteration_n",
    "iteration_s_sum",
)

THREADS_PRELUDE = f"""
import duckdb
_connect = duckdb.connect
def _two_threads(*a, **k):
    con = _connect(*a, **k)
    con.execute("SET threads = {THREADS}")
    return con
duckdb.connect = _two_threads
"""
"""Run first in each child: every DuckDB connection it opens uses ``THREADS`` threads."""

FLOOR = """
import duckdb, sys
con = duckdb.connect(sys.argv[1], read_only=True)
con.execute("SET threads = {threads}")
con.execute("SET enable_progress_bar = false")
rows = con.execute("SELECT engine_id, count(*), {aggs} FROM windows_1s "
                   "WHERE ts_s >= ? AND ts_s < ? GROUP BY engine_id",
                   [int(float(sys.argv[2])), float(sys.argv[3])]).fetchall()
print(len(rows))
"""

ADVISE = (
    THREADS_PRELUDE
    + """
import sys
from kvscope.report.sources import StoreSource, open_store
from kvscope.advisor import analyze
src = StoreSource(open_store(sys.argv[1]))
report = analyze(src, float(sys.argv[2]), float(sys.argv[3]))
print(len(report.engines), sorted({v.bottleneck for v in report.engines}))
"""
)


REPORT = (
    THREADS_PRELUDE
    + """
import sys
from kvscope.cli.main import main
sys.exit(main(["report", *sys.argv[1:]]))
"""
)


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Run ``cmd`` (this checkout first on the path); return wall seconds, the child's
    own peak RSS in GB (``wait4``), its stdout."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=err,
            text=True,
        )
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed ({p.returncode}):\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss / 1024**2, stdout.strip()


def ensure_store(path: Path, engines: int, days: float) -> None:
    from tqdm import tqdm

    from kvscope.lab.fleetgen import FleetSpec, generate_fleet_store

    if path.exists():
        print(f"store: {path} (reused; delete it to generate again)")
        return
    spec = FleetSpec(n_engines=engines, days=days)
    bar = tqdm(total=engines, desc="generating windows", unit="engine", file=sys.stderr)

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "windows":
            bar.n = done
            bar.refresh()
        else:
            bar.set_description(f"generating {stage}")

    t0 = time.perf_counter()
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    generate_fleet_store(tmp, spec, progress=progress)
    tmp.rename(path)
    bar.close()
    print(f"store: {path} generated in {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--store",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvscope-advisor-scale.duckdb",
        help="generated store file, reused when it exists (default: %(default)s)",
    )
    ap.add_argument("--engines", type=int, default=100, help="engines (default: 100)")
    ap.add_argument("--days", type=float, default=7.0, help="days of windows (default: 7)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each measurement (default: 3)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.engines < 1 or args.days <= 0:
        ap.error("--runs, --engines and --days must be positive")
    ensure_store(args.store, args.engines, args.days)

    import duckdb

    con = duckdb.connect(str(args.store), read_only=True)
    n_rows, first, last = con.execute(
        "SELECT count(*), min(ts_s), max(ts_s) FROM windows_1s"
    ).fetchone()
    n_req = con.execute("SELECT count(*) FROM requests").fetchone()[0]
    n_eng = con.execute("SELECT count(*) FROM engines").fetchone()[0]
    con.close()
    since, until = str(int(first)), str(int(last) + 1)
    print(
        f"{n_rows:,} window rows, {n_req:,} finished requests, {n_eng} engines, "
        f"{(int(last) + 1 - int(first)) / 86400:.1f} days; DuckDB at {THREADS} threads"
    )

    aggs = ", ".join(f"sum({c}), max({c})" for c in FLOOR_COLUMNS)
    floor_code = FLOOR.format(threads=THREADS, aggs=aggs)
    py = sys.executable
    out_dir = Path(tempfile.mkdtemp(prefix="kvscope-scale-report-"))
    cases = [
        (
            "floor: one DuckDB GROUP BY engine scan of windows_1s",
            [py, "-c", floor_code, str(args.store), since, until],
        ),
        (
            "kvscope.advisor.analyze, whole fleet, one week",
            [py, "-c", ADVISE, str(args.store), since, until],
        ),
        (
            "kvscope report --store, end to end (files written)",
            [
                py,
                "-c",
                REPORT,
                "--store",
                str(args.store),
                "--since",
                since,
                "--until",
                until,
                "--out",
                str(out_dir),
                "--no-progress",
            ],
        ),
    ]
    results = []
    for name, cmd in cases:
        walls, peaks, last_out = [], [], ""
        for i in range(args.runs):
            wall, peak, last_out = timed(cmd)
            walls.append(wall)
            peaks.append(peak)
            print(f"  {name}: run {i + 1}: {wall:.1f} s", file=sys.stderr)
        results.append(
            {
                "case": name,
                "median_s": statistics.median(walls),
                "runs_s": walls,
                "peak_rss_gb": max(peaks),
                "output": last_out.splitlines()[-1:],
            }
        )
    floor_s = results[0]["median_s"]
    print()
    print(f"{'measurement':<60} {'median s':>9} {'x floor':>8} {'peak RSS':>9}  target")
    print("-" * 100)
    for r in results:
        target = (
            ""
            if r is results[0]
            else (
                f"<= {TARGET_S:.0f} s, <= {TARGET_RSS_GB:.0f} GB: "
                + (
                    "met"
                    if r["median_s"] <= TARGET_S and r["peak_rss_gb"] <= TARGET_RSS_GB
                    else "MISSED"
                )
            )
        )
        print(
            f"{r['case']:<60} {r['median_s']:>9.1f} {r['median_s'] / floor_s:>8.1f} "
            f"{r['peak_rss_gb']:>7.2f} GB  {target}"
        )
    print(f"\n(runs per row: {args.runs}; report files in {out_dir})")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"windows": n_rows, "requests": n_req, "engines": n_eng, "results": results},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
