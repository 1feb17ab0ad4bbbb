"""The report for pipes, files and tickets: plain text and Markdown (``kvscope advise``).

On a terminal ``kvscope advise`` prints :func:`~kvscope.advisor.render.render_report`'s
layout, wrapped to the window. Anywhere else (``| less``, cron mail, a CI log, a file) a
wrapped layout breaks words at column 80, pads lines with spaces and splits the snippets
to copy; :func:`text_report` prints the same content, in the same order, with no wrapping
and no padding: one line per sentence, the findings as a list, and each snippet of a
change (vLLM flags, an nginx block, a router's flags, whatever a recommendation
carries) on lines of its own, exactly as it is to be pasted. :func:`markdown_report` is
the same again as Markdown: lists, and each snippet in a fenced block.

It only presents: every line comes from the terminal view's own builders.
"""

from __future__ import annotations

from typing import Any, TextIO

from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvscope.advisor.findings import Finding, Report
from kvscope.advisor.render import (
    MAX_PLOTS,
    RECOMMENDATIONS_HEADING,
    _change_rows,
    _plot_lines,
    _prefix_block,
    _read_line,
    _recommendation_text,
    _verdict,
    render_report,
)

__all__ = ["FORMATS", "markdown_report", "print_report", "text_report"]

FORMATS = ("text", "markdown", "json")
"""``kvscope advise --format``: text (the terminal layout on a terminal, plain text
elsewhere), Markdown, or the JSON report."""

_PLOTS_LEFT_OUT = "(plots of {n} more engine(s) left out; --json carries every curve)"


def _lines(items: list[Text | Padding]) -> list[tuple[int, str]]:
    """(indent, text) of the terminal view's lines, without their styles."""
    out = []
    for item in items:
        if isinstance(item, Padding):
            inner = item.renderable
            out.append((item.left, inner.plain if isinstance(inner, Text) else str(inner)))
        else:
            out.append((0, item.plain))
    return out


def _plots(report: Report, max_plots: int) -> tuple[list[tuple[str, list[str]]], str]:
    """Up to ``max_plots`` (title, lines), and the note on those left out."""
    plots: list[tuple[str, list[str]]] = []
    for i, v in enumerate(report.engines):
        if len(plots) >= max_plots:
            return plots, _PLOTS_LEFT_OUT.format(n=len(report.engines) - i)
        plot = _plot_lines(report, v)
        if plot is not None:
            plots.append(plot)
    return plots, ""


def _scope(f: Finding) -> str:
    return f.scope.engine_id or f"pool {f.scope.pool}"


def _snippet(text: Any) -> list[str]:
    return str(text).splitlines() or [""]


def text_report(
    report: Report, *, source: str = "", window: str = "", max_plots: int = MAX_PLOTS
) -> str:
    """The report as plain text: no wrapping, no trailing spaces, snippets on lines of
    their own."""
    out: list[str] = []
    add = out.append
    out += [" " * n + t for n, t in _lines(_verdict(report))]
    add(_read_line(report, source, window))
    plots, left_out = _plots(report, max_plots)
    for title, lines in plots:
        out += ["", title, *lines]
    if left_out:
        add(left_out)
    prefix = [b for pv in report.pools for b in _prefix_block(report, pv)]
    if prefix:
        out += ["", "Prefix cache and routing"]
        out += [" " * n + t for n, t in _lines(prefix)]
    add("")
    if report.recommendations:
        add(RECOMMENDATIONS_HEADING)
        for i, r in enumerate(report.recommendations, start=1):
            head, *rest = _recommendation_text(r)
            pad = " " * len(f"{i}. ")
            add(f"{i}. {head.plain}")
            out += [pad + t.plain for t in rest]
            rows = _change_rows(r.change)
            if rows:
                add(f"{pad}change:")
                for label, text in rows:
                    add(f"{pad}  {label}:")
                    out += [f"{pad}    {line}" for line in _snippet(text)]
    else:
        add("No recommendations: nothing to change on this data.")
    if report.findings:
        out += ["", "Findings"]
        out += [
            f"- {f.kind} [{_scope(f)}] {f.severity}, confidence {f.confidence:.2f}: {f.summary}"
            for f in report.findings
        ]
    return "\n".join(line.rstrip() for line in out) + "\n"


def _md(text: str) -> str:
    """``text`` with the characters Markdown would read as markup escaped."""
    for ch in ("\\", "`", "*", "<", "[", "]"):
        text = text.replace(ch, "\\" + ch)
    return text


def _fence(lines: list[str], indent: str = "", lang: str = "") -> list[str]:
    return [f"{indent}```{lang}", *(indent + line for line in lines), f"{indent}```"]


def markdown_report(
    report: Report, *, source: str = "", window: str = "", max_plots: int = MAX_PLOTS
) -> str:
    """The report as Markdown: the verdict and the findings as lists, each plot and each
    snippet of a change in a fenced block."""
    out = ["# kvscope advise", "", "## Verdict", ""]
    out += [f"{' ' * n}- {_md(t)}" for n, t in _lines(_verdict(report))]
    out += ["", f"_{_md(_read_line(report, source, window))}_"]
    plots, left_out = _plots(report, max_plots)
    if plots:
        out += ["", "## Throughput against load"]
        for title, lines in plots:
            out += ["", f"**{_md(title)}**", "", *_fence(lines, lang="text")]
        if left_out:
            out += ["", _md(left_out)]
    prefix = [b for pv in report.pools for b in _prefix_block(report, pv)]
    if prefix:
        out += ["", "## Prefix cache and routing", ""]
        out += [f"{' ' * n}- {_md(t)}" for n, t in _lines(prefix)]
    out += ["", f"## {RECOMMENDATIONS_HEADING}", ""]
    if not report.recommendations:
        out.append("No recommendations: nothing to change on this data.")
    for i, r in enumerate(report.recommendations, start=1):
        head, *rest = _recommendation_text(r)
        out += [f"{i}. **{_md(r.summary)}**", f"   {_md(head.plain[len(r.summary) :].strip())}"]
        out += [f"   - {_md(t.plain)}" for t in rest]
        for label, text in _change_rows(r.change):
            out += [f"   - {_md(label)}:", "", *_fence(_snippet(text), "     "), ""]
        out.append("")
    if report.findings:
        out += ["## Findings", ""]
        out += [
            f"- **{_md(f.kind)}** ({_md(_scope(f))}; {f.severity}; confidence "
            f"{f.confidence:.2f}): {_md(f.summary)}"
            for f in report.findings
        ]
    while out and not out[-1]:
        out.pop()
    return "\n".join(line.rstrip() for line in out) + "\n"


def print_report(
    report: Report, out: TextIO, *, fmt: str = "text", source: str = "", window: str = ""
) -> None:
    """Write the report to ``out``: ``fmt`` "text" is the terminal layout when ``out`` is
    a terminal and :func:`text_report` otherwise; "markdown" is :func:`markdown_report`."""
    if fmt == "markdown":
        out.write(markdown_report(report, source=source, window=window))
    elif out.isatty():
        render_report(report, Console(file=out, highlight=False), source=source, window=window)
    else:
        out.write(text_report(report, source=source, window=window))
