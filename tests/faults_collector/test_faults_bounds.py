"""A buggy or hostile sender cannot corrupt the store, steer an engine's identity or stop
the service: bounded values and times at the door, rows past them quarantined at open,
pool-scoped tokens, a limit on boots, surrogates and overflowing queries refused, and a
/healthz that says when the store cannot write. Each test runs a real collector process
over real HTTP; each failed on the collector before these bounds (see
docs/reliability.md#a-hostile-or-buggy-sender)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from _faults_collector_helpers import batch, counter, post, request, start_collector

from kvscope.collector.process import CollectorProcess
from kvscope.collector.store import Store

INT64_MAX = 2**63 - 1


def _now_batch(engine_id: str, boot_id: str, seq: int, **over: Any) -> dict[str, Any]:
    """A valid batch of one step at the current time, with a hello dated now."""
    now = time.time()
    b = batch(engine_id, boot_id, seq, with_hello=True, step_ts=[now - 0.5], sent_unix_s=now)
    b["hello"]["started_unix_s"] = now - 60
    b.update(over)
    return b


def _error(body: bytes) -> str:
    return str(json.loads(body)["error"])


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProcess]:
    c = start_collector(tmp_path / "store.duckdb", "--max-backfill", "15d")
    try:
        yield c
    finally:
        c.stop()


def test_overflowing_counts_are_refused_and_the_store_restarts(
    collector: CollectorProcess, tmp_path: Path
) -> None:
    url = collector.url
    assert post(url, _now_batch("e", "b1", 0))[0] == 200
    now = time.time()
    # Two steps in different seconds, each past what any step holds: 2^63-1 wrapped the
    # counter to -2 and made every later read of the engine's totals fail.
    b = batch("e", "b1", 1, step_ts=[now - 3.2, now - 2.2], sent_unix_s=now)
    b["steps"]["prompt_tokens"] = [INT64_MAX, INT64_MAX]
    status, _, body = post(url, b)
    assert status == 400 and "steps.prompt_tokens" in _error(body), body
    assert "<=" in _error(body)  # the bound is named
    # Same second, 2^62 each: was stored as INT64_MIN.
    b = batch("e", "b1", 2, step_ts=[now - 1.5, now - 1.4], sent_unix_s=now)
    b["steps"]["generation_tokens"] = [2**62, 2**62]
    status, _, body = post(url, b)
    assert status == 400 and "steps.generation_tokens" in _error(body), body
    # A time of 1e308 had its window land at INT64_MIN.
    b = batch("e", "b1", 3, step_ts=[1e308], sent_unix_s=now)
    status, _, body = post(url, b)
    assert status == 400 and "steps.ts_unix_s" in _error(body), body
    # Counts within one step's bound add up exactly.
    b = batch("e", "b1", 4, step_ts=[now - 1.0], sent_unix_s=now)
    b["steps"]["prompt_tokens"] = [2**32]
    assert post(url, b)[0] == 200
    totals = collector.get_json("/v1/totals", params={"engine": "e"})["rows"]
    assert totals[0]["prompt_tokens"] == 2**32  # the first batch's step had none
    collector.stop()
    again = CollectorProcess(
        collector.store_path, port=collector.port, extra_args=collector.extra_args
    ).start()
    try:
        assert again.get_json("/v1/totals")["rows"][0]["prompt_tokens"] == 2**32
        labels = {"engine": "e", "pool": "pool-a", "model": "qwen-0.5b"}
        text = again.get_text("/metrics")
        assert counter(text, "kvscope_engine_prompt_tokens_total", **labels) == 2**32
    finally:
        again.stop()


def _old_store(path: Path) -> None:
    """A store as the collector before the bounds left it after the hostile batches: two
    windows whose counts sum past 2^63, one wrapped to INT64_MIN, a window dated at
    INT64_MIN, an engine whose identity is dated in the year 3e10 and one dated next year."""
    Store(str(path)).close()
    con = duckdb.connect(str(path))
    try:
        con.execute(
            "INSERT INTO windows_1s (engine_id, ts_s, n_steps, n_parts, batch_sum, "
            "prompt_tokens, generation_tokens) VALUES "
            f"('e', 1700000000, 1, 1, 1, {INT64_MAX}, 1), "
            f"('e', 1700000001, 1, 1, 1, {INT64_MAX}, 1), "
            f"('e', 1700000002, 2, 2, 2, {-(2**63)}, 1), "
            f"('e', {-(2**63)}, 1, 1, 1, 5, 1), "
            "('e', 1700000003, 1, 1, 3, 7, 2)"
        )
        con.execute(
            "INSERT INTO engines (engine_id, boot_id, has_hello, started_unix_s, pool, model, "
            "first_seen_unix_s, last_seen_unix_s) VALUES "
            "('victim', 'evil-boot', true, 1e18, 'evil', 'm', 1700000000, 1700000000), "
            f"('near', 'evil-boot', true, {time.time() + 365 * 86_400}, 'evil', 'm', "
            "1700000000, 1700000000), "
            "('e', 'b1', true, 1700000000, 'pool-a', 'm', 1700000000, 1700000000)"
        )
    finally:
        con.close()


def test_a_store_with_rows_past_the_bounds_starts_and_quarantines_them(tmp_path: Path) -> None:
    store = tmp_path / "old.duckdb"
    _old_store(store)
    c = start_collector(store, "--retention-interval", "1s")
    try:
        totals = {r["engine_id"]: r for r in c.get_json("/v1/totals")["rows"]}
        assert totals["e"]["prompt_tokens"] == 7  # only the window within the bounds
        text = c.get_text("/metrics")
        assert counter(text, "kvscope_collector_quarantined_rows") == 5
        # Retention and rollup passes run on the store without failing.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            behind = counter(c.get_text("/metrics"), "kvscope_collector_rollup_behind_seconds")
            if behind is not None and behind == behind:  # not NaN: a pass has run
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no retention pass ran within 20 s")
        time.sleep(1.5)
        log = c.log_path.read_text()
        assert "retention failed" not in log, log[-3000:]
        assert "moved to quarantined_rows" in log
        # Future-dated identities (past any time, or only next year) no longer hold off
        # the engines' genuine hellos.
        now = time.time()
        for engine_id in ("victim", "near"):
            real = batch(engine_id, "real-boot", 0, with_hello=True, sent_unix_s=now)
            real["hello"].update(pool="prod", started_unix_s=now - 30)
            assert post(c.url, real)[0] == 200
        engines = {r["engine_id"]: r for r in c.get_json("/v1/engines")["rows"]}
        assert engines["victim"]["pool"] == engines["near"]["pool"] == "prod"
        text = c.get_text("/metrics")
        for engine_id in ("victim", "near"):  # /metrics labels them with the new pool
            assert f'engine="{engine_id}",pool="prod"' in text, engine_id
    finally:
        c.stop()
    # And it starts again (the quarantine is done once).
    again = start_collector(store)
    try:
        assert json.loads(again.request("/healthz")[1])["status"] == "ok"
        assert counter(again.get_text("/metrics"), "kvscope_collector_quarantined_rows") == 5
    finally:
        again.stop()


def test_future_dates_cannot_hijack_an_engine_or_freeze_its_gauges(
    collector: CollectorProcess,
) -> None:
    url, now = collector.url, time.time()
    assert post(url, _now_batch("victim", "b1", 0))[0] == 200
    # A hello of a boot dated far ahead relabelled the engine for good.
    evil = batch("victim", "evil", 0, with_hello=True, sent_unix_s=now)
    evil["hello"].update(pool="evil", started_unix_s=1e18)
    status, _, body = post(url, evil)
    assert status == 400 and "hello.started_unix_s" in _error(body), body
    evil["hello"]["started_unix_s"] = now + 3600
    status, _, body = post(url, evil)
    assert status == 400 and "ahead of the collector's clock" in _error(body), body
    # A step dated year 9999, or an hour ahead, froze the engine's gauges.
    for ts in (253_402_300_000.0, now + 3600):
        b = batch("victim", "b1", 1, step_ts=[ts], sent_unix_s=now)
        status, _, body = post(url, b)
        assert status == 400 and "steps.ts_unix_s" in _error(body), body
    b = batch("victim", "b1", 2, step_ts=[time.time() - 0.2], sent_unix_s=now)
    b["steps"]["batch_size"] = [77]
    assert post(url, b)[0] == 200
    text = collector.get_text("/metrics")
    labels = {"engine": "victim", "pool": "pool-a", "model": "qwen-0.5b"}
    assert counter(text, "kvscope_engine_batch_size", **labels) == 77
    # Data older than the backfill window is refused with the flag to raise it.
    old = batch("victim", "b1", 3, step_ts=[now - 20 * 86_400], sent_unix_s=now)
    status, _, body = post(url, old)
    assert status == 400 and "--max-backfill" in _error(body), body


def test_pool_tokens_write_and_read_only_their_pool(tmp_path: Path) -> None:
    c = start_collector(
        tmp_path / "store.duckdb",
        "--pool-token",
        "a=TA",
        "--pool-token",
        "b=TB",
        token="FLEET",
    )
    try:
        url = c.url
        ea = _now_batch("ea", "b1", 0)
        ea["hello"]["pool"] = "a"
        eb = _now_batch("eb", "b1", 0)
        eb["hello"]["pool"] = "b"
        assert post(url, ea, token="TA")[0] == 200
        assert post(url, eb, token="TB")[0] == 200
        assert post(url, eb, token="TA")[0] == 403  # its hello names pool b
        # Pool a's token cannot move pool b's engine to its own pool...
        steal = _now_batch("eb", "b2", 0)
        steal["hello"]["pool"] = "a"
        status, _, body = post(url, steal, token="TA")
        assert status == 403 and "belongs to pool 'b'" in _error(body), body
        # ... nor write hello-less data for an engine it has not introduced (the plugin
        # answers need_hello by sending the hello first).
        bare = batch("new", "b1", 0, step_ts=[time.time() - 1], sent_unix_s=time.time())
        status, _, body = post(url, bare, token="TA")
        assert status == 403 and json.loads(body)["need_hello"] is True
        assert post(url, ea, token="nope")[0] == 401
        hdr = {"Authorization": "Bearer TA"}
        status, _, body = request(url, "GET", "/v1/engines", headers=hdr)
        assert status == 200
        assert [r["engine_id"] for r in json.loads(body)["rows"]] == ["ea"]
        status, _, body = request(url, "GET", "/v1/windows?since=1d", headers=hdr)
        assert status == 200 and {r["engine_id"] for r in json.loads(body)["rows"]} == {"ea"}
        assert request(url, "GET", "/v1/windows?pool=b", headers=hdr)[0] == 403
        status, _, body = request(url, "GET", "/v1/totals", headers=hdr)
        assert [r["engine_id"] for r in json.loads(body)["rows"]] == ["ea"]
        assert request(url, "GET", "/v1/engines/eb/configs", headers=hdr)[0] == 404
        assert request(url, "GET", "/metrics", headers=hdr)[0] == 403
        fleet = {"Authorization": "Bearer FLEET"}
        assert request(url, "GET", "/metrics", headers=fleet)[0] == 200
        status, _, body = request(url, "GET", "/v1/engines", headers=fleet)
        pools = {r["engine_id"]: r["pool"] for r in json.loads(body)["rows"]}
        assert pools == {"ea": "a", "eb": "b"}
        text = request(url, "GET", "/metrics", headers=fleet)[2].decode()
        assert counter(text, "kvscope_collector_rejected_batches_total", reason="forbidden") == 3
    finally:
        c.stop()


def _post_raw(url: str, text: str) -> tuple[int, bytes]:
    status, _, body = request(
        url,
        "POST",
        "/v1/ingest",
        gzip.compress(text.encode()),
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    return status, body


def test_surrogates_and_overflowing_queries_get_400(collector: CollectorProcess) -> None:
    url = collector.url
    b = _now_batch("s", "b1", 0, requests=batch(req_ts=[time.time() - 1])["requests"])
    b["requests"] = {k: v[:1] for k, v in b["requests"].items()}
    assert post(url, {**b, "seq": 9})[0] == 200  # valid as it is
    text = json.dumps(b)  # ASCII: a lone surrogate travels as the escape \ud800
    for old, new in (
        ('"engine_id": "s"', '"engine_id": "s\\ud800"'),
        ('"pool": "pool-a"', '"pool": "\\udfff"'),
        ('"finish_reason": ["length"]', '"finish_reason": ["\\ud800"]'),
    ):
        assert old in text, old
        status, body = _post_raw(url, text.replace(old, new))
        assert status == 400 and "Unicode" in _error(body), (new, status, body)
    for query in (
        "/v1/windows?since=1e308",
        "/v1/windows?since=" + "9" * 30 + "w",
        "/v1/windows?until=-1e308",
        "/v1/steps?every=" + "9" * 30,
        "/v1/requests_1m?step=" + "9" * 30 + "w",
    ):
        status, _, body = request(url, "GET", query)
        assert status == 400, (query, status, body)


def test_new_boot_ids_of_one_engine_are_limited(collector: CollectorProcess) -> None:
    url = collector.url
    statuses = [post(url, _now_batch("e", f"boot-{i}", 0))[0] for i in range(14)]
    assert statuses[:10] == [200] * 10 and statuses[10:] == [429] * 4, statuses
    status, headers, body = post(url, _now_batch("e", "boot-99", 0))
    assert status == 429 and headers["retry-after"] == "60" and "boot ids" in _error(body)
    # Boots already admitted go on; another engine is not held by this one's limit.
    assert post(url, _now_batch("e", "boot-3", 1))[0] == 200
    assert post(url, _now_batch("other", "boot-0", 0))[0] == 200
    text = collector.get_text("/metrics")
    assert counter(text, "kvscope_collector_rejected_batches_total", reason="boot_limit") == 5


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs: a disk that fills up."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.fail("mount(8) is needed to make a small file system")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_healthz_says_degraded_while_the_store_cannot_write(small_disk: Path) -> None:
    """A full disk: writes fail with 500 (nothing acknowledged that is not stored),
    /healthz says degraded with the reason until a write succeeds again."""
    c = start_collector(small_disk / "store.duckdb")
    acked = 0
    try:
        assert post(c.url, _now_batch("e", "b1", 0))[0] == 200
        acked += 1
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={small_disk / 'filler'}", "bs=1M", "count=64"],
            capture_output=True,
        )
        statuses = []
        for seq in range(1, 40):
            now = time.time()
            steps = [now - 1 + i / 4000 for i in range(4000)]
            statuses.append(post(c.url, batch("e", "b1", seq, step_ts=steps, sent_unix_s=now))[0])
            acked += 4000 if statuses[-1] == 200 else 0
            if statuses[-1] == 500:
                break
        assert statuses[-1] == 500, statuses
        status, body = c.request("/healthz")
        health = json.loads(body)
        assert status == 503 and health["status"] == "degraded", health
        assert "every write fails" in health["reason"], health
        assert counter(c.get_text("/metrics"), "kvscope_collector_store_write_failing") == 1
        (small_disk / "filler").unlink()
        deadline, seq = time.monotonic() + 20, 100
        while time.monotonic() < deadline:
            b = batch("e", "b1", seq, step_ts=[time.time() - 0.5], sent_unix_s=time.time())
            if post(c.url, b)[0] == 200:
                acked += 1
                break
            seq += 1
            time.sleep(0.5)
        status, body = c.request("/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok", body
    finally:
        c.stop()
    # Every acknowledged step is in the store after a restart, nothing else.
    again = start_collector(small_disk / "store.duckdb")
    try:
        rows = again.get_json("/v1/totals", params={"source": "steps"})["rows"]
        assert rows[0]["n_steps"] == acked, (rows, acked)
    finally:
        again.stop()
