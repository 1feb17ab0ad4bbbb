"""POST /v1/ingest over real HTTP: acknowledgement, idempotency and every rejection."""

from __future__ import annotations

import copy
import gzip
import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _collector_helpers import batch, encode, http, post_batch

DATA_TABLES = (
    "engines",
    "engine_configs",
    "steps",
    "windows_1s",
    "requests",
    "ingested_batches",
    "exporter_stats",
)


def _counts(lc: Any) -> dict[str, int]:
    c = lc.store.table_counts()
    return {t: c[t] for t in DATA_TABLES}


def test_stored_after_200(collector: Any) -> None:
    b = batch(with_hello=True, step_ts=[100.1, 100.4, 101.2], req_ts=[100.5, 101.0])
    status, answer = post_batch(collector.url, b)
    assert status == 200
    assert answer == {"status": "stored", "need_hello": False}
    # The answer came after the commit: a fresh read sees everything.
    assert _counts(collector) == {
        "engines": 1,
        "engine_configs": 1,
        "steps": 3,
        "windows_1s": 2,
        "requests": 2,
        "ingested_batches": 1,
        "exporter_stats": 1,
    }
    steps = collector.store.steps()
    assert steps["ts_unix_s"].tolist() == [100.1, 100.4, 101.2]
    assert steps["batch_size"].tolist() == b["steps"]["batch_size"]
    assert steps["iteration_s"].isna().tolist() == [True, False, True]
    reqs = collector.store.requests()
    assert reqs["finish_reason"].tolist() == b["requests"]["finish_reason"]


def test_resent_batch_is_stored_once(collector: Any) -> None:
    b = batch(with_hello=True, step_ts=[100.1, 100.2], req_ts=[100.5])
    assert post_batch(collector.url, b)[1]["status"] == "stored"
    before = _counts(collector)
    for _ in range(3):
        status, answer = post_batch(collector.url, b)
        assert (status, answer["status"]) == (200, "duplicate")
    assert _counts(collector) == before
    # Same seq of another boot is a different batch.
    assert (
        post_batch(collector.url, batch(boot_id="boot-2", step_ts=[102.0]))[1]["status"] == "stored"
    )


def test_concurrent_duplicates_and_batches(collector: Any) -> None:
    """Many senders at once (group commit): every batch once, duplicates detected."""
    bodies = [
        batch(
            engine_id=f"e{e}",
            seq=s,
            with_hello=s == 0,
            step_ts=[1000.0 + s + i / 10 for i in range(10)],
        )
        for e in range(8)
        for s in range(6)
    ]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda b: post_batch(collector.url, b), bodies + bodies))
    assert all(status == 200 for status, _ in answers)
    statuses = [a["status"] for _, a in answers]
    assert statuses.count("stored") == len(bodies)
    assert statuses.count("duplicate") == len(bodies)
    assert _counts(collector)["steps"] == 10 * len(bodies)
    assert _counts(collector)["ingested_batches"] == len(bodies)


def test_need_hello_until_hello_arrives(collector: Any) -> None:
    status, answer = post_batch(collector.url, batch(seq=0, step_ts=[100.0]))
    assert (status, answer) == (200, {"status": "stored", "need_hello": True})
    assert collector.store.steps()["engine_id"].tolist() == ["host-a:8000:0"]
    engines = collector.store.engines()
    assert engines["has_hello"].tolist() == [False]
    _, answer = post_batch(collector.url, batch(seq=1, with_hello=True))
    assert answer == {"status": "stored", "need_hello": False}
    _, answer = post_batch(collector.url, batch(seq=2, step_ts=[101.0]))
    assert answer["need_hello"] is False
    # A new boot needs its own hello.
    _, answer = post_batch(collector.url, batch(boot_id="boot-2", seq=0, step_ts=[102.0]))
    assert answer["need_hello"] is True


def test_identity_encoding_accepted(collector: Any) -> None:
    status, answer = post_batch(collector.url, batch(step_ts=[1.0]), compress=False)
    assert (status, answer["status"]) == (200, "stored")


