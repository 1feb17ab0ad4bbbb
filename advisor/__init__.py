"""kvscope advisor: analyses of vLLM engine telemetry, frames in, findings out.

Each analysis is a pure, deterministic function or sklearn-style detector over
DataFrames (``__init__`` stores parameters, ``fit`` returns self, learned attributes
end in ``_``); :func:`analyze` runs them all per engine and pool through a
:class:`Source` and returns a versioned :class:`Report`.
"""

from advisor.analyze import analyze, analyze_frames
from advisor.balance import LoadBalance
from advisor.bottleneck import BottleneckClassifier
from advisor.cap import ConcurrencyCap
from advisor.capacity import KvCapacityModel, WhatIf, replica_whatif
from advisor.curve import NotEnoughData, ThroughputCurve
from advisor.findings import (
    BOTTLENECKS,
    SCHEMA_VERSION,
    EngineVerdict,
    Finding,
    PoolVerdict,
    Recommendation,
    Report,
    SchemaVersionError,
    Scope,
)
from advisor.latency import LatencyVsLoad
from advisor.prefill import PrefillCost
from advisor.prefix import KV_EVENT_COLUMNS, PrefixRouting
from advisor.prometheus import PrometheusSource, analyze_prometheus
from advisor.sources import CollectorSource, FrameSource, Source, SourceError, WindowSample
from advisor.steptime import StepTimeModel

__all__ = [
    "BOTTLENECKS",
    "KV_EVENT_COLUMNS",
    "SCHEMA_VERSION",
    "BottleneckClassifier",
    "CollectorSource",
    "ConcurrencyCap",
    "EngineVerdict",
    "Finding",
    "FrameSource",
    "KvCapacityModel",
    "LatencyVsLoad",
    "LoadBalance",
    "NotEnoughData",
    "PoolVerdict",
    "PrefillCost",
    "PrefixRouting",
    "PrometheusSource",
    "Recommendation",
    "Report",
    "SchemaVersionError",
    "Scope",
    "Source",
    "SourceError",
    "StepTimeModel",
    "ThroughputCurve",
    "WhatIf",
    "WindowSample",
    "analyze",
    "analyze_frames",
    "analyze_prometheus",
    "replica_whatif",
]
