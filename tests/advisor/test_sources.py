"""The sources' kv_events: filtering in memory, and the collector's endpoint over HTTP; what
the collector source says when the URL is not a collector's."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pandas as pd
import pytest

from kvscope.advisor import CollectorSource, FrameSource, SourceError


def test_frame_source_kv_events_filters_pool_and_time() -> None:
    engines = pd.DataFrame({"engine_id": ["a", "b"], "pool": ["p", "q"]})
    ev = pd.DataFrame(
        {"engine_id": ["a", "a", "b"], "ts_s": [10, 20, 10], "stored_blocks": [1, 2, 3]}
    )
    src = FrameSource(engines, pd.DataFrame(), kv_events=ev)
    assert src.kv_events(pool="p")["stored_blocks"].tolist() == [1, 2]
    assert src.kv_events(since=15)["stored_blocks"].tolist() == [2]
    assert src.kv_events(until=15, pool="q")["stored_blocks"].tolist() == [3]
    assert FrameSource(engines, pd.DataFrame()).kv_events().empty  # not configured


class _Handler(BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, dict[str, Any]]]] = []
    seen: ClassVar[list[tuple[str, dict[str, list[str]]]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        self.seen.append((url.path, urllib.parse.parse_qs(url.query)))
        status, body = self.answers.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def stub() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"answers": [], "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_collector_kv_events_reads_rows_with_only_the_endpoints_parameters(
    stub: tuple[str, type[_Handler]],
) -> None:
    url, h = stub
    rows = [{"engine_id": "a", "ts_s": 10, "stored_blocks": 4, "dup_blocks": 1}]
    h.answers.append((200, {"rows": rows}))
    df = CollectorSource(url).kv_events(until=100, pool="p")
    assert df.to_dict("records") == rows
    ((path, params),) = h.seen
    assert path == "/v1/kv_events"
    assert params == {"since": ["0"], "until": ["100"], "pool": ["p"]}


def test_collector_kv_events_pages_truncated_answers(stub: tuple[str, type[_Handler]]) -> None:
    url, h = stub
    h.answers.extend(
        [
            (
                200,
                {
                    "rows": [{"engine_id": "a", "ts_s": 10}, {"engine_id": "a", "ts_s": 11}],
                    "truncated": True,
                },
            ),
            (200, {"rows": [{"engine_id": "a", "ts_s": 11}, {"engine_id": "b", "ts_s": 11}]}),
        ]
    )
    df = CollectorSource(url).kv_events()
    assert list(zip(df["engine_id"], df["ts_s"], strict=True)) == [("a", 10), ("a", 11), ("b", 11)]
    assert h.seen[1][1]["since"] == ["11.0"]


def test_an_older_collector_without_kv_events_gives_an_empty_frame(
    stub: tuple[str, type[_Handler]],
) -> None:
    url, h = stub
    h.answers.append((404, {"error": "not found"}))
    assert CollectorSource(url).kv_events().empty
    h.answers.append((500, {"error": "store"}))
    with pytest.raises(SourceError) as err:
        CollectorSource(url).kv_events()
    assert err.value.status == 500


class _Page(BaseHTTPRequestHandler):
    body = b"<!doctype html><html><head><title>Streamlit</title></head></html>"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_page_or_foreign_json_is_not_a_collector(stub: tuple[str, type[_Handler]]) -> None:
    url, h = stub
    h.answers.append((200, {"status": "success", "data": []}))
    with pytest.raises(SourceError) as err:
        CollectorSource(url).engines()
    assert err.value.kind == "not_collector"
    assert err.value.reason == "JSON, but not the collector's rows"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(SourceError) as err:
            CollectorSource(page).engines()
        assert err.value.kind == "not_collector"
        assert "looks like the kvscope dashboard" in err.value.reason
        # https:// to the same plain-HTTP server: a TLS mix-up, not a certificate problem
        with pytest.raises(SourceError) as err:
            CollectorSource(page.replace("http:", "https:"), timeout_s=5).engines()
        assert err.value.kind == "tls_mismatch" and err.value.status is None
    finally:
        server.shutdown()
        server.server_close()
