"""The result of a sweep: a versioned JSON document and a text table.

JSON layout (``schema_version`` 1)::

    {
      "schema_version": 1,
      "url": "http://127.0.0.1:8000", "model": "kvscope-lab",
      "started_unix_s": 1764430000.0, "finished_unix_s": 1764430090.0,
      "config": {...SweepConfig, api key masked...},
      "levels": [{...LevelResult fields...}, ...]
    }

Bump :data:`SCHEMA_VERSION` on any change an old reader would misread; adding a
field with a default is not such a change.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from kvscope.lab.sweep.errors import SweepError
from kvscope.lab.sweep.stats import LevelResult

SCHEMA_VERSION = 1


@dataclass
class SweepResult:
    """All levels of one sweep against one server and model."""

    url: str
    model: str
    started_unix_s: float
    finished_unix_s: float
    config: dict[str, Any]
    levels: list[LevelResult] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``schema_version`` first)."""
        data = asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepResult:
        """Inverse of :meth:`to_dict`; raises :class:`SweepError` on another schema version."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SweepError(
                f"sweep result schema_version {version!r}; this reader knows {SCHEMA_VERSION}"
            )
        level_fields = {f.name for f in fields(LevelResult)}
        levels = [
            LevelResult(**{k: v for k, v in lv.items() if k in level_fields})
            for lv in data["levels"]
        ]
        return cls(
            url=data["url"],
            model=data["model"],
            started_unix_s=data["started_unix_s"],
            finished_unix_s=data["finished_unix_s"],
            config=data["config"],
            levels=levels,
        )

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON document to ``path`` (parents created); returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def read_json(cls, path: str | os.PathLike[str]) -> SweepResult:
        """Read a document written by :meth:`write_json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("conc", "{:>5}"),
    ("in-flight", "{:>9}"),
    ("done", "{:>6}"),
    ("errors", "{:>6}"),
    ("out tok/s", "{:>9}"),
    ("total tok/s", "{:>11}"),
    ("req/s", "{:>6}"),
    ("TTFT p50", "{:>8}"),
    ("TTFT p99", "{:>9}"),
    ("e2e p50", "{:>7}"),
    ("e2e p99", "{:>8}"),
    ("warm+window", "{:>11}"),
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def format_table(result: SweepResult) -> str:
    """The levels as a fixed-width text table, one row per level."""
    header = "  ".join(fmt.format(name) for name, fmt in _COLUMNS)
    replicas = result.config.get("replicas") or []
    where = (
        result.url
        if not replicas
        else (f"{result.url} + {len(replicas)} more, {result.config.get('routing')} routing")
    )
    lines = [f"{result.model} @ {where}", header, "-" * len(header)]
    for lv in result.levels:
        cells = (
            lv.concurrency,
            f"{lv.mean_in_flight:.1f}",
            lv.requests_completed,
            lv.error_count,
            f"{lv.output_tokens_per_s:.0f}",
            f"{lv.total_tokens_per_s:.0f}",
            f"{lv.requests_per_s:.2f}",
            _seconds(lv.ttft_p50_s),
            (">" if lv.ttft_p99_truncated else "") + _seconds(lv.ttft_p99_s),
            _seconds(lv.e2e_p50_s),
            (">" if lv.e2e_p99_truncated else "") + _seconds(lv.e2e_p99_s),
            f"{lv.warmup_s:.0f}+{lv.duration_s:.0f}s",
        )
        lines.append(
            "  ".join(fmt.format(cell) for (_, fmt), cell in zip(_COLUMNS, cells, strict=True))
        )
    if replicas:
        for lv in result.levels:
            if lv.requests_per_target:
                lines.append(
                    f"concurrency {lv.concurrency}: requests per server "
                    + ", ".join(str(n) for n in lv.requests_per_target)
                )
    if any(lv.e2e_p99_truncated or lv.ttft_p99_truncated for lv in result.levels):
        lines.append(
            "a p99 marked '>' is a lower bound: requests older than it were still waiting "
            "at the window's end (lengthen --duration; --fixed-windows cuts levels short)"
        )
    kinds = sorted({k for lv in result.levels for k in lv.errors})
    if kinds:
        lines.append(
            "errors by kind: "
            + ", ".join(f"{k}={sum(lv.errors.get(k, 0) for lv in result.levels)}" for k in kinds)
        )
        for lv in result.levels:
            for kind, example in lv.error_examples.items():
                lines.append(f"  concurrency {lv.concurrency}, first {kind} {example}")
    return "\n".join(lines)


def print_table(result: SweepResult, file: TextIO | None = None) -> None:
    """Print :func:`format_table` to ``file`` (stdout by default)."""
    print(format_table(result), file=file)