def _mutate(path: str, value: Any) -> dict[str, Any]:
    b = batch(with_hello=True, step_ts=[100.1, 100.2], req_ts=[100.5])
    target: Any = b
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if isinstance(target, list) else target[k]
    last = keys[-1]
    if isinstance(target, list):
        target[int(last)] = value
    elif value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return b


_DELETE = object()

SCHEMA_CASES = [
    # (id, mutated path, value, text the message must contain)
    ("bad_version", "schema_version", 2, "schema_version"),
    ("missing_version", "schema_version", _DELETE, "schema_version"),
    ("wrong_type_str", "steps.batch_size.0", "3", "steps.batch_size[0]"),
    ("wrong_type_bool", "steps.waiting.1", True, "steps.waiting[1]"),
    ("float_for_int", "steps.preemptions.0", 1.5, "steps.preemptions[0]"),
    ("nan", "steps.kv_usage_ratio.0", float("nan"), "steps.kv_usage_ratio[0]"),
    ("infinity", "requests.e2e_s.0", float("inf"), "requests.e2e_s[0]"),
    ("negative", "steps.prompt_tokens.1", -1, "steps.prompt_tokens[1]"),
    ("kv_over_one", "steps.kv_usage_ratio.1", 1.5, "steps.kv_usage_ratio[1]"),
    ("unknown_envelope", "extra", 1, "extra"),
    ("unknown_column", "steps.gpu_util", [1, 2], "gpu_util"),
    ("unknown_hello_field", "hello.color", "red", "color"),
    ("missing_column", "steps.waiting", _DELETE, "waiting"),
    ("mismatched_lengths", "steps.waiting", [1, 2, 3], "steps.waiting"),
    ("null_not_nullable", "steps.step.0", None, "steps.step[0]"),
    ("hello_other_engine", "hello.engine_id", "someone-else", "hello"),
    ("negative_seq", "seq", -1, "seq"),
    ("empty_engine_id", "engine_id", "", "engine_id"),
    ("int_overflow", "steps.prompt_tokens.0", 2**70, "steps.prompt_tokens"),
    ("float_overflow", "requests.queue_s.0", 10**400, "requests.queue_s"),
    ("string_too_long", "requests.finish_reason.0", "x" * 100, "requests.finish_reason[0]"),
    ("steps_not_object", "steps", [1, 2], "steps"),
]


