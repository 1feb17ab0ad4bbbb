"""Fixtures for the dashboard tests: a real collector holding the demo fleet (the three
bundled real vLLM recordings replayed as three engines), the advisor's report on it,
and a real headless Chromium."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _browser import SAVED
from _fleet import KV_STARVED, expected_report

from kvscope.advisor import Report
from kvscope.collector.process import CollectorProcess
from kvscope.dashboard.demo import demo_collector
from tests._resources import release_after_last_use

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[CollectorProcess]:
    """A collector process fed the demo fleet over HTTP, as ``kvscope dashboard --demo``
    feeds it; stopped after the last test that reads it."""
    with demo_collector(tmp_path_factory.mktemp("dashboard_fleet"), progress=False) as c:
        release_after_last_use(request, c.stop)
        yield c


@pytest.fixture(scope="session")
def expected(demo_fleet: CollectorProcess) -> Report:
    report = expected_report(demo_fleet.url)
    # The fixture data must show what the pages are tested on.
    assert report.engine(KV_STARVED).bottleneck == "kv_cache_bound"
    assert report.engine(KV_STARVED).recommended_concurrency_cap is not None
    return report


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed through scripts/_setup.sh when missing."""
    path = shutil.which("chromium")
    if path is None:
        proc = subprocess.run(
            ["bash", "-c", f"source '{ROOT}/scripts/_setup.sh' && ensure_chromium"],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        path = shutil.which("chromium")
        if path is None:
            pytest.fail(
                "the dashboard's browser tests need Debian's chromium; "
                "`ensure_chromium` (scripts/_setup.sh) could not install it "
                f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
    return path


@pytest.fixture(scope="session")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots and DOM dumps are kept (under pytest's base temp dir)."""
    d = tmp_path_factory.getbasetemp() / "dashboard-screenshots"
    d.mkdir(exist_ok=True)
    return d


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SAVED:
        terminalreporter.write_sep("-", "dashboard screenshots")
        for p in SAVED:
            terminalreporter.write_line(str(p))
