"""Typed, versioned results of the analyses: findings, recommendations, verdicts, report.

Every result is a plain dataclass that round-trips through JSON (``to_dict`` /
``from_dict``); :class:`Report` carries ``schema_version``, bumped on a change an
older reader would misread. Adding a field, a finding ``kind`` or a recommendation
``kind`` is not such a change: readers ignore verdict fields they do not know, and
kinds are open strings. Renderers (CLI, dashboard, ``/metrics``) only present
these objects; they never recompute.

Conventions: numbers carry their unit in the key (``tokens_per_s``, ``_s``,
``_ratio``); a *frame* is a dict of equal-length columns (``{column: [values]}``),
the data behind a finding's plot; ``scope`` names the engine and/or pool the result
is about (``engine_id`` is ``None`` for a pool-level result).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.advisor.request_latency import RequestLatency

SCHEMA_VERSION = 1
"""Version of the report's JSON layout."""

JSON_SCHEMA_PATH = Path(__file__).with_name("advise.schema.json")
"""JSON Schema (draft 2020-12) of the report ``kvscope advise --json`` writes (with
``generated_unix_s``, ``kvscope_version`` and ``source`` set)."""

Frame = dict[str, list[Any]]

#: Bottleneck labels an engine verdict can carry.
BOTTLENECKS = (
    "kv_cache_bound",
    "max_num_seqs_bound",
    "token_budget_bound",
    "compute_bound",
    "frontend_bound",
    "unexplained",
    "not_saturated",
    "insufficient_data",
)
SEVERITIES = ("info", "warning", "critical")

#: What a recommendation's ``expected_gain`` measures: a relative throughput gain (the
#: plateau), a relative latency reduction (P99 or mean TTFT), or a relative cost saving.
#: Gains of different kinds are not on one scale and are never ranked against each other.
GAIN_KINDS = ("throughput", "latency", "cost")
_GAIN_KIND_OF = {
    "concurrency_cap": "latency",
    "pool_concurrency_cap": "latency",
    "prefix_aware_routing": "latency",
    "least_loaded_routing": "latency",
    "raise_max_num_seqs": "throughput",
    "raise_max_num_batched_tokens": "throughput",
    "scale_api_server": "throughput",
}


def gain_kind_of(kind: str) -> str:
    """The :data:`GAIN_KINDS` entry of a recommendation kind (``whatif_*``: throughput)."""
    if kind.startswith("whatif_"):
        return "throughput"
    return _GAIN_KIND_OF.get(kind, "throughput")


class SchemaVersionError(ValueError):
    """A report was written with a schema version this kvscope cannot read."""


def _clean(v: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN/inf and pandas' missing values
    (``pd.NA`` of a nullable column, ``pd.NaT``) to None, tuples to lists."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if type(v).__name__ in ("NAType", "NaTType"):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@dataclass(frozen=True)
class Scope:
    """What a result is about: one engine of a pool, or a whole pool."""

    engine_id: str | None = None
    pool: str | None = None


@dataclass
class Finding:
    """One observation with its evidence.

    ``kind`` names the analysis result (``throughput_curve``, ``bottleneck``,
    ``kv_capacity``, ``latency_vs_load``, ``preemption_thrash``...); ``evidence`` holds
    the numbers the summary states; ``frame`` the columns behind its plot.
    """

    kind: str
    scope: Scope
    summary: str
    severity: str = "info"
    confidence: float = 1.0
    evidence: dict[str, Any] = field(default_factory=dict)
    frame: Frame | None = None

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            kind=d["kind"],
            scope=Scope(**d["scope"]),
            summary=d["summary"],
            severity=d.get("severity", "info"),
            confidence=d.get("confidence", 1.0),
            evidence=dict(d.get("evidence") or {}),
            frame=d.get("frame"),
        )


