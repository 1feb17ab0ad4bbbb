"""What one level measured: per-request records in, one :class:`LevelResult` out.

Clocks: every ``*_s`` time of a :class:`RequestRecord` is ``time.perf_counter()``
(monotonic, process-local); only differences are reported, except the window's
wall-clock bounds (``*_unix_s``), which align a level with server-side telemetry.

A level's measurement window is ``[window_start_s, window_end_s)``, after the warm-up;
at its end the requests in flight are cancelled. The summary counts:

- **output tokens** arriving inside the window, from every request (warm-up and
  cancelled ones included): ``output_tokens_per_s`` is unbiased by requests straddling
  the edges; **prompt tokens** when the first output token arrives inside it;
- **completed requests** inside the window: ``requests_per_s`` and e2e percentiles;
  ``e2e_p99_truncated`` marks the P99 as a lower bound when more than one request, and
  more than 1% as many as completed, were cancelled already older than it;
- **TTFT** percentiles over first tokens inside the window (``ttft_p99_truncated``
  likewise, for requests cancelled before their first token);
- **errors** of the whole level by kind; **mean in-flight** over the window.

The truncation rule and why it is rare in steady state: docs/sweep.md#steady-state-levels
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request as the client saw it; filled in while it streams."""

    start_s: float
    max_tokens: int
    est_prompt_tokens: int
    first_token_s: float | None = None
    end_s: float | None = None
    """When it completed or failed; ``None`` while in flight or if cancelled."""
    prompt_tokens: int | None = None
    """As the server reported it (``usage.prompt_tokens``), if it did."""
    output_tokens: int = 0
    token_events: list[tuple[float, int]] = field(default_factory=list)
    """``(arrival_s, new_tokens)`` for every chunk that brought output tokens."""
    error: str | None = None
    """Error kind: ``http_<status>``, ``timeout``, ``connection``, ``protocol``, ``server_error``, ``incomplete``."""
    error_detail: str | None = None
    """What went wrong, as the client saw it (the exception, the server's message)."""
    finish_reason: str | None = None

    def add_tokens(self, now_s: float, n_tokens: int) -> None:
        """Record ``n_tokens`` new output tokens arriving at ``now_s``."""
        if n_tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.output_tokens += n_tokens
        self.token_events.append((now_s, n_tokens))


@dataclass
class LevelResult:
    """The summary of one concurrency level (see the module docstring for definitions)."""

    concurrency: int
    duration_s: float
    warmup_s: float
    requests_started: int
    requests_completed: int
    requests_cancelled: int
    """Requests still unfinished at the window's end (then cancelled)."""
    errors: dict[str, int]
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    mean_in_flight: float
    window_start_unix_s: float = 0.0
    """Wall-clock start of the measurement window, to align it with server telemetry."""
    window_end_unix_s: float = 0.0
    requests_per_target: list[int] | None = None
    """Requests sent to each server (in ``--url`` order) when there are several."""
    ttft_p99_truncated: bool = False
    """The TTFT P99 is a lower bound: as for the e2e P99, with the requests cancelled
    before their first token."""
    e2e_p99_truncated: bool = False
    """The e2e P99 is a lower bound: more than one of the requests cancelled at the
    window's end, and more than 1% as many as completed, were already older (see the
    module)."""
    error_examples: dict[str, str] = field(default_factory=dict)
    """For each error kind, its first occurrence: when (seconds into the level) and what
    the client saw, e.g. ``"at 23.4 s: ServerDisconnectedError: Server disconnected"``."""

    @property
    def error_count(self) -> int:
        """All errors of the level."""
        return sum(self.errors.values())


