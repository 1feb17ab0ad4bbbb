"""Which raw engine steps the engine page reads and plots, for any time range.

A busy engine makes a hundred steps a second or more: a day is millions of rows, more
than a page can read or a browser can draw. The 1-second windows count the steps of
each second (``n_steps``), so the number of steps in a range is known before reading
it. :func:`plan_steps` decides from that count: up to ``max_plotted`` steps are read
and drawn one by one; past that the collector sends every k-th step of the range
(``/v1/steps?every=k``), so a page reads about ``max_plotted`` rows whatever the range,
and says "every k-th step of N". The per-second series keep every second's mean and
maximum either way. Raw steps are kept for the collector's raw retention (a day by
default); older ranges have the per-second and per-minute series only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

MAX_PLOTTED = 5_000
"""Steps drawn at most (each is a point of two lines and of the KV-usage line)."""


@dataclass(frozen=True)
class StepPlan:
    """``n_steps`` in the range (from the windows); ``k``: every k-th is read and drawn."""

    since_unix_s: float
    until_unix_s: float
    n_steps: int
    k: int

    @property
    def text(self) -> str:
        """``all 3,412 steps`` or ``every 4th step of 18,213``."""
        if self.k == 1:
            return f"all {self.n_steps:,} steps"
        return f"every {ordinal(self.k)} step of {self.n_steps:,}"


def ordinal(k: int) -> str:
    """``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    if 10 <= k % 100 <= 20:
        return f"{k}th"
    return f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th') }"


def steps_in(windows: pd.DataFrame, since_unix_s: float, until_unix_s: float) -> int:
    """Steps in ``[since, until)`` by the 1-second windows' ``n_steps`` (windows that
    overlap the range count whole)."""
    if not len(windows) or "n_steps" not in windows or "ts_s" not in windows:
        return 0
    ts = pd.to_numeric(windows["ts_s"], errors="coerce")
    inside = (ts + 1.0 > since_unix_s) & (ts < until_unix_s)
    return int(pd.to_numeric(windows.loc[inside, "n_steps"], errors="coerce").fillna(0).sum())


def plan_steps(
    windows: pd.DataFrame,
    since_unix_s: float,
    until_unix_s: float,
    *,
    max_plotted: int = MAX_PLOTTED,
) -> StepPlan:
    """What to read and draw of the steps in ``[since, until)``."""
    n = steps_in(windows, since_unix_s, until_unix_s)
    k = max(1, math.ceil(n / max_plotted))
    return StepPlan(since_unix_s, until_unix_s, n, k)


def every_kth(steps: pd.DataFrame, k: int) -> pd.DataFrame:
    """Every ``k``-th step (the 1st, the (k+1)-th, ...), oldest first."""
    return steps.iloc[:: max(1, k)].reset_index(drop=True)
