"""The report's JSON round trip and versioning."""

from __future__ import annotations

import json

import pytest

from kvscope.advisor import FrameSource, Report, SchemaVersionError, analyze
from kvscope.advisor.datasets import make_engine


def test_report_round_trips_through_json() -> None:
    s = make_engine("kv_cache_bound", seed=0)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests))
    text = rep.to_json()
    back = Report.from_json(text)
    assert back.to_dict() == json.loads(text)
    assert back.engine("synth:8000:0").bottleneck == "kv_cache_bound"
    assert json.loads(text)["schema_version"] == 1
    kinds = {f.kind for f in back.findings}
    assert {"throughput_curve", "bottleneck", "kv_capacity", "latency_vs_load"} <= kinds
    curve = back.findings_of("throughput_curve")[0]
    assert curve.frame is not None and len(curve.frame["load"]) == curve.evidence["n_bins"]


def test_other_schema_version_is_refused() -> None:
    with pytest.raises(SchemaVersionError):
        Report.from_dict({"schema_version": 99})


def test_too_little_data_gives_insufficient_data() -> None:
    s = make_engine("compute_bound", seed=0)
    rep = analyze(FrameSource(s.engines, s.windows.head(3), s.requests.head(2)))
    assert rep.engines[0].bottleneck == "insufficient_data"
