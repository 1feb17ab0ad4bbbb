"""PrometheusSource on real Prometheus and VictoriaMetrics servers that scraped a replayed
real vLLM run (see conftest.py): the advisor's verdict from vLLM's own series, under
both vLLM naming generations and across a counter reset, and from a collector's series.

The expected answer is the plugin path's on the same recording
(``tests/advisor/test_recordings.py``): KV-cache bound, saturated, knee between 6 and 16
requests in flight (the 8-client level sits at 86-91% of the plateau, so the knee lands
between the 8 and 16 levels depending on a few percent of throughput), plateau about
1,290 tokens/s, cap 6-16. From scrapes the knee may also land just below the 8-client
level (queue depths are snapshots), so it must be between 5 and 16 here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _promfleet import Fleet

from kvscope.advisor import SourceError
from kvscope.sources.prometheus.source import PrometheusSource, analyze_prometheus

BACKENDS = ["prometheus", "victoria-metrics"]
KVSCOPE_ENGINE = "demo-host:8000:0"


def _recorded_totals(fleet: Fleet) -> dict[str, float]:
    steps = [b["steps"] for b in fleet.recording.batches if b.get("steps")]
    reqs = [b["requests"] for b in fleet.recording.batches if b.get("requests")]
    return {
        "generation_tokens": float(sum(sum(s["generation_tokens"]) for s in steps)),
        "preemptions": float(sum(sum(s["preemptions"]) for s in steps)),
        "requests": float(sum(len(r["finished_unix_s"]) for r in reqs)),
    }


@pytest.fixture(scope="module", params=BACKENDS)
def analysed(request: pytest.FixtureRequest, fleet: Fleet) -> tuple[str, PrometheusSource, Any]:
    backend = fleet.backends[request.param]
    source = PrometheusSource(backend.url)
    return request.param, source, analyze_prometheus(source, fleet.since, fleet.until)


def test_the_fleet_was_fed(fleet: Fleet) -> None:
    assert not fleet.feed_errors
    assert fleet.new.scrapes > 50 and fleet.old.scrapes > 50


def test_verdicts_agree_with_the_plugin_path(
    analysed: tuple[str, PrometheusSource, Any], fleet: Fleet
) -> None:
    name, _, report = analysed
    ids = {fleet.engine_id(fleet.new), fleet.engine_id(fleet.old), KVSCOPE_ENGINE}
    assert {v.engine_id for v in report.engines} == ids, name
    for v in report.engines:
        where = f"{name} {v.engine_id}"
        assert v.bottleneck == "kv_cache_bound" and v.saturated, where
        assert 5 <= (v.knee_concurrency or 0) <= 16, where
        assert 1_050 <= (v.plateau_tokens_per_s or 0) <= 1_450, where
        if v.engine_id == KVSCOPE_ENGINE:
            # A collector's /metrics has no latency histograms: no requests, so no cap.
            assert v.recommended_concurrency_cap is None, where
            continue
        assert v.recommended_concurrency_cap is not None, where
        assert 6 <= v.recommended_concurrency_cap <= 16, where
        assert 0 < v.confidence <= 0.9, where  # scaled by the resolution
    # The collector's counters, whose steps arrived late three times (conftest.OUTAGES),
    # give the plateau vLLM's own give.
    plateau = {v.engine_id: v.plateau_tokens_per_s or 0.0 for v in report.engines}
    vllm = (plateau[fleet.engine_id(fleet.new)] + plateau[fleet.engine_id(fleet.old)]) / 2
    assert plateau[KVSCOPE_ENGINE] == pytest.approx(vllm, rel=0.08), (name, plateau)
    pools = {p.pool: p.engine_ids for p in report.pools}
    assert pools == {
        "kvscope-demo": [fleet.engine_id(fleet.new)],
        "old-model": [fleet.engine_id(fleet.old)],
        "demo": [KVSCOPE_ENGINE],
    }


def test_resolution_is_stated(analysed: tuple[str, PrometheusSource, Any]) -> None:
    name, _, report = analysed
    cov = report.coverage
    assert cov["source"] == "prometheus" and cov["resolution_s"] == 1, name
    assert cov["scrape_interval_s"] == pytest.approx(1.0, abs=0.05)
    assert cov["confidence_factor"] == 0.9  # vLLM gauges at 1 s
    assert cov["confidence_factor_by_engine"][KVSCOPE_ENGINE] == 1.0  # per-step means
    assert cov["requests_from_histograms"] is True
    found = report.findings_of("scrape_resolution")
    assert len(found) == 1 and "1 s resolution" in found[0].summary
    assert "vllm:gpu_cache_usage_perc" in found[0].evidence["metric_names"]


def test_both_name_generations_are_read(analysed: tuple[str, PrometheusSource, Any]) -> None:
    _, source, _ = analysed
    f = source.last_fetch
    assert f is not None
    assert f.vllm["kv_usage"] == ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    assert f.vllm["prefix_hits"] == ["vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"]
    assert f.vllm["itl"] == [
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ]


def test_counters_add_up_to_the_recording(
    analysed: tuple[str, PrometheusSource, Any], fleet: Fleet
) -> None:
    """Increases between scrapes, summed, are the run's totals: exactly for the engine
    that ran through, within the few seconds lost at the restart for the other."""
    name, source, _ = analysed
    want = _recorded_totals(fleet)
    w = source.windows(fleet.since, fleet.until)
    r = source.requests(fleet.since, fleet.until)
    for replay, tol in ((fleet.new, 0.0), (fleet.old, 0.03)):
        eid = fleet.engine_id(replay)
        mine = w[w["engine_id"] == eid]
        gen = float(mine["generation_tokens"].sum())  # per second, 1 s windows
        assert gen == pytest.approx(want["generation_tokens"], rel=tol, abs=1e-6), (name, eid)
        assert float(mine["preemptions"].sum()) == pytest.approx(
            want["preemptions"], rel=max(tol, 0.0), abs=1e-6
        )
        n = int((r["engine_id"] == eid).sum())
        assert n == pytest.approx(want["requests"], rel=tol, abs=0), (name, eid)
        counts = mine[["generation_tokens", "prompt_tokens", "preemptions"]]
        assert (counts.fillna(0) >= 0).all().all()  # resets never read as negative


def test_collector_series_carry_the_queue_per_step(
    analysed: tuple[str, PrometheusSource, Any], fleet: Fleet
) -> None:
    """From a collector's series the queue is a per-step mean (its per-step sums over the
    steps), as in the store, not the latest step's gauge: weighted by the windows' steps,
    it adds up to the recording's queue summed over its steps."""
    name, source, _ = analysed
    w = source.windows(fleet.since, fleet.until)
    mine = w[w["engine_id"] == KVSCOPE_ENGINE]
    steps = [b["steps"] for b in fleet.recording.batches if b.get("steps")]
    want = float(sum(sum(s["waiting"]) for s in steps))
    assert want > 1_000  # the recording queues
    got = float((mine["waiting_mean"] * mine["n_steps"]).sum())  # 1 s windows
    assert got == pytest.approx(want, rel=0.02), name
    # Not integers as a gauge's sample would be.
    queued = mine["waiting_mean"][mine["waiting_mean"] > 0].to_numpy(float)
    assert (np.abs(queued - np.round(queued)) > 1e-6).mean() > 0.5, name


