"""Memory a hostile client can make a real collector process hold, and for how long.

* Bodies that are cheap to send but dear to parse (63 MiB of ``{},`` gzip to 63 KiB and
  parse into 22 million dicts, 1.6 GB): four at once must be refused (400, 413 or 503)
  while the process grows by no more than its in-flight limit plus :data:`MARGIN_MIB`,
  and ``/metrics`` must answer meanwhile.
* Clients that request ``/metrics`` and never read: each must hold a bounded share of
  memory (not the response), be cut at ``--response-timeout`` and be counted in
  ``kvscope_collector_slow_readers_closed_total``; memory returns once they are cut.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _faults_collector_helpers import (
    RssSampler,
    batch,
    counter,
    post,
    request,
    rss_bytes,
    start_collector,
)

from kvscope.collector._parse_budget import parse_cost
from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins.schema import (
    MAX_ROWS_PER_BATCH,
    REQUEST_FIELDS,
    STEP_FIELDS,
    SchemaError,
    validate_batch,
)

MIB = 1024 * 1024
INFLIGHT_MIB = 64
MARGIN_MIB = 48
"""Allowed beyond the in-flight limit: zlib's buffers and the body's growth by an eighth
(its buffer), the pre-scan's 1 MiB windows, connection buffers, allocator slack. The
process grew by 1.6 GB before parsing was budgeted."""
SCRAPE_S = 2.0
RESPONSE_TIMEOUT_S = 2.0
N_ENGINES = 200
"""Engines registered so that /metrics is several MiB (about 26 KiB an engine)."""
N_READERS = 30
READERS_GROWTH_MIB = 64
"""Allowed growth while the readers wait: one rendering (its text, then its bytes) and
each connection's transport buffer (64 KiB high-water mark plus a 128 KiB chunk)."""


def _gzip_body(raw: bytes) -> bytes:
    return gzip.compress(raw, compresslevel=6)


def _objects_body() -> bytes:
    """63 MiB of ``{},``: 22 million empty objects, no batch at all."""
    n = 63 * MIB // 3
    return b"[" + b"{}," * (n - 1) + b"{}]"


def _values_body() -> bytes:
    """A batch-shaped object of 10 million floats in one column: fewer values than the
    schema's structure allows with strings, more than parsing fits the in-flight limit."""
    n = 10_000_000
    return b'{"steps": {"ts_unix_s": [' + b"0.5," * (n - 1) + b"0.5]}}"


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    c = start_collector(
        tmp_path_factory.mktemp("memory") / "memory.duckdb",
        "--max-inflight-mib",
        str(INFLIGHT_MIB),
    )
    yield c
    c.stop()


@pytest.mark.parametrize(
    ("shape", "make", "statuses"),
    [
        ("objects", _objects_body, {400, 503}),
        ("values", _values_body, {413, 503}),
    ],
)
def test_four_dear_bodies_at_once_stay_within_the_inflight_limit(
    tight: CollectorProcess, shape: str, make: Callable[[], bytes], statuses: set[int]
) -> None:
    raw = make()
    body = _gzip_body(raw)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    pid = tight.proc.pid if tight.proc is not None else 0
    time.sleep(0.5)
    before = rss_bytes(pid)
    sampler = RssSampler(pid)
    sampler.start()
    answers: list[tuple[int, bytes]] = []

    def send() -> None:
        status, _, resp = request(tight.url, "POST", "/v1/ingest", body, headers, timeout_s=60)
        answers.append((status, resp))

    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    scrapes: list[float] = []
    while any(t.is_alive() for t in senders) or not scrapes:
        t0 = time.monotonic()
        status, _, _ = request(tight.url, "GET", "/metrics", timeout_s=60)
        scrapes.append(time.monotonic() - t0)
        assert status == 200
    for t in senders:
        t.join()
    time.sleep(0.2)
    sampler.stop.set()
    sampler.join()
    growth_mib = (sampler.peak - before) / MIB
    print(
        f"{shape}: {len(raw) / MIB:.0f} MiB ({len(body) / 1024:.0f} KiB gzipped) x4: "
        f"{sorted(s for s, _ in answers)}; RSS {before / MIB:.0f} MiB + {growth_mib:.0f} MiB "
        f"at peak; {len(scrapes)} scrapes, slowest {max(scrapes):.2f} s"
    )
    assert {s for s, _ in answers} <= statuses, answers
    for status, resp in answers:
        if status == 400:
            assert "cannot be a batch" in json.loads(resp)["error"], resp
    assert growth_mib <= INFLIGHT_MIB + MARGIN_MIB, growth_mib
    assert max(scrapes) < SCRAPE_S, scrapes
    text = request(tight.url, "GET", "/metrics")[2].decode()
    assert counter(text, "kvscope_collector_inflight_ingest_bytes") == 0


