"""Hostile input to every endpoint of a real collector process.

Each bad request gets a clear 4xx (JSON ``error`` naming what is wrong), nothing
crashes, nothing is written (the store stays empty), and every rejection is counted
by reason on /metrics (reasons exported at 0 before the first rejection). Slow clients
(slowloris headers, a dribbled body) are cut off and cannot hold the server.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

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

from kvscope.collector.metrics import READ_REJECT_REASONS, REJECT_REASONS
from kvscope.collector.process import CollectorProcess

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    c = start_collector(
        tmp_path_factory.mktemp("hostile") / "hostile.duckdb",
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
    )
    yield c
    c.stop()


def _valid() -> dict[str, Any]:
    return batch(
        "evil-host:8000:0",
        "boot-1",
        0,
        with_hello=True,
        step_ts=[1.7e9, 1.7e9 + 0.5],
        req_ts=[1.7e9 + 0.4],
    )


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    b = copy.deepcopy(_valid())
    obj = b
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    return b


def _raw(data: bytes, encoding: str | None = "gzip") -> tuple[bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    return (gzip.compress(data) if encoding == "gzip" else data), headers


def _bomb(inflated_bytes: int) -> bytes:
    """A small gzip stream that inflates to ``inflated_bytes`` of zeros."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    parts = [comp.compress(zeros) for _ in range(inflated_bytes >> 20)]
    return b"".join(parts) + comp.flush()


SCHEMA_CASES: list[tuple[str, Any, str]] = [
    # (what, batch object, words the error must contain)
    ("wrong schema version", _with(("schema_version",), 99), "schema_version"),
    ("unknown top-level field", _with(("extra",), 1), "unknown field"),
    ("unknown step column", _with(("steps", "gpu_temp"), [1, 2]), "unknown column"),
    ("unknown hello field", _with(("hello", "shell"), "rm -rf"), "unknown field"),
    ("seq as a string", _with(("seq",), "7"), "seq"),
    ("negative seq", _with(("seq",), -1), "seq"),
    ("negative waiting", _with(("steps", "waiting"), [0, -3]), "steps.waiting[1]"),
    ("NaN usage", _with(("steps", "kv_usage_ratio"), [0.1, float("nan")]), "finite"),
    ("infinite e2e", _with(("requests", "e2e_s"), [float("inf")]), "finite"),
    ("usage above 1", _with(("steps", "kv_usage_ratio"), [0.1, 7.0]), "kv_usage_ratio"),
    ("integer overflow", _with(("steps", "prompt_tokens"), [0, 2**70]), "prompt_tokens"),
    ("bool as a number", _with(("steps", "batch_size"), [True, 1]), "batch_size"),
    ("ragged columns", _with(("steps", "waiting"), [0]), "values where"),
    ("engine id too long", _with(("engine_id",), "e" * 201), "engine_id"),
    ("pool too long", _with(("hello", "pool"), "p" * 201), "hello.pool"),
    ("hello of another engine", _with(("hello", "engine_id"), "other:1:0"), "hello"),
    ("array instead of object", [1, 2, 3], "expected a JSON object"),
]


