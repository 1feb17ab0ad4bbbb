"""The generated two weeks in a real collector, and ``kvscope report`` run on them.

One session fixture does everything that needs the order collector-up then
collector-down: it generates the weeks (:mod:`_week`), runs the report through the
collector, reads the advisor's own answer for the same window over HTTP, checks that
``--store`` refuses a file the running collector holds, stops the collector, runs
the report on the store file, and renders the HTML in a real headless Chromium.
The tests then only read what it kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _runs import Browser, Run, Session
from _week import generate

from kvscope.advisor import CollectorSource, analyze
from kvscope.collector.process import CollectorProcess
from kvscope.report.sources import StoreSource, open_store
from tests._artefacts import keep

ROOT = Path(__file__).resolve().parents[2]
ARTEFACTS: list[Path] = []
"""Screenshots and reports kept in this session (listed at the end of the run)."""


def kvscope_report(*args: str, out: Path) -> Run:
    cmd = [sys.executable, "-m", "kvscope.cli.main", "report", *args, "--out", str(out)]
    t0 = time.monotonic()
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return Run(cmd, out, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


def chromium(html: Path, shot: Path) -> Browser:
    """Screenshot and DOM of ``html`` in headless Chromium (fails when it is missing)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail(
            "chromium is not installed: the report test renders the HTML in a real "
            "headless Chromium (Debian: apt-get install -y chromium; ./scripts/test "
            "installs it)"
        )
    base = [
        binary,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={shot.parent / 'profile'}",
    ]
    p = subprocess.run(
        [*base, f"--screenshot={shot}", "--window-size=1300,2000", html.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = subprocess.run(
        [*base, "--dump-dom", html.resolve().as_uri()], capture_output=True, text=True, timeout=120
    )
    return Browser(shot, dom.stdout, p.returncode or dom.returncode, p.stderr + dom.stderr)


@pytest.fixture(scope="session")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.getbasetemp() / "report-artefacts"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def session(tmp_path_factory: pytest.TempPathFactory, artefacts: Path) -> Iterator[Session]:
    work = tmp_path_factory.mktemp("weekly")
    store = work / "kvscope.duckdb"
    c = CollectorProcess(
        store,
        extra_args=[
            "--advise-interval-s",
            "0",
            "--kv-events",
            "off",
            # A generated week is sent in seconds: its engines' restarts arrive at once.
            "--max-new-boots-per-engine-per-minute",
            "1000",
        ],
    )
    c.start()
    try:
        week = generate(c.url, time.time())
        via_collector = kvscope_report(
            "--collector", c.url, "--since", "7d", out=artefacts / "via-collector"
        )
        assert via_collector.returncode == 0, via_collector.stderr
        window = via_collector.json["window"]
        reference = analyze(CollectorSource(c.url), window["since_unix_s"], window["until_unix_s"])
        locked = kvscope_report("--store", str(store), "--since", "7d", out=work / "locked")
        no_data = kvscope_report(
            "--collector", c.url, "--since", "1000", "--until", "2000", out=work / "no-data"
        )
    finally:
        c.stop()
    via_store = kvscope_report("--store", str(store), "--since", "7d", out=artefacts / "via-store")
    assert via_store.returncode == 0, via_store.stderr
    window = via_store.json["window"]
    offline = StoreSource(open_store(store))
    try:
        store_reference = analyze(offline, window["since_unix_s"], window["until_unix_s"])
    finally:
        offline.close()
    s = Session(
        week=week,
        url=c.url,
        store=store,
        via_collector=via_collector,
        via_store=via_store,
        locked=locked,
        no_data=no_data,
        advisor_engines=[v.to_dict() for v in reference.engines],
        store_advisor_engines=[v.to_dict() for v in store_reference.engines],
    )
    ARTEFACTS.extend([via_collector.out / "report.html", via_store.out / "report.html"])
    yield s


@pytest.fixture(scope="session")
def browser(session: Session, artefacts: Path) -> Browser:
    b = chromium(session.via_collector.out / "report.html", artefacts / "report.png")
    ARTEFACTS.append(keep(b.screenshot, "report"))
    for name in ("report.html", "report.md", "report.json"):
        keep(session.via_collector.out / name, "report")
    print(f"\nreport screenshot: {b.screenshot}")
    return b


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ARTEFACTS:
        terminalreporter.write_sep("-", "weekly report artefacts")
        for p in ARTEFACTS:
            terminalreporter.write_line(str(p))
