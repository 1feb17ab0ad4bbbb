"""The suite's own rules for heavy resources (``tests/_resources.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvscope.lab.engine import VllmServer
from tests import _resources
from tests._resources import (
    ENGINE_ARG,
    EngineOverlap,
    check_engine_may_start,
    live_engines,
    order_items,
    side_by_side,
)


@pytest.fixture
def pretend_engine() -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping process whose command line reads like a vLLM API server's."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", ENGINE_ARG])
    deadline = time.monotonic() + 10
    while proc.pid not in {pid for pid, _ in live_engines()}:
        assert time.monotonic() < deadline, "the process never showed in /proc"
        time.sleep(0.05)
    yield proc
    proc.kill()
    proc.wait()


def test_an_engine_may_not_start_beside_another(
    pretend_engine: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(EngineOverlap, match=f"pid {pretend_engine.pid}"):
        check_engine_may_start()
    # VllmServer.start is checked before anything is spawned (the serial session's guard,
    # installed here too for a run under xdist, whose workers have none).
    _resources.guard_engine_starts(monkeypatch)
    server = VllmServer("/nonexistent", python="/bin/false", startup_timeout_s=5)
    with pytest.raises(EngineOverlap):
        server.start()
    assert server.pid is None


def test_a_declared_pool_may_run_side_by_side(
    pretend_engine: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the engines are counted here: another xdist worker may have a Prometheus up.
    monkeypatch.setattr(_resources, "live_heavy_servers", lambda: [])
    with side_by_side(2):
        check_engine_may_start()
    with pytest.raises(EngineOverlap):
        check_engine_may_start()


def _item(nodeid: str, fixtures: tuple[str, ...] = (), engine: bool = False) -> Any:
    module = SimpleNamespace(__name__=nodeid.split("::")[0])
    return SimpleNamespace(
        nodeid=nodeid,
        module=module,
        fixturenames=list(fixtures),
        get_closest_marker=lambda name: object() if engine else None,
    )


def test_engine_tests_run_last_with_shared_engine_modules_together() -> None:
    items = [
        _item("a::x", engine=True),
        _item("b::shared1", ("overload_run",), engine=True),
        _item("b::other", engine=True),  # same module: stays with its module
        _item("c::fast"),
        _item("d::alone", engine=True),
        _item("e::shared2", ("overload_run",), engine=True),
        _item("f::fast"),
    ]
    order_items(items)
    assert [i.nodeid for i in items] == [
        "c::fast",
        "f::fast",
        "a::x",
        "b::shared1",
        "b::other",
        "e::shared2",
        "d::alone",
    ]


def _register_srv(monkeypatch: pytest.MonkeyPatch, items: list[Any]) -> list[str]:
    """Fresh release state (the session's own stay as they are) with ``items`` collected
    and a fixture ``srv`` registered; returns the list its releases are appended to."""
    for name in ("_releases", "_position", "_last_use"):
        monkeypatch.setattr(_resources, name, {})
    _resources.note_positions(items)
    released: list[str] = []
    request = SimpleNamespace(fixturename="srv")
    _resources.release_after_last_use(request, lambda: released.append("srv"))  # type: ignore[arg-type]
    return released


def test_a_fixture_is_released_after_its_last_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = [_item("m::1", ("srv",)), _item("m::2", ("srv",)), _item("m::3")]
    released = _register_srv(monkeypatch, items)
    _resources.release_unused(items[0])
    assert released == []
    _resources.release_unused(items[1])
    assert released == ["srv"]
    _resources.release_unused(items[2])
    assert released == ["srv"]


def test_an_xdist_worker_keeps_fixtures_to_their_scope_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker runs its share in an order of its own: the collected positions say
    nothing of what it runs next, so nothing is released early there."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    items = [_item("m::1", ("srv",)), _item("m::2")]
    released = _register_srv(monkeypatch, items)
    _resources.release_unused(items[1])
    assert released == []


def test_a_worker_runs_a_folder_whole_and_top_level_modules_apart() -> None:
    group = _resources.worker_group
    assert group("tests/prometheus/test_a.py::t[x]") == group("tests/prometheus/sub/test_b.py::t")
    assert group("tests/prometheus/test_a.py::Class::t") == "tests/prometheus"
    assert group("tests/test_sweep.py::t") == "tests/test_sweep.py"
    assert group("tests/test_sweep.py::t") != group("tests/test_docs.py::t")
    assert group("tests/dashboard/test_x.py::t") != group("tests/report/test_x.py::t")
