"""Fixtures for the advisor tests: real collectors fed with real recordings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import load_recording, replay
from tests._resources import release_after_last_use

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "lab" / "recordings"
END_AT_UNIX_S = 1_790_000_000.0
"""Recordings end at a fixed time (September 2026), imported as old data: the collectors
take any age (``--max-backfill 0``)."""


@pytest.fixture(scope="session")
def replayed(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, CollectorProcess]]:
    """One collector process per bundled recording, each fed the recording over HTTP;
    stopped after the last test that reads them."""
    out: dict[str, CollectorProcess] = {}
    release_after_last_use(request, lambda: [c.stop() for c in out.values()])
    try:
        for path in sorted(RECORDINGS.glob("*.jsonl.gz")):
            name = path.name.split(".")[0]
            store = tmp_path_factory.mktemp(name) / "kvscope.duckdb"
            c = CollectorProcess(
                store, extra_args=["--raw-retention-s", "0", "--max-backfill", "0"]
            ).start()
            out[name] = c
            replay(load_recording(path), c.url, end_at_unix_s=END_AT_UNIX_S, progress=False)
        yield out
    finally:
        for c in out.values():
            c.stop()