def test_engine_configuration_from_the_info_series(
    analysed: tuple[str, PrometheusSource, Any], fleet: Fleet
) -> None:
    _, source, _ = analysed
    e = source.engines().set_index("engine_id")
    new = e.loc[fleet.engine_id(fleet.new)]
    assert (new["num_gpu_blocks"], new["block_size"]) == (48, 32)
    assert bool(new["enable_prefix_caching"]) and new["model"] == "kvscope-demo"
    assert new["series"] == "vllm" and new["pool"] == "kvscope-demo"
    assert math.isnan(float(new["max_num_seqs"]))  # not exported by vLLM, not pinned here
    kv = e.loc[KVSCOPE_ENGINE]
    assert kv["series"] == "kvscope" and kv["pool"] == "demo"
    assert (kv["max_num_seqs"], kv["max_num_batched_tokens"]) == (256, 2048)


def test_requests_are_histogram_estimates(
    analysed: tuple[str, PrometheusSource, Any], fleet: Fleet
) -> None:
    _, source, _ = analysed
    r = source.requests(fleet.since, fleet.until)
    mine = r[r["engine_id"] == fleet.engine_id(fleet.new)]
    real = np.concatenate(
        [b["requests"]["e2e_s"] for b in fleet.recording.batches if b.get("requests")]
    )
    # Bucket interpolation keeps each percentile in the bucket the real one is in.
    les = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]  # vLLM's e2e buckets
    for q in (0.1, 0.5, 0.9, 0.99):
        est, true = float(mine["e2e_s"].quantile(q)), float(np.quantile(real, q))
        assert np.searchsorted(les, est) == np.searchsorted(les, true), (q, est, true)
    assert float(mine["generation_tokens"].mean()) == pytest.approx(128, rel=0.02)
    assert (mine["weight"] == 1.0).all()
    # Finish reasons from vLLM's request_success counter: the recording's, in its counts.
    reasons = Counter(
        x
        for b in fleet.recording.batches
        if b.get("requests")
        for x in b["requests"]["finish_reason"]
    )
    assert dict(Counter(mine["finish_reason"])) == dict(reasons)


