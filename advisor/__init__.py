"""kvscope advisor: analyses of vLLM engine telemetry, frames in, findings out.

Each analysis is a pure, deterministic function or sklearn-style detector over
DataFrames (``__init__`` stores parameters, ``fit`` returns self, learned attributes
end in ``_``); :func:`analyze` runs them all per engine and pool through a
:class:`Source` and returns a versioned :class:`Report`.
"""

from kvscope.advisor.analyze import analyze, analyze_frames
from kvscope.advisor.balance import LoadBalance
from kvscope.advisor.bottleneck import BottleneckClassifier
from kvscope.advisor.cap import ConcurrencyCap
from kvscope.advisor.capacity import KvCapacityModel, WhatIf, replica_whatif
from kvscope.advisor.curve import NotEnoughData, ThroughputCurve
from kvscope.advisor.findings import (
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
from kvscope.advisor.latency import LatencyVsLoad
from kvscope.advisor.prefill import PrefillCost
from kvscope.advisor.prefix import KV_EVENT_COLUMNS, PrefixRouting
from kvscope.advisor.sources import CollectorSource, FrameSource, Source, SourceError, WindowSample
from kvscope.advisor.steptime import StepTimeModel

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
    "replica_whatif",
]