def test_hostile_ingest_is_rejected_counted_and_writes_nothing(hostile: CollectorProcess) -> None:
    c = hostile
    before = c.get_text("/metrics")
    for reason in REJECT_REASONS:  # exported before the first rejection
        assert counter(before, "kvscope_collector_rejected_batches_total", reason=reason) == 0
    for reason in READ_REJECT_REASONS:
        assert counter(before, "kvscope_collector_rejected_reads_total", reason=reason) == 0
    expected: dict[str, int] = {}

    def check(status: int, body: bytes, want_status: int, reason: str, words: str) -> None:
        assert status == want_status, (reason, words, status, body[:200])
        assert words.lower() in json.loads(body)["error"].lower(), (words, body[:300])
        expected[reason] = expected.get(reason, 0) + 1

    for what, obj, words in SCHEMA_CASES:
        status, _, body = post(c.url, obj)
        check(status, body, 400, "schema", words)
        assert what
    raw_cases = [
        (b"{not json", "gzip", 400, "bad_json", "invalid JSON"),
        (b"", None, 400, "bad_json", "invalid JSON"),
        (b'{"x": "\xc3\x28"}', None, 400, "bad_json", "UTF-8"),
        (b"[" * 200_000 + b"]" * 200_000, "gzip", 400, "bad_json", "JSON"),
    ]
    for data, enc, want, reason, words in raw_cases:
        body_bytes, headers = _raw(data, enc)
        status, _, body = request(c.url, "POST", "/v1/ingest", body_bytes, headers)
        check(status, body, want, reason, words)
    # Encodings: not gzip at all, truncated gzip, unknown encoding.
    status, _, body = request(c.url, "POST", "/v1/ingest", b"plain", {"Content-Encoding": "gzip"})
    check(status, body, 400, "bad_encoding", "gzip")
    good = gzip.compress(json.dumps(_valid()).encode())
    status, _, body = request(c.url, "POST", "/v1/ingest", good[:-9], {"Content-Encoding": "gzip"})
    check(status, body, 400, "bad_encoding", "truncated")
    status, _, body = request(c.url, "POST", "/v1/ingest", good, {"Content-Encoding": "br"})
    check(status, body, 415, "unsupported_encoding", "not supported")
    # Oversized: announced by Content-Length, and sent chunked without a length.
    big = b"x" * (9 * 1024 * 1024)
    status, _, body = request(c.url, "POST", "/v1/ingest", big, {})
    check(status, body, 413, "too_large", "exceeds")
    status, _, body = _chunked_post(c.url, big)
    check(status, body, 413, "too_large", "exceeds")
    # A decompression bomb: 1 GiB of zeros in about 1 MiB; inflation stops at the limit.
    bomb = _bomb(1 << 30)
    assert c.proc is not None
    rss0 = rss_bytes(c.proc.pid)
    sampler = RssSampler(c.proc.pid)
    sampler.start()
    t = time.perf_counter()
    status, _, body = request(c.url, "POST", "/v1/ingest", bomb, {"Content-Encoding": "gzip"})
    bomb_s = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    bomb_rss = sampler.peak - rss0
    check(status, body, 413, "too_large", "decompressed body exceeds")
    print(
        f"\n[hostile] gzip bomb {len(bomb) / 2**20:.1f} MiB -> 1 GiB: 413 in {bomb_s:.2f} s, "
        f"collector peak RSS +{bomb_rss / 2**20:.0f} MiB"
    )
    assert bomb_rss < 80 * 2**20  # the 64 MiB inflation limit, not the bomb's 1 GiB

    after = c.get_text("/metrics")
    for reason, n in expected.items():
        assert counter(after, "kvscope_collector_rejected_batches_total", reason=reason) == n, (
            reason
        )
    assert counter(after, "kvscope_collector_ingest_batches_total", result="stored") == 0
    assert c.get_json("/v1/engines")["n_rows"] == 0, "a rejected batch left data behind"
    assert c.get_json("/v1/totals")["n_rows"] == 0
    # The collector is unharmed: a valid batch is stored.
    status, _, body = post(c.url, _valid())
    assert status == 200 and json.loads(body)["status"] == "stored"


