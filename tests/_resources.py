"""Heavy test resources: one real vLLM engine at a time, servers stopped after their last test.

On a 2-core machine an idle vLLM engine still spins a core, and a Prometheus or
VictoriaMetrics next to it takes its share: either moves a measured throughput by tens
of percent. Two rules keep the engine tier's figures about the engine under test:

* **One engine at a time.** For the whole session (the serial one that runs the engine
  tests; pytest-xdist's workers run none) ``VllmServer.start`` is checked: an
  engine started while another vLLM API server is alive on this machine (left running
  by an earlier fixture, or another job's) fails at once, naming both. Tests that need
  a pool of engines on purpose say so with :func:`side_by_side`. No Prometheus or
  VictoriaMetrics may be alive either when an engine starts: a test that scrapes an
  engine starts them after it, and stops them with the test.
* **Released after the last use.** A fixture that holds a server for several modules
  registers it with :func:`release_after_last_use`: the server is stopped right after
  the last test of the session that requests the fixture, not when the session ends.
  :func:`order_items` runs the engine tests last and keeps the modules that share an
  engine fixture next to each other, so that moment comes before the next engine starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ENGINE_ARG = "vllm.entrypoints.openai.api_server"
"""An argument of every vLLM API server's command line (``kvscope.lab.engine.VllmServer``)."""
HEAVY_SERVERS = ("prometheus", "victoria-metrics")
"""Programs that must not run while an engine starts (matched on the command's name)."""
SHARED_ENGINE_FIXTURES = ("overload_run",)
"""Fixtures that hold one engine for tests in several modules; those modules run together."""

_allowed_engines = 1
_releases: dict[str, Callable[[], None]] = {}
_last_use: dict[str, int] = {}
_position: dict[str, int] = {}


class EngineOverlap(RuntimeError):
    """An engine was about to start while another engine or a heavy server was alive."""


def processes() -> Iterator[tuple[int, list[str]]]:
    """``(pid, argv)`` of every process on this machine that can be read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if raw:
            yield int(entry.name), raw.decode(errors="replace").rstrip("\0").split("\0")


def live_engines() -> list[tuple[int, str]]:
    """vLLM API servers alive now: ``(pid, command line)``."""
    return [
        (pid, " ".join(argv))
        for pid, argv in processes()
        if ENGINE_ARG in argv and pid != os.getpid()
    ]


def live_heavy_servers() -> list[tuple[int, str]]:
    """Prometheus and VictoriaMetrics servers alive now: ``(pid, command line)``."""
    return [
        (pid, " ".join(argv))
        for pid, argv in processes()
        if os.path.basename(argv[0]) in HEAVY_SERVERS
    ]


def check_engine_may_start() -> None:
    """Raise :class:`EngineOverlap` unless an engine may start now."""
    engines, heavy = live_engines(), live_heavy_servers()
    problems = []
    if len(engines) >= _allowed_engines:
        problems.append(
            f"{len(engines)} vLLM engine(s) already running, {_allowed_engines - 1} allowed "
            "beside a new one (a test that needs a pool says so with side_by_side(n)):"
        )
        problems += [f"  pid {pid}: {cmd[:300]}" for pid, cmd in engines]
    if heavy:
        problems.append(
            "servers that must be stopped before an engine starts "
            "(start them after the engine, stop them with the test):"
        )
        problems += [f"  pid {pid}: {cmd[:300]}" for pid, cmd in heavy]
    if problems:
        raise EngineOverlap(
            "a vLLM engine is starting while other heavy processes run; "
            "its measurements would share the cores with them.\n" + "\n".join(problems)
        )


@contextlib.contextmanager
def side_by_side(n: int) -> Iterator[None]:
    """Allow up to ``n`` engines at once inside the block (a pool of replicas)."""
    global _allowed_engines
    before, _allowed_engines = _allowed_engines, n
    try:
        yield
    finally:
        _allowed_engines = before


def guard_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check every ``VllmServer.launch`` (``start`` launches too) of the session with
    :func:`check_engine_may_start`."""
    from kvscope.lab.engine import VllmServer

    launch = VllmServer.launch

    def checked_launch(self: VllmServer) -> VllmServer:
        check_engine_may_start()
        return launch(self)

    monkeypatch.setattr(VllmServer, "launch", checked_launch)


def release_after_last_use(request: pytest.FixtureRequest, release: Callable[[], None]) -> None:
    """Call ``release`` right after the last test of the session that uses this fixture
    (the fixture's own teardown still runs at its scope's end: ``release`` must be safe
    to call twice). Fixture names registered here must be unique in the suite."""
    if request.fixturename in _releases:
        raise RuntimeError(f"two live fixtures named {request.fixturename!r} registered")
    _releases[request.fixturename] = release


def engine_group(item: pytest.Item) -> str | None:
    """The shared engine fixture a test uses, if any."""
    return next((f for f in SHARED_ENGINE_FIXTURES if f in item.fixturenames), None)


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else item.nodeid


def order_items(items: list[pytest.Item]) -> None:
    """Engine tests last; among them, the modules sharing an engine fixture together
    (at the place of the first), every other module in its collected order."""
    group: dict[str, str] = {}
    for item in items:
        shared = engine_group(item)
        if shared is not None:
            group.setdefault(_module(item), shared)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(group.get(_module(item), _module(item)), i)

    def key(pair: tuple[int, pytest.Item]) -> tuple[bool, int, int]:
        i, item = pair
        return (
            item.get_closest_marker("engine") is not None,
            first[group.get(_module(item), _module(item))],
            i,
        )

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def note_positions(items: list[pytest.Item]) -> None:
    """Remember where each test runs and the last test that uses each fixture."""
    _position.clear()
    _last_use.clear()
    for i, item in enumerate(items):
        _position[item.nodeid] = i
        for name in item.fixturenames:
            _last_use[name] = i


def in_xdist_worker() -> bool:
    """Whether this process is one of pytest-xdist's workers (``scripts/test`` runs the
    tiers without an engine on every core)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def worker_group(nodeid: str) -> str:
    """The unit of tests one xdist worker runs whole (``conftest.py``'s scheduler): a
    folder of ``tests/``, so that a fixture shared by a folder's modules starts once and
    its servers never run twice side by side; a module at the top level, which shares
    none."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests":
        return "/".join(parts[:2])
    return path


def release_unused(item: pytest.Item) -> None:
    """Release every registered fixture no test after ``item`` uses.

    Not in an xdist worker: a worker runs its share of the tests in an order of its
    own, so the collected positions do not say which of its tests come later; there a
    fixture is released at its scope's end. (No engine runs under xdist.)"""
    if in_xdist_worker():
        return
    here = _position.get(item.nodeid)
    if here is None:
        return
    for name in [n for n in _releases if _last_use.get(n, -1) <= here]:
        _releases.pop(name)()