def steady_window_s(
    concurrency: int,
    warmup_s: float,
    returned: int,
    least_s: float,
    most_s: float,
) -> float:
    """The window of a steady-state closed-loop level whose warm-up of ``warmup_s``
    seconds saw ``returned`` requests come back: at least ``least_s``, and at least one
    cycle of the loop (Little's law: ``concurrency`` clients over the requests per
    second the warm-up measured), at most ``most_s`` (or ``least_s`` if longer).
    Shared by the load generator and the engine twin's closed loops."""
    if returned <= 0:
        return max(least_s, most_s)
    cycle_s = concurrency * warmup_s / returned
    return max(least_s, min(cycle_s, most_s))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default.

    ``None`` for no values.
    """
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], not {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize_level(
    records: Sequence[RequestRecord],
    *,
    concurrency: int,
    level_start_s: float,
    window_start_s: float,
    window_end_s: float,
    unix_offset_s: float = 0.0,
    requests_per_target: list[int] | None = None,
) -> LevelResult:
    """Summarise one level's records over its measurement window.

    ``unix_offset_s`` (``time.time() - time.perf_counter()``) converts the window's
    bounds to wall-clock time for :attr:`LevelResult.window_start_unix_s`.
    """
    duration_s = window_end_s - window_start_s
    if duration_s <= 0:
        raise ValueError("the measurement window must have a positive length")

    def inside(t: float | None) -> bool:
        return t is not None and window_start_s <= t < window_end_s

    output_tokens = 0
    prompt_tokens = 0
    ttfts: list[float] = []
    e2es: list[float] = []
    errors: Counter[str] = Counter()
    examples: dict[str, tuple[float, str]] = {}  # kind: (seconds into the level, detail)
    busy_s = 0.0
    completed = cancelled = 0
    cancelled_ages: list[float] = []
    unserved_ages: list[float] = []  # cancelled before their first token
    for rec in records:
        output_tokens += sum(n for t, n in rec.token_events if inside(t))
        if rec.first_token_s is not None and inside(rec.first_token_s):
            ttfts.append(rec.first_token_s - rec.start_s)
            prompt_tokens += (
                rec.prompt_tokens if rec.prompt_tokens is not None else rec.est_prompt_tokens
            )
        if rec.error is not None:
            errors[rec.error] += 1
            at = (rec.end_s if rec.end_s is not None else rec.start_s) - level_start_s
            if rec.error not in examples or at < examples[rec.error][0]:
                examples[rec.error] = (at, rec.error_detail or rec.error)
        elif rec.end_s is None or rec.end_s >= window_end_s:
            cancelled += 1
            cancelled_ages.append(window_end_s - rec.start_s)
            if rec.first_token_s is None or rec.first_token_s >= window_end_s:
                unserved_ages.append(window_end_s - rec.start_s)
        elif rec.end_s >= window_start_s:
            completed += 1
            e2es.append(rec.end_s - rec.start_s)
        end = window_end_s if rec.end_s is None else rec.end_s
        busy_s += max(0.0, min(end, window_end_s) - max(rec.start_s, window_start_s))
    e2e_p99 = percentile(e2es, 99)
    ttft_p99 = percentile(ttfts, 99)
    return LevelResult(
        concurrency=concurrency,
        duration_s=duration_s,
        warmup_s=window_start_s - level_start_s,
        requests_started=len(records),
        requests_completed=completed,
        requests_cancelled=cancelled,
        errors=dict(sorted(errors.items())),
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        output_tokens_per_s=output_tokens / duration_s,
        total_tokens_per_s=(output_tokens + prompt_tokens) / duration_s,
        requests_per_s=completed / duration_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=ttft_p99,
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=e2e_p99,
        mean_in_flight=busy_s / duration_s,
        window_start_unix_s=window_start_s + unix_offset_s,
        window_end_unix_s=window_end_s + unix_offset_s,
        requests_per_target=requests_per_target,
        error_examples={k: f"at {at:.1f} s: {what}" for k, (at, what) in sorted(examples.items())},
        ttft_p99_truncated=_cut_off(unserved_ages, ttft_p99, len(ttfts)),
        e2e_p99_truncated=_cut_off(cancelled_ages, e2e_p99, completed),
    )


def _cut_off(ages: Sequence[float], p99: float | None, measured: int) -> bool:
    """Whether a P99 over ``measured`` requests is only a lower bound: more than one of
    the requests cut off at the window's end (aged ``ages`` then), and more than 1% as
    many as were measured, were already older than it."""
    if p99 is None:
        return False
    older = sum(1 for age in ages if age > p99)
    return older > max(1.0, 0.01 * measured)
