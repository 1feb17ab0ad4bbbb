"""What the collector's minute rollup costs its writer: one pass per retention interval.

One command (under a minute)::

    .venv/bin/python bench/rollup_pass.py [--engines 100,1000,2000] [--runs 5]
        [--backfill-days 1 --backfill-engines 100]

What it does
------------
A store (:class:`kvscope.collector.store.Store`, a temporary file) is filled with the
1-second windows of ``N`` engines stepping every second of the last minutes, as the
collector holds them, and the rollup's pass is timed as the retention task runs it every
``retention_interval_s`` (60 s) under the writer's lock: the minute that just completed
plus the default lookback (``rollup_lookback_s``), and with a 10-minute lookback for
comparison. The baseline, measured in the same run on the same store, is the writer's
other periodic job: deleting the raw rows past their retention, here one minute of the
fleet's 1-second windows. The same pass over the request tier (``requests_1m``, of
``REQUESTS_PER_S`` finished requests a second per engine) follows, timed the same way.
Medians of ``--runs`` passes; the share is the pass over the retention interval: the
part of the writer's time the rollup takes.

With ``--backfill-days``: a store holding that many days of windows and requests and
no tier (what a kvscope from before the tiers leaves) is rolled up by the retention
task's passes, each stopping after the chunk (an hour of rows) that took it past its
budget (``ROLLUP_PASS_BUDGET_S``); each pass's seconds are how long ingest waits for it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvscope.collector import _request_rollup, _rollup
from kvscope.collector.settings import Settings
from kvscope.collector.store import Store

NOW = 1_800_000_000
REQUESTS_PER_S = 2


def _fill(con: object, engines: int, minutes: int) -> int:
    t0 = NOW - _rollup.ROLLUP_LAG_S - minutes * 60
    con.execute("DELETE FROM windows_1s")  # type: ignore[attr-defined]
    con.execute(  # type: ignore[attr-defined]
        "INSERT INTO windows_1s (engine_id, ts_s, n_steps, n_parts, batch_sum, batch_mean, "
        "batch_min, batch_max, kv_usage_sum, kv_usage_mean, kv_usage_max, waiting_sum, "
        "waiting_mean, generation_tokens, prompt_tokens, preemptions) "
        f"SELECT 'e' || e, {t0} + t, 50, 1, 500 + t % 7, 10.0 + t % 7 / 50.0, 5, 15, 25.0, 0.5, "
        "0.9, 100, 2.0, 500, 100, t % 3 "
        f"FROM range({engines}) a(e), range({minutes * 60}) b(t)"
    )
    return t0


def _fill_requests(con: object, engines: int, minutes: int, per_s: int) -> int:
    """``per_s`` finished requests a second per engine (the recordings finish 1.8)."""
    t0 = NOW - _rollup.ROLLUP_LAG_S - minutes * 60
    con.execute("DELETE FROM requests")  # type: ignore[attr-defined]
    con.execute(  # type: ignore[attr-defined]
        "INSERT INTO requests (engine_id, boot_id, finished_unix_s, e2e_s, queue_s, prefill_s, "
        "decode_s, ttft_s, prompt_tokens, generation_tokens, cached_tokens, preemptions, "
        "finish_reason) "
        f"SELECT 'e' || e, 'b', {t0} + t / {per_s} + 0.1, 1.0 + t % 13 / 4.0, t % 5 / 10.0, "
        "0.05 + t % 7 / 100.0, 0.9 + t % 11 / 5.0, NULL, 200 + t % 900, 20 + t % 300, "
        "t % 64, 0, CASE WHEN t % 9 = 0 THEN 'length' ELSE 'stop' END "
        f"FROM range({engines}) a(e), range({minutes * 60 * per_s}) b(t)"
    )
    return t0


def _pass_s(
    store: Store,
    engines: int,
    lookback_s: float,
    runs: int,
    tier: _rollup.Tier = _rollup.WINDOWS_1M,
) -> tuple[float, int]:
    con = store._con
    minutes = int(lookback_s // 60) + 2
    if tier is _rollup.WINDOWS_1M:
        t0 = _fill(con, engines, minutes)
    else:
        t0 = _fill_requests(con, engines, minutes, REQUESTS_PER_S)
    out, rows = [], 0
    for _ in range(runs):
        _rollup._set_until(con, t0 + (minutes - 1) * 60, tier)  # one new minute, as every pass
        a = time.perf_counter()
        rows, _, _ = _rollup.roll_up(con, NOW, lookback_s, set(), tier)
        out.append(time.perf_counter() - a)
    return statistics.median(out), rows


def backfill(store: Store, engines: int, days: float) -> list[tuple[float, int, int]]:
    """A store holding ``days`` of ``engines``' 1-second windows and finished requests
    and no tier (as a kvscope before the tiers left it), rolled up by the retention
    task's passes: per pass its seconds (the writer waits that long) and the window and
    request-minute rows it wrote, until both tiers are caught up."""
    con = store._con
    minutes = int(days * 1440)
    _fill(con, engines, minutes)
    _fill_requests(con, engines, minutes, REQUESTS_PER_S)
    con.execute("DELETE FROM windows_1m")
    con.execute("DELETE FROM requests_1m")
    con.execute(
        "DELETE FROM meta WHERE key IN (?, ?)",
        [_rollup.ROLLED_UNTIL_KEY, _request_rollup.REQUESTS_ROLLED_UNTIL_KEY],
    )
    s = Settings()
    passes: list[tuple[float, int, int]] = []
    while True:
        a = time.perf_counter()
        out = store.apply_lifecycle(
            window_retention_s=0,
            request_retention_s=0,
            rollup_retention_s=0,
            rollup_lookback_s=s.rollup_lookback_s,
            now_unix_s=NOW,
        )
        passes.append(
            (time.perf_counter() - a, out["windows_1m_written"], out["requests_1m_written"])
        )
        done = [
            _rollup.rolled_until(con, t) for t in (_rollup.WINDOWS_1M, _request_rollup.REQUESTS_1M)
        ]
        if all(
            d is not None and d >= _rollup.minute_floor(NOW - _rollup.ROLLUP_LAG_S) for d in done
        ):
            return passes


def _delete_s(store: Store, engines: int, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = _fill(store._con, engines, 2)
        a = time.perf_counter()
        store._delete("windows_1s", "ts_s", t0 + 60)
        out.append(time.perf_counter() - a)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--engines", default="100,1000,2000", help="fleet sizes (default: 100,1000,2000)"
    )
    p.add_argument("--runs", type=int, default=5, help="passes per measurement (default: 5)")
    p.add_argument(
        "--backfill-days",
        type=float,
        default=0.0,
        help="also time the passes that roll up a backlog of this many days (a store from "
        "before the tiers) of --backfill-engines engines (default: 0, skipped)",
    )
    p.add_argument(
        "--backfill-engines", type=int, default=100, help="engines of the backlog (default: 100)"
    )
    args = p.parse_args(argv)
    s = Settings()
    interval, lookback = s.retention_interval_s, s.rollup_lookback_s
    print(
        f"{'engines':>8} {'delete 1 min (baseline)':>24} {f'rollup, lookback {lookback:g} s':>26} "
        f"{'x baseline':>10} {'of the interval':>16} {'rollup, lookback 600 s':>23} "
        f"{'request minutes':>16} {'both, of the interval':>22}"
    )
    with tempfile.TemporaryDirectory(prefix="kvscope-rollup-") as tmp:
        store = Store(str(Path(tmp) / "rollup.duckdb"))
        try:
            for n in (int(x) for x in args.engines.split(",")):
                base = _delete_s(store, n, args.runs)
                cost, _ = _pass_s(store, n, lookback, args.runs)
                wide, _ = _pass_s(store, n, 600.0, args.runs)
                req, _ = _pass_s(store, n, lookback, args.runs, _request_rollup.REQUESTS_1M)
                print(
                    f"{n:>8,} {base * 1000:>21.1f} ms {cost * 1000:>23.1f} ms "
                    f"{cost / base:>10.1f} {cost / interval:>15.2%} {wide * 1000:>20.1f} ms "
                    f"{req * 1000:>13.1f} ms {(cost + req) / interval:>22.2%}"
                )
        finally:
            store.close()
    print(
        f"a pass rolls up the minute that completed and re-reads {lookback:g} s before it; "
        f"it runs every {interval:g} s on the writer thread"
    )
    if args.backfill_days > 0:
        with tempfile.TemporaryDirectory(prefix="kvscope-backfill-") as tmp:
            store = Store(str(Path(tmp) / "backfill.duckdb"))
            try:
                n, d = args.backfill_engines, args.backfill_days
                print(f"\nbackfill: {n} engines x {d:g} days, filling the store ...")
                passes = backfill(store, n, d)
            finally:
                store.close()
        secs = [x[0] for x in passes]
        print(f"{'pass':>5} {'seconds':>8} {'window minutes':>15} {'request minutes':>16}")
        for i, (sec, w, r) in enumerate(passes, 1):
            print(f"{i:>5} {sec:>8.2f} {w:>15,} {r:>16,}")
        print(
            f"{len(passes)} passes (chunks of {_rollup.ROLLUP_CHUNK_S // 3600} h until "
            f"{_rollup.ROLLUP_PASS_BUDGET_S:g} s per tier and pass, one pass every "
            f"{interval:g} s): the writer waits at most {max(secs):.2f} s at a time (median "
            f"{statistics.median(secs):.2f} s), {sum(secs):.1f} s in all"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
