"""Test-suite wide hooks, and the shared replayed-collector fixture."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import load_recording, replay
from tests._resources import (
    guard_engine_starts,
    in_xdist_worker,
    note_positions,
    order_items,
    release_unused,
    worker_group,
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that start the real vLLM engine last, the modules that share one
    engine together (``tests/_resources.py``).

    The engine busy-polls a core while it runs; keeping it out of the way lets the
    fast tests (some of which drive small local servers) run on a quiet machine.
    """
    order_items(items)
    # The long real-engine matrices run only when asked for (``-m matrix``).
    if "matrix" not in (config.option.markexpr or ""):
        keep = [i for i in items if i.get_closest_marker("matrix") is None]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist with ``--dist loadscope`` (scripts/test), one worker runs a
    folder of ``tests/`` (or a top-level module) whole: its shared fixtures start once,
    its servers never twice at a time (``tests/_resources.py``'s ``worker_group``)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return FolderScheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    note_positions(session.items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if in_xdist_worker() and item.get_closest_marker("engine") is not None:
        pytest.fail(
            "an engine test under pytest-xdist: real engines run one at a time, in a "
            'serial session (scripts/test runs -m "engine and not matrix" without -n)',
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        release_unused(item)


@pytest.fixture(scope="session", autouse=True)
def _one_engine_at_a_time() -> Iterator[None]:
    """Every vLLM engine of the session starts alone (``tests/_resources.py``).

    Not in an xdist worker: scripts/test runs the engine tests in a serial session of
    their own, and the workers' tests start no engine (a failing start of a pretend one
    at most) while another worker's Prometheus may well be up."""
    if in_xdist_worker():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        guard_engine_starts(mp)
        yield


RECORDINGS = Path(__file__).resolve().parents[1] / "lab" / "recordings"
KV_STARVED_ENDED_AGO_S = 120.0
"""The shared KV-starved replay ends this long before it is sent: recent enough for
``--since 30m`` and the collector's advisor window, old enough for an empty
``--since 60s`` window."""


@dataclass
class Replayed:
    """A collector process holding one replayed recording."""

    collector: CollectorProcess
    end_at_unix_s: float
    """Where the recording's last step was moved to."""
    done_unix_s: float
    """When the replay finished (every batch stored)."""


@pytest.fixture(scope="module")
def kv_starved_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replayed]:
    """A collector (advisor every 2 s over 15 min) fed the real KV-starved vLLM run.

    One per module: the replay is placed relative to the wall clock (``--since 30m``, the
    commands' default, must cover it), and on a slow machine a session can outlast that
    window between a fixture's first and last test."""
    c = CollectorProcess(
        tmp_path_factory.mktemp("kv_starved") / "kvscope.duckdb",
        extra_args=[
            "--raw-retention-s",
            "0",
            "--advise-interval-s",
            "2",
            "--advise-window-s",
            "900",
        ],
    ).start()
    try:
        end = time.time() - KV_STARVED_ENDED_AGO_S
        replay(
            load_recording(RECORDINGS / "overload_kv_starved.jsonl.gz"),
            c.url,
            end_at_unix_s=end,
            progress=False,
        )
        yield Replayed(c, end, time.time())
    finally:
        c.stop()
