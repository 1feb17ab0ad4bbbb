"""One small batch of old data does not hold the collector's writer (issue 44, finding 3).

An engine sends one batch of 20,000 steps 61 minutes apart, all older than the window
retention (15 days): every step is a minute of its own, behind the rolled-up end, and
0.13 MiB gzipped. Rolled up one transaction per minute it held the writer, and so every
engine's ingest, for minutes. Now its minutes are rolled up many to a statement and a
bounded part per retention pass: another engine posting small batches every 0.2 s waits
for its answers no longer than a pass (about a second), and every minute of the batch ends
in ``windows_1m`` within seconds; its 1-second windows are deleted only after that.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path

import duckdb
from _faults_collector_helpers import batch, counter, post, start_collector

from kvscope.collector.process import CollectorProcess

STEPS = 20_000
GAP_S = 61 * 60
DAY_S = 86400.0
B_EVERY_S = 0.2
MAX_LATENCY_S = 3.0
"""What another engine may wait for an answer while the batch is rolled up: a pass's
budget is about a second (``ROLLUP_PASS_BUDGET_S``); before, it waited minutes."""
OLD = "old-engine:8000:0"
LIVE = "live-engine:8000:0"


COLLECTOR_ARGS = ["--max-backfill", "0", "--rollup-retention", "0", "--retention-interval", "0.5"]
"""Times of any age accepted (as an operator importing old data would), 1-minute windows
kept (all of the batch's are counted) and the retention task every 0.5 s."""


class LiveEngine(threading.Thread):
    """Posts 5 steps stamped now every ``B_EVERY_S``, one POST at a time, and keeps each
    POST's seconds to its answer (a POST that times out counts as its timeout)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__(daemon=True, name="live-engine")
        self.url, self.timeout_s = url, timeout_s
        self.latencies: list[tuple[float, float]] = []
        """(monotonic send time, seconds to the answer)."""
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            now = time.time()
            b = batch(
                LIVE,
                "boot-1",
                seq,
                with_hello=seq == 0,
                step_ts=[now - 0.15 + 0.03 * i for i in range(5)],
                sent_unix_s=now,
            )
            if b["hello"] is not None:
                b["hello"]["started_unix_s"] = now - 60
            t0 = time.monotonic()
            try:
                status, _, body = post(self.url, b, timeout_s=self.timeout_s)
                dt = time.monotonic() - t0
                if status != 200:
                    self.errors.append(f"HTTP {status}: {body[:200]!r}")
            except OSError as exc:
                dt = time.monotonic() - t0
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.latencies.append((t0, dt))
            seq += 1
            self.stop.wait(max(0.0, B_EVERY_S - dt))


def _metric(c: CollectorProcess, name: str, **labels: str) -> float | None:
    return counter(c.get_text("/metrics", timeout_s=10.0), name, **labels)


def _minutes_in_tier(c: CollectorProcess, since: float) -> int:
    got = c.get_json(
        "/v1/windows_1m",
        params={"engine": OLD, "since": int(since), "fields": "ts_s", "format": "columns"},
        timeout_s=10.0,
    )
    return int(got["n_rows"])


def test_a_batch_of_old_minutes_leaves_other_engines_ingest_waiting_a_pass_at_most(
    tmp_path: Path,
) -> None:
    path = tmp_path / "backfill.duckdb"
    c = start_collector(path, *COLLECTOR_ARGS)
    live = LiveEngine(c.url, timeout_s=15.0)
    newest = time.time() - 16 * DAY_S  # older than the window retention (15 days)
    ts = [newest - k * GAP_S for k in range(STEPS)][::-1]
    minutes = {math.floor(t / 60) * 60 for t in ts}
    try:
        # the retention task's first pass (at start) has marked the rolled-up end
        deadline = time.monotonic() + 15
        while not math.isfinite(_metric(c, "kvscope_collector_rollup_behind_seconds") or math.nan):
            assert time.monotonic() < deadline, "no rollup pass in 15 s"
            time.sleep(0.1)
        live.start()
        time.sleep(2.0)  # the live engine's data is the newest: the retention counts from it
        sent = time.monotonic()
        status, _, body = post(
            c.url, batch(OLD, "boot-1", 0, with_hello=True, step_ts=ts), timeout_s=60.0
        )
        assert status == 200, body
        done_s = None
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not live.errors:
            if _minutes_in_tier(c, ts[0] - 60) == STEPS:
                done_s = time.monotonic() - sent
                break
            time.sleep(0.25)
        time.sleep(1.0)  # a few more posts after the last pass
        live.stop.set()
        live.join(timeout=30)
        during = [dt for t0, dt in live.latencies if t0 >= sent]
        assert during, "the live engine got no answer during the backfill"
        print(
            f"live engine's ingest during the backfill: {len(during)} posts, median "
            f"{statistics.median(during) * 1000:.0f} ms, max {max(during) * 1000:.0f} ms; "
            f"the {STEPS} minutes rolled up "
            + ("not in 40 s" if done_s is None else f"{done_s:.1f} s after the batch was sent")
        )
        assert not live.errors, live.errors[:3]
        assert max(during) < MAX_LATENCY_S, sorted(during)[-5:]
        assert done_s is not None, "the old minutes were not all rolled up in 40 s"
        # nothing waits any more, and the batch's seconds were deleted once rolled up
        deadline = time.monotonic() + 15
        while (_metric(c, "kvscope_collector_rollup_pending_minute_windows") or 0) > 0 or (
            _metric(c, "kvscope_collector_retention_deleted_rows_total", table="windows_1s") or 0
        ) < STEPS:
            assert time.monotonic() < deadline, c.get_text("/metrics")[-2000:]
            time.sleep(0.25)
        assert json.loads(c.request("/healthz")[1])["pending_batches"] == 0
    finally:
        live.stop.set()
        c.stop()
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute(
            "SELECT ts_s, n_seconds, n_steps FROM windows_1m WHERE engine_id = ?", [OLD]
        ).fetchall()
        left = con.execute("SELECT count(*) FROM windows_1s WHERE engine_id = ?", [OLD]).fetchone()
    finally:
        con.close()
    assert {r[0] for r in rows} == minutes and len(rows) == STEPS
    assert {(r[1], r[2]) for r in rows} == {(1, 1)}  # each minute: its one second, one step
    assert left == (0,)
