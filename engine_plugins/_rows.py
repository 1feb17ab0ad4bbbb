"""Raw row layouts, folding of token-only rows, and columns for the wire schema.

``record()`` appends raw tuples (built by :mod:`kvscope.engine_plugins._adapter`) as fast as
it can; everything here runs in the exporter thread.

Raw step row (``RAW_STEP_LAYOUT``)::

    (ts_unix_s, step, running, waiting, deferred, kv_usage, prefix_queries,
     prefix_hits, preemptions, prompt_tokens, generation_tokens, elapsed_ms)

Raw request row (``RAW_REQUEST_LAYOUT``)::

    (finished_unix_s, e2e_s, queue_s, prefill_s, decode_s, first_token_latency_s,
     prompt_tokens, generation_tokens, cached_tokens, preemptions, finish_reason)

``step`` is the logger's own count of ``record()`` calls that produced a row (vLLM's
``step_counter`` is kept only for data-parallel load balancing). A *token-only* row
(iteration stats without scheduler stats, common with ``--api-server-count`` > 1) has no
gauges; :class:`StepFolder` adds its tokens and preemptions to the engine's next step
row of the same wall-clock second, or, when that second ends first, emits them as a row
of their own (the last known gauges, the last token-only row's ``step`` and time, no
prefix counts, ``iteration_s`` null), so step rows stay one per scheduler step, token
totals equal vLLM's, and no second reads another one's tokens. Column builders coerce every value into what :func:`schema.validate_batch`
accepts; a value that cannot be read is replaced (0, or null) and counted.

Why the folding stays in its second, measured: docs/plugin.md#several-api-server-processes
"""

from __future__ import annotations

import math
from typing import Any

from kvscope.engine_plugins.schema import REQUEST_COLUMNS, STEP_COLUMNS

RAW_STEP_LAYOUT = (
    "ts_unix_s", "step", "running", "waiting", "deferred", "kv_usage", "prefix_queries",
    "prefix_hits", "preemptions", "prompt_tokens", "generation_tokens", "elapsed_ms",
)  # fmt: skip
RAW_REQUEST_LAYOUT = (
    "finished_unix_s", "e2e_s", "queue_s", "prefill_s", "decode_s", "first_token_latency_s",
    "prompt_tokens", "generation_tokens", "cached_tokens", "preemptions", "finish_reason",
)  # fmt: skip

TS, STEP, RUNNING, WAITING, DEFERRED, KV, PQ, PH, PREEMPT, PROMPT, GEN, ELAPSED_MS = range(12)

_MAX_REASON_CHARS = 32