@dataclass
class Recommendation:
    """A concrete change with its predicted effect.

    ``change`` holds what to apply, e.g. ``{"vllm_flags": ["--max-num-seqs 12"], "gateway":
    {"nginx": {"config": "server h1:8000 max_conns=12;", "scope": "replica", "excess":
    "...", ...}}}`` (a gateway's rendering, :mod:`kvscope.advisor.gateways`);
    ``expected_effect`` the predicted numbers (``throughput_fraction``,
    ``plateau_tokens_per_s``, ``p99_e2e_s``...); ``expected_gain`` one number used to
    rank recommendations of one ``gain_kind`` (:data:`GAIN_KINDS`): a relative throughput
    gain, or a relative latency reduction; ``gain_kind`` defaults from ``kind``
    (:func:`gain_kind_of`).
    """

    kind: str
    scope: Scope
    summary: str
    change: dict[str, Any]
    expected_effect: dict[str, Any]
    tradeoff: str = ""
    confidence: float = 1.0
    expected_gain: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    gain_kind: str = ""

    def __post_init__(self) -> None:
        if not self.gain_kind:
            self.gain_kind = gain_kind_of(self.kind)

    @property
    def id(self) -> str:
        """``rec-`` and 12 hex digits of a SHA-256 over ``kind``, ``scope`` and ``change``
        (canonical JSON): the same advice gets the same id run after run, week after
        week; a different cap or flag is a different id. Predictions, evidence and wording
        do not enter it."""
        key = {"kind": self.kind, "scope": dataclasses.asdict(self.scope), "change": self.change}
        canon = json.dumps(_clean(key), sort_keys=True, separators=(",", ":"))
        return "rec-" + hashlib.sha256(canon.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **_clean(dataclasses.asdict(self))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recommendation:
        return cls(
            kind=d["kind"],
            scope=Scope(**d["scope"]),
            summary=d["summary"],
            change=dict(d["change"]),
            expected_effect=dict(d["expected_effect"]),
            tradeoff=d.get("tradeoff", ""),
            confidence=d.get("confidence", 1.0),
            expected_gain=d.get("expected_gain", 0.0),
            evidence=dict(d.get("evidence") or {}),
            gain_kind=d.get("gain_kind", ""),
        )


@dataclass
class EngineVerdict:
    """The answer for one engine: where its throughput stops growing, why, what cap.

    ``bottleneck`` is one of :data:`BOTTLENECKS`; when the engine is not saturated,
    ``approaching`` names the ceiling the top of the observed load range points to.
    ``knee_concurrency`` and caps are in in-flight requests (running + waiting); the knee
    is None for an engine that did not saturate.
    """

    engine_id: str
    pool: str | None
    bottleneck: str
    saturated: bool
    knee_concurrency: float | None = None
    plateau_tokens_per_s: float | None = None
    plateau_total_tokens_per_s: float | None = None
    max_load_seen: float | None = None
    headroom: str = ""
    approaching: str | None = None
    preemption_thrash: bool = False
    recommended_concurrency_cap: int | None = None
    predicted_throughput_fraction_at_cap: float | None = None
    predicted_p99_e2e_s_at_cap: float | None = None
    p99_e2e_s_at_max_load: float | None = None
    confidence: float = 0.0
    prefix_hit_rate: float | None = None
    """Prefix-cache hits / queries (tokens) over the window; None without queries."""
    latency: RequestLatency | None = None
    """What the engine's finished requests saw: percentiles, lengths, finish reasons and
    SLO attainment (:mod:`kvscope.advisor.request_latency`); None without requests."""

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineVerdict:
        return cls(**_fields(cls, d))


@dataclass
class PoolVerdict:
    """A pool (deployment) summed over its engines.

    The prefix and routing fields come from :mod:`kvscope.advisor.prefix` and
    :mod:`kvscope.advisor.balance`: ``prefix_hit_rate`` (hits / queries over the pool's
    engines), ``prefix_routing_loss`` (share of looked-up tokens recomputed while
    another replica held them; needs KV-cache events and two engines),
    ``predicted_prefix_hit_rate_affine`` (hit rate predicted under prefix-affine
    routing: delivered + routing loss, a lower bound) and ``load_imbalance`` (busiest
    replica's mean in-flight load / the pool mean; two engines or more).
    """

    pool: str | None
    engine_ids: list[str]
    bottlenecks: dict[str, int]
    plateau_tokens_per_s: float | None = None
    recommended_concurrency_cap: int | None = None
    engines_without_cap: list[str] = field(default_factory=list)
    engines_not_saturated: list[str] = field(default_factory=list)
    """Engines whose load never went past a knee: no plateau of theirs is in
    ``plateau_tokens_per_s`` (their capacity is above what they served)."""
    prefix_hit_rate: float | None = None
    prefix_routing_loss: float | None = None
    predicted_prefix_hit_rate_affine: float | None = None
    load_imbalance: float | None = None
    latency: RequestLatency | None = None
    """The finished requests of all the pool's engines taken together (see
    :attr:`EngineVerdict.latency`)."""

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolVerdict:
        return cls(**_fields(cls, d))


def _fields(cls: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``d`` that are fields of ``cls`` (others are ignored), ``latency``
    read back into a :class:`RequestLatency`."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in d.items() if k in names}
    if isinstance(out.get("latency"), dict):
        out["latency"] = RequestLatency.from_dict(out["latency"])
    return out


@dataclass
class Report:
    """Everything one ``analyze`` run found, per engine and per pool."""

    since_unix_s: float | None
    until_unix_s: float | None
    parameters: dict[str, Any] = field(default_factory=dict)
    engines: list[EngineVerdict] = field(default_factory=list)
    pools: list[PoolVerdict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    coverage: dict[str, Any] = field(default_factory=dict)
    """What the analysis read: ``n_engines_known`` (in the source, after the pool
    filter), ``n_engines_analyzed`` (those with windows in the time range),
    ``n_engines_latency_only`` (those with finished requests and no window in it: their
    1-second windows aged out; latency only), ``n_windows``, ``n_requests``, ``first_window_s`` / ``last_window_s`` (first and
    last second with data), ``latest_step_unix_s`` (the newest step any of those
    engines ever sent, also outside the range) and ``pools`` (every pool the source
    knows)."""
    schema_version: int = SCHEMA_VERSION
    generated_unix_s: float | None = None
    """Wall-clock time the report was written (set by the command that writes it; None
    from :func:`~kvscope.advisor.analyze`, which stays deterministic)."""
    kvscope_version: str | None = None
    """The kvscope that wrote the report (set with ``generated_unix_s``)."""
    source: dict[str, Any] | None = None
    """What was read: ``{"kind": "collector" | "prometheus", "url": ...}``."""

    @property
    def has_data(self) -> bool:
        """True when at least one engine had windows or finished requests in the time
        range (for a report written without ``coverage``: when it has engine verdicts)."""
        if "n_engines_analyzed" not in self.coverage:
            return bool(self.engines)
        return bool(
            self.coverage["n_engines_analyzed"] or self.coverage.get("n_engines_latency_only")
        )

    def engine(self, engine_id: str) -> EngineVerdict:
        """The verdict of one engine (KeyError when absent)."""
        for v in self.engines:
            if v.engine_id == engine_id:
                return v
        raise KeyError(engine_id)

    def findings_of(self, kind: str, engine_id: str | None = None) -> list[Finding]:
        return [
            f
            for f in self.findings
            if f.kind == kind and (engine_id is None or f.scope.engine_id == engine_id)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "since_unix_s": _clean(self.since_unix_s),
            "until_unix_s": _clean(self.until_unix_s),
            "parameters": _clean(self.parameters),
            "engines": [v.to_dict() for v in self.engines],
            "pools": [v.to_dict() for v in self.pools],
            "findings": [f.to_dict() for f in self.findings],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "coverage": _clean(self.coverage),
            "generated_unix_s": _clean(self.generated_unix_s),
            "kvscope_version": self.kvscope_version,
            "source": _clean(self.source),
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"report schema_version {version!r}; this kvscope reads {SCHEMA_VERSION}"
            )
        return cls(
            since_unix_s=d.get("since_unix_s"),
            until_unix_s=d.get("until_unix_s"),
            parameters=dict(d.get("parameters") or {}),
            engines=[EngineVerdict.from_dict(x) for x in d.get("engines", [])],
            pools=[PoolVerdict.from_dict(x) for x in d.get("pools", [])],
            findings=[Finding.from_dict(x) for x in d.get("findings", [])],
            recommendations=[Recommendation.from_dict(x) for x in d.get("recommendations", [])],
            coverage=dict(d.get("coverage") or {}),
            generated_unix_s=d.get("generated_unix_s"),
            kvscope_version=d.get("kvscope_version"),
            source=d.get("source"),
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))
