"""``kvscope dashboard`` as a real process, every page loaded in a real headless Chromium.

The pages must render without a Streamlit exception and show the advisor's numbers
for the demo fleet; each page's screenshot and DOM are kept under pytest's base
temp dir (``dashboard-screenshots/``, printed at the end of the run).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
from _browser import SAVED, Chromium
from _fleet import KV_STARVED, SEQ_CAPPED

from kvscope.advisor import Report
from kvscope.advisor.render_latency import p50_p90_p99
from kvscope.collector.process import CollectorProcess, free_port
from tests._artefacts import keep

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def start_dashboard(args: list[str], log_path: Path, timeout_s: float = 90.0) -> Served:
    """``kvscope dashboard ARGS --port P`` in its own process group, once it answers."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.cli.main", "dashboard", *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    served = Served(f"http://127.0.0.1:{port}", port, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not healthy(served.url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(served)
            reap(served)
            pytest.fail(f"kvscope dashboard did not come up:\n{served.log()}")
        time.sleep(0.5)
    return served


def stop(served: Served, sig: int = signal.SIGTERM) -> int:
    """Signal ``kvscope dashboard`` (only it, not its group) and wait for its exit."""
    if served.proc.poll() is None:
        served.proc.send_signal(sig)
    try:
        return served.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reap(served)
        return served.proc.wait()


def reap(served: Served) -> None:
    """Kill whatever of the process group is left (after the checks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(served.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(
    demo_fleet: CollectorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    s = start_dashboard(["--collector", demo_fleet.url, "--refresh", "5"], log)
    try:
        yield s
    finally:
        stop(s)
        reap(s)


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Chromium]:
    with Chromium(chromium) as b:
        yield b


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def _overview(r: Report) -> list[str]:
    kv = r.engine(KV_STARVED)
    return [
        "Fleet overview",
        "Pools, the ones needing attention first",
        KV_STARVED,
        SEQ_CAPPED,
        f"kv_cache_bound, saturated, knee {kv.knee_concurrency:.1f}, "
        f"cap {kv.recommended_concurrency_cap} in flight",
    ]


def _engine(r: Report) -> list[str]:
    kv = r.engine(KV_STARVED)
    return [
        "Engine detail",
        "KV cache 48 blocks x 32 tokens = 1,536 tokens",
        "Batch size and waiting queue against max_num_seqs",
        "max_num_seqs 256, far above",
        "num_gpu_blocks 48",
        "Latency percentiles of finished requests",
        "Per engine step: requests",
        "Per engine step: KV-cache usage",
        "time (UTC)",
        f"{kv.knee_concurrency:.1f}",
    ]


def _plateau(r: Report) -> list[str]:
    kv = r.engine(KV_STARVED)
    return [
        "Throughput and P99 latency against load",
        "P99 latency (s)",
        f"knee {kv.knee_concurrency:.1f}",
        f"cap {kv.recommended_concurrency_cap}",
        f"plateau {kv.plateau_tokens_per_s:,.0f} tok/s",
        f"{kv.predicted_throughput_fraction_at_cap:.0%}",
        "Why: the bottleneck",
    ]


def _recommendations(r: Report) -> list[str]:
    cap = r.engine(KV_STARVED).recommended_concurrency_cap
    first = r.recommendations[0]
    return [
        f"1. {first.summary}",
        f"--max-num-seqs {cap} --max-num-queued-reqs {cap + -(-cap // 4)}",
        f"server demo-host:8000 max_conns={cap};",
        "nginx: what happens to the excess",
        f"{len(r.recommendations)}. {r.recommendations[-1].summary}",
    ]


def _prefix(r: Report) -> list[str]:
    demo = next(p for p in r.pools if p.pool == "demo")
    return [
        "Prefix-cache hit rate per replica",
        "pool demo-ample",
        _pct(demo.prefix_hit_rate),
        _pct(r.engine(SEQ_CAPPED).prefix_hit_rate),
        "--kv-events-config",
        "Time to first token with and without cached prompt tokens",
    ]


def _latency(r: Report) -> list[str]:
    demo = next(p for p in r.pools if p.pool == "demo")
    assert demo.latency is not None
    return [
        "SLO targets",
        "Finish reasons",
        "Time to first token",
        "Inter-token latency",
        "Prompt length",
        "time (UTC)",
        p50_p90_p99(demo.latency.ttft_s).split(" / ")[0],
    ]


PAGES: list[tuple[str, str, Callable[[Report], list[str]]]] = [
    ("overview", "", _overview),
    ("engine", "engine?steps=1", _engine),
    ("plateau", "plateau", _plateau),
    ("recommendations", "recommendations", _recommendations),
    ("prefix", "prefix", _prefix),
    ("latency", "latency", _latency),
]


@pytest.mark.parametrize(("name", "path", "wanted"), PAGES, ids=[p[0] for p in PAGES])
def test_page_loads_in_chromium_with_its_key_numbers(
    name: str,
    path: str,
    wanted: Callable[[Report], list[str]],
    served: Served,
    browser: Chromium,
    expected: Report,
    artefacts: Path,
) -> None:
    want = wanted(expected)
    page = browser.load(f"{served.url}/{path}", wait_for=want)
    shot = browser.screenshot(artefacts / f"{name}.png")
    (artefacts / f"{name}.html").write_text(page.html)
    SAVED.append(keep(shot, "dashboard"))
    keep(artefacts / f"{name}.html", "dashboard")
    print(f"screenshot {shot} ({page.seconds:.1f} s to render)")
    assert page.exceptions == []
    for bad in ("Traceback", "Collector unreachable", "No data.", "Not authorized"):
        assert bad not in page.text
    missing = [w for w in want if w not in page.text]
    assert not missing
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


_PLOT_BOX_JS = """(() => {
  const charts = Array.from(document.querySelectorAll('[data-testid="stVegaLiteChart"]'));
  const c = charts.find(e => e.innerText.includes('Throughput'));
  if (!c) return null;
  c.scrollIntoView({block: 'center'});
  const plot = c.querySelector('canvas, svg');
  const r = plot.getBoundingClientRect();
  return [r.left, r.top, r.width, r.height];
})()"""


def _range_inputs(browser: Chromium) -> list[str]:
    """What the sidebar's From and To fields hold."""
    return list(
        browser.eval(
            "[...document.querySelectorAll('input')].filter(i => /^(From|To) \\(UTC\\)$/"
            ".test(i.getAttribute('aria-label') || '')).map(i => i.value)"
        )
    )


def test_a_drag_across_a_time_chart_zooms_every_chart_and_the_link_keeps_it(
    served: Served, browser: Chromium, artefacts: Path
) -> None:
    page = browser.load(f"{served.url}/engine", wait_for=["Throughput", "Drag across"])
    assert page.exceptions == []
    left, top, width, height = browser.wait_for(_PLOT_BOX_JS)
    # Drag over the middle third of the throughput chart's plot, at half its height.
    y = top + height * 0.55
    browser.drag(left + width * 0.35, y, left + width * 0.65, y)
    url = browser.wait_for(
        "location.search.includes('time=range') && location.search.includes('from=') "
        "? location.href : ''",
        timeout_s=60,
    )
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    since, until = (
        datetime.fromisoformat(q[k][0].replace("Z", "+00:00")).timestamp() for k in ("from", "to")
    )
    assert until - since >= 2
    zoomed = browser.load(url, wait_for=["Throughput", "From (UTC)"])
    assert zoomed.exceptions == []
    shot = browser.screenshot(artefacts / "engine_zoomed.png")
    SAVED.append(keep(shot, "dashboard"))
    # The sidebar holds the dragged stretch as its range, and every chart reads it.
    shown = _range_inputs(browser)
    assert shown == [q["from"][0], q["to"][0]]
    assert "Time series (per second" in zoomed.text
    assert "No windows of this engine" not in zoomed.text


def test_a_grafana_data_link_opens_its_page_on_grafanas_time_range(
    served: Served, browser: Chromium
) -> None:
    # The form of deploy/grafana's data links once Grafana filled them in: a deep link to
    # a page other than the first, the engine and the range in unix seconds.
    until = int(time.time()) + 60
    since = until - 4 * 3600
    engine = urllib.parse.quote(SEQ_CAPPED, safe="")
    url = f"{served.url}/plateau?engine={engine}&time=range&from={since}&to={until}"
    page = browser.load(url, wait_for=["(range)", "From (UTC)"])
    assert page.exceptions == []
    stamp = "%Y-%m-%d %H:%M:%S UTC"
    span = " to ".join(
        datetime.fromtimestamp(t, timezone.utc).strftime(stamp) for t in (since, until)
    )
    assert f"{span} (range)" in page.text
    shown = _range_inputs(browser)
    assert shown == [str(since), str(until)]
    # The page is the plateau page inside the app (its navigation shown), of that engine:
    # the sequence-capped one's verdict (the page shows the KV-starved one unless told).
    assert "Fleet overview" in page.text and "knee (in flight)" in page.text
    assert "max_num_seqs_bound saturated" in page.text


def test_the_page_refreshes_itself(served: Served, browser: Chromium) -> None:
    browser.load(f"{served.url}/", wait_for=["read "])
    first = re.search(r"read (\d\d:\d\d:\d\d) UTC", browser.text())
    assert first is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1)
        now = re.search(r"read (\d\d:\d\d:\d\d) UTC", browser.text())
        if now is not None and now.group(1) != first.group(1):
            return
    pytest.fail(f"the page still shows the read of {first.group(1)} after 30 s (--refresh 5)")


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_listens_on_loopback_only(served: Served) -> None:
    assert _listeners(served.port) == ["0100007F"]  # 127.0.0.1, nothing on 0.0.0.0 or ::


def test_sigterm_stops_the_app_process_too(demo_fleet: CollectorProcess, tmp_path: Path) -> None:
    s = start_dashboard(["--collector", demo_fleet.url], tmp_path / "dashboard.log")
    try:
        assert _listeners(s.port)
        assert stop(s, signal.SIGTERM) == 143
        time.sleep(0.5)
        assert not healthy(s.url)
        assert _listeners(s.port) == [], "the Streamlit process outlived kvscope dashboard"
    finally:
        reap(s)


def test_demo_mode_serves_the_replayed_recordings(
    browser: Chromium, tmp_path: Path, artefacts: Path
) -> None:
    s = start_dashboard(
        ["--demo", "--demo-dir", str(tmp_path), "--refresh", "0"],
        tmp_path / "dashboard.log",
        timeout_s=300,
    )
    try:
        m = re.search(r"collector (http://127\.0\.0\.1:(\d+))", s.log())
        assert m is not None, s.log()
        collector_port = int(m.group(2))
        page = browser.load(
            f"{s.url}/",
            wait_for=[KV_STARVED, SEQ_CAPPED, "kv_cache_bound, saturated", "engines analyzed"],
        )
        shot = browser.screenshot(artefacts / "demo_overview.png")
        SAVED.append(keep(shot, "dashboard"))
        assert page.exceptions == []
        assert re.search(r"engines analyzed\s*(help\s*)?\s*3", page.text), page.text[:2000]
        assert (tmp_path / "dashboard-demo.duckdb").exists()
    finally:
        code = stop(s)
    try:
        assert code == 143
        assert _listeners(s.port) == []
        assert _listeners(collector_port) == [], "the demo collector outlived the dashboard"
    finally:
        reap(s)
