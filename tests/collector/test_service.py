"""Settings validation, the writer thread, and serve() as a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _collector_helpers import batch, encode, get_json, http, post_batch

from kvscope.collector._writer import GroupCommitWriter, Overloaded, WriterClosed
from kvscope.collector.batch import prepare_batch
from kvscope.collector.settings import Settings
from kvscope.collector.store import Store


def test_settings_defaults_and_validation() -> None:
    s = Settings()
    assert (s.host, s.port, s.token) == ("127.0.0.1", 8844, None)
    assert s.raw_step_retention_s == 86400 and s.max_body_bytes == 8 * 1024 * 1024
    for bad in (
        {"port": 70000},
        {"raw_step_retention_s": -1},
        {"max_body_bytes": 0},
        {"token": "  "},
        {"store_path": ""},
        {"retention_interval_s": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(**bad)
    assert "hunter2" not in repr(Settings(token="hunter2"))
    assert s.replace(port=9000).port == 9000


def test_writer_groups_and_flushes_on_close(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "w.duckdb"))
    seen: list[int] = []
    writer = GroupCommitWriter(
        store, max_group_batches=50, on_committed=lambda bs, rs: seen.append(len(bs))
    )
    batches = [prepare_batch(batch(seq=i, step_ts=[1000.0 + i]), time.time()) for i in range(200)]
    futs = [writer.submit(b) for b in batches]  # queued before the thread starts
    writer.start()
    assert [f.result(timeout=30).status for f in futs] == ["stored"] * 200
    assert max(seen) == 50 and sum(seen) == 200
    late = [
        writer.submit(prepare_batch(batch(seq=1000 + i, step_ts=[5.0]), time.time()))
        for i in range(20)
    ]
    writer.close()
    assert all(f.done() and f.result().status == "stored" for f in late)
    assert store.table_counts()["ingested_batches"] == 220
    with pytest.raises(WriterClosed):
        writer.submit(batches[0])
    store.close()


def test_writer_overload(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "o.duckdb"))
    writer = GroupCommitWriter(store, max_pending_batches=3)  # not started: nothing drains
    b = prepare_batch(batch(step_ts=[1.0]), time.time())
    for _ in range(3):
        writer.submit(b)
    with pytest.raises(Overloaded):
        writer.submit(b)
    writer.start()
    writer.close()
    store.close()


def test_writer_job_runs_on_writer_thread(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "j.duckdb"))
    writer = GroupCommitWriter(store).start()
    assert writer.call(lambda: threading.current_thread().name).result(10) == "kvscope-writer"
    writer.close()
    store.close()


def test_serve_process_graceful_shutdown(tmp_path: Path) -> None:
    store = tmp_path / "svc.duckdb"
    code = (
        "import sys; from kvscope.collector.server import serve; from kvscope.collector.settings import "
        f"Settings; serve(Settings(port=0, store_path={str(store)!r}))"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        url = None
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            url = m.group(1) if m else None
        assert url, "the collector did not log where it listens"
        now = time.time()  # recent steps: the default 24 h retention keeps them
        assert post_batch(url, batch(with_hello=True, step_ts=[now - 1, now]))[0] == 200
        assert get_json(url, "/healthz")[1]["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with Store(str(store)) as s:
        assert s.table_counts()["steps"] == 2


def test_ingest_503_when_overloaded(make_collector: Any) -> None:
    lc = make_collector(max_pending_batches=1)
    # Hold the writer busy with a job so submitted batches pile up.
    gate = threading.Event()
    lc.running.ctx.writer.call(gate.wait)
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(post_batch(lc.url, batch(step_ts=[1.0]))))
    t.start()
    deadline = time.monotonic() + 10
    while lc.running.ctx.writer.pending_batches < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, headers, body = http(
        "POST",
        lc.url + "/v1/ingest",
        encode(batch(seq=1, step_ts=[2.0])),
        {"Content-Encoding": "gzip"},
    )
    gate.set()
    t.join(10)
    assert status == 503 and "overloaded" in json.loads(body)["error"]
    assert headers["retry-after"] == "1"
    assert results[0][0] == 200


def test_retention_task_deletes_old_steps(make_collector: Any) -> None:
    lc = make_collector(raw_step_retention_s=3600, retention_interval_s=0.1)
    now = time.time()
    b = batch(step_ts=[now - 7200, now - 10, now])
    assert post_batch(lc.url, b)[0] == 200
    deadline = time.monotonic() + 10
    while len(lc.store.steps()) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(lc.store.steps()["ts_unix_s"]) == [now - 10, now]
    assert lc.store.windows()["n_steps"].sum() == 3


def test_start_fails_cleanly_on_a_newer_store(tmp_path: Path) -> None:
    import asyncio

    import duckdb

    from kvscope.collector.server import start
    from kvscope.collector.store import StoreVersionError

    path = str(tmp_path / "newer.duckdb")
    Store(path).close()
    con = duckdb.connect(path)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'store_schema_version'")
    con.close()
    with pytest.raises(StoreVersionError):
        asyncio.run(start(Settings(port=0, store_path=path)))
    # The file is not left locked: it opens again (and fails the same way).
    with pytest.raises(StoreVersionError):
        Store(path)
