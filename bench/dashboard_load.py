"""First load of each dashboard page in a real headless Chromium: median seconds.

One command (a few minutes: the demo replays its recordings first)::

    .venv/bin/python bench/dashboard_load.py [--runs 5] [--pages overview,engine,...]
        [--json out.json]

What it does
------------
Starts ``kvscope dashboard --demo --refresh 0`` (a local collector fed the bundled real
vLLM recordings, three engines) and waits for its health check. Then, ``--runs`` times
per page, it opens a fresh Chromium (Debian's ``chromium``, driven over the DevTools
protocol by the dashboard tests' driver, ``tests/dashboard/_browser.py``), navigates
to the page and measures the seconds until the page has rendered: the app is idle,
the page's text holds what the page must show, and the text has not changed for
``--settle`` seconds (the settle time is subtracted). A fresh browser each run makes
every load a first load (new session, nothing cached by Streamlit's session state;
the app's data cache is shared across sessions, as in service).

The baseline, measured the same way in the same run: a bare Streamlit app (a title and a
line of text) served by the same Streamlit on another port: what any Streamlit page
costs a fresh browser on this machine.

It prints one row per page: median, minimum and maximum seconds over the runs, the
median over the bare app's and over the 3-s target. Do not run it beside other
CPU-heavy work: the numbers measure the machine too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))

from _browser import Chromium  # noqa: E402

from kvscope.collector.process import free_port  # noqa: E402

PAGES = {
    "overview": ("", ["Fleet overview", "Engines"]),
    "engine": ("engine", ["Engine detail", "Show each engine step", "Throughput"]),
    "engine-steps": ("engine?steps=1", ["Engine detail", "Per engine step: KV-cache usage"]),
    "plateau": ("plateau", ["Throughput and P99 latency against load", "Why: the bottleneck"]),
    "recommendations": ("recommendations", ["1. "]),
    "prefix": ("prefix", ["Prefix-cache hit rate per replica"]),
    "latency": ("latency", ["One engine over time"]),
}
TARGET_S = 3.0
BARE_APP = 'import streamlit as st\n\nst.title("bare")\nst.write("a bare Streamlit page")\n'
"""The baseline: a Streamlit page with nothing to read."""
"""Page name -> (URL path, text the loaded page holds)."""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return bool(r.read().strip() == b"ok")
    except OSError:
        return False


@contextlib.contextmanager
def _served(what: str, args: list[str], log_path: Path, timeout_s: float) -> Iterator[str]:
    """``python -m <args> --port P`` on a free port P; its URL once Streamlit's health check
    answers; stopped (SIGTERM, then SIGKILL of its group) on exit."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            *args,
            "--port" if args[0] != "streamlit" else "--server.port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} did not come up:\n" + log_path.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def demo_dashboard(
    workdir: Path, timeout_s: float = 600.0
) -> contextlib.AbstractContextManager[str]:
    """``kvscope dashboard --demo`` on a free port; its URL once it answers."""
    args = ["kvscope.cli.main", "dashboard", "--demo", "--demo-dir", str(workdir), "--refresh", "0"]
    return _served("kvscope dashboard --demo", args, workdir / "dashboard.log", timeout_s)


def bare_streamlit(
    workdir: Path, timeout_s: float = 120.0
) -> contextlib.AbstractContextManager[str]:
    """A bare Streamlit app on a free port; its URL once it answers."""
    app = workdir / "bare_app.py"
    app.write_text(BARE_APP)
    args = ["streamlit", "run", str(app), "--server.headless", "true"]
    args += ["--browser.gatherUsageStats", "false"]
    return _served("the bare Streamlit app", args, workdir / "bare.log", timeout_s)


def first_load_s(url: str, wait_for: list[str], settle_s: float) -> float:
    """Seconds from navigation to the rendered page, in a fresh browser."""
    with Chromium() as browser:
        page = browser.load(url, wait_for=wait_for, timeout_s=300.0, settle_s=settle_s)
        if page.exceptions:
            raise RuntimeError(f"{url}: {page.exceptions[0][:500]}")
        return max(0.0, page.seconds - settle_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--pages", default=",".join(PAGES), help="comma-separated page names")
    p.add_argument("--settle", type=float, default=2.0, help="seconds without change")
    p.add_argument("--json", type=Path, default=None, help="write the timings here too")
    args = p.parse_args(argv)
    pages = [x.strip() for x in args.pages.split(",") if x.strip()]
    unknown = [x for x in pages if x not in PAGES]
    if unknown:
        p.error(f"unknown page(s): {', '.join(unknown)}; pages: {', '.join(PAGES)}")
    timings: dict[str, list[float]] = {name: [] for name in pages}
    bare: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp,
        demo_dashboard(Path(tmp)) as url,
        bare_streamlit(Path(tmp)) as bare_url,
    ):
        print(f"dashboard {url}; {args.runs} first load(s) per page", file=sys.stderr)
        for run in range(args.runs):
            b = first_load_s(bare_url, ["a bare Streamlit page"], args.settle)
            bare.append(b)
            print(f"run {run + 1} bare Streamlit: {b:.2f} s", file=sys.stderr)
            for name in pages:
                path, wanted = PAGES[name]
                s = first_load_s(f"{url}/{path}", wanted, args.settle)
                timings[name].append(s)
                print(f"run {run + 1} {name}: {s:.2f} s", file=sys.stderr)
    base = statistics.median(bare)
    print(
        f"{'page':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'runs':>5} "
        f"{'x bare':>7} {f'of {TARGET_S:g} s':>7}"
    )
    for name, ts in [("bare Streamlit", bare), *timings.items()]:
        med = statistics.median(ts)
        print(
            f"{name:<16} {med:>9.2f} {min(ts):>7.2f} {max(ts):>7.2f} {len(ts):>5} "
            f"{med / base if base > 0 else float('nan'):>7.1f} {med / TARGET_S:>7.0%}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"runs": args.runs, "seconds": timings, "bare_seconds": bare}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
