"""Request-length traces: read public LLM-serving traces into :class:`TraceRow` lists.

The format is recognised from the file itself:

- **Mooncake** (``.jsonl``, kvcache-ai/Mooncake FAST'25): one JSON object per line
  with ``input_length``, ``output_length`` and ``hash_ids`` (the ids of the prompt's
  512-token prefix blocks; equal ids mean an identical prefix block).
- **Azure LLM inference 2023** (``.csv``): columns ``ContextTokens``, ``GeneratedTokens``.
- **Length statistics** (``.csv``, sarathi-serve ShareGPT, vidur arXiv summarization):
  columns ``num_prefill_tokens``, ``num_decode_tokens``.

Arrival times (Mooncake ``timestamp`` in milliseconds, Azure ``TIMESTAMP``) are read
into ``arrival_s``, seconds after the trace's first request; the closed-loop sweep uses
only the lengths (and prefix blocks), the engine twin (:mod:`kvscope.twin`) replays the
arrivals. Rows with a prompt or an output of fewer than one token are skipped.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from kvscope.lab.sweep.errors import TraceFormatError

#: Tokens per Mooncake ``hash_ids`` block.
MOONCAKE_BLOCK_TOKENS = 512

#: CSV header pairs (prompt tokens, output tokens) by format name.
CSV_COLUMNS: dict[str, tuple[str, str]] = {
    "azure": ("ContextTokens", "GeneratedTokens"),
    "lengths": ("num_prefill_tokens", "num_decode_tokens"),
}


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace."""

    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] = ()
    """Prefix block ids (Mooncake ``hash_ids``), each :data:`MOONCAKE_BLOCK_TOKENS` tokens."""
    arrival_s: float | None = None
    """Seconds after the trace's first arrival; None when the trace has no times."""


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRow]:
    """Read up to ``limit`` rows of the trace at ``path`` (format detected from its content).

    Raises :class:`TraceFormatError` for an unknown format, a bad row (naming the line)
    or a trace without usable rows.
    """
    p = Path(path)
    try:
        with p.open(newline="", encoding="utf-8") as fh:
            first = fh.readline()
            fh.seek(0)
            if first.lstrip().startswith("{"):
                rows = _read_mooncake(fh, limit)
            else:
                rows = _read_csv(fh, limit)
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {p}: {exc}") from exc
    if not rows:
        raise TraceFormatError(f"trace {p} has no rows with at least one prompt and output token")
    return rows


def _read_mooncake(lines: TextIO, limit: int | None) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ts = obj.get("timestamp")
            row = TraceRow(
                int(obj["input_length"]),
                int(obj["output_length"]),
                tuple(int(b) for b in obj.get("hash_ids", ())),
                None if ts is None else float(ts) / 1000.0,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"line {lineno}: not a Mooncake trace row: {exc}") from exc
        if row.input_tokens >= 1 and row.output_tokens >= 1:
            rows.append(row)
    return _from_first(rows)


def _read_csv(fh: TextIO, limit: int | None) -> list[TraceRow]:
    reader = csv.DictReader(fh)
    header = set(reader.fieldnames or ())
    for in_col, out_col in CSV_COLUMNS.values():
        if {in_col, out_col} <= header:
            break
    else:
        known = "; ".join(" + ".join(cols) for cols in CSV_COLUMNS.values())
        raise TraceFormatError(f"unknown CSV trace header {sorted(header)}; expected {known}")
    timed = "TIMESTAMP" in header
    rows: list[TraceRow] = []
    for record in reader:
        if limit is not None and len(rows) >= limit:
            break
        try:
            at = _azure_time(record["TIMESTAMP"]) if timed else None
            row = TraceRow(round(float(record[in_col])), round(float(record[out_col])), (), at)
        except (ValueError, TypeError) as exc:
            raise TraceFormatError(f"line {reader.line_num}: bad row: {exc}") from exc
        if row.input_tokens >= 1 and row.output_tokens >= 1:
            rows.append(row)
    return _from_first(rows)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of an Azure ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``:
    seven fractional digits, which :meth:`datetime.fromisoformat` of Python 3.10 refuses)."""
    whole, _, frac = text.strip().partition(".")
    t = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return t.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def _from_first(rows: list[TraceRow]) -> list[TraceRow]:
    """Arrival times relative to the earliest one."""
    times = [r.arrival_s for r in rows if r.arrival_s is not None]
    if not times:
        return rows
    t0 = min(times)
    return [r if r.arrival_s is None else replace(r, arrival_s=r.arrival_s - t0) for r in rows]
