"""The advisor on a block sample of the windows against the advisor on every window, and
the usage sums in SQL against the ones from frames: a store generated from the real
recordings (:mod:`kvscope.lab.fleetgen`, one engine per recording, half a day each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from kvscope.advisor import analyze
from kvscope.advisor.usage import usage_from_days, weekly_usage
from kvscope.lab.fleetgen import TEMPLATES, FleetSpec, generate_fleet_store
from kvscope.report.sources import StoreSource, open_store

SPEC = FleetSpec(n_engines=3, n_pools=3, days=0.5, request_every=4, seed=3)
SINCE, UNTIL = float(SPEC.start_unix_s), float(SPEC.end_unix_s)
BUDGET = 4000
"""Windows per engine the sampled analysis reads: under a tenth of the 43,200."""


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("fleet")) / "fleet.duckdb"
    generate_fleet_store(path, SPEC)
    return path


@pytest.fixture(scope="module")
def source(store_path: Path) -> Iterator[StoreSource]:
    src = StoreSource(open_store(store_path))
    yield src
    src.close()


@pytest.fixture(scope="module")
def reports(source: StoreSource) -> dict:
    return {
        "sampled": analyze(source, SINCE, UNTIL, max_windows_per_engine=BUDGET),
        "all": analyze(source, SINCE, UNTIL, max_windows_per_engine=None),
    }


def test_the_sample_is_a_small_part_and_coverage_counts_everything(reports: dict) -> None:
    s, a = reports["sampled"].coverage, reports["all"].coverage
    assert 0 < s["window_sample_share"] <= 1.5 * BUDGET / (SPEC.days * 86400)
    for k in ("n_windows", "n_requests", "first_window_s", "last_window_s", "n_engines_analyzed"):
        assert s[k] == a[k], k
    assert a["n_windows"] > 3 * 40000


def test_sampled_verdicts_agree_with_every_window(reports: dict) -> None:
    """Same bottleneck for the two clearly saturated regimes; knee within 10%, plateau
    within 5%, the cap within 20% for every engine (the ample-KV engine sits at the
    saturation margin, so its label may flip; its numbers may not move)."""
    sampled = {v.engine_id: v for v in reports["sampled"].engines}
    full = {v.engine_id: v for v in reports["all"].engines}
    assert sampled.keys() == full.keys() and len(full) == 3
    for i, eid in enumerate(sorted(full)):
        s, a = sampled[eid], full[eid]
        if TEMPLATES[i] != "ample_kv":
            assert (s.bottleneck, s.saturated) == (a.bottleneck, a.saturated), eid
        if s.knee_concurrency is None or a.knee_concurrency is None:
            # A knee is published only for a saturated engine.
            assert TEMPLATES[i] == "ample_kv" or s.knee_concurrency == a.knee_concurrency, eid
        else:
            assert s.knee_concurrency == pytest.approx(a.knee_concurrency, rel=0.10), eid
        assert s.plateau_tokens_per_s == pytest.approx(a.plateau_tokens_per_s, rel=0.05), eid
        if s.recommended_concurrency_cap and a.recommended_concurrency_cap:
            assert s.recommended_concurrency_cap == pytest.approx(
                a.recommended_concurrency_cap, rel=0.20
            ), eid
    assert {full[e].bottleneck for e in full} >= {"kv_cache_bound", "max_num_seqs_bound"}


def test_a_budget_above_the_data_reads_everything(source: StoreSource, reports: dict) -> None:
    whole = analyze(source, SINCE, UNTIL, max_windows_per_engine=10**6)
    assert "window_sample_share" not in whole.coverage
    assert [v.to_dict() for v in whole.engines] == [v.to_dict() for v in reports["all"].engines]


def test_usage_summed_in_sql_equals_usage_from_frames(source: StoreSource, reports: dict) -> None:
    report = reports["all"]
    assert any(v.saturated for v in report.engines)
    since = SINCE + 0.5  # a fractional start: windows from its second, requests after it
    frames = weekly_usage(
        source.windows(since, UNTIL), source.requests(since, UNTIL), report, since, UNTIL
    )
    knees = pd.DataFrame(
        {
            "engine_id": [v.engine_id for v in report.engines],
            "knee": [v.knee_concurrency if v.saturated else None for v in report.engines],
        },
        dtype=object,
    )
    sql = usage_from_days(source.usage_days(knees, since, UNTIL), report, since, UNTIL)
    assert sql.to_dict() == frames.to_dict()
    assert sum(sql.engines["saturated_s"]) > 0 and sum(sql.engines["requests"]) > 0


def test_report_cli_bounds_the_read_and_reads_everything_with_0(
    store_path: Path, tmp_path: Path
) -> None:
    covs = {}
    for n in ("2000", "0"):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvscope.cli.main",
                "report",
                "--store",
                str(store_path),
                "--since",
                str(int(SINCE)),
                "--until",
                str(int(UNTIL)),
                "--no-progress",
                "--max-windows-per-engine",
                n,
                "--out",
                str(tmp_path / n),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert p.returncode == 0, p.stderr
        covs[n] = json.loads((tmp_path / n / "report.json").read_text())["current"]["coverage"]
    assert covs["2000"]["window_sample_share"] < 0.1
    assert "window_sample_share" not in covs["0"]
    assert covs["2000"]["n_windows"] == covs["0"]["n_windows"] > 3 * 40000
