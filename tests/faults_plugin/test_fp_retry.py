"""Retry semantics of the exporter against real HTTP servers and real processes.

Retry-After honoured (gap measured), other 4xx dropped at once and counted by reason
(the count reaches the collector in the next batch), exponential backoff with jitter
(gaps measured against an always-503 server), and an exit that keeps its deadline
with an unreachable collector (a real Python process exiting through ``atexit``).
"""

from __future__ import annotations

import itertools
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fp_helpers import fp_exporter, push
from _plugin_testkit import RecordingServer, assert_accounting

from kvscope.collector.process import free_port
from kvscope.engine_plugins import _sender as sender_mod
from kvscope.engine_plugins import exporter as exporter_mod

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    s = RecordingServer()
    yield s
    s.close()


@pytest.mark.parametrize(("status", "retry_after_s"), [(429, 1.0), (503, 2.0)])
def test_retry_after_is_honoured(
    server: RecordingServer, status: int, retry_after_s: float
) -> None:
    server.answer(status, headers={"Retry-After": f"{retry_after_s:g}"})
    exp, eng = fp_exporter(server.url)
    push(eng, 20, time.time() - 5.0, n_requests=2)
    exp.start()
    try:
        assert server.wait_for(2, timeout_s=retry_after_s + 5.0)
    finally:
        exp.shutdown()
    t = server.times()
    gap = t[1] - t[0]
    first, second = server.batches(acknowledged=False)[:2]
    print(
        f"\n{status} Retry-After {retry_after_s:g} s: resent after {gap:.3f} s "
        f"(allowed {retry_after_s:g}-{retry_after_s * 1.1 + 0.25:.2f} s)"
    )
    # The wait is Retry-After times a jitter of 1.0-1.1, checked at the next 0.1 s tick.
    assert retry_after_s <= gap <= retry_after_s * 1.1 + 0.25
    assert (second["engine_id"], second["boot_id"], second["seq"]) == (
        first["engine_id"],
        first["boot_id"],
        first["seq"],
    )
    s = assert_accounting(exp)
    assert s["steps_sent"] == 20 and s["send_failures"] == 1 and s["batches_dropped"] == 0


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_other_4xx_is_not_retried_and_is_counted_by_reason(
    server: RecordingServer, status: int
) -> None:
    server.answer(status)
    exp, eng = fp_exporter(server.url)
    now = time.time()
    push(eng, 10, now - 5.0, n_requests=1)
    exp.tick(now_unix_s=now)
    push(eng, 7, now - 4.0)
    exp.tick(now_unix_s=now + 0.2)
    sent = server.batches(acknowledged=False)
    print(f"\nHTTP {status}: {len(sent)} requests, seqs {[b['seq'] for b in sent]}")
    assert [b["seq"] for b in sent] == [0, 1]  # batch 0 was not resent
    s = assert_accounting(exp)
    assert (s["batches_dropped"], s["batches_dropped_rejected"], s["batches_dropped_full"]) == (
        1,
        1,
        0,
    )
    assert (s["steps_dropped"], s["requests_dropped"], s["steps_sent"]) == (10, 1, 7)
    # The next batch tells the collector, by reason.
    counters = sent[1]["exporter"]
    assert counters["dropped_batches"] == counters["dropped_batches_rejected"] == 1
    assert counters["dropped_steps"] == 10 and counters["dropped_batches_full"] == 0


def test_backoff_is_exponential_with_jitter(server: RecordingServer) -> None:
    server.default = (503, {})
    exp, eng = fp_exporter(server.url)
    push(eng, 5, time.time() - 5.0)
    exp.start()
    n = 5  # gaps of 0.25-0.5, 0.5-1, 1-2, 2-4 s: at most 7.5 s
    try:
        assert server.wait_for(n, timeout_s=12.0)
    finally:
        exp.shutdown(timeout_s=0.0)
    t = server.times()[:n]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    bases = [exporter_mod.INITIAL_BACKOFF_S * 2**k for k in range(len(gaps))]
    fractions = [g / b for g, b in zip(gaps, bases, strict=True)]
    print("\nbackoff gaps (s): " + ", ".join(f"{g:.3f}" for g in gaps))
    print("gap / nominal:    " + ", ".join(f"{f:.2f}" for f in fractions))
    tick = 0.1 + exporter_mod.TICK_OFFSET_S + 0.1  # the thread checks once per 0.1 s tick
    for g, b in zip(gaps, bases, strict=True):
        assert 0.5 * b - 0.05 <= g <= b + tick, (g, b)
    # Exponential: each gap about doubles (jitter 0.5-1.0 bounds a ratio to 0.5-4).
    ratios = [b / a for a, b in itertools.pairwise(gaps)]
    assert statistics.median(ratios) > 1.3, ratios
    # Jitter: the fractions of the nominal delay are not all the same.
    assert max(fractions[1:]) - min(fractions[1:]) > 0.02, fractions
    assert all(b["seq"] == 0 for b in server.batches(acknowledged=False))


_EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from kvscope.engine_plugins._config import load_settings
    from kvscope.engine_plugins.exporter import get_exporter
    exp = get_exporter(load_settings())
    eng = exp.register("fphost:9100:0", {"host": "fphost", "port": 9100, "pid": os.getpid(),
        "engine_index": 0, "pool": "fp", "model": "m", "started_unix_s": time.time(),
        "vllm_version": "0", "kvscope_version": "0"})
    now = time.time()
    for i in range(500):
        eng.steps.append((now - 1.0 + i * 1e-4, i + 1, 4, 1, 0, 0.5, 10, 5, 0, 3, 2, 9.0))
        eng.steps_produced += 1
    time.sleep(0.3)  # the thread is now mid-attempt or waiting
    print(f"EXITING {time.time():.6f}", flush=True)
    sys.exit(0)
""")


def _exit_delay(url: str, shutdown_timeout_s: float) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSCOPE_COLLECTOR_URL": url,
           "KVSCOPE_SHUTDOWN_TIMEOUT_S": f"{shutdown_timeout_s:g}", "KVSCOPE_TIMEOUT_S": "10",
           "KVSCOPE_FLUSH_INTERVAL_S": "0.1"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=60)
    ended = time.time()
    assert proc.returncode == 0, err.decode()
    marks = [line for line in out.decode().splitlines() if line.startswith("EXITING ")]
    assert marks, (out, err)
    return ended - float(marks[0].split()[1])


def test_exit_keeps_its_deadline_with_an_unreachable_collector(server: RecordingServer) -> None:
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)  # accepts connections in the kernel, never answers
    hole = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
    closed = f"http://127.0.0.1:{free_port()}"
    deadline_s = 1.0
    try:
        delays = {
            "collector up": _exit_delay(server.url, deadline_s),
            "blackhole": _exit_delay(hole, deadline_s),
            "closed port": _exit_delay(closed, deadline_s),
            "blackhole, deadline 0": _exit_delay(hole, 0.0),
        }
    finally:
        blackhole.close()
    print(
        "\nexit delay after sys.exit (s), KVSCOPE_SHUTDOWN_TIMEOUT_S=1 unless said, "
        "request timeout 10 s:"
    )
    for what, d in delays.items():
        print(f"  {what:<22} {d:.3f}")
    # Interpreter teardown takes ~0.05 s; the flush adds at most its deadline.
    assert delays["blackhole"] <= deadline_s + 0.5
    assert delays["closed port"] <= deadline_s + 0.5
    assert delays["blackhole, deadline 0"] <= 0.5
    assert delays["collector up"] <= deadline_s + 0.5
    assert server.batches(acknowledged=False), "the flush with the collector up delivered nothing"


def test_drops_reach_the_collector_without_waiting_for_new_rows(
    server: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sender_mod, "INITIAL_BACKOFF_S", 0.001)
    monkeypatch.setattr(sender_mod, "MAX_BACKOFF_S", 0.002)
    server.default = (503, {})
    exp, eng = fp_exporter(server.url, max_pending_batches=2)
    now = time.time()
    for i in range(5):  # the collector is overloaded: the queue fills, the oldest go
        push(eng, 10, now - 20.0 + i)
        time.sleep(0.005)
        exp.tick(now_unix_s=now + i * 0.1)
    server.default = (200, {})
    for i in range(3):  # it recovers; no more rows arrive
        time.sleep(0.005)
        exp.tick(now_unix_s=now + 1.0 + i * 0.1)
    s = assert_accounting(exp)
    ok = server.batches(status=200)
    print(
        f"\nqueue cap 2, 5 batches: dropped {s['batches_dropped_full']}; the last of "
        f"{len(ok)} delivered batches carries dropped_batches_full="
        f"{ok[-1]['exporter']['dropped_batches_full']}"
    )
    assert s["batches_dropped_full"] == 3 and s["batches_pending"] == 0
    assert ok[-1]["exporter"]["dropped_batches_full"] == 3
    assert ok[-1]["exporter"]["dropped_steps"] == s["steps_dropped"] == 30
