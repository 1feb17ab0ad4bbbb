"""The on-disk spool against the real collector process.

Time is compressed: the exporter is driven one cycle per simulated second (rows
stamped in the past ten minutes), so "ten minutes without a collector" takes seconds.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fp_helpers import ENGINE_ID, fp_exporter, metric, push, stored_counts
from _plugin_testkit import assert_accounting

from kvscope.collector.process import CollectorProcess, free_port
from kvscope.engine_plugins import _sender as sender_mod
from kvscope.engine_plugins._spool import Spool, SpoolBusy, read_records
from kvscope.engine_plugins.exporter import Exporter

ROOT = Path(__file__).resolve().parents[2]
STEPS_PER_S, REQUESTS_PER_S = 20, 2


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated seconds pass in milliseconds: retry at once instead of after 0.5-30 s.
    monkeypatch.setattr(sender_mod, "INITIAL_BACKOFF_S", 0.001)
    monkeypatch.setattr(sender_mod, "MAX_BACKOFF_S", 0.002)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def collector(tmp_path: Path, port: int) -> Iterator[CollectorProcess]:
    """The real collector, not started: tests start it when it "comes back"."""
    c = CollectorProcess(tmp_path / "store.duckdb", port=port, log_path=tmp_path / "c.log")
    yield c
    c.stop()


def run_seconds(exp: Exporter, t0: float, first: int, n: int, per_batch: int = 1) -> None:
    """Simulate seconds ``first`` .. ``first + n`` of load, one cycle per ``per_batch`` s."""
    eng = exp._engines[ENGINE_ID]
    for i in range(first, first + n):
        push(eng, STEPS_PER_S, t0 + i + 0.5, n_requests=REQUESTS_PER_S)
        if (i + 1 - first) % per_batch == 0:
            time.sleep(0.003)  # let retries fall due
            exp.tick(now_unix_s=t0 + i + 1.05)


def drain(exp: Exporter, t0: float, first: int, timeout_s: float = 90.0) -> int:
    """Run cycles without new rows until nothing waits, in memory or on disk."""
    deadline = time.monotonic() + timeout_s
    i = first
    while time.monotonic() < deadline:
        exp.tick(now_unix_s=t0 + i + 1.05)
        i += 1
        s = exp.stats()
        if s["batches_pending"] == 0 and s["spool_records"] == 0:
            return i
        time.sleep(0.003)
    raise AssertionError(f"the backlog did not drain: {exp.stats()}")


def test_ten_minutes_without_collector_lose_nothing_and_store_no_duplicate(
    tmp_path: Path, port: int, collector: CollectorProcess
) -> None:
    url = f"http://127.0.0.1:{port}"
    spool_dir = tmp_path / "spool"
    t0 = math.floor(time.time()) - 900.0
    # One batch per 5 simulated seconds: the collector's ingest takes ~80 ms a request,
    # so replaying 600 one-second batches one by one would take most of a minute.
    kw = dict(spool_dir=str(spool_dir), max_pending_batches=5, flush_interval_s=5.0)
    # First boot: 400 s without a collector, then the engine process exits.
    exp1, _ = fp_exporter(url, **kw)
    run_seconds(exp1, t0, 0, 400, per_batch=5)
    s1 = assert_accounting(exp1)
    assert s1["steps_sent"] == 0 and s1["steps_dropped"] == 0
    assert exp1.shutdown(timeout_s=2.0)
    s1 = assert_accounting(exp1)
    # Every batch built is on disk (the final cycle adds one, empty, with the hello).
    assert s1["steps_buffered"] == 400 * STEPS_PER_S
    assert s1["batches_in_spool"] == s1["batches_spooled"] == s1["batches_built"] >= 80
    # Second boot on the same host and port: 200 s more without a collector.
    exp2, _ = fp_exporter(url, **kw)
    run_seconds(exp2, t0, 400, 200, per_batch=5)
    s2 = assert_accounting(exp2)
    n_spooled = s1["batches_built"] + s2["batches_built"]
    assert s2["spool_records"] == n_spooled and s2["batches_pending"] == 0
    spool_bytes = s2["spool_bytes"]
    snapshot = tmp_path / "spool-copy"
    shutil.copytree(spool_dir, snapshot, ignore=shutil.ignore_patterns("LOCK"))
    # The collector comes back on the same port: everything is sent, oldest first.
    collector.start()
    started = time.monotonic()
    drain(exp2, t0, 600)
    drain_s = time.monotonic() - started
    s2 = assert_accounting(exp2)
    produced_steps = 600 * STEPS_PER_S
    produced_requests = 600 * REQUESTS_PER_S
    steps, reqs = stored_counts(collector)
    print(
        f"\n600 simulated s without a collector, 2 boots: {s2['spool_records']} left, "
        f"spool peaked at {spool_bytes} bytes; drained {n_spooled} batches in "
        f"{drain_s:.1f} s; "
        f"stored {steps[ENGINE_ID]} of {produced_steps} steps, {reqs[ENGINE_ID]} of "
        f"{produced_requests} requests; replayed from the earlier boot: "
        f"{exp2.replayed_batches}"
    )
    assert steps[ENGINE_ID] == produced_steps and reqs[ENGINE_ID] == produced_requests
    assert exp2.replayed_batches == s1["batches_built"]
    assert s2["steps_sent"] == 200 * STEPS_PER_S and s2["steps_dropped"] == 0
    assert not any(spool_dir.joinpath(exp2.settings.spool_key).glob("*.seg"))
    # A replay of the same spool (a crash right after sending, before the records were
    # removed): the collector recognises every batch and stores nothing twice.
    dup_before = metric(collector, "kvscope_collector_ingest_batches_total", result="duplicate")
    exp3, _ = fp_exporter(url, spool_dir=str(snapshot), max_pending_batches=5, flush_interval_s=5.0)
    drain(exp3, t0, 700)
    dup = (
        metric(collector, "kvscope_collector_ingest_batches_total", result="duplicate") - dup_before
    )
    steps_again, reqs_again = stored_counts(collector)
    print(
        f"replayed a copy of the spool: {dup:.0f} duplicates answered, stored steps "
        f"{steps_again[ENGINE_ID]}, requests {reqs_again[ENGINE_ID]}"
    )
    assert dup >= n_spooled
    assert (steps_again, reqs_again) == (steps, reqs)
    exp2.shutdown(timeout_s=1.0)
    exp3.shutdown(timeout_s=1.0)


def test_size_cap_drops_oldest_segments_and_counts_them(
    tmp_path: Path, port: int, collector: CollectorProcess
) -> None:
    url = f"http://127.0.0.1:{port}"
    t0 = math.floor(time.time()) - 900.0
    cap = 64 * 1024
    exp, eng = fp_exporter(
        url,
        spool_dir=str(tmp_path / "spool"),
        spool_max_bytes=cap,
        max_pending_batches=5,
        flush_interval_s=1.0,
    )
    run_seconds(exp, t0, 0, 400)
    s = assert_accounting(exp)
    segment_bytes = exp._spool.store.segment_bytes if exp._spool else 0
    print(
        f"\nspool cap {cap} bytes (segments of {segment_bytes}): holds {s['spool_bytes']} "
        f"bytes, {s['spool_records']} of 400 batches; dropped {s['batches_dropped_full']} "
        f"batches ({s['steps_dropped']} steps, {s['requests_dropped']} requests)"
    )
    assert 0 < s["spool_bytes"] <= cap + segment_bytes
    assert s["batches_dropped_full"] == s["batches_dropped"] > 0
    assert s["batches_dropped"] + s["spool_records"] == 400
    assert s["steps_dropped"] == s["batches_dropped"] * STEPS_PER_S
    # The oldest went: what is left is the newest, in order.
    seqs = [e.meta["seq"] for e in exp._spool.store.entries()] if exp._spool else []
    assert seqs == list(range(400 - len(seqs), 400))
    collector.start()
    end = drain(exp, t0, 400)
    push(eng, 1, t0 + end + 0.5)  # a fresh batch carries the final counters
    drain(exp, t0, end)
    s = assert_accounting(exp)
    steps, reqs = stored_counts(collector)
    assert steps[ENGINE_ID] == s["steps_sent"] == s["steps_produced"] - s["steps_dropped"]
    assert reqs[ENGINE_ID] == s["requests_sent"]
    dropped_full = metric(
        collector, "kvscope_exporter_dropped_batches_full_total", engine=ENGINE_ID
    )
    dropped_steps = metric(collector, "kvscope_exporter_dropped_steps_total", engine=ENGINE_ID)
    print(
        f"collector /metrics: dropped_batches_full {dropped_full:.0f}, dropped_steps "
        f"{dropped_steps:.0f}"
    )
    assert dropped_full == s["batches_dropped_full"]
    assert dropped_steps == s["steps_dropped"]
    exp.shutdown(timeout_s=1.0)


_WRITER = textwrap.dedent("""
    import os, sys, time
    from kvscope.engine_plugins._config import load_settings
    from kvscope.engine_plugins.exporter import get_exporter
    exp = get_exporter(load_settings())
    eng = exp.register("fphost:9100:0", {"host": "fphost", "port": 9100, "pid": os.getpid(),
        "engine_index": 0, "pool": "fp", "model": "m", "started_unix_s": time.time(),
        "vllm_version": "0", "kvscope_version": "0"})
    print("READY", flush=True)
    step = 0
    while True:  # record() at ~2,000 steps/s until killed
        step += 1
        eng.steps.append((time.time() - 2.0, step, 4, 1, 0, 0.5, 10, 5, 0, 3, 2, 9.0))
        eng.steps_produced += 1
        time.sleep(0.0005)
