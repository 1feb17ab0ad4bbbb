"""The report's JSON round trip, versioning, schema and recommendation ids."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pandas as pd
import pytest

from kvscope.advisor import FrameSource, Report, SchemaVersionError, Scope, analyze
from kvscope.advisor.datasets import make_engine
from kvscope.advisor.findings import JSON_SCHEMA_PATH


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


def _stamped(rep: Report) -> dict[str, object]:
    """The report as ``kvscope advise`` writes it."""
    rep.generated_unix_s, rep.kvscope_version = 1_764_430_000.0, "0.0.0"
    rep.source = {"kind": "collector", "url": "http://c:8844"}
    return dict(json.loads(rep.to_json()))


@pytest.mark.parametrize("regime", ["kv_cache_bound", "max_num_seqs_bound", "compute_bound"])
def test_reports_validate_against_the_shipped_schema(regime: str) -> None:
    schema = json.loads(JSON_SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    a = make_engine(regime, seed=0, engine_id="h1:8000:0", pool="p")
    b = make_engine("kv_cache_bound", seed=1, engine_id="h2:8000:0", pool="p")
    frames = [
        pd.concat([x, y], ignore_index=True)
        for x, y in ((a.engines, b.engines), (a.windows, b.windows), (a.requests, b.requests))
    ]
    d = _stamped(analyze(FrameSource(*frames)))
    jsonschema.validate(d, schema)
    assert Report.from_dict(d).to_dict() == d
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**d, "generated_unix_s": None}, schema)


def test_recommendation_ids_come_from_kind_scope_and_change_only() -> None:
    s = make_engine("kv_cache_bound", seed=0)
    one = analyze(FrameSource(s.engines, s.windows, s.requests)).recommendations
    two = analyze(FrameSource(s.engines, s.windows, s.requests)).recommendations
    assert [r.id for r in one] == [r.id for r in two]
    assert len({r.id for r in one}) == len(one)
    r = one[0]
    reworded = dataclasses.replace(r, summary="x", confidence=0.1, expected_effect={})
    assert reworded.id == r.id
    assert dataclasses.replace(r, change={**r.change, "concurrency_cap": 999}).id != r.id
    assert dataclasses.replace(r, scope=Scope("other:8000:0", "p")).id != r.id
    assert r.to_dict()["id"] == r.id
