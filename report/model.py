"""The weekly report as one versioned object: what ``report.json`` holds.

:class:`WeeklyReport` carries both weeks' advisor reports (this week's and the
week before, analysed alike), both weeks' usage (:func:`kvscope.advisor.usage.weekly_usage`),
the comparison (:func:`kvscope.advisor.weekly.compare_weeks`) and the configuration history
it read. The renderers (:mod:`kvscope.report.html`, :mod:`kvscope.report.markdown`)
take only this object; they never recompute.

``schema_version`` is bumped on a change an older reader would misread; adding a
field is not such a change (readers ignore fields they do not know).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvscope.advisor.findings import Frame, Report, SchemaVersionError, _clean
from kvscope.advisor.usage import Usage
from kvscope.advisor.weekly import Comparison

REPORT_KIND = "kvscope-weekly-report"
REPORT_SCHEMA_VERSION = 1


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
    schema_version: int = REPORT_SCHEMA_VERSION

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
        )

    @classmethod
    def from_json(cls, text: str) -> WeeklyReport:
        return cls.from_dict(json.loads(text))