def test_selector_and_pool_label(fleet: Fleet) -> None:
    url = fleet.backends["prometheus"].url
    only_old = PrometheusSource(url, selector='{model_name="old-model"}', series="vllm")
    w = only_old.windows(fleet.since, fleet.until)
    assert set(w["engine_id"]) == {fleet.engine_id(fleet.old)}
    by_job = PrometheusSource(url, pool_label="job", series="vllm")
    by_job.windows(fleet.since, fleet.until)
    assert set(by_job.engines()["pool"]) == {"vllm"}
    kvs = PrometheusSource(url, series="kvscope")
    assert set(kvs.windows(fleet.since, fleet.until)["engine_id"]) == {KVSCOPE_ENGINE}


def test_engines_before_any_range_is_read(fleet: Fleet) -> None:
    source = PrometheusSource(fleet.backends["prometheus"].url, lookback_s=3600)
    e = source.engines()
    assert set(e["engine_id"]) == {
        fleet.engine_id(fleet.new),
        fleet.engine_id(fleet.old),
        KVSCOPE_ENGINE,
    }
    assert set(e.loc[e["series"] == "vllm", "num_gpu_blocks"]) == {48}


def test_errors_name_the_cause(fleet: Fleet) -> None:
    url = fleet.backends["prometheus"].url
    with pytest.raises(SourceError, match=r"answered 400 .*bad_data"):
        PrometheusSource(url, selector='{job=~"("}').windows(fleet.since, fleet.until)
    with pytest.raises(SourceError, match="cannot reach Prometheus"):
        PrometheusSource("http://127.0.0.1:9", timeout_s=2).windows(fleet.since, fleet.until)
    with pytest.raises(SourceError, match=r"answered 404 .*base URL"):
        PrometheusSource(fleet.new.url).windows(fleet.since, fleet.until)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_cli_advise_from_prometheus(fleet: Fleet, tmp_path: Path) -> None:
    url = fleet.backends["victoria-metrics"].url
    window = ["--since", f"{fleet.since:.3f}", "--until", f"{fleet.until:.3f}"]
    out = tmp_path / "advice.json"
    p = _cli("advise", "--prometheus", url, *window, "--json", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["coverage"]["source"] == "prometheus"
    assert {e["bottleneck"] for e in doc["engines"]} == {"kv_cache_bound"}
    text = _cli("advise", "--prometheus", url, *window, "--pool", "kvscope-demo")
    assert text.returncode == 0, text.stderr
    assert "kv_cache_bound" in text.stdout and f"Prometheus {url}" in text.stdout
    assert "scrape_resolution" in text.stdout


def test_cli_advise_errors(fleet: Fleet) -> None:
    url = fleet.backends["prometheus"].url
    window = ["--since", f"{fleet.since:.3f}", "--until", f"{fleet.until:.3f}"]
    none = _cli("advise", "--prometheus", url, *window, "--selector", '{job="nope"}')
    assert none.returncode == 3
    assert "tried vllm:num_requests_running or kvscope_engine_steps_total" in none.stderr
    bad = _cli("advise", "--prometheus", url, *window, "--selector", '{job=~"("}')
    assert bad.returncode == 2 and "400" in bad.stderr and "bad_data" in bad.stderr
    sel = _cli("advise", "--prometheus", url, "--selector", "vllm:foo")
    assert sel.returncode == 2 and "--selector" in sel.stderr
    down = _cli("advise", "--prometheus", "http://127.0.0.1:9", "--timeout", "2")
    assert down.returncode == 2 and "cannot reach Prometheus at http://127.0.0.1:9" in down.stderr
    neither = _cli("advise")
    assert neither.returncode == 2 and "--prometheus" in neither.stderr
