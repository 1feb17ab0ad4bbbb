"""The exporter against a real local HTTP server: format, delivery, retries, drops, exit."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _ep_helpers import Blackhole, push_steps, refused_url
from _plugin_testkit import RecordingServer, assert_accounting, make_settings

from kvscope.engine_plugins import _batch as batch_mod
from kvscope.engine_plugins import _builder as builder_mod
from kvscope.engine_plugins import _sender as sender_mod
from kvscope.engine_plugins import exporter as exporter_mod
from kvscope.engine_plugins import schema
from kvscope.engine_plugins.exporter import EngineBuffer, Exporter

T0 = 1_800_000_000.0  # a whole second; rows at T0 + fractions belong to one window

HELLO = {
    "host": "testhost", "port": 8123, "pid": 1, "engine_index": 0, "pool": "p",
    "model": "m", "started_unix_s": T0, "vllm_version": "0.32.0", "kvscope_version": "0.1.0",
    "num_gpu_blocks": 48, "block_size": 32, "max_num_seqs": 6, "max_num_batched_tokens": 512,
    "max_model_len": 512, "enable_prefix_caching": True, "kv_cache_dtype": "auto",
    "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
}  # fmt: skip


def new_exporter(url: str, **kw: Any) -> tuple[Exporter, EngineBuffer]:
    exp = Exporter(make_settings(url, **kw))
    return exp, exp.register("testhost:8123:0", {**HELLO, "engine_id": "x", "boot_id": "y"})


def test_batches_follow_the_schema_gzip_and_auth(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url, token="s3cret")
    push_steps(eng, 5, T0 + 0.2)
    eng.requests.append((T0 + 0.3, 2.0, 0.1, 0.2, 1.7, None, 30, 16, 8, 0, "length"))
    eng.requests_produced += 1
    exp.tick(now_unix_s=T0 + 1.05)
    push_steps(eng, 3, T0 + 1.5)
    exp.tick(now_unix_s=T0 + 2.05)
    assert len(collector.received) == 2
    first, second = collector.received
    assert first.path == schema.INGEST_PATH
    assert first.headers["Content-Encoding"] == "gzip"
    assert first.headers["Content-Type"] == "application/json"
    assert first.headers["Authorization"] == "Bearer s3cret"
    assert first.raw[:2] == b"\x1f\x8b"  # gzip magic
    for r in collector.received:
        schema.validate_batch(r.batch)
    assert [r.batch["seq"] for r in collector.received] == [0, 1]
    assert {r.batch["boot_id"] for r in collector.received} == {exp.boot_id}
    assert first.batch["hello"]["engine_id"] == "testhost:8123:0"  # the buffer's own id
    assert first.batch["hello"]["boot_id"] == exp.boot_id
    assert second.batch["hello"] is None  # acknowledged once, not repeated
    assert first.batch["steps"]["kv_blocks_used"] == [24] * 5  # 0.5 x 48 blocks
    assert len(second.batch["steps"]["step"]) == 3
    assert first.batch["requests"]["ttft_s"] == [pytest.approx(0.3)]
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["requests_sent"], s["batches_sent"]) == (8, 1, 2)


def test_steps_of_the_current_second_are_held_back(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url)
    push_steps(eng, 4, T0 + 0.5)
    push_steps(eng, 2, T0 + 1.2)
    exp.tick(now_unix_s=T0 + 1.5)  # second T0+1 is not complete yet
    assert len(collector.batches()[0]["steps"]["ts_unix_s"]) == 4
    assert exp.stats()["steps_buffered"] == 2
    exp.tick(now_unix_s=T0 + 1.9)  # still incomplete: nothing new is sent
    assert len(collector.received) == 1
    exp.tick(now_unix_s=T0 + 2.01)
    assert collector.batches()[1]["steps"]["ts_unix_s"] == [T0 + 1.2] * 2
    push_steps(eng, 1, T0 + 2.5)
    exp.tick(now_unix_s=T0 + 2.6, final=True)  # the final flush holds nothing back
    assert collector.batches()[2]["steps"]["ts_unix_s"] == [T0 + 2.5]
    assert assert_accounting(exp)["steps_buffered"] == 0


def test_503_with_retry_after_is_retried_unchanged_and_the_hello_follows(
    collector: RecordingServer,
) -> None:
    exp, eng = new_exporter(collector.url)
    push_steps(eng, 2, T0)
    exp.tick(now_unix_s=T0 + 1.05)  # seq 0, with the hello, acknowledged
    collector.answer(503, {"error": "busy"}, {"Retry-After": "1"})
    push_steps(eng, 3, T0 + 1.1)
    exp.tick(now_unix_s=T0 + 2.05)  # seq 1 fails
    assert [r.status for r in collector.received] == [200, 503]
    assert exp.stats()["batches_pending"] == 1
    exp.tick(now_unix_s=T0 + 2.1)  # Retry-After not over: no attempt
    assert len(collector.received) == 2
    time.sleep(1.15)
    exp.tick(now_unix_s=T0 + 3.05)
    assert [r.status for r in collector.received] == [200, 503, 200]
    failed, retried = collector.received[1], collector.received[2]
    assert retried.batch["seq"] == 1
    assert retried.raw == failed.raw  # the same bytes: a built batch is never re-encoded
    assert retried.batch["hello"] is None
    assert retried.batch["exporter"]["send_failures"] == 0  # counters as when it was built
    # The collector may have restarted meanwhile: the next batch built carries the hello
    # (here an empty one: the engine is idle).
    exp.tick(now_unix_s=T0 + 4.05)
    follow = collector.received[3].batch
    assert (follow["seq"], follow["steps"]["step"]) == (2, [])
    assert follow["hello"] is not None
    s = assert_accounting(exp)
    assert (s["send_failures"], s["batches_sent"], s["steps_sent"]) == (1, 3, 5)
    assert s["hellos_sent"] == 2


def test_400_is_not_retried_and_is_counted(
    collector: RecordingServer, log_records: list[Any]
) -> None:
    exp, eng = new_exporter(collector.url)
    collector.answer(400, {"error": "steps.batch_size[0]: must be >= 0"})
    push_steps(eng, 4, T0)
    exp.tick(now_unix_s=T0 + 1.05)
    push_steps(eng, 1, T0 + 1.2)
    exp.tick(now_unix_s=T0 + 2.05)
    # Batch 0 is not sent again; batch 1 reports the drop and carries the hello,
    # which batch 0 could not deliver.
    assert [(r.batch["seq"], r.status) for r in collector.received] == [(0, 400), (1, 200)]
    last = collector.batches()[-1]
    assert last["steps"]["step"] == [1]
    assert last["exporter"]["dropped_steps"] == 4
    assert last["exporter"]["dropped_batches"] == 1
    assert last["hello"] is not None
    s = assert_accounting(exp)
    assert (s["batches_dropped"], s["steps_dropped"], s["send_failures"]) == (1, 4, 1)
    assert any("must be >= 0" in r.getMessage() for r in log_records)


def test_need_hello_in_a_response_brings_the_hello_back(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url)
    push_steps(eng, 1, T0)
    exp.tick(now_unix_s=T0 + 1.05)
    push_steps(eng, 1, T0 + 1.1)
    collector.answer(200, {"ok": True, "need_hello": True})
    exp.tick(now_unix_s=T0 + 2.05)
    push_steps(eng, 1, T0 + 2.1)
    exp.tick(now_unix_s=T0 + 3.05)
    assert [b["hello"] is not None for b in collector.batches()] == [True, False, True]


def test_4xx_asking_for_hello_sends_a_hello_batch_ahead_then_the_batch_again(
    collector: RecordingServer,
) -> None:
    exp, eng = new_exporter(collector.url)
    push_steps(eng, 1, T0)
    exp.tick(now_unix_s=T0 + 1.05)
    collector.answer(409, {"error": "unknown engine", "need_hello": True})
    push_steps(eng, 2, T0 + 1.1)
    exp.tick(now_unix_s=T0 + 2.05)
    assert [r.status for r in collector.received] == [200, 409, 200, 200]
    assert [r.batch["seq"] for r in collector.received] == [0, 1, 2, 1]
    hello_batch, resent = collector.received[2].batch, collector.received[3]
    assert hello_batch["hello"] is not None and hello_batch["steps"]["step"] == []
    assert resent.raw == collector.received[1].raw
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["batches_dropped"], s["send_failures"]) == (3, 0, 1)


def test_a_batch_refused_for_want_of_the_hello_twice_is_dropped(
    collector: RecordingServer,
) -> None:
    exp, eng = new_exporter(collector.url)
    push_steps(eng, 1, T0)
    exp.tick(now_unix_s=T0 + 1.05)
    collector.answer(409, {"error": "unknown engine", "need_hello": True})
    collector.answer(200)  # the hello batch sent ahead
    collector.answer(409, {"error": "unknown engine", "need_hello": True})
    push_steps(eng, 2, T0 + 1.1)
    exp.tick(now_unix_s=T0 + 2.05)
    assert [(r.batch["seq"], r.status) for r in collector.received] == [
        (0, 200),
        (1, 409),
        (2, 200),
        (1, 409),
    ]
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["steps_dropped"], s["batches_dropped_rejected"]) == (1, 2, 1)


def test_collector_away_drops_oldest_batches_and_accounts_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sender_mod, "INITIAL_BACKOFF_S", 0.001)
    monkeypatch.setattr(sender_mod, "MAX_BACKOFF_S", 0.002)
    url = refused_url()
    exp, eng = new_exporter(url, max_pending_batches=3)
    for i in range(6):
        push_steps(eng, 10, T0 + i + 0.5)
        eng.requests.append((T0 + i, 1.0, 0.0, 0.1, 0.9, None, 1, 1, 0, 0, "stop"))
        eng.requests_produced += 1
        time.sleep(0.005)
        exp.tick(now_unix_s=T0 + i + 1.05)
    s = assert_accounting(exp)
    assert (s["batches_pending"], s["batches_dropped"]) == (3, 3)
    assert (s["steps_dropped"], s["steps_buffered"]) == (30, 30)
    assert (s["requests_dropped"], s["requests_buffered"]) == (3, 3)
    assert s["send_failures"] >= 3 and s["steps_sent"] == 0
    # The collector comes back on the same address: the oldest kept batch goes first.
    port = int(url.rsplit(":", 1)[1])
    collector = RecordingServer(port)
    try:
        time.sleep(0.01)
        exp.tick(now_unix_s=T0 + 7.05)
        seqs = [b["seq"] for b in collector.batches()]
        assert seqs == [3, 4, 5]
        assert collector.batches()[0]["hello"] is not None
        s = assert_accounting(exp)
        assert (s["steps_sent"], s["steps_dropped"], s["steps_buffered"]) == (30, 30, 0)
        assert collector.batches()[0]["exporter"]["dropped_batches"] == 0  # built before drops
    finally:
        collector.close()


def test_pending_batches_are_bounded_in_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_mod, "MAX_PENDING_BYTES", 1)
    exp, eng = new_exporter(refused_url(), max_pending_batches=100)
    for i in range(4):
        push_steps(eng, 10, T0 + i + 0.5)
        exp.tick(now_unix_s=T0 + i + 1.05)
    s = assert_accounting(exp)
    assert (s["batches_pending"], s["batches_dropped"], s["steps_dropped"]) == (1, 3, 30)


def test_full_buffer_drops_oldest_rows_and_counts_them(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url, buffer_steps=100)
    for i in range(250):
        eng.steps.append((T0, i + 1, 1, 0, 0, 0.1, 0, 0, 0, 0, 1, None))
        eng.steps_produced += 1
    s = assert_accounting(exp)
    assert (s["steps_dropped"], s["steps_buffered"]) == (150, 100)
    exp.tick(now_unix_s=T0 + 1.05)
    batch = collector.batches()[0]
    assert batch["steps"]["step"] == list(range(151, 251))  # the newest rows survive
    assert batch["exporter"]["dropped_steps"] == 150
    assert assert_accounting(exp)["steps_sent"] == 100


def test_token_only_calls_are_folded_and_totals_kept(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url)
    rows = [
        (T0 + 0.1, 1, 3, 0, 0, 0.2, 5, 1, 0, 10, 3, None),
        (T0 + 0.2, 2, None, None, None, None, 0, 0, 1, 4, 2, None),
        (T0 + 0.3, 3, 3, 0, 0, 0.2, 5, 1, 0, 0, 3, None),
        (T0 + 0.4, 4, None, None, None, None, 0, 0, 0, 0, 6, None),
    ]
    for r in rows:
        eng.steps.append(r)
        eng.steps_produced += 1
    exp.tick(now_unix_s=T0 + 0.9)  # the second still runs: the trailing row waits for a step
    assert not any(b["steps"]["step"] for b in collector.batches())  # rows of this second wait
    exp.tick(now_unix_s=T0 + 1.05)  # its second is over: a row of its own, in that second
    steps = collector.batches()[-1]["steps"]
    assert steps["step"] == [1, 3, 4]
    assert (steps["generation_tokens"], steps["batch_size"]) == ([3, 5, 6], [3, 3, 3])
    assert max(steps["ts_unix_s"]) < T0 + 1
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["steps_merged"]) == (3, 1)


def test_idle_engine_sends_hello_then_heartbeats(
    collector: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp, _eng = new_exporter(collector.url)
    exp.tick(now_unix_s=T0)
    exp.tick(now_unix_s=T0 + 1)
    batches = collector.batches()
    assert len(batches) == 1 and batches[0]["hello"] is not None
    schema.validate_batch(batches[0])
    monkeypatch.setattr(builder_mod, "HEARTBEAT_S", 0.0)
    exp.tick(now_unix_s=T0 + 2)
    assert len(collector.batches()) == 2 and collector.batches()[1]["hello"] is None


def test_thread_exports_on_its_own_and_stops_on_shutdown(collector: RecordingServer) -> None:
    exp, eng = new_exporter(collector.url, flush_interval_s=0.1)
    exp.start()
    assert exp._thread is not None
    assert exp._thread.name == "kvscope-exporter" and exp._thread.daemon
    push_steps(eng, 3, time.time() - 1.0)
    assert collector.wait_for(1, timeout_s=3.0)
    push_steps(eng, 2, time.time())  # current second: only the exit flush sends it
    assert exp.shutdown(2.0)
    assert not exp.running
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["steps_buffered"]) == (5, 0)


@pytest.mark.parametrize("where", ["blackhole", "unroutable"])
def test_shutdown_returns_within_its_deadline(blackhole: Blackhole, where: str) -> None:
    url = blackhole.url if where == "blackhole" else "http://10.255.255.1:9"
    exp, eng = new_exporter(url, timeout_s=10.0, flush_interval_s=0.05)
    exp.start()
    push_steps(eng, 5, time.time() - 2.0)
    time.sleep(0.2)  # the thread is now stuck in a request that will not answer
    start = time.monotonic()
    exp.shutdown(0.5)
    assert time.monotonic() - start < 0.9


def test_shutdown_without_thread_flushes_in_caller(blackhole: Blackhole) -> None:
    exp, eng = new_exporter(blackhole.url, timeout_s=10.0)
    push_steps(eng, 5, T0)
    start = time.monotonic()
    assert exp.shutdown(0.3)
    assert time.monotonic() - start < 0.7
    s = assert_accounting(exp)
    assert (s["steps_dropped"], s["batches_dropped"], s["steps_buffered"]) == (5, 1, 0)


def test_a_batch_is_resent_byte_for_byte_from_memory_and_from_the_spool(
    collector: RecordingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sender_mod, "INITIAL_BACKOFF_S", 0.001)
    monkeypatch.setattr(sender_mod, "MAX_BACKOFF_S", 0.002)
    # A replay budget (a share of the flush interval) that a busy machine cannot exhaust.
    exp, eng = new_exporter(collector.url, spool_dir=str(tmp_path / "spool"), flush_interval_s=1.0)
    push_steps(eng, 1, T0)
    exp.tick(now_unix_s=T0 + 1.05)  # seq 0, with the hello, acknowledged
    push_steps(eng, 1, T0 + 1.2)
    collector.answer(500, {"error": "boom"})
    exp.tick(now_unix_s=T0 + 2.05)  # seq 1 (no hello) fails
    collector.answer(503, {"error": "busy"})
    time.sleep(0.01)
    # Failing: seq 1 moves to the spool as it is, followed by an empty batch carrying
    # the hello (a later process replaying the spool could not add it); its replay fails.
    exp.tick(now_unix_s=T0 + 3.05)
    time.sleep(0.01)
    exp.tick(now_unix_s=T0 + 4.05)  # the spool is replayed
    assert [(r.batch["seq"], r.status) for r in collector.received][:5] == [
        (0, 200),
        (1, 500),
        (1, 503),
        (1, 200),
        (2, 200),
    ]
    assert {r.raw for r in collector.received[1:4]} == {collector.received[1].raw}
    hello_batch = collector.received[4].batch
    assert hello_batch["hello"] is not None and hello_batch["steps"]["step"] == []
    s = assert_accounting(exp)
    assert (s["steps_sent"], s["steps_buffered"], s["batches_in_spool"]) == (2, 0, 0)
    exp.shutdown(0.5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_after_fork_gets_a_new_exporter(collector: RecordingServer) -> None:
    parent = exporter_mod.get_exporter(make_settings(collector.url))
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report, never return into pytest
            try:
                ok = exporter_mod.current_exporter() is None
                child = exporter_mod.get_exporter(make_settings(collector.url))
                ok = ok and child is not parent and child.boot_id != parent.boot_id
                ok = ok and child.running
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(w)
        answer = os.read(r, 1)
        os.waitpid(pid, 0)
        assert answer == b"1"
        assert exporter_mod.current_exporter() is parent
    finally:
        parent.shutdown(0.5)
        exporter_mod._EXPORTER = None


def test_record_threads_and_exporter_thread_keep_exact_totals(
    collector: RecordingServer,
) -> None:
    exp, eng = new_exporter(collector.url, flush_interval_s=0.05, buffer_steps=500)
    exp.start()
    n = 20_000

    def produce() -> None:
        for i in range(n):
            eng.steps.append((time.time(), i + 1, 1, 0, 0, 0.1, 0, 0, 0, 0, 1, None))
            eng.steps_produced += 1

    t = threading.Thread(target=produce)
    t.start()
    t.join()
    assert exp.shutdown(3.0)
    s = assert_accounting(exp)
    assert s["steps_produced"] == n
    assert s["steps_sent"] == sum(len(b["steps"]["step"]) for b in collector.batches())
    assert s["steps_buffered"] == 0
