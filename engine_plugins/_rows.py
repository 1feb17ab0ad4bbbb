"""Raw row layouts, folding of token-only rows, and columns for the wire schema.

``record()`` appends raw tuples (built by :mod:`kvscope.engine_plugins._adapter`) as fast as
it can; everything here runs in the exporter thread.

Raw step row (``RAW_STEP_LAYOUT``)::

    (ts_unix_s, step, running, waiting, deferred, kv_usage, prefix_queries,
     prefix_hits, preemptions, prompt_tokens, generation_tokens, elapsed_ms)

``step`` is the logger's own count of ``record()`` calls that produced a row
(vLLM's ``SchedulerStats.step_counter`` is only maintained for data-parallel
load balancing). A *token-only* row comes from a ``record()`` call that carried
iteration stats but no scheduler stats; its gauges (running .. kv_usage) are None.

Folding (:class:`StepFolder`): a token-only row does not become a step row of its
own. Its prompt/generation tokens and preemptions are added to the engine's next
step row, so the step rows stay one per scheduler step and the token totals still
equal vLLM's counters. If no step row follows within ``CARRY_MAX_S`` (an API
server process that never receives scheduler stats), or at the final flush, the
carried counts are emitted as one row with the last known gauges of that engine
(zeros if none is known yet), the ``step`` and ``ts_unix_s`` of the last
token-only row, no prefix-cache counts, and ``iteration_s`` null.

Raw request row (``RAW_REQUEST_LAYOUT``)::

    (finished_unix_s, e2e_s, queue_s, prefill_s, decode_s, first_token_latency_s,
     prompt_tokens, generation_tokens, cached_tokens, preemptions, finish_reason)

Column builders coerce every value into what :func:`schema.validate_batch`
accepts (ints, finite non-negative floats, lowercase reason strings); a value that
cannot be read is replaced (0, or null where the schema allows) and counted.
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

#: How long token-only counts wait for a step row before they become a row of their own.
CARRY_MAX_S = 2.0

_MAX_REASON_CHARS = 32


class StepFolder:
    """Fold token-only rows into step rows, per engine (see the module docstring)."""

    def __init__(self) -> None:
        self.merged_rows = 0
        """Raw rows absorbed into another row (cumulative)."""
        self.carry_rows = 0
        """Token-only rows currently carried."""
        self._carry = [0, 0, 0]  # preemptions, prompt tokens, generation tokens
        self._carry_first_ts = 0.0
        self._carry_last: tuple[Any, ...] | None = None
        self._gauges: tuple[Any, ...] = (0, 0, 0, 0.0)

    def feed(self, raw: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Take one raw row; return the row to emit, or None when it was carried."""
        if raw[RUNNING] is None:
            if self.carry_rows == 0:
                self._carry_first_ts = _num(raw[TS], 0.0)
            self._carry[0] += _num(raw[PREEMPT], 0)
            self._carry[1] += _num(raw[PROMPT], 0)
            self._carry[2] += _num(raw[GEN], 0)
            self._carry_last = raw
            self.carry_rows += 1
            return None
        self._gauges = raw[RUNNING : KV + 1]
        if self.carry_rows == 0:
            return raw
        p, t, g = self._carry
        row = (
            *raw[:PREEMPT],
            _num(raw[PREEMPT], 0) + p,
            _num(raw[PROMPT], 0) + t,
            _num(raw[GEN], 0) + g,
            raw[ELAPSED_MS],
        )
        self._reset_carry(merged=self.carry_rows)
        return row

    def take_carry(self, now_unix_s: float, *, final: bool) -> tuple[Any, ...] | None:
        """Return the carried counts as a row if they waited too long (or ``final``)."""
        last = self._carry_last
        if last is None or not (final or now_unix_s - self._carry_first_ts >= CARRY_MAX_S):
            return None
        p, t, g = self._carry
        row = (last[TS], last[STEP], *self._gauges, 0, 0, p, t, g, None)
        self._reset_carry(merged=self.carry_rows - 1)
        return row

    def _reset_carry(self, *, merged: int) -> None:
        self.merged_rows += merged
        self.carry_rows = 0
        self._carry = [0, 0, 0]
        self._carry_last = None


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