""")


def test_torn_segment_after_kill_is_skipped_and_counted(
    tmp_path: Path, port: int, collector: CollectorProcess
) -> None:
    spool_dir = tmp_path / "spool"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSCOPE_COLLECTOR_URL": url,
           "KVSCOPE_SPOOL_DIR": str(spool_dir), "KVSCOPE_FLUSH_INTERVAL_S": "0.05",
           "KVSCOPE_MAX_PENDING_BATCHES": "2", "KVSCOPE_HOST": "fphost", "KVSCOPE_PORT": "9100",
           "KVSCOPE_SPOOL_MAX_BYTES": str(1 << 30)}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", _WRITER], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"
        time.sleep(2.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    key_dir = spool_dir / "fphost_9100"
    segments = sorted(key_dir.glob("*.seg"), key=lambda p: int(p.stem))
    assert segments, "the killed writer left no spool"
    intact = [read_records(p.read_bytes()) for p in segments]
    assert all(clean for _, clean in intact[:-1])
    # Tear the newest record in half, as a crash mid-write (or a power loss) leaves it.
    last = segments[-1]
    records, _ = intact[-1]
    assert records, "the newest segment is empty"
    offset, size, _, _ = records[-1]
    with open(last, "r+b") as fh:
        fh.truncate(offset + size // 2)
    expected_steps = sum(m["n_steps"] for recs, _ in intact for _, _, m, _ in recs)
    expected_steps -= records[-1][2]["n_steps"]
    expected_batches = sum(len(recs) for recs, _ in intact) - 1
    # A new process on the same spool, with the collector back.
    collector.start()
    exp, eng = fp_exporter(url, spool_dir=str(spool_dir), flush_interval_s=1.0)
    t0 = math.floor(time.time()) - 60.0
    end = drain(exp, t0, 0)
    push(eng, 1, t0 + end + 0.5)  # a fresh batch carries the counters
    drain(exp, t0, end)
    s = assert_accounting(exp)
    steps, _ = stored_counts(collector)
    stored_from_spool = steps[ENGINE_ID] - s["steps_sent"]
    corrupt = metric(collector, "kvscope_exporter_spool_corrupt_records_total", engine=ENGINE_ID)
    print(
        f"\nkilled writer left {len(segments)} segment(s), {expected_batches + 1} records; "
        f"tore the last: replayed {exp.replayed_batches} batches, stored {stored_from_spool} "
        f"of {expected_steps} intact steps; corrupt records counted: {s['spool_corrupt_records']}"
        f" (collector /metrics: {corrupt:.0f})"
    )
    assert s["spool_corrupt_records"] == 1 and corrupt == 1
    assert exp.replayed_batches == expected_batches
    assert stored_from_spool == expected_steps
    exp.shutdown(timeout_s=1.0)


def test_spool_io_runs_only_in_the_exporter_thread(tmp_path: Path) -> None:
    threads: set[str] = set()
    originals = {name: getattr(Spool, name) for name in ("__init__", "append", "peek", "sync")}

    def spy(name: str):  # type: ignore[no-untyped-def]
        def wrapper(self, *a, **kw):  # type: ignore[no-untyped-def]
            threads.add(threading.current_thread().name)
            return originals[name](self, *a, **kw)

        return wrapper

    mp = pytest.MonkeyPatch()
    try:
        for name in originals:
            mp.setattr(Spool, name, spy(name))
        exp, eng = fp_exporter(
            f"http://127.0.0.1:{free_port()}",
            spool_dir=str(tmp_path / "spool"),
            max_pending_batches=1,
        )
        exp.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and exp.stats()["batches_spooled"] < 5:
            push(eng, 5, time.time() - 3.0)  # the caller plays record()
            time.sleep(0.05)
        assert exp.shutdown(timeout_s=2.0)
    finally:
        mp.undo()
    s = assert_accounting(exp)
    print(f"\nspool calls made from threads {sorted(threads)}; {s['batches_spooled']} spooled")
    assert s["batches_spooled"] >= 5
    assert threads == {"kvscope-exporter"}


def test_flipped_byte_skips_the_rest_of_its_segment_only(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", max_bytes=1 << 20, segment_bytes=2_000)
    for seq in range(30):
        spool.append(
            {"engine_id": "e", "boot_id": "b", "seq": seq, "n_steps": 1, "n_requests": 0},
            os.urandom(200),
        )
    spool.close()
    segments = sorted((tmp_path / "s").glob("*.seg"), key=lambda p: int(p.stem))
    assert len(segments) >= 3
    first = [m["seq"] for _, _, m, _ in read_records(segments[0].read_bytes())[0]]
    # Flip one byte inside the body of the first segment's second record.
    data = bytearray(segments[0].read_bytes())
    offset, size, _, _ = read_records(bytes(data))[0][1]
    data[offset + size - 10] ^= 0xFF
    segments[0].write_bytes(bytes(data))
    reopened = Spool(tmp_path / "s", max_bytes=1 << 20, segment_bytes=2_000)
    seqs = []
    while (got := reopened.peek()) is not None:
        seqs.append(got[0].meta["seq"])
        reopened.pop()
    print(
        f"\n30 records in {len(segments)} segments, byte flipped in record "
        f"{first[1]}: read back {len(seqs)}, corrupt {reopened.corrupt_records}"
    )
    assert reopened.corrupt_records == 1
    assert seqs == [first[0], *range(len(first), 30)]
    reopened.close()


def test_a_second_owner_of_the_spool_is_refused(tmp_path: Path) -> None:
    first = Spool(tmp_path / "s", max_bytes=1 << 20)
    with pytest.raises(SpoolBusy, match="another process"):
        Spool(tmp_path / "s", max_bytes=1 << 20)
    first.close()
    Spool(tmp_path / "s", max_bytes=1 << 20).close()  # free again once closed
