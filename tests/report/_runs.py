"""The records the weekly-report tests share: one ``kvscope report`` run, one browser
rendering, and the session that holds them (kept out of ``conftest`` so that test
modules import them by a name no other test folder uses)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _week import Week


@dataclass
class Run:
    """One ``kvscope report`` subprocess."""

    args: list[str]
    out: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def json(self) -> dict[str, Any]:
        return dict(json.loads((self.out / "report.json").read_text()))

    @property
    def html(self) -> str:
        return (self.out / "report.html").read_text()

    @property
    def md(self) -> str:
        return (self.out / "report.md").read_text()


@dataclass
class Browser:
    screenshot: Path
    dom: str
    returncode: int
    stderr: str


@dataclass
class Session:
    week: Week
    url: str
    store: Path
    via_collector: Run
    via_store: Run
    locked: Run
    no_data: Run
    advisor_engines: list[dict[str, Any]]
    """``kvscope.advisor.analyze`` over the collector for the collector run's window."""
    store_advisor_engines: list[dict[str, Any]]
    """``kvscope.advisor.analyze`` over the store file for the store run's window."""
