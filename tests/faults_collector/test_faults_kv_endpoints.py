"""KV-event endpoints a real collector process refuses (issue 44, finding 4).

Hellos may advertise any endpoint. A collector process (``--kv-events auto``, two
sockets at most) gets hellos advertising a foreign host, an ``ipc://`` path and one
loopback publisher more than it may subscribe to: each is refused, logged once and
counted, while vLLM's real publishers of the engines it subscribed to keep delivering.
Restarted on the same store (whose engines keep their advertised endpoints), it starts
cleanly, connects to nothing before the engines send again, and serves them as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _faults_collector_helpers import batch, counter, post, start_collector
from test_kv_events import P1, P2, Engine, connect, scrape, send, stored, totals, wait_for

from kvscope.collector.process import CollectorProcess

KV = ["--kv-events", "auto", "--kv-events-max-sockets", "2"]
"""After the helpers' flags (which turn KV events off): argparse keeps the last."""
FOREIGN = "tcp://192.0.2.1:5557"  # TEST-NET-1 (RFC 5737): never a real host
IPC = "ipc:///tmp/kvscope-faults-kv-events"
REFUSED = "kvscope_kv_events_refused_endpoints_total"
FAILED = "the KV-event subscriber failed"


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def _post(c: CollectorProcess, e: Engine, seq: int, advertise: str | None = None) -> None:
    """One batch of ``e`` dated now; with its hello (advertising ``advertise`` if given)
    when ``seq`` is 0."""
    now = time.time()
    h = None
    if seq == 0:
        h = e.hello(started_unix_s=now)
        if advertise is not None:
            h["kv_events_endpoint"] = advertise
    status, _, body = post(c.url, batch(e.engine_id, "boot-1", seq, sent_unix_s=now, hello=h))
    assert status == 200, body


def _subscribed(c: CollectorProcess) -> dict[str, float]:
    """Engine -> the ``kvscope_kv_events_subscribed`` gauge."""
    out = {}
    for (name, labels), v in scrape(c.url)[1].items():
        if name == "kvscope_kv_events_subscribed":
            out[dict(labels)["engine"]] = v
    return out


def _refused(c: CollectorProcess) -> dict[str, float | None]:
    text = c.get_text("/metrics")
    return {
        r: counter(text, REFUSED, reason=r)
        for r in ("not_allowed", "ipc", "socket_limit", "connect_error")
    }


def _lines(text: str, engine: Engine) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if f"not subscribing to the KV events of {engine.engine_id} " in line
    ]


def test_refused_endpoints_and_a_clean_restart(tmp_path: Path, engines: list[Engine]) -> None:
    a, b, extra = Engine("a:8000:0", "p"), Engine("b:8000:0", "p"), Engine("x:8000:0", "p")
    foreign = Engine("foreign:8000:0", "p", advertise=False)
    ipc = Engine("ipc:8000:0", "p", advertise=False)
    engines += [a, b, extra, foreign, ipc]
    store = tmp_path / "kv.duckdb"

    c = start_collector(store, *KV)
    try:
        for e in (a, b):
            _post(c, e, 0)
        _post(c, foreign, 0, FOREIGN)
        _post(c, ipc, 0, IPC)
        _post(c, extra, 0)  # a third loopback publisher: beyond the two sockets
        _post(c, foreign, 1)  # the engine again: not logged or counted again
        refusals = {"not_allowed": 1, "ipc": 1, "socket_limit": 1, "connect_error": 0}
        wait_for(lambda: _refused(c) == refusals, "the refusals")
        want = {a.engine_id: 1, b.engine_id: 1, extra.engine_id: 0}
        want |= {foreign.engine_id: 0, ipc.engine_id: 0}
        wait_for(lambda: _subscribed(c) == want, "the subscription gauges")
        # The subscriber serves the engines it has.
        connect(c.url, a)
        send(c.url, a, [stored([1, 2], None, P1 + P2)])
        assert totals(c.url, a.engine_id)["stored_blocks"] == 2
        log = c.log_path.read_text()
        assert len(_lines(log, foreign)) == 1 and len(_lines(log, ipc)) == 1
        (line,) = _lines(log, extra)
        assert "(socket_limit)" in line and "--kv-events-max-sockets" in line
        assert "--kv-events-allow 192.0.2.1" in _lines(log, foreign)[0]
        assert "--kv-events-allow-ipc" in _lines(log, ipc)[0]
        assert FAILED not in log and "Traceback" not in log
    finally:
        c.stop()

    offset = len(c.log_path.read_bytes())
    c = start_collector(store, *KV)
    try:
        # Known engines, stored endpoints: nothing connected before they send again.
        wait_for(lambda: len(_subscribed(c)) == 5, "the gauges of the stored engines")
        assert set(_subscribed(c).values()) == {0}
        assert _refused(c) == {"not_allowed": 0, "ipc": 0, "socket_limit": 0, "connect_error": 0}
        for e in (a, b, extra, foreign, ipc):
            _post(c, e, 1)
        wait_for(lambda: _refused(c) == refusals, "the refusals again")
        wait_for(lambda: _subscribed(c) == want, "the subscription gauges after the restart")
        connect(c.url, a)
        send(c.url, a, [stored([11], None, P1)])  # a new process's view: not held yet
        assert totals(c.url, a.engine_id)["stored_blocks"] == 3
        log = c.log_path.read_bytes()[offset:].decode()
        assert FAILED not in log and "Traceback" not in log
        assert c.get_json("/healthz")["status"] == "ok"
    finally:
        c.stop()