def _chunked_post(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    import http.client

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        chunks = (data[i : i + 65536] for i in range(0, len(data), 65536))
        # The server may answer and close before the rest was sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request("POST", "/v1/ingest", body=chunks, encode_chunked=True)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


BAD_READS = [
    ("/v1/windows", {"since": "yesterday"}, "since"),
    ("/v1/windows", {"until": "NaN"}, "until"),
    ("/v1/windows", {"since": "-5"}, "since"),
    ("/v1/steps", {"limit": "-1"}, "limit"),
    ("/v1/steps", {"limit": "1e99"}, "limit"),
    ("/v1/requests", {"format": "xml"}, "format"),
    ("/v1/requests", {"fields": "no_such_column"}, "fields"),
    ("/v1/kv_events", {"engine_id": "a", "engine": "b"}, "engine"),
    ("/v1/windows", {"drop": "table"}, "drop"),
    ("/v1/request_stats", {"group_by": "model"}, "group_by"),
    ("/v1/totals", {"source": "disk"}, "source"),
    ("/v1/engines", {"since": "1h"}, "since"),
]


def test_bad_read_parameters_get_400_and_are_counted(hostile: CollectorProcess) -> None:
    c = hostile
    base = (
        counter(
            c.get_text("/metrics"), "kvscope_collector_rejected_reads_total", reason="bad_params"
        )
        or 0
    )
    for path, params, words in BAD_READS:
        status, body = c.request(path, params=params)
        assert status == 400, (path, params, status, body[:200])
        assert words in json.loads(body)["error"], (path, params, body[:300])
    status, body = c.request("/v1/engines/" + "x" * 5000 + "/configs")
    assert status == 404 and "not known" in json.loads(body)["error"]
    for method, path in (
        ("POST", "/metrics"),
        ("DELETE", "/v1/engines"),
        ("PUT", "/healthz"),
        ("GET", "/v1/ingest"),
    ):
        assert request(c.url, method, path)[0] == 405, (method, path)
    metrics = c.get_text("/metrics")
    assert counter(
        metrics, "kvscope_collector_rejected_reads_total", reason="bad_params"
    ) == base + len(BAD_READS)
    assert c.get_json("/healthz")["status"] == "ok"


def test_slow_clients_are_cut_off_and_do_not_hold_the_server(hostile: CollectorProcess) -> None:
    c = hostile
    host, port = "127.0.0.1", c.port
    base = counter(c.get_text("/metrics"), "kvscope_collector_slow_connections_closed_total")
    # 40 slowloris connections (a header byte now and then) and 10 that send nothing.
    slow = [socket.create_connection((host, port)) for _ in range(50)]
    for s in slow[:40]:
        s.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nX-a")
    t0 = time.monotonic()
    served: list[float] = []
    open_socks = set(range(len(slow)))
    closed_at: dict[int, float] = {}
    while open_socks and time.monotonic() - t0 < 10:
        for i in list(open_socks):
            s = slow[i]
            try:
                if i < 40:
                    s.sendall(b"a")
                s.settimeout(0.01)
                if s.recv(1024) == b"":
                    raise ConnectionResetError
            except TimeoutError:
                continue
            except OSError:
                open_socks.discard(i)
                closed_at[i] = time.monotonic() - t0
        t = time.perf_counter()
        assert c.request("/healthz", timeout_s=5)[0] == 200
        served.append(time.perf_counter() - t)
        time.sleep(0.1)
    for s in slow:
        s.close()
    # A kept-alive connection idle between requests longer than the header timeout is
    # not cut (only a started, unfinished request head is): the plugin reuses its connection.
    import http.client

    keep = http.client.HTTPConnection(host, port, timeout=5)
    keep.request("GET", "/healthz")
    assert keep.getresponse().read() and keep.sock is not None
    first_sock = keep.sock
    time.sleep(HEADER_TIMEOUT_S * 1.5)
    keep.request("GET", "/healthz")
    resp = keep.getresponse()
    assert resp.status == 200 and resp.read() and keep.sock is first_sock
    keep.close()
    # A body dribbled slower than the body timeout gets 408.
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    t_body = time.monotonic()
    answer = b""
    sock.settimeout(0.3)
    while time.monotonic() - t_body < 10 and b"\r\n\r\n" not in answer:
        try:
            sock.sendall(b" ")
            answer += sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
    body_cut_s = time.monotonic() - t_body
    sock.close()
    metrics = c.get_text("/metrics")
    closed = counter(metrics, "kvscope_collector_slow_connections_closed_total")
    print(
        f"\n[hostile] 50 slow connections closed after {min(closed_at.values()):.1f}-"
        f"{max(closed_at.values()):.1f} s (header timeout {HEADER_TIMEOUT_S:g} s); /healthz "
        f"meanwhile: max {max(served) * 1e3:.0f} ms over {len(served)} requests; dribbled "
        f"body answered after {body_cut_s:.1f} s (body timeout {BODY_TIMEOUT_S:g} s)"
    )
    assert not open_socks, f"{len(open_socks)} slow connections still open after 10 s"
    assert max(closed_at.values()) < HEADER_TIMEOUT_S + 2.0
    assert closed is not None and closed - (base or 0) >= 50
    assert max(served) < 1.0, "slow clients held up a normal request"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert BODY_TIMEOUT_S - 0.1 < body_cut_s < BODY_TIMEOUT_S + 2.0
    assert counter(metrics, "kvscope_collector_rejected_batches_total", reason="timeout") == 1