def test_valid_batches_pass_the_pre_scan() -> None:
    """The largest batch the schema allows, its strings full of the bytes the pre-scan
    counts, is not refused as a structure (only, maybe, by the budget)."""
    rows = MAX_ROWS_PER_BATCH
    reqs: dict[str, object] = {f.name: [1.0] * rows for f in REQUEST_FIELDS}
    reqs["finish_reason"] = ['{[,"' * 8] * rows
    steps = {f.name: [1] * rows for f in STEP_FIELDS}
    b = batch("e" * 200, "b" * 200, 0, with_hello=True)
    b.update(steps=steps, requests=reqs)
    body = json.dumps(b).encode()
    validate_batch(json.loads(body))
    assert parse_cost(body) > len(body)
    more_objects = body.replace(b"{", b'{"x": [' + b"{}," * 10_000 + b"{}], ", 1)
    with pytest.raises(SchemaError, match=r"cannot be a batch: .* JSON objects"):
        parse_cost(more_objects)


@pytest.fixture
def big_metrics(tmp_path: Path) -> Iterator[CollectorProcess]:
    c = start_collector(
        tmp_path / "readers.duckdb", "--response-timeout", f"{RESPONSE_TIMEOUT_S:g}s"
    )
    try:
        ts = [1.7e9 + i * 0.1 for i in range(20)]
        req_ts = [1.7e9 + i * 0.3 for i in range(5)]

        def register(i: int) -> int:
            eid = f"host-{i}:8000:0"
            return post(c.url, batch(eid, "boot-1", 0, with_hello=True, step_ts=ts, req_ts=req_ts))[
                0
            ]

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(register, range(N_ENGINES))) == {200}
        yield c
    finally:
        c.stop()


def _slow_readers_closed(c: CollectorProcess) -> float | None:
    text = request(c.url, "GET", "/metrics", timeout_s=10)[2].decode()
    return counter(text, "kvscope_collector_slow_readers_closed_total")


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s``: reading it ends (EOF or reset) within what the
    kernel buffers, where an open connection would go on sending its response."""
    s.settimeout(2.0)
    received = 0
    try:
        while received < MIB:
            data = s.recv(64 * 1024)
            if not data:
                return True
            received += len(data)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_readers_that_never_read_are_cut_at_the_response_timeout(
    big_metrics: CollectorProcess,
) -> None:
    c = big_metrics
    pid = c.proc.pid if c.proc is not None else 0
    size = len(request(c.url, "GET", "/metrics")[2])
    assert size > 4 * MIB, size  # the test needs a large response
    time.sleep(0.5)
    before = rss_bytes(pid)
    socks = []
    for _ in range(N_READERS):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel keeps little
        s.connect(("127.0.0.1", c.port))
        socks.append(s)
    try:
        sampler = RssSampler(pid)
        sampler.start()
        for s in socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: kvscope\r\n\r\n")
        t_sent = time.monotonic()
        time.sleep(RESPONSE_TIMEOUT_S - 0.5)
        early = _slow_readers_closed(c)
        while _slow_readers_closed(c) != N_READERS and time.monotonic() - t_sent < 15:
            time.sleep(0.1)
        cut_after = time.monotonic() - t_sent
        sampler.stop.set()
        sampler.join()
        closed = [_closed_by_server(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    after = rss_bytes(pid)
    growth_mib = (sampler.peak - before) / MIB
    print(
        f"/metrics {size / MIB:.1f} MiB, {N_READERS} readers that never read: RSS "
        f"{before / MIB:.0f} MiB + {growth_mib:.0f} MiB at peak, {after / MIB:.0f} MiB after; "
        f"all cut {cut_after:.1f} s after their requests"
    )
    assert early == 0, early  # none before the deadline
    assert cut_after <= RESPONSE_TIMEOUT_S + 3.0, cut_after
    assert all(closed), closed
    assert _slow_readers_closed(c) == N_READERS
    assert growth_mib <= READERS_GROWTH_MIB, growth_mib
    assert (after - before) / MIB <= 16, (before, after)
