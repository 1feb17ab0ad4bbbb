"""The advisor's verdicts on /metrics: a real collector process running the advisor
over a real vLLM recording; the loop's failure handling on a store that fails."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from _collector_helpers import http
from prometheus_client.parser import text_string_to_metric_families

from kvscope.collector._exposition import TextWriter
from kvscope.collector.settings import Settings
from kvscope.collector.store import Store
from kvscope.collector.verdicts import VerdictLoop

PROMTOOL = "/usr/bin/promtool"
ENGINE_LABELS = (("engine", "demo-host:8000:0"), ("model", "kvscope-demo"), ("pool", "demo"))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _advisor(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_verdict_gauges_after_a_replay(kv_starved_collector: Any) -> None:
    c = kv_starved_collector.collector  # advisor every 2 s
    deadline = time.monotonic() + 30
    while True:
        text = c.get_text("/metrics")
        m = _samples(text)
        bottleneck = _advisor(m, "kvscope_advisor_bottleneck")
        last_run = m.get(("kvscope_advisor_last_run_timestamp_seconds", ()), 0.0)
        if last_run > kv_starved_collector.done_unix_s and bottleneck:
            break
        assert time.monotonic() < deadline, f"no verdict after the replay:\n{text[-3000:]}"
        time.sleep(0.3)
    assert bottleneck == {tuple(sorted((*ENGINE_LABELS, ("bottleneck", "kv_cache_bound")))): 1.0}
    e = ENGINE_LABELS
    cap = m[("kvscope_advisor_recommended_concurrency_cap", e)]
    assert 5 <= m[("kvscope_advisor_knee_concurrency", e)] <= 16
    assert 5 <= cap <= 16 and cap == int(cap)
    assert 1_100 <= m[("kvscope_advisor_plateau_tokens_per_second", e)] <= 1_400
    assert m[("kvscope_advisor_saturated", e)] == 1
    assert m[("kvscope_advisor_cap_throughput_ratio", e)] >= 0.85
    assert m[("kvscope_advisor_pool_recommended_concurrency_cap", (("pool", "demo"),))] == cap
    assert m[("kvscope_advisor_runs_total", (("result", "ok"),))] >= 1
    assert m[("kvscope_advisor_runs_total", (("result", "error"),))] == 0
    if not shutil.which(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is missing: install the Debian 'prometheus' package")
    res = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    assert not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr
    assert "Traceback" not in c.log_tail(200)


class _FailingStore:
    """A store whose reads fail, as a closed or broken database would."""

    def __init__(self) -> None:
        self.calls = 0

    def engines(self) -> Any:
        self.calls += 1
        raise RuntimeError("store is closed")


def test_failures_are_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    loop = VerdictLoop(_FailingStore(), interval_s=1, window_s=60)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="kvscope.collector.verdicts"):
        assert [loop.run_once() for _ in range(3)] == ["error"] * 3
    assert len(caplog.records) == 1 and "store is closed" in caplog.records[0].getMessage()
    w = TextWriter()
    loop.render(w)
    m = _samples(w.text())
    assert m[("kvscope_advisor_runs_total", (("result", "error"),))] == 3
    assert m[("kvscope_advisor_runs_total", (("result", "ok"),))] == 0
    assert ("kvscope_advisor_last_success_timestamp_seconds", ()) not in m
    assert ("kvscope_advisor_last_run_timestamp_seconds", ()) in m


def test_empty_store_is_no_data(tmp_path: Path) -> None:
    with Store(str(tmp_path / "s.duckdb")) as store:
        loop = VerdictLoop(store, interval_s=1, window_s=60)
        assert loop.run_once() == "no_data"
        w = TextWriter()
        loop.render(w)
        assert "kvscope_advisor_bottleneck{" not in w.text()


def test_interval_zero_disables_the_advisor(make_collector: Any) -> None:
    lc = make_collector(advise_interval_s=0)
    status, _, body = http("GET", lc.url + "/metrics")
    assert status == 200 and b"kvscope_advisor_" not in body
    on = make_collector(store_path=str(Path(lc.settings.store_path).with_name("on.duckdb")))
    _, _, body = http("GET", on.url + "/metrics")
    assert b"kvscope_advisor_runs_total" in body


def test_settings_validate_the_advisor() -> None:
    with pytest.raises(ValueError, match="advise_interval_s"):
        Settings(advise_interval_s=-1)
    with pytest.raises(ValueError, match="advise_window_s"):
        Settings(advise_window_s=0)


class _FrameStore:
    """A store whose reads return fixed frames (the advisor's synthetic prefix pool)."""

    def __init__(self, pool: Any) -> None:
        self.p = pool

    @staticmethod
    def _cut(
        df: Any,
        col: str,
        since_unix_s: float | None,
        until_unix_s: float | None,
        engine_id: str | None = None,
    ) -> Any:
        out = df
        if not len(out):
            return out
        if engine_id is not None:
            out = out[out["engine_id"] == engine_id]
        if since_unix_s is not None:
            out = out[out[col] >= since_unix_s]
        if until_unix_s is not None:
            out = out[out[col] < until_unix_s]
        return out.reset_index(drop=True)

    def engines(self) -> Any:
        return self.p.engines

    def windows(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
    ) -> Any:
        return self._cut(self.p.windows, "ts_s", since_unix_s, until_unix_s, engine_id)

    def requests(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
    ) -> Any:
        return self._cut(self.p.requests, "finished_unix_s", since_unix_s, until_unix_s, engine_id)

    def kv_event_windows(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
    ) -> Any:
        return self._cut(self.p.kv_events, "ts_s", since_unix_s, until_unix_s, engine_id)


def test_pool_prefix_gauges_come_from_the_kv_events() -> None:
    from kvscope.advisor.datasets import make_prefix_pool

    pool = make_prefix_pool(seed=3)
    t_end = float(pool.windows["ts_s"].max()) + 1
    loop = VerdictLoop(
        _FrameStore(pool),
        interval_s=1,
        window_s=3600,  # type: ignore[arg-type]
        clock=lambda: t_end + 10,
    )
    assert loop.run_once() == "ok"
    w = TextWriter()
    loop.render(w)
    m = _samples(w.text())
    label = (("pool", "px"),)
    truth = pool.truth
    assert m[("kvscope_advisor_pool_prefix_hit_ratio", label)] == pytest.approx(
        truth["hit_rate"], abs=0.01
    )
    assert m[("kvscope_advisor_pool_prefix_routing_loss_ratio", label)] == pytest.approx(
        truth["routing_loss"], abs=0.01
    )
    assert m[("kvscope_advisor_pool_predicted_prefix_hit_ratio_affine", label)] == pytest.approx(
        truth["hit_rate"] + truth["routing_loss"], abs=0.01
    )
    assert m[("kvscope_advisor_pool_load_imbalance_ratio", label)] > 1.25

    # Without KV events the loss and prediction are not published, the hit ratio is.
    no_events = make_prefix_pool(seed=3, with_events=False)
    loop = VerdictLoop(
        _FrameStore(no_events),
        interval_s=1,
        window_s=3600,  # type: ignore[arg-type]
        clock=lambda: t_end + 10,
    )
    assert loop.run_once() == "ok"
    w = TextWriter()
    loop.render(w)
    m = _samples(w.text())
    assert ("kvscope_advisor_pool_prefix_hit_ratio", label) in m
    assert ("kvscope_advisor_pool_prefix_routing_loss_ratio", label) not in m
