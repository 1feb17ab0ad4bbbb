"""A concurrency sweep without the engine, and the advisor's verdict on it.

:func:`sweep` runs closed-loop levels one after another on one twin (as a benchmark
client raising ``--max-concurrency`` would), and summarises each level over its steady
part. By default (``steady_state``) a level's warm-up lasts at least ``warmup_share`` of
``seconds_per_level`` and until every client's first request has returned, and its
window at least the rest of ``seconds_per_level`` and at least one cycle of the loop
(:class:`~kvscope.twin.streams.ClosedLoop`): the clients start together, and a level
shorter than a request's time in the engine would measure their first wave (on a GPU,
outputs of 1,000 tokens at 30 ms a step spend 30 s decoding alone). Without it, a level
is exactly ``seconds_per_level``, measured after ``warmup_share`` of it. With a
``feed_url`` every step also goes through the real plugin into that collector, and
:func:`advise` then reads it back with the advisor, exactly as for a real engine: the
knee, plateau, bottleneck and cap of a configuration nobody has started.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvscope.twin.shape import EngineShape
from kvscope.twin.sim import Sink, Twin, TwinResult
from kvscope.twin.steptime import StepCost
from kvscope.twin.streams import ClosedLoop, StreamError, TwinRequest


@dataclass(frozen=True)
class SweepLevel:
    """One level's steady state."""

    concurrency: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    mean_running: float
    mean_waiting: float
    kv_usage_mean: float
    preemptions_per_request: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    finished: int
    warmup_s: float = math.nan
    """Simulated seconds from the level's start to its window."""
    window_s: float = math.nan
    """Simulated seconds of the window the level is summarised over."""


@dataclass
class SweepResult:
    """Every level, and the run they came from."""

    shape: EngineShape
    cost: dict[str, Any]
    levels: list[SweepLevel]
    run: TwinResult
    seconds_per_level: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak(self) -> SweepLevel:
        return max(self.levels, key=lambda lv: lv.output_tokens_per_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.shape.describe(),
            "step_time": self.cost,
            "seconds_per_level": self.seconds_per_level,
            "simulated_s": self.run.sim_s,
            "wall_s": self.run.wall_s,
            "levels": [lv.__dict__ for lv in self.levels],
            **self.extra,
        }


def repeat(requests: Sequence[TwinRequest]) -> Iterator[TwinRequest]:
    """``requests`` over and over, each round with its own tokens after the shared blocks
    (a new conversation with the same system prompt, not a cached copy)."""
    if not requests:
        raise StreamError("a sweep needs at least one request to repeat")
    n = len(requests)
    for rnd in itertools.count():
        for r in requests:
            yield replace(r, arrival_s=None, key=r.key + rnd * n * 7 + rnd) if rnd else r


def sweep(
    shape: EngineShape,
    cost: StepCost,
    requests: Sequence[TwinRequest],
    levels: Sequence[int],
    *,
    seconds_per_level: float = 60.0,
    warmup_share: float = 0.25,
    steady_state: bool = True,
    max_stretch_s: float = 3600.0,
    sink: Sink | None = None,
    start_unix_s: float | None = None,
    progress: Callable[[float], None] | None = None,
) -> SweepResult:
    """Run each concurrency of ``levels`` for ``seconds_per_level`` simulated seconds, or
    longer with ``steady_state`` (module docstring; warm-up and window each at most
    ``max_stretch_s``)."""
    if not levels or min(levels) < 1:
        raise StreamError(f"levels must be positive concurrencies (got {list(levels)})")
    if not seconds_per_level > 0:
        raise StreamError(f"seconds_per_level must be positive (got {seconds_per_level})")
    twin = Twin(shape, cost, sink=sink, start_unix_s=start_unix_s, progress=progress)
    source = endless(requests)
    warmup_s = warmup_share * seconds_per_level
    if steady_state:
        phases = [
            ClosedLoop(
                source,
                int(c),
                duration_s=seconds_per_level - warmup_s,
                steady_state=True,
                warmup_s=warmup_s,
                max_stretch_s=max_stretch_s,
            )
            for c in levels
        ]
    else:
        phases = [ClosedLoop(source, int(c), duration_s=seconds_per_level) for c in levels]
    run = twin.run(*phases)
    starts = run.extra["phase_starts"]
    windows = run.extra["phase_windows"]
    out = []
    for c, start, (a, b) in zip(levels, starts, windows, strict=True):
        if not steady_state:
            a, b = start + warmup_s, start + seconds_per_level
        out.append(replace(_level(run, int(c), a, b), warmup_s=a - start, window_s=b - a))
    return SweepResult(shape, cost.describe(), out, run, seconds_per_level)


def endless(requests: Sequence[TwinRequest]) -> Sequence[TwinRequest]:
    """:func:`repeat` as a request source a :class:`ClosedLoop` takes (clients then send
    for the loop's whole ``duration_s``; one source shared by several loops goes on
    where the last one stopped)."""
    return _Feed(repeat(requests))


class _Feed(Sequence[TwinRequest]):
    """An endless request source that :class:`ClosedLoop` can take (it only iterates)."""

    def __init__(self, source: Iterator[TwinRequest]) -> None:
        self._source = source

    def __iter__(self) -> Iterator[TwinRequest]:
        return self._source

    def __len__(self) -> int:
        return 1  # never empty

    def __getitem__(self, i: Any) -> Any:  # pragma: no cover - not used by ClosedLoop
        raise TypeError("an endless request source cannot be indexed")


def _level(run: TwinResult, concurrency: int, a: float, b: float) -> SweepLevel:
    s = run.steps
    in_w = (s["t_end"] > a) & (s["t_end"] <= b)
    r = run.requests
    done = r[(r["finish"] > a) & (r["finish"] <= b)]
    dur = b - a
    w = s.loc[in_w, "step_s"].to_numpy(float)

    def avg(col: str) -> float:
        v = s.loc[in_w, col].to_numpy(float)
        return float(np.average(v, weights=w)) if w.sum() > 0 else math.nan

    def pct(col: str, q: float) -> float:
        v = done[col].to_numpy(float)
        return float(np.percentile(v, q)) if len(v) else math.nan

    gen = float(s.loc[in_w, "generated"].sum())
    prompt = float(s.loc[in_w, "prompt_tokens"].sum())
    return SweepLevel(
        concurrency=concurrency,
        output_tokens_per_s=gen / dur,
        total_tokens_per_s=(gen + prompt) / dur,
        requests_per_s=len(done) / dur,
        mean_running=avg("running"),
        mean_waiting=avg("waiting"),
        kv_usage_mean=avg("kv_usage"),
        preemptions_per_request=float(done["preemptions"].mean()) if len(done) else math.nan,
        ttft_p50_s=pct("ttft_s", 50),
        ttft_p99_s=pct("ttft_s", 99),
        e2e_p50_s=pct("e2e_s", 50),
        e2e_p99_s=pct("e2e_s", 99),
        finished=len(done),
    )