class StepFolder:
    """Fold token-only rows into step rows, per engine (see the module docstring)."""

    def __init__(self) -> None:
        self.merged_rows = 0
        """Raw rows absorbed into another row (cumulative)."""
        self.carry_rows = 0
        """Token-only rows currently carried."""
        self._carry = [0, 0, 0]  # preemptions, prompt tokens, generation tokens
        self._carry_second = -1
        self._carry_last: tuple[Any, ...] | None = None
        self._gauges: tuple[Any, ...] = (0, 0, 0, 0.0)

    def feed(self, raw: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Take one raw row; return the rows to emit (none when it was carried)."""
        out: list[tuple[Any, ...]] = []
        if self.carry_rows and _second(raw[TS]) != self._carry_second:
            out.append(self._carry_row())
        if raw[RUNNING] is None:
            if self.carry_rows == 0:
                self._carry_second = _second(raw[TS])
            self._carry[0] += _num(raw[PREEMPT], 0)
            self._carry[1] += _num(raw[PROMPT], 0)
            self._carry[2] += _num(raw[GEN], 0)
            self._carry_last = raw
            self.carry_rows += 1
            return out
        self._gauges = raw[RUNNING : KV + 1]
        if self.carry_rows == 0:
            out.append(raw)
            return out
        p, t, g = self._carry
        out.append(
            (
                *raw[:PREEMPT],
                _num(raw[PREEMPT], 0) + p,
                _num(raw[PROMPT], 0) + t,
                _num(raw[GEN], 0) + g,
                raw[ELAPSED_MS],
            )
        )
        self._reset_carry(merged=self.carry_rows)
        return out

    def take_carry(self, now_unix_s: float, *, final: bool) -> tuple[Any, ...] | None:
        """Return the carried counts as a row once their second is over (or ``final``)."""
        if self._carry_last is None:
            return None
        if not (final or _second(now_unix_s) > self._carry_second):
            return None
        return self._carry_row()

    def _carry_row(self) -> tuple[Any, ...]:
        last = self._carry_last
        assert last is not None
        p, t, g = self._carry
        row = (last[TS], last[STEP], *self._gauges, 0, 0, p, t, g, None)
        self._reset_carry(merged=self.carry_rows - 1)
        return row

    def _reset_carry(self, *, merged: int) -> None:
        self.merged_rows += merged
        self.carry_rows = 0
        self._carry = [0, 0, 0]
        self._carry_last = None


def _second(ts: Any) -> int:
    """The wall-clock second (collector window) of a timestamp; unreadable ones share -1."""
    v = _num(ts, -1.0)
    return math.floor(v) if v >= 0 else -1


def _num(v: Any, default: float) -> Any:
    """Return ``v`` if it is a finite real number (a bool counts as 0 / 1), else ``default``."""
    if isinstance(v, (int, float)) and math.isfinite(v):
        return int(v) if isinstance(v, bool) else v
    return default


class ColumnBuilder:
    """Coerce raw rows into schema columns; ``invalid_values`` counts replacements."""

    def __init__(self) -> None:
        self.invalid_values = 0

    def _int(self, v: Any) -> int:
        if type(v) is int and v >= 0:
            return v
        try:
            f = float(v)
        except (TypeError, ValueError):
            self.invalid_values += 1
            return 0
        if not math.isfinite(f) or f < 0:
            self.invalid_values += 1
            return 0
        return round(f)

    def _float(self, v: Any, hi: float | None = None) -> float:
        """Return a finite float in [0, hi]; negatives read as 0 (not counted as invalid:
        vLLM reports e.g. a negative queue time for a request aborted before scheduling).
        """
        try:
            f = float(v)
        except (TypeError, ValueError):
            self.invalid_values += 1
            return 0.0
        if not math.isfinite(f):
            self.invalid_values += 1
            return 0.0
        if f < 0.0:
            return 0.0
        if hi is not None and f > hi:
            return hi
        return f

    def _float_or_none(self, v: Any) -> float | None:
        if v is None:
            return None
        try:
            f = float(v)
        except (TypeError, ValueError):
            self.invalid_values += 1
            return None
        if not math.isfinite(f):
            self.invalid_values += 1
            return None
        return f if f >= 0.0 else None

    def _reason(self, v: Any) -> str:
        name = getattr(v, "name", None)  # an enum such as vLLM's FinishReason
        text = name if isinstance(name, str) else str(v)
        return text.lower()[:_MAX_REASON_CHARS] or "unknown"

    def steps(
        self, rows: list[tuple[Any, ...]], num_gpu_blocks: int | None
    ) -> dict[str, list[Any]]:
        """Return the step columns (``schema.STEP_COLUMNS``) of emitted step rows."""
        cols: dict[str, list[Any]] = {name: [] for name in STEP_COLUMNS}
        ts, step, batch, waiting, deferred, kv, blocks, pq, ph, pre, prompt, gen, it_s = (
            cols[name] for name in STEP_COLUMNS
        )
        blocks_total = num_gpu_blocks or 0
        for r in rows:
            ts.append(self._float(r[TS]))
            step.append(self._int(r[STEP]))
            batch.append(self._int(r[RUNNING]))
            waiting.append(self._int(r[WAITING]))
            deferred.append(self._int(r[DEFERRED]))
            ratio = self._float(r[KV], 1.0)
            kv.append(ratio)
            blocks.append(round(ratio * blocks_total))
            pq.append(self._int(r[PQ]))
            ph.append(self._int(r[PH]))
            pre.append(self._int(r[PREEMPT]))
            prompt.append(self._int(r[PROMPT]))
            gen.append(self._int(r[GEN]))
            ms = self._float_or_none(r[ELAPSED_MS])
            it_s.append(None if ms is None else ms / 1000.0)
        return cols

    def requests(self, rows: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
        """Return the request columns (``schema.REQUEST_COLUMNS``) of raw request rows."""
        cols: dict[str, list[Any]] = {name: [] for name in REQUEST_COLUMNS}
        ts, e2e, queue, prefill, decode, ttft, prompt, gen, cached, pre, reason = (
            cols[name] for name in REQUEST_COLUMNS
        )
        for r in rows:
            ts.append(self._float(r[0]))
            e2e.append(self._float(r[1]))
            q, p = self._float(r[2]), self._float(r[3])
            queue.append(q)
            prefill.append(p)
            decode.append(self._float(r[4]))
            n_gen = self._int(r[7])
            first = self._float_or_none(r[5])
            if first is None and n_gen > 0 and (q > 0.0 or p > 0.0):
                first = q + p  # engine-side TTFT: queued + prefill
            ttft.append(first)
            prompt.append(self._int(r[6]))
            gen.append(n_gen)
            cached.append(self._int(r[8]))
            pre.append(self._int(r[9]))
            reason.append(self._reason(r[10]))
        return cols