@pytest.mark.parametrize(
    ("path", "value", "needle"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_errors_rejected_with_400(
    collector: Any, path: str, value: Any, needle: str
) -> None:
    post_batch(collector.url, batch(engine_id="other", step_ts=[50.0]))
    before = _counts(collector)
    body = json.dumps(_mutate(path, value)).encode()  # NaN/Infinity as JS literals
    status, answer = post_batch(
        collector.url, None, raw=gzip.compress(body), headers={"Content-Encoding": "gzip"}
    )
    assert status == 400, answer
    assert needle in answer["error"]
    assert _counts(collector) == before


BODY_CASES = [
    ("not_json", gzip.compress(b"{not json"), "invalid JSON"),
    ("json_array", gzip.compress(b"[1, 2]"), "expected a JSON object"),
    ("not_utf8", gzip.compress(b"\xff\xfe{}"), "body"),
    ("not_gzip", b"plain text, not gzip", "gzip"),
    ("truncated_gzip", gzip.compress(encode(batch(), compress=False))[:-12], "truncated"),
    ("trailing_data", gzip.compress(b"{}") + b"junk", "after the end"),
    ("empty", b"", "empty"),
]


@pytest.mark.parametrize(
    ("raw", "needle"), [c[1:] for c in BODY_CASES], ids=[c[0] for c in BODY_CASES]
)
def test_malformed_bodies_rejected_with_400(collector: Any, raw: bytes, needle: str) -> None:
    before = _counts(collector)
    status, answer = post_batch(collector.url, None, raw=raw, headers={"Content-Encoding": "gzip"})
    assert status == 400, answer
    assert needle in answer["error"]
    assert _counts(collector) == before


def test_unsupported_encoding_415(collector: Any) -> None:
    raw = zlib.compress(encode(batch(step_ts=[1.0]), compress=False))
    status, answer = post_batch(collector.url, None, raw=raw, headers={"Content-Encoding": "br"})
    assert status == 415
    assert "br" in answer["error"]
    assert _counts(collector)["ingested_batches"] == 0


def test_oversized_body_413(make_collector: Any) -> None:
    lc = make_collector(max_body_bytes=10_000)
    raw = bytes(range(256)) * 100  # 25.6 kB of incompressible-ish data
    status, answer = post_batch(lc.url, None, raw=raw, headers={"Content-Encoding": "gzip"})
    assert status == 413
    assert "10000" in answer["error"]
    # Identity bodies too, and a valid batch that is merely large.
    big = batch(step_ts=[100.0 + i / 1000 for i in range(2000)])
    status, answer = post_batch(lc.url, big, compress=False)
    assert status == 413
    assert _counts(lc)["ingested_batches"] == 0


def test_chunked_oversized_body_413(make_collector: Any) -> None:
    """No Content-Length: the limit is enforced while reading."""
    lc = make_collector(max_body_bytes=10_000)
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(lc.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        chunks = iter([b"x" * 4096] * 10)
        conn.request(
            "POST",
            "/v1/ingest",
            body=chunks,
            encode_chunked=True,
            headers={"Transfer-Encoding": "chunked"},
        )
        resp = conn.getresponse()
        assert resp.status == 413
    finally:
        conn.close()


def test_decompression_bomb_413(make_collector: Any) -> None:
    lc = make_collector(max_decompressed_bytes=1_000_000)
    bomb = gzip.compress(b"0" * 50_000_000)  # ~50 kB compressed, 50 MB inflated
    assert len(bomb) < lc.settings.max_body_bytes
    status, answer = post_batch(lc.url, None, raw=bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    assert "decompressed" in answer["error"]
    assert _counts(lc)["ingested_batches"] == 0


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", "Basic c2VjcmV0", "Bearer "])
def test_token_required(make_collector: Any, auth: str | None) -> None:
    lc = make_collector(token="s3cret-token")
    headers = {"Content-Encoding": "gzip"}
    if auth is not None:
        headers["Authorization"] = auth
    status, answer = post_batch(lc.url, None, raw=encode(batch(step_ts=[1.0])), headers=headers)
    assert status == 401
    assert "token" in answer["error"]
    assert "s3cret" not in json.dumps(answer)
    assert _counts(lc)["ingested_batches"] == 0
    status, answer = post_batch(lc.url, batch(step_ts=[1.0]), token="s3cret-token")
    assert (status, answer["status"]) == (200, "stored")


@pytest.mark.parametrize(
    "path", ["/metrics", "/v1/engines", "/v1/windows?since=0", "/v1/request_stats"]
)
def test_token_protects_reads_and_metrics_but_not_healthz(make_collector: Any, path: str) -> None:
    lc = make_collector(token="s3cret-token")
    status, _, _ = http("GET", lc.url + path)
    assert status == 401
    status, _, _ = http("GET", lc.url + path, headers={"Authorization": "Bearer nope"})
    assert status == 401
    status, _, _ = http("GET", lc.url + path, headers={"Authorization": "Bearer s3cret-token"})
    assert status == 200
    status, _, _ = http("GET", lc.url + "/healthz")
    assert status == 200


def test_large_batch_parsed_off_loop(make_collector: Any) -> None:
    lc = make_collector(inline_parse_bytes=1000)
    b = batch(step_ts=[100.0 + i / 100 for i in range(500)])
    status, answer = post_batch(lc.url, b)
    assert (status, answer["status"]) == (200, "stored")
    bad = copy.deepcopy(b)
    bad["steps"]["batch_size"][499] = -3
    status, answer = post_batch(lc.url, bad)
    assert status == 400
    assert "steps.batch_size[499]" in answer["error"]


def test_wrong_method_and_path(collector: Any) -> None:
    assert http("GET", collector.url + "/v1/ingest")[0] == 405
    assert http("POST", collector.url + "/v1/nothing", b"{}")[0] == 404
