"""The weekly report as one versioned object: what ``report.json`` holds.

:class:`WeeklyReport` carries both weeks' advisor reports (this week's and the
week before, analysed alike), both weeks' usage (:func:`kvscope.advisor.usage.weekly_usage`),
the comparison (:func:`kvscope.advisor.weekly.compare_weeks`) and the configuration history
it read, and what :func:`~kvscope.report.build.build_weekly_report` derived from them
with the advisor's functions: the action list (:mod:`kvscope.advisor.actions`), GPU-hours
per pool (:mod:`kvscope.advisor.gpu_hours`) and the capacity forecast
(:mod:`kvscope.advisor.forecast`). :attr:`WeeklyReport.change_counts` is the one count of
what changed that every rendering shows. The renderers (:mod:`kvscope.report.html`,
:mod:`kvscope.report.markdown`, :mod:`kvscope.report.text`) take only this object; they
never recompute.

``schema_version`` is bumped on a change an older reader would misread; adding a
field is not such a change (readers ignore fields they do not know).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kvscope import __version__
from kvscope.advisor.actions import Action
from kvscope.advisor.findings import Frame, Report, SchemaVersionError, _clean
from kvscope.advisor.forecast import PoolForecast
from kvscope.advisor.gpu_hours import PoolHours
from kvscope.advisor.usage import Usage
from kvscope.advisor.weekly import Comparison

REPORT_KIND = "kvscope-weekly-report"
REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ChangeCounts:
    """How many changes of each group the comparison lists.

    ``compared`` is False when the week before had no data: then nothing was lined up
    and only configuration changes can be counted (the ``no_previous_data`` marker is
    not a change)."""

    compared: bool
    worse: int
    better: int
    other: int
    config: int

    @property
    def total(self) -> int:
        return self.worse + self.better + self.other + self.config

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclass
class WeeklyReport:
    """This week, the week before, and what changed (see the module docstring)."""

    source: str
    """Where the data came from: ``collector http://...`` or ``store path``."""
    generated_unix_s: float
    current: Report
    previous: Report
    usage: Usage
    previous_usage: Usage
    comparison: Comparison
    configs: Frame = field(default_factory=dict)
    """Configuration history (one row per engine hello) up to the end of the window."""
    week_configs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """``{"current" | "previous": {engine_id: {field: value}}}``: each engine's
    configuration fields (:data:`kvscope.advisor.weekly.CONFIG_FIELDS`) as each week was
    analysed."""
    parameters: dict[str, Any] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    """This week's and last week's advice as a list of actions, in reading order."""
    gpu_hours: list[PoolHours] = field(default_factory=list)
    """Engine-hours, GPU-hours and their cost per pool this week."""
    forecast: list[PoolForecast] = field(default_factory=list)
    """Per pool: the trend of the daily peak load against the capacity."""
    gpu_hour_cost: float | None = None
    """USD per GPU-hour (None: GPU-hours only)."""
    schema_version: int = REPORT_SCHEMA_VERSION

    @property
    def change_counts(self) -> ChangeCounts:
        """The count of what changed since the week before (see :class:`ChangeCounts`)."""
        changes = [c for c in self.comparison.changes if c.kind != "no_previous_data"]
        config = [c for c in changes if c.kind == "config_change"]
        rest = [c for c in changes if c.kind != "config_change"]
        return ChangeCounts(
            compared=self.previous.has_data
            and not any(c.kind == "no_previous_data" for c in self.comparison.changes),
            worse=sum(1 for c in rest if c.direction == "worse"),
            better=sum(1 for c in rest if c.direction == "better"),
            other=sum(1 for c in rest if c.direction not in ("worse", "better")),
            config=len(config),
        )

    @property
    def since_unix_s(self) -> float:
        return float(self.usage.since_unix_s)

    @property
    def until_unix_s(self) -> float:
        return float(self.usage.until_unix_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": REPORT_KIND,
            "schema_version": self.schema_version,
            "kvscope_version": __version__,
            "source": self.source,
            "generated_unix_s": self.generated_unix_s,
            "window": {
                "since_unix_s": self.usage.since_unix_s,
                "until_unix_s": self.usage.until_unix_s,
            },
            "previous_window": {
                "since_unix_s": self.previous_usage.since_unix_s,
                "until_unix_s": self.previous_usage.until_unix_s,
            },
            "parameters": _clean(self.parameters),
            "current": self.current.to_dict(),
            "previous": self.previous.to_dict(),
            "usage": self.usage.to_dict(),
            "previous_usage": self.previous_usage.to_dict(),
            "comparison": self.comparison.to_dict(),
            "change_counts": self.change_counts.to_dict(),
            "actions": [a.to_dict() for a in self.actions],
            "gpu_hour_cost": self.gpu_hour_cost,
            "gpu_hours": [p.to_dict() for p in self.gpu_hours],
            "forecast": [f.to_dict() for f in self.forecast],
            "configs": _clean(self.configs),
            "week_configs": _clean(self.week_configs),
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeeklyReport:
        if d.get("kind") != REPORT_KIND:
            raise ValueError(f"not a kvscope weekly report (kind {d.get('kind')!r})")
        if d.get("schema_version") != REPORT_SCHEMA_VERSION:
            raise SchemaVersionError(
                f"weekly report schema_version {d.get('schema_version')!r}; "
                f"this kvscope reads {REPORT_SCHEMA_VERSION}"
            )
        return cls(
            source=d["source"],
            generated_unix_s=d["generated_unix_s"],
            current=Report.from_dict(d["current"]),
            previous=Report.from_dict(d["previous"]),
            usage=Usage.from_dict(d["usage"]),
            previous_usage=Usage.from_dict(d["previous_usage"]),
            comparison=Comparison.from_dict(d["comparison"]),
            configs=dict(d.get("configs") or {}),
            week_configs=dict(d.get("week_configs") or {}),
            parameters=dict(d.get("parameters") or {}),
            actions=[Action.from_dict(x) for x in d.get("actions") or []],
            gpu_hours=[PoolHours.from_dict(x) for x in d.get("gpu_hours") or []],
            forecast=[PoolForecast.from_dict(x) for x in d.get("forecast") or []],
            gpu_hour_cost=d.get("gpu_hour_cost"),
        )

    @classmethod
    def from_json(cls, text: str) -> WeeklyReport:
        return cls.from_dict(json.loads(text))
