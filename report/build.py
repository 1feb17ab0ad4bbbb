"""Build the weekly report: read two weeks once, analyse each, compare, write the files.

"This week" is ``[since, until)``; "the week before" the window of the same length
ending at ``since``. Both are analysed by :func:`kvscope.advisor.analyze` over the same
frames, each with the engines' configuration as it was at the end of its window
(:func:`kvscope.advisor.weekly.config_as_of`), so last week is judged by last week's
``max_num_seqs``. Usage and the comparison come from :mod:`kvscope.advisor.usage` and
:mod:`kvscope.advisor.weekly`, the action list, GPU-hours and capacity forecast from
:mod:`kvscope.advisor.actions`, :mod:`kvscope.advisor.gpu_hours` and
:mod:`kvscope.advisor.forecast`; nothing here derives a number of its own.

A source that can sample (the store, :class:`~kvscope.report.sources.StoreSource`)
is asked for each week's :class:`~advisor.WindowSample` instead (whole time blocks, at
most about ``max_windows_per_engine`` windows per engine: the analyses fit on it) and
for the usage sums per engine and day (``usage_days``, DuckDB over every window), so
memory stays bounded however large the fleet; a fleet small enough is read whole and
analysed exactly as from frames.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from kvscope import __version__
from kvscope.advisor import FrameSource, Report, WindowSample, analyze
from kvscope.advisor.actions import action_list
from kvscope.advisor.analyze import MAX_WINDOWS_PER_ENGINE, analyze_sample
from kvscope.advisor.forecast import capacity_forecast
from kvscope.advisor.frames import frame_of
from kvscope.advisor.gpu_hours import gpu_hours
from kvscope.advisor.minute_windows import append_minute_windows, sample_with_minutes
from kvscope.advisor.sources import Source, SourceError
from kvscope.advisor.usage import Usage, usage_from_days, weekly_usage
from kvscope.advisor.weekly import CONFIG_FIELDS, compare_weeks, config_as_of
from kvscope.report.model import WeeklyReport

BUILD_STEPS = 8
"""Progress steps :func:`build_weekly_report` takes (for the bar's total)."""
WRITE_STEPS = 3
FILES = ("report.html", "report.md", "report.json")


class Progress(Protocol):
    """What is used of a tqdm bar."""

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None: ...

    def update(self, n: float | None = 1) -> bool | None: ...


class _Silent:
    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        return None

    def update(self, n: float | None = 1) -> bool | None:
        return None


class ReportSource(Source, Protocol):
    """The advisor's source questions and the configuration history."""

    def engine_configs(self) -> pd.DataFrame: ...


def build_weekly_report(
    source: ReportSource,
    since: float,
    until: float,
    *,
    pool: str | None = None,
    source_label: str = "",
    progress: Progress | None = None,
    max_windows_per_engine: int | None = MAX_WINDOWS_PER_ENGINE,
    gpu_hour_cost: float | None = None,
    forecast_min_days: int = 4,
    forecast_horizon_weeks: float = 8.0,
    forecast_history_weeks: float = 4.0,
    **analyze_kw: Any,
) -> WeeklyReport:
    """Read, analyse and compare (see the module docstring). ``analyze_kw`` go to
    :func:`kvscope.advisor.analyze` for both weeks (SLOs, ``cap_fraction``...);
    ``max_windows_per_engine`` bounds a sampling source's read (``None``: read every
    window into memory, from any source); ``gpu_hour_cost`` (USD per GPU-hour) prices
    the GPU-hours; the forecast needs ``forecast_min_days`` days with data, looks
    ``forecast_horizon_weeks`` ahead and draws its line through the daily peaks of the
    week and, from a source with 1-minute windows (``daily_load_peaks``), of the
    ``forecast_history_weeks`` before it."""
    bar = progress or _Silent()
    length = until - since
    prev_since = since - length

    def step(desc: str) -> None:
        bar.set_description(desc)

    step("reading engines and their configuration history")
    engines = source.engines()
    configs = source.engine_configs()
    if len(configs) and "engine_id" in configs and pool is not None and "pool" in engines:
        configs = configs[
            configs["engine_id"].isin(set(engines.loc[engines["pool"] == pool, "engine_id"]))
        ]
    bar.update(1)
    sampler = getattr(source, "window_sample", None)
    samples: dict[str, WindowSample] = {}
    if sampler is not None and max_windows_per_engine:
        for name, start, end in (("current", since, until), ("previous", prev_since, since)):
            step(
                f"reading {'this week' if name == 'current' else 'the week before'}: "
                "windows, requests, KV-cache events"
            )
            s = sampler(start, end, pool=pool, max_windows_per_engine=max_windows_per_engine)
            samples[name] = sample_with_minutes(source, engines, s, start, end, pool)
            bar.update(1)
        bar.update(1)
        windows = requests = kv_events = pd.DataFrame()
    else:
        step("reading two weeks of 1-second windows")
        windows = source.windows(prev_since, until, pool=pool)
        bar.update(1)
        step("reading finished requests")
        # week by week: rows standing for deleted requests lie inside their own week
        parts = [source.requests(a, b, pool=pool) for a, b in ((prev_since, since), (since, until))]
        kept = [p for p in parts if len(p)]
        requests = pd.concat(kept, ignore_index=True) if len(kept) > 1 else (kept or parts)[0]
        bar.update(1)
        step("reading KV-cache events")
        kv_events = source.kv_events(prev_since, until, pool=pool)
        bar.update(1)
    minutes = (
        None if samples else _minutes_without_seconds(source, windows, prev_since, until, pool)
    )

    week_configs: dict[str, dict[str, dict[str, Any]]] = {}

    def week(name: str, start: float, end: float) -> Report:
        as_of = config_as_of(engines, configs, end)
        week_configs[name] = {
            str(r["engine_id"]): {f: r.get(f) for f in CONFIG_FIELDS if f in r}
            for r in (as_of.to_dict("records") if "engine_id" in as_of else [])
        }
        if name in samples:
            return analyze_sample(
                as_of, samples[name], since=start, until=end, pool=pool, **analyze_kw
            )
        in_week = windows
        if "ts_s" in windows:
            ts = pd.to_numeric(windows["ts_s"], errors="coerce")
            in_week = windows[(ts >= start) & (ts < end)]
        week_windows = append_minute_windows(source, engines, in_week, start, end, pool)
        frames = FrameSource(as_of, week_windows, requests, kv_events)
        return analyze(frames, start, end, pool, **analyze_kw)

    def week_usage(report: Report, start: float, end: float) -> Usage:
        sums = getattr(source, "usage_days", None)
        if sums is None or not samples:
            return weekly_usage(windows, requests, report, start, end, minutes=minutes)
        knees = pd.DataFrame(
            {
                "engine_id": [v.engine_id for v in report.engines],
                "knee": [v.knee_concurrency if v.saturated else None for v in report.engines],
            },
            dtype=object,
        )
        return usage_from_days(sums(knees, start, end), report, start, end)

    step("analysing this week")
    current = week("current", since, until)
    bar.update(1)
    step("analysing the week before")
    previous = week("previous", prev_since, since)
    bar.update(1)
    step("usage per day")
    usage = week_usage(current, since, until)
    previous_usage = week_usage(previous, prev_since, since)
    bar.update(1)
    step("comparing the weeks")
    comparison = compare_weeks(current, previous, configs, usage=usage)
    pool_hours, values = gpu_hours(
        usage, current, week_configs.get("current"), gpu_hour_cost=gpu_hour_cost
    )
    actions = action_list(
        current, previous, week_configs.get("current"), values, week_configs.get("previous")
    )
    history = None
    peaks_of = getattr(source, "daily_load_peaks", None)
    if peaks_of is not None and forecast_history_weeks > 0:
        step("daily peaks of the weeks before (1-minute windows)")
        start = max(0.0, since - forecast_history_weeks * 7 * 86400.0)
        history = peaks_of(start, since, pool=pool) if since > start else None
    forecast = capacity_forecast(
        usage,
        current,
        min_days=forecast_min_days,
        horizon_weeks=forecast_horizon_weeks,
        history=history,
    )
    bar.update(1)
    history = configs
    if len(configs) and "started_unix_s" in configs:
        history = configs[
            pd.to_numeric(configs["started_unix_s"], errors="coerce").fillna(0.0) < until
        ]
    generated = round(time.time(), 3)
    kind, _, where = source_label.partition(" ")
    for r in (current, previous):  # each week's report says what wrote it, as advise's do
        r.generated_unix_s = generated
        r.kvscope_version = __version__
        if kind.lower() in ("collector", "prometheus", "store") and where:
            r.source = {"kind": kind.lower(), "url": where}
    return WeeklyReport(
        source=source_label,
        generated_unix_s=generated,
        current=current,
        previous=previous,
        usage=usage,
        previous_usage=previous_usage,
        comparison=comparison,
        configs=frame_of(history, list(history.columns)),
        week_configs=week_configs,
        parameters={
            "pool": pool,
            **analyze_kw,
            "forecast_min_days": forecast_min_days,
            "forecast_horizon_weeks": forecast_horizon_weeks,
            "forecast_history_weeks": forecast_history_weeks,
        },
        actions=actions,
        gpu_hours=pool_hours,
        forecast=forecast,
        gpu_hour_cost=gpu_hour_cost,
    )


def write_report_files(
    report: WeeklyReport, out_dir: str | Path, progress: Progress | None = None
) -> list[Path]:
    """Write ``report.html``, ``report.md`` and ``report.json`` into ``out_dir``."""
    from kvscope.report.html import render_html
    from kvscope.report.markdown import render_markdown

    bar = progress or _Silent()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, render in (
        ("report.html", render_html),
        ("report.md", render_markdown),
        ("report.json", lambda r: r.to_json(indent=1) + "\n"),
    ):
        bar.set_description(f"writing {name}")
        path = out / name
        path.write_text(render(report), encoding="utf-8")
        written.append(path)
        bar.update(1)
    return written


def out_dir_problem(out_dir: str | Path) -> str | None:
    """Why ``out_dir`` cannot take the report files, or None when it can: an existing
    writable folder, or a new one in an existing writable folder. Checked before the
    analysis, so a wrong ``--out`` fails at once instead of after the work."""
    p = Path(out_dir)
    if p.exists():
        if not p.is_dir():
            return f"{p} exists and is not a folder"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"the folder {p} is not writable"
        for name in FILES:
            f = p / name
            if f.exists() and (f.is_dir() or not os.access(f, os.W_OK)):
                return f"{f} cannot be overwritten"
        return None
    parent = p.absolute().parent
    if not parent.is_dir():
        return f"the folder {parent} does not exist (create it, or choose another --out)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {p}: the folder {parent} is not writable"
    return None


def _minutes_without_seconds(
    source: Any, windows: pd.DataFrame, since: float, until: float, pool: str | None
) -> pd.DataFrame | None:
    """The collector's 1-minute windows of ``[since, until)`` before the first 1-second
    window read (``windows``): where the window retention deleted the seconds, the
    weeks' usage is summed from the minutes. ``None`` from a source without them or
    when the seconds cover the range."""
    read = getattr(source, "minute_windows", None)
    if read is None:
        return None
    first = (
        float(pd.to_numeric(windows["ts_s"], errors="coerce").min())
        if len(windows) and "ts_s" in windows
        else until
    )
    if not first > since + 60:
        return None
    try:
        return read(since, min(first, until), pool=pool)
    except SourceError as exc:
        if exc.status == 404:  # a collector from before the minute tier
            return None
        raise
