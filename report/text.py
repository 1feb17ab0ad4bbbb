"""The summary ``kvscope report`` prints: the counts, the action list, GPU-hours and the
capacity forecast, in the words of :mod:`kvscope.report._plan` (as in ``report.md``
and ``report.html``). Presents the :class:`~kvscope.report.model.WeeklyReport` only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvscope.report import _plan as plan
from kvscope.report.model import WeeklyReport

MAX_ACTIONS = 10
"""Action lines printed at most (the files hold every one)."""


def render_summary(wr: WeeklyReport, paths: Sequence[Path | str] = ()) -> str:
    """The summary as lines of text, ending with the files written."""
    _, n_actions, actions_note = plan.actions_figure(wr)
    out = [
        f"weekly report for {len(wr.current.engines)} engine(s) in {len(wr.current.pools)} pool(s)",
        f"changes since the week before: {plan.counts_text(wr)}",
        f"actions to take: {n_actions} ({actions_note})",
    ]
    shown = 0
    for key, title, items in plan.numbered(wr):
        if key == "closed":
            continue
        out.append(f"  {title.split(':')[0]}:")
        for i, a in items:
            if shown == MAX_ACTIONS:
                break
            shown += 1
            out.append(
                f"    {i}. [{plan.STATUS_TEXT[a.status]}] {plan.effect_text(a)} on "
                f"{a.scope.engine_id or f'pool {a.scope.pool}'}: {a.summary}"
            )
    if shown < int(n_actions):
        out.append(f"    ... {int(n_actions) - shown} more in report.md")
    head, rows = plan.gpu_hours_table(wr)
    for row in rows:
        out.append("GPU-hours: " + "; ".join(f"{h} {c}" for h, c in zip(head, row, strict=True)))
    out += [f"forecast: {plan.forecast_text(wr, f)}" for f in wr.forecast]
    out += [f"  {p}" for p in paths]
    return "\n".join(out)
