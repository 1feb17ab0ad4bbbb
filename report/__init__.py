"""The weekly tuning report (``kvscope report``): HTML, Markdown and JSON.

:func:`build_weekly_report` reads two weeks from a collector (:class:`HttpSource`) or
a store file (:class:`StoreSource`, read-only), runs :func:`kvscope.advisor.analyze` on each
and :mod:`kvscope.advisor.weekly` on the pair, and returns a versioned
:class:`WeeklyReport`; :func:`write_report_files` renders it. Names are imported on
first use, so ``kvscope --help`` does not load pandas.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.report.build import build_weekly_report, write_report_files
    from kvscope.report.html import render_html
    from kvscope.report.markdown import render_markdown
    from kvscope.report.model import REPORT_SCHEMA_VERSION, WeeklyReport
    from kvscope.report.sources import (
        HttpSource,
        ReadOnlyStore,
        StoreLockedError,
        StoreOpenError,
        StoreSource,
        open_store,
    )

_WHERE = {
    "build_weekly_report": "build",
    "write_report_files": "build",
    "render_html": "html",
    "render_markdown": "markdown",
    "REPORT_SCHEMA_VERSION": "model",
    "WeeklyReport": "model",
    "HttpSource": "sources",
    "ReadOnlyStore": "sources",
    "StoreLockedError": "sources",
    "StoreOpenError": "sources",
    "StoreSource": "sources",
    "open_store": "sources",
}

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "HttpSource",
    "ReadOnlyStore",
    "StoreLockedError",
    "StoreOpenError",
    "StoreSource",
    "WeeklyReport",
    "build_weekly_report",
    "open_store",
    "render_html",
    "render_markdown",
    "write_report_files",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"kvscope.report.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'kvscope.report' has no attribute {name!r}")
