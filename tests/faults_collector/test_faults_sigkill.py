"""SIGKILL a real collector process many times mid-ingest, at random moments.

Clients post batches concurrently, each resending its current batch (same idempotency
key) until it gets an answer, as the engine plugin does. After every kill the collector
restarts on the same store. At the end: every batch that was acknowledged is stored,
no batch is stored twice (the step numbers are unique per batch), resends of stored
batches answer ``duplicate``, and the store file opens cleanly.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import duckdb
from _faults_collector_helpers import post, start_collector, unique_steps_batch

from kvscope.collector.process import free_port

N_CLIENTS = 4
N_KILLS = 20
STEPS_PER_BATCH = 50


class _Client(threading.Thread):
    """Posts batches of one engine; an unanswered batch is resent with the same key."""

    def __init__(self, idx: int, url: str, stop: threading.Event, t0: float) -> None:
        super().__init__(name=f"fault-client-{idx}", daemon=True)
        self.engine_id = f"kill-host:{8000 + idx}:0"
        self.url, self.stop, self.t0 = url, stop, t0
        self.seq = 0
        self.acked: dict[int, str] = {}  # seq -> status answered with 200
        self.errors = 0
        self.resends = 0

    def run(self) -> None:
        attempts = 0
        while not self.stop.is_set():
            b = unique_steps_batch(
                self.engine_id, self.seq, STEPS_PER_BATCH, self.t0, with_hello=self.seq == 0
            )
            try:
                status, _, body = post(self.url, b, timeout_s=5)
            except (OSError, http.client.HTTPException):
                status, body = 0, b""
            if status == 200:
                self.acked[self.seq] = json.loads(body)["status"]
                self.resends += attempts > 0
                self.seq += 1
                attempts = 0
            else:  # connection refused/reset, or 503 while shutting down: resend later
                self.errors += 1
                attempts += 1
                time.sleep(0.02)


def test_sigkill_many_times_loses_no_acknowledged_batch(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    store = tmp_path / "killed.duckdb"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    clients = [_Client(i, url, stop, 1_700_000_000.0 + 10_000 * i) for i in range(N_CLIENTS)]
    for cl in clients:
        cl.start()
    started = time.monotonic()
    restarts: list[float] = []
    for _ in range(N_KILLS):
        t = time.monotonic()
        proc = start_collector(store, port=port)
        restarts.append(time.monotonic() - t)
        time.sleep(rng.uniform(0.05, 0.6))  # the kill lands at a random point of ingest
        assert proc.proc is not None
        os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait()
    kill_phase_s = time.monotonic() - started
    # A last, clean run: the clients' outstanding batches get answered.
    final = start_collector(store, port=port)
    try:
        time.sleep(1.0)
        stop.set()
        for cl in clients:
            cl.join(30)
        # Resending already acknowledged batches must not store them again.
        dup_statuses = [
            post(url, unique_steps_batch(cl.engine_id, 0, STEPS_PER_BATCH, cl.t0, with_hello=True))[
                2
            ]
            for cl in clients
        ]
    finally:
        final.stop()
    assert all(json.loads(b)["status"] == "duplicate" for b in dup_statuses)

    con = duckdb.connect(str(store), read_only=True)  # opens cleanly after the kills
    try:
        ledger = set(con.execute("SELECT engine_id, seq FROM ingested_batches").fetchall())
        steps = con.execute("SELECT engine_id, step FROM steps").fetchall()
    finally:
        con.close()
    total_acked = sum(len(cl.acked) for cl in clients)
    missing = [
        (cl.engine_id, s) for cl in clients for s in cl.acked if (cl.engine_id, s) not in ledger
    ]
    print(
        f"\n[sigkill] {N_KILLS} kills in {kill_phase_s:.1f} s (restart median "
        f"{sorted(restarts)[len(restarts) // 2]:.2f} s); {total_acked} batches acknowledged, "
        f"{len(ledger)} stored, {sum(cl.errors for cl in clients)} failed attempts, "
        f"{sum(cl.resends for cl in clients)} batches resent after a failure; "
        f"{len(steps)} step rows"
    )
    assert total_acked >= N_KILLS, "too little traffic reached the collector to test anything"
    assert sum(cl.resends for cl in clients) > 0, "no kill interrupted a send"
    assert not missing, f"acknowledged batches missing after the kills: {missing[:5]}"
    # Stored exactly once: every stored batch's steps are there, none twice.
    assert len(steps) == len(set(steps)), "a batch was stored twice"
    assert len(steps) == STEPS_PER_BATCH * len(ledger)
    # Nothing is stored that was never sent (a batch can be stored without its answer).
    for cl in clients:
        sent_upto = cl.seq  # the batch at cl.seq may have been stored unanswered
        assert all(s <= sent_upto for e, s in ledger if e == cl.engine_id)
