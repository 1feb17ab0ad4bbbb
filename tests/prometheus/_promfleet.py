"""The replayed fleet's parts (see conftest.py): a paced collector feed, a scrape check."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from _backends import Backend
from _vllm_replay import VllmReplay

from kvscope.advisor.sources import SourceError
from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import Recording, post_batch, rebased
from kvscope.sources.prometheus.client import PromClient

SCRAPE_S = 1.0


OUTAGES = ((20.0, 3.0), (55.0, 3.0), (66.0, 3.0))
"""(start, seconds) into the replayed run in which the collector receives nothing."""


class PacedFeed:
    """Sends a recording's batches to a collector when their last step is due.

    ``outages``: (start, seconds) from the recording's start during which the collector
    is taken as unreachable: the batches due then are sent together at its end, as the
    plugin sends what it buffered once the collector answers again."""

    def __init__(
        self,
        recording: Recording,
        url: str,
        t0_wall: float,
        outages: tuple[tuple[float, float], ...] = (),
    ) -> None:
        first, _ = recording.span_unix_s
        self.shift = t0_wall - first
        self.batches = list(
            rebased(sorted(recording.batches, key=_batch_end), shift_s=self.shift, boot_ids={})
        )
        self.outages = [(t0_wall + a, t0_wall + a + s) for a, s in outages]
        self.url = url
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="paced-feed", daemon=True)
        self._stop = threading.Event()

    def _run(self) -> None:
        for b in self.batches:
            due = _batch_end(b)
            due = next((end for start, end in self.outages if start <= due < end), due)
            if self._stop.wait(max(0.0, due - time.time())):
                return
            try:
                post_batch(self.url, b)
            except Exception as e:  # kept and reported by the test
                self.errors.append(str(e))

    def start(self) -> PacedFeed:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


def wait_scraped(url: str, n_targets: int, timeout_s: float = 30.0, auth: Any = None) -> None:
    client = PromClient(url, timeout_s=5, auth=auth)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = client.query("count_over_time(up[1m]) >= 2", time.time())
        except SourceError:
            got = []
        if len(got) >= n_targets:
            return
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not scrape its {n_targets} targets twice in {timeout_s} s")


def _batch_end(b: dict) -> float:
    ts = (b.get("steps") or {}).get("ts_unix_s") or [b.get("sent_unix_s", 0.0)]
    return float(max(ts))


@dataclass
class Fleet:
    recording: Recording
    new: VllmReplay
    old: VllmReplay
    collector: CollectorProcess
    backends: dict[str, Backend] = field(default_factory=dict)
    since: float = 0.0
    until: float = 0.0
    feed_errors: list[str] = field(default_factory=list)

    def engine_id(self, replay: VllmReplay) -> str:
        return f"{replay.target}:0"
