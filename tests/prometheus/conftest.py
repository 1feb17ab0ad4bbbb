"""A replayed fleet scraped by real Prometheus and VictoriaMetrics servers (once per session).

The fleet, all from the bundled real vLLM run (KV-starved, 1 to 32 clients, 78 s), at
its recorded pace:

* ``new``: vLLM 0.32's own ``/metrics`` (the real scrape in ``tests/fixtures``, values
  replayed), pool ``kvscope-demo`` by ``model_name``;
* ``old``: the same run under vLLM 0.9.1's names (``vllm:gpu_cache_usage_perc``,
  ``vllm:gpu_prefix_cache_*``, ``vllm:time_per_output_token_seconds``), model
  ``old-model``, restarted half-way (every counter back to zero);
* ``kvscope``: a kvscope collector process receiving the plugin's recorded batches at
  their pace (engine ``demo-host:8000:0``, pool ``demo``), its ``/metrics`` scraped too;
  three times (``OUTAGES``, one at a low load and two past the knee) the batches of 3 s
  reach it together at their end, as a plugin's buffer does after the collector was
  unreachable.

The backends (Prometheus, VictoriaMetrics, and a Prometheus behind HTTPS and basic
auth) scrape all three every second. The recording itself is the expected
answer: the plugin path's verdict on it is what ``tests/advisor/test_recordings.py``
checks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _backends import Backend, PrometheusServer, SecuredPrometheusServer, VictoriaMetricsServer
from _promfleet import OUTAGES, SCRAPE_S, Fleet, PacedFeed, wait_scraped
from _vllm_replay import VllmReplay

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording
from tests._resources import release_after_last_use


@pytest.fixture(scope="session")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    """Two replayed vLLM servers and a collector, scraped by Prometheus, VictoriaMetrics
    and a Prometheus behind TLS and basic auth; all stopped after the last test using it."""
    workdir = tmp_path_factory.mktemp("prom-fleet")
    recording = load_recording(BUNDLED_RECORDING)
    new = VllmReplay(recording).start()
    old = VllmReplay(recording, old_names=True, restart_at=0.5, model="old-model").start()
    collector = CollectorProcess(
        workdir / "store.duckdb",
        log_path=workdir / "collector.log",
        extra_args=["--advise-interval-s", "0", "--kv-events", "off"],
    )
    started: list[Backend] = []
    feed: PacedFeed | None = None

    stopped: list[bool] = []

    def stop() -> None:
        if stopped:
            return
        stopped.append(True)
        if feed is not None:
            feed.stop()
        for b in started:
            b.stop()
        collector.stop()
        new.stop()
        old.stop()

    release_after_last_use(request, stop)
    try:
        collector.start()
        targets = [new.target, old.target, collector.url.split("://", 1)[1]]
        for cls in (PrometheusServer, VictoriaMetricsServer, SecuredPrometheusServer):
            started.append(cls(workdir, targets, scrape_interval_s=SCRAPE_S).start())
        for b in started:  # every target scraped twice before the run starts
            wait_scraped(b.url, len(targets), auth=b.auth)
        new.begin()
        old.t0_wall = new.t0_wall
        assert new.t0_wall is not None
        feed = PacedFeed(recording, collector.url, new.t0_wall, OUTAGES).start()
        since = new.t0_wall - 2.0
        time.sleep(new.duration_wall_s + 3 * SCRAPE_S)
        feed.thread.join(15)
        yield Fleet(
            recording,
            new,
            old,
            collector,
            {b.name: b for b in started},
            since=since,
            until=time.time(),
            feed_errors=feed.errors,
        )
    finally:
        stop()
