"""The advisor on the real vLLM engine: three regimes, the closed loop, the capacity model.

One command (about ten minutes on a 2-core machine, five engine starts included)::

    .venv/bin/python bench/advisor_scenarios.py [--duration 5] [--json out.json]

What it does
------------
1. A collector process on a fresh store. For each regime of :data:`SCENARIOS` (the
   engine configurations of ``kvscope.lab.engine.REGIMES``) it starts the real vLLM CPU
   engine on the lab's "mid" model with the kvscope plugin pointed at the
   collector, warms it up, and runs a closed-loop sweep (concurrency 1 to 32, a few
   seconds per level; the overload level as long as the capped runs below), then back
   down from the level below the top to a quarter of it (the machine's drift cancels,
   see ``AdvisorLab``). Once the
   collector holds every token and preemption vLLM's own ``/metrics`` counted,
   :func:`kvscope.advisor.analyze` reads the sweep's time range back over HTTP
   (:class:`advisor.CollectorSource`) and gives the engine's verdict.
   Each engine is stopped before the next starts (an engine keeps a core busy).
2. **Closed loop** on the KV-starved engine, with the advisor's recommended cap
   ``C``: (a) on the same engine, load at client concurrency ``C``; (b) a restarted
   engine with the recommendation's vLLM flags (``--max-num-seqs C
   --max-num-queued-reqs C+Q``: admission control, requests beyond ``C + Q`` in flight
   are rejected with 503 for the client or gateway to retry elsewhere), driven at the
   sweep's highest concurrency.
   Each is set against the uncapped overload (the sweep's highest concurrency) measured
   in the same stretch of time: (a) the cap and the uncapped load alternate on the same
   engine, ``ROUNDS`` rounds; (b) the flags' engine runs ``ROUNDS`` times and is set
   against the uncapped runs of (a) and of a restarted uncapped engine after it (one
   engine start differs from the next by up to 10% here). While a setting's runs are
   noisier than ``MAX_RELATIVE_ERROR`` another round is run (up to ``MAX_ROUNDS``).
   Throughput, e2e P99 (vLLM's own and the load generator's) and preemptions per
   second are compared; each property the tests hold the cap to is a ratio with its 95%
   confidence interval from the runs (:mod:`bench.noise`) and a verdict: holds, fails,
   or within noise (:func:`checks`).
3. **Capacity model**: the KV capacity model's predicted plateau against the
   measured plateau: the client throughput of the sweep levels at or past
   ``SATURATED_MARGIN`` x the knee (the levels where throughput no longer grows), or
   of the highest level when the advisor finds the engine unsaturated, together with
   the uncapped overload runs of the closed loop (a).

Every load level (sweep levels and capped runs) is its own short run, checked against
the collector: if the engine did not see the clients' load (on these machines vLLM's
API server now and then delivers whole responses a second or more late, so closed-loop
clients stop feeding the engine), the level measured the stall, not the engine, and is
run again (see ``MAX_ATTEMPTS``; sweep levels below a quarter of the top concurrency
are run once, nothing is read from them but the advisor's windows); the tables report
the runs per level. The advisor reads every window, stalled runs included. For the
same reason latency under a cap is compared with vLLM's own e2e latency (arrival at
the engine to finish, queueing included) beside the load generator's.

Where the numbers come from: throughput (output tokens/s) and the client's e2e P99
are the load generator's, over each level's measurement window; requests in flight,
preemptions per second and engine generated tokens/s come from the collector's
1-second windows inside that window, vLLM's e2e P99 from the requests it stored. The module doubles as the library of the integration tests in
``tests/integration/test_advisor_real.py``, which run the same scenarios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.noise import FAILS, WITHIN_NOISE, Ratio, ratio, ratio_to, relative_error
from kvscope.advisor import CollectorSource, EngineVerdict, Report, analyze
from kvscope.collector.process import CollectorProcess
from kvscope.lab.engine import (
    REGIMES,
    VllmServer,
    build_model,
    default_model_dir,
    vllm_counter_totals,
)
from kvscope.lab.sweep import LevelResult, SweepConfig, SweepResult, run_sweep

CONCURRENCY = (1, 2, 4, 8, 12, 16, 24, 32)
SATURATED_MARGIN = 1.5
"""Sweep levels at or beyond this multiple of the knee count as the measured plateau
(the advisor's own saturation margin)."""
MODEL_NAME = "kvscope-advisor"
DELIVERED_LOAD_RATIO = 0.9
"""A load level counts only if the engine saw at least this share of the clients'
requests in flight (time average over its windows; clean runs show 0.95-1.0);
otherwise the front end stalled and the level is run again."""
MAX_ATTEMPTS = 3
"""Runs of a level the closed loop reads (the overload level, the capped runs); other
sweep levels from a quarter of the top concurrency up get 2, lower ones 1."""
REFUSED_BACKOFF_S = 1.0
"""Seconds a client refused by admission control (HTTP 503) waits before its next request,
as behind a gateway that sends a refused request to another replica (vLLM refuses with
503 so that load balancers retry elsewhere). With the load generator's default 0.1 s,
the 22 clients beyond an admission limit of 10 sent ~220 refused requests a second, and
handling them took CPU the engine core shares on a 2-core machine: the flags' engine at
cap 8 gave 1,024 tok/s where 8 clients on the uncapped engine gave 1,254, the same batch."""
MAX_FLAGS_STARTS = 2
"""Pairs of engine starts (capped, then uncapped again) the vLLM flags' comparison makes at
most. The runs of one start share that start's speed, and this machine's speed drifts over
tens of seconds: once, the three capped runs (45 s) measured 366 tok/s with the batch at 12
against 564 and 624 from the uncapped starts around them with the batch at 13 (fewer tokens
per sequence and second at a smaller batch: a slower machine, not the flags; an A/B of the
same flags at 32 clients measured 346-484 tok/s against 342-582 on the uncapped starts
before and after it, every setting moving by a fifth or more within one start). So a first pair whose runs
refute a property is measured again on a second pair, and the verdict is taken on all the
runs; a property the flags really break fails on both."""
ROUNDS = 3
"""Runs of each setting a closed-loop comparison makes, interleaved (cap, uncapped, cap,
uncapped, ...): both sides see the same drift of the machine."""
MAX_ROUNDS = 5
"""Rounds at most: while a setting's runs are noisier than ``MAX_RELATIVE_ERROR``, another
round."""
MAX_RELATIVE_ERROR = 0.03
"""A setting is measured again while the standard error of its runs' log-mean (about the
relative standard error of its mean throughput, :func:`bench.noise.relative_error`) is
above this. Quiet runs of these engines differ by 2-8% ((max - min) / median over three
runs: 1-3% standard error); on a noisy host they differ by 20-27% (4-7%) and every round
up to ``MAX_ROUNDS`` is run. Unlike (max - min), this figure falls as runs are added."""

# -- the properties the closed loop and the capacity model are held to ----------------------

MIN_THROUGHPUT_FRACTION = 0.85
"""Throughput under the cap as client concurrency, as a share of the uncapped overload's
(runs interleaved on the same engine), at least: the advisor picks the cap where its
fitted curve reaches 90% of the plateau, and a cap that keeps less than 85% of the
measured one costs the operator more than it says."""
MIN_THROUGHPUT_FRACTION_RESTARTED = 0.80
"""The same property for the recommendation's vLLM flags, which need their own engine
start: the uncapped reference brackets that start (runs before it and on a restarted
engine after it), but the capped start itself may sit up to half the start-to-start
spread (10% here) off their middle, so the bound is 0.85 less 0.05. Clients refused by
admission control wait ``REFUSED_BACKOFF_S`` before trying again, as behind a gateway
that retries elsewhere (measured: 91-92% of the uncapped throughput; with the load
generator's 0.1 s, the storm of refusals took the engine's CPU: 75%)."""
MAX_P99_RATIO = 0.6
"""vLLM's e2e P99 at the cap (client concurrency = cap) over the uncapped overload
level's, at most. vLLM's own latency (arrival at the engine to finish, queueing
included) rather than the load generator's: on these machines the API server now and
then delivers a whole response a second or more late, which is no effect of the cap.
Measured 0.24-0.36 on AVX-512 machines (caps 8-11) and 0.43-0.45 on AVX2 machines at
caps 11-12; caps of 14-15 there, above the load where vLLM began preempting, read
0.60-0.67, which is why the cap stops at the preemption onset (:mod:`kvscope.advisor.cap`)."""
MAX_P99_RATIO_FLAGS = 0.8
"""The same for the admitted requests under the recommendation's vLLM flags, at most:
the tail falls by a fifth or more. Every admitted request passes through vLLM's queue
(``--max-num-queued-reqs`` C + Q is full all the time with 32 clients), waiting there
for a slot, so its P99 is about the client cap's plus one request's duration: 0.48-0.69
of the uncapped one over seven runs (caps 8-11), about twice the client cap's
0.24-0.36. How much more than the client cap it costs is ``MAX_FLAGS_OVER_PREDICTED``."""
MAX_FLAGS_OVER_PREDICTED = 2.5
"""The admitted requests' P99 under the vLLM flags over the advisor's predicted P99 at
the cap (the gateway cap's), at most: the cap's trade-off text says the flags alone add
up to about one request's duration, i.e. about doubling it. Measured 1.67-2.13x over
five runs."""
MACHINE_SPEED_CHANGE = 1.5
"""A shared machine can change speed within a run (measured: the uncapped KV-starved engine
at 1,174 tok/s in the regime sweep, then 439 and 433 on the restarts around the flags'
start, 40 minutes later). The advisor's predicted P99 is in seconds of the first start's
speed: past this factor between the first start and the later ones, the prediction is
scaled by it before the flags' P99 is held to it (:attr:`CapRun.machine_slowdown`)."""
MAX_PLATEAU_ERROR = 0.2
"""The capacity model's predicted plateau within this share of the measured one
(measured runs / prediction between 1 / 1.2 and 1 / 0.8)."""
SWEEP_SPEED_CHANGE = 1.25
"""The machine's speed is taken as steady over a sweep when the levels run both on the
way up and on the way back down (8 clients and more) agree within this factor, up over
down, geometric mean over the pairs (:attr:`RegimeRun.sweep_drift`): 0.89-1.03 on
three steady sweeps (each pair within 1.42). The capacity model's plateau is predicted in
the speed of the sweep's windows; runs at another speed say nothing of the model: past
this factor within the sweep, the prediction is not judged, and uncapped closed-loop runs
whose median is off the sweep's top level by more are left out (the check says so)."""


@dataclass(frozen=True)
class Check:
    """One property of the measurements: a ratio with its confidence interval, the bound,
    and the verdict (:mod:`bench.noise`)."""

    name: str
    what: str
    """The property in words, with its bound."""
    ratio: Ratio
    verdict: str
    note: str = ""
    """What the runs judged leave out, or why the property was not judged."""

    @property
    def failed(self) -> bool:
        return self.verdict == FAILS

    def describe(self) -> str:
        tail = f" ({self.note})" if self.note else ""
        return f"{self.name}: {self.what}: {self.ratio.describe()} -> {self.verdict}{tail}"


@dataclass(frozen=True)
class Scenario:
    """One engine configuration and the verdicts that count as right for it."""

    name: str
    expected: tuple[str, ...]
    num_gpu_blocks: int
    max_num_seqs: int

    @property
    def pool(self) -> str:
        return f"advisor-{self.name}"


SCENARIOS: dict[str, Scenario] = {
    "kv-starved": Scenario("kv-starved", ("kv_cache_bound",), **REGIMES["kv-starved"]),
    "seq-capped": Scenario("seq-capped", ("max_num_seqs_bound",), **REGIMES["seq-capped"]),
    # Ample KV, cap 256: the compute ceiling. Whether a sweep up to 32 clients goes
    # far enough past the knee to call it saturated depends on the curve; either
    # answer is right as long as an unsaturated one names compute as the ceiling.
    "ample-kv": Scenario("ample-kv", ("compute_bound", "not_saturated"), **REGIMES["ample-kv"]),
}


@dataclass
class LevelMeasure:
    """One load level: the client's measurements and the engine's from the collector."""

    concurrency: int
    client_tokens_per_s: float
    e2e_p99_s: float | None
    ttft_p99_s: float | None
    completed: int
    errors: int
    engine_tokens_per_s: float
    preemptions_per_s: float
    batch_median: float
    waiting_median: float
    load_median: float
    """Requests in flight at the engine (running + waiting), median over the windows."""
    load_mean: float
    """The same, mean over the windows (what :attr:`delivered` checks)."""
    kv_usage_median: float
    n_windows: int
    engine_e2e_p99_s: float | None = None
    """P99 of vLLM's own e2e latency (arrival at the engine to finish, queueing included)
    of the requests that finished inside the window; unlike the client's, it holds no
    front-end delay."""
    attempts: int = 1
    """Runs of this level made until the engine saw the load (the last one is kept)."""
    admit_limit: int | None = None
    """Requests the engine admits at most (``--max-num-seqs`` + ``--max-num-queued-reqs``)
    when admission control is on; the rest are rejected with 503."""
    error_kinds: dict[str, int] = field(default_factory=dict)
    """The client's failed requests by kind (``http_503``, ``connection``, ``timeout``...)."""
    error_examples: dict[str, str] = field(default_factory=dict)
    """Each kind's first failure: when and what the client saw."""

    @property
    def offered(self) -> int:
        """Requests in flight the engine should see: the clients, or its admission limit."""
        c = self.concurrency
        return c if self.admit_limit is None else min(c, self.admit_limit)

    @property
    def delivered(self) -> bool:
        """Whether the engine saw the clients' load (the front end did not stall)."""
        return self.load_mean >= DELIVERED_LOAD_RATIO * self.offered

    @property
    def clean(self) -> bool:
        """Whether every request was answered: without admission control, a failed request
        is load the engine never served (with it, the excess is meant to get 503)."""
        return self.admit_limit is not None or self.errors == 0

    def trouble(self) -> str:
        """What is wrong with this run, in words ('' when nothing)."""
        out = []
        if not self.delivered:
            out.append(
                f"the engine saw {self.load_mean:.1f} requests in flight on average, "
                "the front end stalled"
            )
        if not self.clean:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.error_kinds.items()))
            out.append(f"{self.errors} requests failed ({kinds or 'kind unknown'})")
            out.extend(f"first {k} {e}" for k, e in sorted(self.error_examples.items()))
        return "; ".join(out)


@dataclass
class RegimeRun:
    """A regime's engine, sweep and the advisor's report on it."""

    scenario: Scenario
    engine_id: str
    startup_s: float
    since_unix_s: float
    until_unix_s: float
    levels: list[LevelMeasure]
    report: Report
    client_cap: CapRun | None = None
    return_levels: list[LevelMeasure] = field(default_factory=list)
    """The sweep's way back down (see ``AdvisorLab.return_pass``)."""

    @property
    def verdict(self) -> EngineVerdict:
        return self.report.engine(self.engine_id)

    @property
    def correct(self) -> bool:
        v = self.verdict
        if v.bottleneck not in self.scenario.expected:
            return False
        # An unsaturated verdict is right only when it names the expected ceiling.
        return v.bottleneck != "not_saturated" or v.approaching in self.scenario.expected

    def evidence(self, kind: str) -> dict[str, Any]:
        found = self.report.findings_of(kind, self.engine_id)
        return found[0].evidence if found else {}

    @property
    def peak(self) -> LevelMeasure:
        """The sweep level with the highest client throughput."""
        return max(self.levels, key=lambda lv: lv.client_tokens_per_s)

    @property
    def top(self) -> LevelMeasure:
        """The sweep level with the highest concurrency (the uncapped overload)."""
        return max(self.levels, key=lambda lv: lv.concurrency)

    @property
    def plateau_levels(self) -> list[LevelMeasure]:
        """Levels at or past ``SATURATED_MARGIN`` x the knee; for an engine the advisor
        finds unsaturated, the highest level (where the capacity model predicts)."""
        v = self.verdict
        if v.knee_concurrency is None:
            return []
        if not v.saturated:
            return [self.top] if self.top.delivered else []
        return [
            lv
            for lv in [*self.levels, *self.return_levels]
            if lv.delivered and lv.concurrency >= SATURATED_MARGIN * v.knee_concurrency
        ]

    @property
    def growth_last_doubling(self) -> float | None:
        """Client throughput at the highest level over the level at half its concurrency
        (``None`` unless the engine saw the load of both)."""
        half = [lv for lv in self.levels if 2 * lv.concurrency == self.top.concurrency]
        if (
            not half
            or half[0].client_tokens_per_s <= 0
            or not (half[0].delivered and self.top.delivered)
        ):
            return None
        return self.top.client_tokens_per_s / half[0].client_tokens_per_s - 1.0

    @property
    def measured_plateau_tokens_per_s(self) -> float | None:
        lvs = self.plateau_levels
        return sum(lv.client_tokens_per_s for lv in lvs) / len(lvs) if lvs else None

    @property
    def plateau_runs(self) -> list[LevelMeasure]:
        """Every run at the plateau: :attr:`plateau_levels` and, when the closed loop (a)
        ran, its uncapped overload runs (the same engine at the sweep's top concurrency)."""
        extra = self.client_cap.reference.runs if self.client_cap is not None else []
        return [*self.plateau_levels, *(lv for lv in extra if lv.delivered)]

    @property
    def speed_pairs(self) -> list[tuple[int, float, float]]:
        """``(clients, up, down)`` client tok/s of each level run both on the way up and
        on the way back down, both delivered."""
        up = {lv.concurrency: lv for lv in self.levels if lv.delivered}
        return [
            (lv.concurrency, up[lv.concurrency].client_tokens_per_s, lv.client_tokens_per_s)
            for lv in self.return_levels
            if lv.delivered
            and lv.concurrency in up
            and lv.client_tokens_per_s > 0
            and up[lv.concurrency].client_tokens_per_s > 0
        ]

    @property
    def sweep_drift(self) -> float | None:
        """How the machine's speed moved over the sweep: the geometric mean over
        :attr:`speed_pairs` of up / down (above 1: slower on the way down; ``None``
        without pairs)."""
        pairs = self.speed_pairs
        if not pairs:
            return None
        return math.exp(statistics.fmean(math.log(u / d) for _, u, d in pairs))

    @property
    def closed_loop_drift(self) -> float | None:
        """The sweep's top level over the median of the closed loop's uncapped runs at
        the same concurrency (above 1: the machine ran slower since; ``None`` without)."""
        cap = self.client_cap
        runs = [lv.client_tokens_per_s for lv in cap.reference.runs] if cap else []
        runs = [v for v in runs if v > 0]
        if not runs or not self.top.delivered or not self.top.client_tokens_per_s > 0:
            return None
        return self.top.client_tokens_per_s / statistics.median(runs)

    @property
    def predicted_plateau_tokens_per_s(self) -> float | None:
        v = self.evidence("kv_capacity").get("predicted_plateau_tokens_per_s")
        return None if v is None else float(v)

    @property
    def prediction_error_ratio(self) -> float | None:
        p, m = self.predicted_plateau_tokens_per_s, self.measured_plateau_tokens_per_s
        return None if p is None or not m else p / m - 1.0


@dataclass
class Repeated:
    """One setting's runs of a closed-loop comparison."""

    label: str
    runs: list[LevelMeasure]
    left_out: list[LevelMeasure] = field(default_factory=list)
    """Runs whose front end still stalled, or whose requests failed without admission
    control, after every attempt: they measured the machine, not the setting, and another
    round stands in for them."""

    @property
    def tokens_per_s(self) -> float:
        """Median client throughput over the runs."""
        return statistics.median(lv.client_tokens_per_s for lv in self.runs)

    @property
    def spread(self) -> float:
        """(max - min) / median of the runs' client throughput (0 for one run)."""
        tps = [lv.client_tokens_per_s for lv in self.runs]
        med = statistics.median(tps)
        return (max(tps) - min(tps)) / med if len(tps) > 1 and med > 0 else 0.0

    @property
    def relative_error(self) -> float:
        """Standard error of the runs' log client throughput (``inf`` for one run)."""
        return relative_error([lv.client_tokens_per_s for lv in self.runs])

    @property
    def engine_e2e_p99_s(self) -> float | None:
        """Median over the runs of vLLM's e2e P99."""
        ps = [lv.engine_e2e_p99_s for lv in self.runs if lv.engine_e2e_p99_s is not None]
        return statistics.median(ps) if ps else None

    @property
    def typical(self) -> LevelMeasure:
        """The run whose throughput is the median (the lower middle one for an even count)."""
        ordered = sorted(self.runs, key=lambda lv: lv.client_tokens_per_s)
        return ordered[(len(ordered) - 1) // 2]

    def describe(self) -> str:
        out = (
            f"{self.label}: median {self.tokens_per_s:,.0f} tok/s over "
            f"{len(self.runs)} runs ({', '.join(f'{lv.client_tokens_per_s:,.0f}' for lv in self.runs)}), "
            f"spread {self.spread:.0%}, standard error {self.relative_error:.1%}"
        )
        if self.left_out:
            out += f"; {len(self.left_out)} run(s) left out ({self.left_out[0].trouble()})"
        return out


@dataclass
class CapRun:
    """A capped setting against the uncapped overload, both run several times.

    ``capped`` and ``reference`` are the two settings' runs: for the cap as client
    concurrency, interleaved on the same engine; for the vLLM flags, the capped engine's
    runs against the uncapped engine's overload runs made before it and on a restart
    after it (engine starts differ, so the reference brackets the capped start).
    Throughput and P99 are compared on medians.
    """

    how: str
    """``client`` (client concurrency = cap) or ``engine`` (the recommendation's vLLM flags:
    ``--max-num-seqs`` = cap and ``--max-num-queued-reqs``, on a restarted engine)."""
    cap: int
    capped: Repeated
    reference: Repeated
    peak_tokens_per_s: float
    predicted_throughput_fraction: float | None = None
    plateau_tokens_per_s: float | None = None
    """The uncapped sweep's measured plateau: mean client throughput of its saturated
    levels (:attr:`RegimeRun.measured_plateau_tokens_per_s`)."""
    predicted_p99_e2e_s: float | None = None
    startup_s: float | None = None
    engine_id: str | None = None
    flags: list[str] | None = None
    """The vLLM flags the engine was restarted with (``engine`` runs)."""

    reference_start_runs: tuple[Repeated, ...] = ()
    """The uncapped runs of each engine start in ``reference`` (flags: before and after)."""
    capped_starts: int = 1
    """Engine starts behind ``capped`` (flags: 2 when the first pair was measured again,
    see ``MAX_FLAGS_STARTS``)."""

    @property
    def reference_starts(self) -> tuple[float, ...]:
        """Median overload throughput of each uncapped engine start in ``reference``."""
        return tuple(g.tokens_per_s for g in self.reference_start_runs)

    @property
    def machine_slowdown(self) -> float:
        """How much slower the machine ran the uncapped engine around the capped starts
        than at the first start, where the advisor made its prediction: the first start's
        median overload throughput over the median of the later starts' (1 with one start,
        or when they are within ``MACHINE_SPEED_CHANGE`` of each other: engine starts
        differ by that much on a steady machine)."""
        t = self.reference_starts
        if len(t) < 2 or not min(t) > 0:
            return 1.0
        factor = t[0] / statistics.median(t[1:])
        return factor if max(factor, 1 / factor) >= MACHINE_SPEED_CHANGE else 1.0

    @property
    def start_spread(self) -> float:
        """(max - min) / median of the uncapped engine starts' medians (0 for one start)."""
        t = self.reference_starts
        med = statistics.median(t) if t else 0.0
        return (max(t) - min(t)) / med if len(t) > 1 and med > 0 else 0.0

    @property
    def level(self) -> LevelMeasure:
        """The capped run with the median throughput."""
        return self.capped.typical

    @property
    def uncapped(self) -> LevelMeasure:
        """The uncapped overload run with the median throughput."""
        return self.reference.typical

    @property
    def throughput(self) -> Ratio:
        """Capped over uncapped client throughput, with its confidence interval."""
        return ratio(
            [lv.client_tokens_per_s for lv in self.capped.runs],
            [lv.client_tokens_per_s for lv in self.reference.runs],
        )

    @property
    def p99(self) -> Ratio | None:
        """Capped over uncapped vLLM e2e P99 (each run's), with its confidence interval."""
        a = [lv.engine_e2e_p99_s for lv in self.capped.runs if lv.engine_e2e_p99_s]
        b = [lv.engine_e2e_p99_s for lv in self.reference.runs if lv.engine_e2e_p99_s]
        return ratio(a, b) if a and b else None

    def noise(self) -> str:
        """The runs behind the comparison, for an assertion message."""
        starts = ""
        if len(self.reference_starts) > 1:
            starts = (
                "; uncapped engine starts: "
                + ", ".join(
                    f"{g.tokens_per_s:,.0f} (spread {g.spread:.0%})"
                    for g in self.reference_start_runs
                )
                + f" tok/s, {self.start_spread:.0%} apart"
            )
        return f"{self.capped.describe()}; {self.reference.describe()}{starts}"

    @property
    def rejected_share(self) -> float:
        """Requests rejected (HTTP 503 from admission control) over requests sent."""
        done = sum(lv.completed for lv in self.capped.runs)
        errors = sum(lv.errors for lv in self.capped.runs)
        return errors / (done + errors) if done + errors else 0.0

    @property
    def throughput_fraction(self) -> float:
        """Median capped throughput over the uncapped sweep's peak level."""
        return self.capped.tokens_per_s / self.peak_tokens_per_s

    @property
    def plateau_fraction(self) -> float:
        """Median capped throughput over the median uncapped overload throughput, both
        measured in the same stretch of time (what the cap keeps of the plateau)."""
        return self.capped.tokens_per_s / self.reference.tokens_per_s

    @property
    def p99_ratio(self) -> float | None:
        """Median engine-side e2e P99 under the cap over the uncapped overload's."""
        a, b = self.capped.engine_e2e_p99_s, self.reference.engine_e2e_p99_s
        return None if a is None or not b else a / b

    @property
    def client_p99_ratio(self) -> float | None:
        """The same with the load generator's e2e P99 (front-end delays included)."""
        a = [lv.e2e_p99_s for lv in self.capped.runs if lv.e2e_p99_s is not None]
        b = [lv.e2e_p99_s for lv in self.reference.runs if lv.e2e_p99_s is not None]
        if not a or not b or not statistics.median(b):
            return None
        return statistics.median(a) / statistics.median(b)


Log = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class AdvisorLab:
    """A collector process and the real engines the scenarios run against.

    ``duration_s`` and ``warmup_s`` are the sweep's per-level measurement window and
    unmeasured ramp; ``cap_duration_s`` and ``cap_warmup_s`` the same for a capped run.
    ``log`` receives one line per step; ``progress`` shows the sweep's progress bars on
    stderr. ``prompt_words`` and ``output_tokens`` are the sweeps' workload.
    ``return_pass``: after the way up, the sweep runs its levels from a quarter of the
    top concurrency to the one below the top once more, downwards. This machine's speed
    drifts by up to 2x over tens of seconds; on a sweep that only climbs, a drift
    masquerades as throughput growing (or not) with load and moves the knee (a
    KV-starved engine measured 1,105 tok/s at 8 clients and 1,086 at 32, against 1,257
    for 32 clients rerun beside a cap of 7 that gave 910: the knee came out at 7 where
    the engine still gained 35% past it). Up and back down, each level's windows span
    both sides of the sweep's midpoint, so a steady drift cancels in the advisor's bins.
    ``steady_runs``: the closed-loop runs set against each other (a cap and the uncapped
    overload, :meth:`_repeated`) run in steady state (the load generator's
    ``steady_state``: the warm-up lasts until every client's first request is back, the
    window at least one cycle of the loop), so that the requests finishing in the window
    include those that spent the overload's whole time in the system. A fixed 3 + 10 s at
    32 clients on an engine finishing 1.6 requests a second (20 s in the system) counted
    only requests that finished within the run's 13 s: an uncapped e2e P99 of 12.1-12.6 s,
    the run's length, against which a cap of 12 (9 s) read 0.73.
    """

    prompt_words: tuple[int, int] = (8, 40)
    output_tokens: int = 128

    def __init__(
        self,
        workdir: str | Path,
        *,
        model_dir: str | Path | None = None,
        concurrency: tuple[int, ...] = CONCURRENCY,
        duration_s: float = 5.0,
        warmup_s: float = 2.0,
        cap_duration_s: float = 10.0,
        cap_warmup_s: float = 3.0,
        seed: int = 3,
        log: Log = _quiet,
        progress: bool = False,
        return_pass: bool = True,
        steady_runs: bool = True,
    ) -> None:
        self.workdir = Path(workdir)
        self.model_dir = Path(model_dir) if model_dir else None
        self.concurrency = tuple(concurrency)
        self.duration_s = duration_s
        self.warmup_s = warmup_s
        self.cap_duration_s = cap_duration_s
        self.cap_warmup_s = cap_warmup_s
        self.seed = seed
        self.log = log
        self.progress = progress
        self.return_pass = return_pass
        self.steady_runs = steady_runs
        self.collector: CollectorProcess | None = None
        self._t0 = time.monotonic()

    # -- set-up -----------------------------------------------------------------------

    def start(self) -> AdvisorLab:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.model_dir is None:
            self.model_dir = build_model(default_model_dir("mid"), "mid")
        # Every run starts a store of its own: the engines of a run are found by pool,
        # and an earlier run's engines have the same pools (its store is kept beside).
        store = self.workdir / "store.duckdb"
        if store.exists():
            store.replace(self.workdir / "store-previous.duckdb")
        self.collector = CollectorProcess(store, log_path=self.workdir / "collector.log").start()
        self._say(f"collector at {self.collector.url}, store {store}")
        return self

    def close(self) -> None:
        if self.collector is not None:
            self.collector.stop()
            self.collector = None

    def __enter__(self) -> AdvisorLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _say(self, text: str) -> None:
        self.log(f"[{time.monotonic() - self._t0:6.1f} s] {text}")

    @property
    def _collector(self) -> CollectorProcess:
        if self.collector is None:
            raise RuntimeError("AdvisorLab.start() first")
        return self.collector

    @contextmanager
    def engine(
        self,
        pool: str,
        *,
        num_gpu_blocks: int,
        max_num_seqs: int,
        extra_args: tuple[str, ...] = (),
        engine_core_nice: int = 19,
        api_server_cpus: float | None = None,
        env: dict[str, str] | None = None,
        replica: int | None = None,
    ) -> Iterator[VllmServer]:
        """A real engine with the plugin shipping to the collector under ``pool``
        (``engine_core_nice``, ``api_server_cpus``: see
        :class:`~kvscope.lab.engine.VllmServer`; ``env``: more of the server's
        environment, e.g. ``VLLM_CPU_OMP_THREADS_BIND``; ``replica``: the engine's index in
        a pool of several, for its log's name)."""
        assert self.model_dir is not None
        self._say(
            f"{pool}: starting vLLM (--num-gpu-blocks-override {num_gpu_blocks}, "
            f"--max-num-seqs {max_num_seqs}{' ' if extra_args else ''}"
            f"{' '.join(extra_args)})"
        )
        server = VllmServer(
            self.model_dir,
            served_model_name=MODEL_NAME,
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=True,
            extra_args=extra_args,
            engine_core_nice=engine_core_nice,
            api_server_cpus=api_server_cpus,
            env={
                "KVSCOPE_COLLECTOR_URL": self._collector.url,
                "KVSCOPE_POOL": pool,
                "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
                **(env or {}),
            },
            log_path=self.workdir / f"vllm-{pool}{'' if replica is None else f'-{replica}'}.log",
        )
        try:
            server.start()
            held = (
                "" if api_server_cpus is None else f", API server held to {api_server_cpus:g} CPUs"
            )
            self._say(f"{pool}: engine up in {server.startup_s:.0f} s at {server.url}{held}")
            yield server
        finally:
            server.stop()
            self._say(f"{pool}: engine stopped")

    # -- load and measurement -----------------------------------------------------------

    def _sweep(
        self,
        server: VllmServer,
        concurrency: list[int],
        duration_s: float,
        warmup_s: float,
        seed: int,
        error_backoff_s: float = 0.1,
        steady_state: bool = False,
    ) -> SweepResult:
        return self._sweep_urls(
            [server.url],
            concurrency,
            duration_s,
            warmup_s,
            seed,
            error_backoff_s,
            MODEL_NAME,
            steady_state=steady_state,
        )

    def _sweep_urls(
        self,
        urls: list[str],
        concurrency: list[int],
        duration_s: float,
        warmup_s: float,
        seed: int,
        error_backoff_s: float,
        model: str,
        *,
        steady_state: bool = False,
    ) -> SweepResult:
        """The lab's workload, closed loop, over ``urls`` (round robin over several);
        ``steady_state``: the load generator's (see ``steady_runs``), else each level lasts
        exactly ``warmup_s + duration_s``."""
        return run_sweep(
            SweepConfig(
                url=urls[0],
                replicas=urls[1:],
                model=model,
                concurrency=concurrency,
                duration_s=duration_s,
                warmup_s=warmup_s,
                cooldown_s=1.0,
                prompt_words=self.prompt_words,
                output_tokens=(self.output_tokens, self.output_tokens),
                seed=seed,
                error_backoff_s=error_backoff_s,
                progress=self.progress,
                # A sweep's levels last exactly what they ask for (the regimes bench sizes
                # its levels from the request rates it measured: RegimeLab._level).
                steady_state=steady_state,
            )
        )

    def _warm(self, server: VllmServer) -> None:
        """A few seconds of load the analysis leaves out (first requests run slower)."""
        self._sweep(server, [4], duration_s=1.0, warmup_s=1.0, seed=self.seed + 100)

    def _engine_id(self, pool: str) -> str:
        deadline = time.monotonic() + 30.0
        while True:
            rows = self._collector.get_json("/v1/engines")["rows"]
            ids = [r["engine_id"] for r in rows if r.get("pool") == pool]
            if ids:
                return str(ids[-1])
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine of pool {pool} reached the collector")
            time.sleep(0.5)

    def _drain(self, server: VllmServer, engine_id: str, timeout_s: float = 30.0) -> None:
        """Wait until the collector holds every token, preemption and request vLLM counted."""
        keys = {
            "generation_tokens": "vllm:generation_tokens_total",
            "prompt_tokens": "vllm:prompt_tokens_total",
            "preemptions": "vllm:num_preemptions_total",
        }
        deadline = time.monotonic() + timeout_s
        while True:
            vllm = vllm_counter_totals(server.metrics_text())
            rows = self._collector.get_json(
                "/v1/totals", params={"source": "windows", "engine": engine_id}
            )["rows"]
            stats = self._collector.get_json(
                "/v1/request_stats",
                params={"since": "0", "engine": engine_id, "group_by": "engine"},
            )["rows"]
            ours = {k: float(rows[0][k]) if rows else 0.0 for k in keys}
            theirs = {k: vllm[v] for k, v in keys.items()}
            n_req = float(stats[0]["n_requests"]) if stats else 0.0
            if ours == theirs and n_req == vllm["vllm:request_success_total"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"collector short of vLLM's counters for {engine_id}: "
                    f"{ours} / {n_req} requests vs {theirs} / "
                    f"{vllm['vllm:request_success_total']}"
                )
            time.sleep(0.5)

    def _measure(self, engine_id: str, levels: list[LevelResult]) -> list[LevelMeasure]:
        lo = math.floor(min(lv.window_start_unix_s for lv in levels))
        hi = math.ceil(max(lv.window_end_unix_s for lv in levels)) + 1
        src = CollectorSource(self._collector.url)
        w = src.windows(lo, hi, engine=engine_id)
        r = src.requests(lo, hi, engine=engine_id)
        return [measure_level(lv, w, r) for lv in levels]

    # -- scenarios ------------------------------------------------------------------------

    def _level(
        self,
        server: VllmServer,
        engine_id: str,
        concurrency: int,
        duration_s: float,
        warmup_s: float,
        seed: int,
        attempts: int = MAX_ATTEMPTS,
        admit_limit: int | None = None,
        steady_state: bool = False,
    ) -> tuple[LevelMeasure, SweepResult]:
        """One load level (``steady_state``: see ``steady_runs``), measured; run again (up to ``attempts`` runs) while the engine
        did not see the clients' load (a stalled front end measures nothing of the engine)
        or, without admission control, a request failed (the engine's log's error lines
        are shown: a failure on an unlimited engine is the lab's, not the setting's)."""
        for attempt in range(1, attempts + 1):
            sweep = self._sweep(
                server,
                [concurrency],
                duration_s,
                warmup_s,
                seed + 1000 * (attempt - 1),
                error_backoff_s=0.1 if admit_limit is None else REFUSED_BACKOFF_S,
                steady_state=steady_state,
            )
            self._drain(server, engine_id)
            level = self._measure(engine_id, sweep.levels)[0]
            level.attempts = attempt
            level.admit_limit = admit_limit
            if level.delivered and level.clean:
                break
            self._say(
                f"{concurrency} clients: {level.trouble()}"
                f"{'; running the level again' if attempt < attempts else ''}"
            )
            if not level.clean:
                for line in server.log_errors():
                    self._say(f"  vLLM: {line}")
        return level, sweep

    def _repeated(
        self,
        server: VllmServer,
        engine_id: str,
        settings: list[tuple[str, int, int | None]],
        seed: int,
        rounds: int = ROUNDS,
    ) -> list[Repeated]:
        """Run each setting ``(label, clients, admit_limit)`` once per round, the settings
        interleaved, for ``rounds`` rounds; then one more round at a time (up to
        ``MAX_ROUNDS``) while a setting's runs are noisier than ``MAX_RELATIVE_ERROR`` or
        fewer than ``rounds``: a run whose front end still stalled (or whose requests
        failed without admission control) after every attempt is left out
        (:attr:`Repeated.left_out`) and another round stands in for it."""
        out = [Repeated(label, []) for label, _, _ in settings]
        last: list[LevelMeasure | None] = [None] * len(settings)
        for r in range(MAX_ROUNDS):
            if all(
                len(rep.runs) >= rounds and rep.relative_error <= MAX_RELATIVE_ERROR for rep in out
            ):
                break
            for i, ((_, clients, admit), rep) in enumerate(zip(settings, out, strict=True)):
                level, _ = self._level(
                    server,
                    engine_id,
                    clients,
                    self.cap_duration_s,
                    self.cap_warmup_s,
                    seed + 10 * r + i,
                    admit_limit=admit,
                    steady_state=self.steady_runs,
                )
                last[i] = level
                if level.delivered and level.clean:
                    rep.runs.append(level)
                else:  # measured the machine, not the setting: another round stands in
                    rep.left_out.append(level)
                    self._say(f"{rep.label}: run left out, another round stands in")
            self._say(
                "round "
                + str(r + 1)
                + ": "
                + "; ".join(
                    f"{rep.label} {lv.client_tokens_per_s:,.0f} tok/s"
                    for rep, lv in zip(out, last, strict=True)
                )
            )
        for rep in out:
            if not rep.runs:  # nothing measured the setting: keep what was, for the verdict to say
                rep.runs, rep.left_out = rep.left_out, []
            self._say(rep.describe())
        return out

    def run_regime(self, scenario: Scenario, *, cap_by_client: bool = False) -> RegimeRun:
        """Start the regime's engine, sweep it, let the advisor judge; with
        ``cap_by_client``, then load the same engine at the recommended cap."""
        with self.engine(
            scenario.pool,
            num_gpu_blocks=scenario.num_gpu_blocks,
            max_num_seqs=scenario.max_num_seqs,
        ) as server:
            self._warm(server)
            engine_id = self._engine_id(scenario.pool)
            top = max(self.concurrency)
            self._say(
                f"{scenario.pool}: sweeping {','.join(map(str, self.concurrency))} "
                f"clients, {self.warmup_s:g} + {self.duration_s:g} s per level "
                f"({self.cap_duration_s:g} s at {top})"
            )
            levels: list[LevelMeasure] = []
            since = until = math.nan
            for i, c in enumerate(self.concurrency):
                # The overload level lasts as long as the capped runs set against it,
                # so their latency percentiles come from samples of the same span.
                duration = self.cap_duration_s if c == top else self.duration_s
                # Low levels are run once: a stall there only moves the advisor's windows
                # to lower loads, and no figure below is read from them.
                attempts = MAX_ATTEMPTS if c == top else 2 if 4 * c >= top else 1
                level, sweep = self._level(
                    server, engine_id, c, duration, self.warmup_s, self.seed + i, attempts
                )
                levels.append(level)
                if i == 0:
                    since = sweep.started_unix_s
                until = sweep.finished_unix_s + 1.0
            back: list[LevelMeasure] = []
            if self.return_pass:
                down = sorted(
                    (c for c in self.concurrency if top > c and 4 * c >= top), reverse=True
                )
                if down:
                    self._say(f"{scenario.pool}: back down, {','.join(map(str, down))} clients")
                for j, c in enumerate(down):
                    level, sweep = self._level(
                        server,
                        engine_id,
                        c,
                        self.duration_s,
                        self.warmup_s,
                        self.seed + 500 + j,
                        2,
                    )
                    back.append(level)
                    until = sweep.finished_unix_s + 1.0
            # Every window of the sweep, stalled attempts included: the advisor reads load
            # at the engine, so a stall only adds windows at a lower load.
            report = analyze(CollectorSource(self._collector.url), since, until, pool=scenario.pool)
            run = RegimeRun(
                scenario=scenario,
                engine_id=engine_id,
                startup_s=server.startup_s or math.nan,
                since_unix_s=since,
                until_unix_s=until,
                levels=levels,
                report=report,
                return_levels=back,
            )
            v = run.verdict
            self._say(
                f"{scenario.pool}: advisor says {v.bottleneck}"
                f"{'' if v.saturated else f' (approaching {v.approaching})'}, knee "
                f"{_num(v.knee_concurrency, '.1f')}, plateau "
                f"{_num(v.plateau_tokens_per_s, ',.0f')} tok/s, cap "
                f"{_num(v.recommended_concurrency_cap, 'd')}"
            )
            if cap_by_client:
                cap = v.recommended_concurrency_cap
                if cap is None:
                    raise RuntimeError(
                        f"{scenario.pool}: the advisor recommended no cap\n" + levels_table(run)
                    )
                self._say(
                    f"{scenario.pool}: closed loop (a), {cap} clients against {top}, "
                    f"interleaved, {self.cap_duration_s:g} s each"
                )
                capped, reference = self._repeated(
                    server,
                    engine_id,
                    [(f"cap {cap}", cap, None), (f"{top} clients", top, None)],
                    self.seed + 50,
                )
                run.client_cap = CapRun(
                    how="client",
                    cap=cap,
                    capped=capped,
                    reference=reference,
                    peak_tokens_per_s=run.peak.client_tokens_per_s,
                    predicted_throughput_fraction=v.predicted_throughput_fraction_at_cap,
                    plateau_tokens_per_s=run.measured_plateau_tokens_per_s,
                    predicted_p99_e2e_s=v.predicted_p99_e2e_s_at_cap,
                    engine_id=engine_id,
                )
        return run

    def run_engine_cap(self, uncapped: RegimeRun) -> CapRun:
        """Restart the regime's engine with the vLLM flags of the advisor's cap
        recommendation (``--max-num-seqs C --max-num-queued-reqs C+Q``: admission control,
        requests beyond C+Q in flight are rejected with 503) and drive it at the sweep's
        highest concurrency."""
        sc = uncapped.scenario
        rec = next(
            (
                r
                for r in uncapped.report.recommendations
                if r.kind == "concurrency_cap" and r.scope.engine_id == uncapped.engine_id
            ),
            None,
        )
        if rec is None:
            raise RuntimeError(f"{sc.pool}: the advisor recommended no cap")
        flags = [str(f) for f in rec.change.get("vllm_flags", [])]
        values = {f.split()[0]: int(f.split()[1]) for f in flags if len(f.split()) == 2}
        cap = values["--max-num-seqs"]
        queued = values.get("--max-num-queued-reqs")
        extra = () if queued is None else ("--max-num-queued-reqs", str(queued))
        top = uncapped.top.concurrency
        # Engine starts differ by up to 10% here: the uncapped overload is measured again
        # on a restarted engine, so the reference brackets the capped start.
        before = (
            uncapped.client_cap.reference.runs
            if uncapped.client_cap is not None
            else [uncapped.top]
        )
        capped_runs: list[LevelMeasure] = []
        starts = [Repeated(f"{top} clients, first start", before)]
        startup_s = math.nan
        engine_id = ""
        for attempt in range(1, MAX_FLAGS_STARTS + 1):
            pool = f"{sc.pool}-capped" if attempt == 1 else f"{sc.pool}-capped-{attempt}"
            with self.engine(
                pool, num_gpu_blocks=sc.num_gpu_blocks, max_num_seqs=cap, extra_args=extra
            ) as server:
                self._warm(server)
                engine_id = self._engine_id(pool)
                if attempt == 1:
                    startup_s = server.startup_s
                self._say(
                    f"{pool}: closed loop (b), {top} clients against {' '.join(flags)} "
                    f"for {self.cap_duration_s:g} s, {ROUNDS} runs"
                )
                (capped,) = self._repeated(
                    server,
                    engine_id,
                    [(" ".join(flags), top, queued)],
                    self.seed + 60 + 100 * (attempt - 1),
                )
            capped_runs += capped.runs
            again_pool = f"{sc.pool}-again" if attempt == 1 else f"{sc.pool}-again-{attempt}"
            with self.engine(
                again_pool, num_gpu_blocks=sc.num_gpu_blocks, max_num_seqs=sc.max_num_seqs
            ) as server:
                self._warm(server)
                again_id = self._engine_id(again_pool)
                self._say(f"{again_pool}: uncapped again, {top} clients, {ROUNDS} runs")
                (after,) = self._repeated(
                    server,
                    again_id,
                    [(f"{top} clients", top, None)],
                    self.seed + 70 + 100 * (attempt - 1),
                )
            starts.append(after)
            result = CapRun(
                how="engine",
                cap=cap,
                capped=Repeated(" ".join(flags), capped_runs),
                reference=Repeated(
                    f"{top} clients uncapped", [lv for g in starts for lv in g.runs]
                ),
                peak_tokens_per_s=uncapped.peak.client_tokens_per_s,
                plateau_tokens_per_s=uncapped.measured_plateau_tokens_per_s,
                startup_s=startup_s,
                engine_id=engine_id,
                flags=flags,
                reference_start_runs=tuple(starts),
                capped_starts=attempt,
            )
            refuted = [c.describe() for c in cap_checks(uncapped, result) if c.failed]
            if not refuted or attempt == MAX_FLAGS_STARTS:
                return result
            self._say(
                "the flags' runs refute a property on this pair of engine starts; its "
                "runs share one start's speed, so both engines are started once more "
                "and the verdict taken on all runs: " + "; ".join(refuted)
            )
        raise AssertionError("unreachable")  # pragma: no cover


def _off(factor: float | None, limit: float) -> bool:
    return factor is not None and max(factor, 1 / factor) > limit


def plateau_checks(run: RegimeRun) -> list[Check]:
    """The capacity model's predicted plateau against every run at the plateau, client
    side (the load generator's output tokens) and engine side (vLLM's generated tokens in
    the collector's windows), at the speed of the sweep the prediction was made on (see
    ``SWEEP_SPEED_CHANGE``: a sweep whose speed drifted is not judged, closed-loop runs at
    another speed are left out)."""
    predicted = run.predicted_plateau_tokens_per_s
    runs = run.plateau_runs
    notes: list[str] = []
    verdict_override = None
    drift, later = run.sweep_drift, run.closed_loop_drift
    if _off(later, SWEEP_SPEED_CHANGE) and run.client_cap is not None:
        left = {id(lv) for lv in run.client_cap.reference.runs}
        runs = [lv for lv in runs if id(lv) not in left]
        notes.append(
            f"the closed loop's {len(left)} uncapped runs left out: the sweep's top level "
            f"ran {later:.2f}x their speed"
        )
    if _off(drift, SWEEP_SPEED_CHANGE):
        pairs = ", ".join(f"{c}: {u:,.0f}/{d:,.0f}" for c, u, d in run.speed_pairs)
        notes.append(
            f"not judged: the machine's speed moved {drift:.2f}x within the sweep "
            f"(tok/s up/down by clients {pairs})"
        )
        verdict_override = WITHIN_NOISE
    if predicted is None or not predicted > 0 or not runs:
        return []
    lo, hi = 1 / (1 + MAX_PLATEAU_ERROR), 1 / (1 - MAX_PLATEAU_ERROR)
    out = []
    for side, values in (
        ("client", [lv.client_tokens_per_s for lv in runs]),
        ("engine", [lv.engine_tokens_per_s for lv in runs]),
    ):
        values = [v for v in values if v > 0 and math.isfinite(v)]
        if not values:
            continue
        r = ratio_to(values, predicted)
        out.append(
            Check(
                f"capacity model ({side})",
                f"measured / predicted plateau ({predicted:,.0f} tok/s) in {lo:.2f}-{hi:.2f}",
                r,
                verdict_override or r.within(lo, hi),
                "; ".join(notes),
            )
        )
    return out


def cap_checks(run: RegimeRun, cap: CapRun) -> list[Check]:
    """The properties a cap is held to (throughput kept, tail cut; for the vLLM flags also
    the admitted requests' P99 against the advisor's prediction), each with its verdict."""
    out = []
    tp, p99 = cap.throughput, cap.p99
    if cap.how == "client":
        name, min_fraction, max_p99 = (
            f"(a) client cap {cap.cap}",
            MIN_THROUGHPUT_FRACTION,
            MAX_P99_RATIO,
        )
    else:
        name = f"(b) {' '.join(cap.flags or [])}"
        min_fraction, max_p99 = MIN_THROUGHPUT_FRACTION_RESTARTED, MAX_P99_RATIO_FLAGS
    out.append(
        Check(
            name,
            f"throughput / uncapped >= {min_fraction:.2f}",
            tp,
            tp.at_least(min_fraction),
        )
    )
    if p99 is not None:
        out.append(
            Check(name, f"vLLM e2e P99 / uncapped <= {max_p99:.2f}", p99, p99.at_most(max_p99))
        )
    if cap.how != "engine":
        return out
    predicted = run.verdict.predicted_p99_e2e_s_at_cap
    measured = [lv.engine_e2e_p99_s for lv in cap.capped.runs if lv.engine_e2e_p99_s]
    if predicted and measured:
        slow = cap.machine_slowdown
        r = ratio_to(measured, predicted * slow)
        scaled = f" x {slow:.2f} (the machine's speed since)" if slow != 1.0 else ""
        out.append(
            Check(
                name,
                f"vLLM e2e P99 / predicted {predicted:.2f} s{scaled} "
                f"<= {MAX_FLAGS_OVER_PREDICTED:g}",
                r,
                r.at_most(MAX_FLAGS_OVER_PREDICTED),
            )
        )
    return out


def checks(runs: list[RegimeRun], engine_cap: CapRun | None) -> list[Check]:
    """Every property judged on the runs: the capacity model, the client cap, the flags."""
    out: list[Check] = []
    for r in runs:
        if r.scenario.name != "kv-starved":
            continue
        out += plateau_checks(r)
        if r.client_cap is not None:
            out += cap_checks(r, r.client_cap)
        if engine_cap is not None:
            out += cap_checks(r, engine_cap)
    return out


def measure_level(
    lv: LevelResult, windows: pd.DataFrame, requests: pd.DataFrame | None = None
) -> LevelMeasure:
    """A sweep level with the engine's windows that lie inside its measurement window
    and the requests that finished inside it (cancelled ones left out)."""
    w = windows
    if len(w):
        ts = pd.to_numeric(w["ts_s"])
        w = w[(ts >= lv.window_start_unix_s) & (ts + 1.0 <= lv.window_end_unix_s + 0.5)]
    n = len(w)
    e2e_p99: float | None = None
    if requests is not None and len(requests):
        fin = pd.to_numeric(requests["finished_unix_s"])
        done = requests[
            (fin >= lv.window_start_unix_s)
            & (fin < lv.window_end_unix_s)
            & (requests["finish_reason"] != "abort")
        ]
        if len(done):
            e2e_p99 = float(pd.to_numeric(done["e2e_s"]).quantile(0.99))

    def col(name: str) -> pd.Series:
        return pd.to_numeric(w[name], errors="coerce") if n else pd.Series(dtype=float)

    def med(name: str) -> float:
        return float(col(name).median()) if n else math.nan

    return LevelMeasure(
        concurrency=lv.concurrency,
        client_tokens_per_s=lv.output_tokens_per_s,
        e2e_p99_s=lv.e2e_p99_s,
        ttft_p99_s=lv.ttft_p99_s,
        completed=lv.requests_completed,
        errors=lv.error_count,
        error_kinds=dict(lv.errors),
        error_examples=dict(lv.error_examples),
        engine_tokens_per_s=float(col("generation_tokens").sum()) / n if n else math.nan,
        preemptions_per_s=float(col("preemptions").sum()) / n if n else math.nan,
        batch_median=med("batch_mean"),
        waiting_median=med("waiting_mean"),
        load_median=float((col("batch_mean") + col("waiting_mean")).median()) if n else math.nan,
        load_mean=float((col("batch_mean") + col("waiting_mean")).mean()) if n else math.nan,
        kv_usage_median=med("kv_usage_mean"),
        n_windows=n,
        engine_e2e_p99_s=e2e_p99,
    )


# -- presentation ----------------------------------------------------------------------------


def _num(v: float | int | None, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _runs(lv: LevelMeasure) -> str:
    return f"{lv.attempts}{'' if lv.delivered else '*'}"


def _pct(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:+.0%}"


def regimes_table(runs: list[RegimeRun]) -> str:
    """Per regime: expected vs verdict, knee, plateau measured vs predicted, cap."""
    head = (
        f"{'regime':<11} {'expected':<29} {'advisor verdict':<34} {'ok':<3} {'knee':>5} "
        f"{'last 2x':>7} {'plateau meas':>12} {'advisor':>8} {'KV model':>8} {'err':>5} "
        f"{'cap':>4}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        v = r.verdict
        verdict = v.bottleneck if v.saturated else f"{v.bottleneck} -> {v.approaching}"
        lines.append(
            f"{r.scenario.name:<11} {' | '.join(r.scenario.expected):<29} {verdict:<34} "
            f"{'yes' if r.correct else 'NO':<3} {_num(v.knee_concurrency, '.1f'):>5} "
            f"{_pct(r.growth_last_doubling):>7} "
            f"{_num(r.measured_plateau_tokens_per_s, ',.0f'):>12} "
            f"{_num(v.plateau_tokens_per_s, ',.0f'):>8} "
            f"{_num(r.predicted_plateau_tokens_per_s, ',.0f'):>8} "
            f"{_pct(r.prediction_error_ratio):>5} {_num(v.recommended_concurrency_cap, 'd'):>4}"
        )
    lines.append(
        "last 2x: client throughput growth from half the top concurrency to the top; "
        f"plateau meas: mean client output tok/s of the levels at >= {SATURATED_MARGIN:g}x the "
        "knee (unsaturated: the top level); advisor: its plateau fitted on the engine's "
        "windows; KV model: the capacity model's prediction (err vs measured)"
    )
    return "\n".join(lines)


def levels_table(run: RegimeRun) -> str:
    """One regime's sweep, client and engine side."""
    head = (
        f"{'clients':>7} {'in flight':>9} {'client tok/s':>12} {'engine tok/s':>12} "
        f"{'batch':>6} {'waiting':>7} {'KV used':>7} {'preempt/s':>9} {'TTFT p99':>8} "
        f"{'e2e p99':>8} {'engine':>7} {'runs':>4}"
    )
    lines = [
        f"{run.scenario.name} ({run.engine_id}, engine up in {run.startup_s:.0f} s)",
        head,
        "-" * len(head),
    ]
    for i, lv in enumerate([*run.levels, *run.return_levels]):
        if i == len(run.levels):
            lines.append("back down:")
        lines.append(
            f"{lv.concurrency:>7} {_num(lv.load_mean, '.1f'):>9} "
            f"{lv.client_tokens_per_s:>12,.0f} "
            f"{_num(lv.engine_tokens_per_s, ',.0f'):>12} {_num(lv.batch_median, '.1f'):>6} "
            f"{_num(lv.waiting_median, '.1f'):>7} {_num(lv.kv_usage_median, '.0%'):>7} "
            f"{_num(lv.preemptions_per_s, '.1f'):>9} {_num(lv.ttft_p99_s):>7}s "
            f"{_num(lv.e2e_p99_s):>7}s {_num(lv.engine_e2e_p99_s):>6}s {_runs(lv):>4}"
        )
    drift, later = run.sweep_drift, run.closed_loop_drift
    if drift is not None:
        lines.append(
            f"machine speed: up / down {drift:.2f} over {len(run.speed_pairs)} levels"
            + (f"; sweep's top level / closed loop's uncapped runs {later:.2f}" if later else "")
            + f" (steady within {SWEEP_SPEED_CHANGE:g})"
        )
    return "\n".join(lines)


def closed_loop_table(run: RegimeRun, engine_cap: CapRun | None) -> str:
    """The two ways of applying the cap, each against the uncapped overload measured in the
    same stretch of time, on medians of repeated runs."""
    v = run.verdict
    head = (
        f"{'setting':<46} {'runs':>4} {'tok/s':>7} {'spread':>6} {'se':>5} {'of uncapped':>11} "
        f"{'in flight':>9} {'e2e p99 engine':>14} {'client':>7} {'preempt/s':>9}"
    )
    lines = [
        f"closed loop on {run.scenario.name}: advisor cap {v.recommended_concurrency_cap} "
        f"(predicted {_num(v.predicted_throughput_fraction_at_cap, '.0%')} of its plateau, "
        f"e2e P99 {_num(v.predicted_p99_e2e_s_at_cap)} s vs "
        f"{_num(v.p99_e2e_s_at_max_load)} s uncapped)",
        head,
        "-" * len(head),
    ]

    def row(name: str, rep: Repeated, ref: Repeated | None) -> str:
        lv = rep.typical
        frac = f"{rep.tokens_per_s / ref.tokens_per_s:.0%}" if ref else ""
        p99 = rep.engine_e2e_p99_s
        ratio = (
            ""
            if ref is None or p99 is None or not ref.engine_e2e_p99_s
            else (f" ({p99 / ref.engine_e2e_p99_s:.2f})")
        )
        return (
            f"{name:<46} {len(rep.runs):>4} {rep.tokens_per_s:>7,.0f} {rep.spread:>6.0%} "
            f"{_num(rep.relative_error, '.1%'):>5} "
            f"{frac:>11} {_num(lv.load_mean, '.1f'):>9} {_num(p99) + 's' + ratio:>14} "
            f"{_num(lv.e2e_p99_s):>6}s {_num(lv.preemptions_per_s, '.1f'):>9}"
        )

    lines.append(row("uncapped sweep, peak level", Repeated("", [run.peak]), None))
    for label, cap in (("(a) client concurrency", run.client_cap), ("(b)", engine_cap)):
        if cap is None:
            continue
        what = (
            f"{label} {cap.cap}" if cap.how == "client" else f"{label} {' '.join(cap.flags or [])}"
        )
        if cap.capped_starts > 1:
            what += f", {cap.capped_starts} starts"
        lines.append(row(what, cap.capped, cap.reference))
        starts = (
            ""
            if len(cap.reference_starts) < 2
            else f", {len(cap.reference_starts)} starts {cap.start_spread:.0%} apart"
        )
        lines.append(
            row(f"    vs {cap.uncapped.concurrency} clients uncapped{starts}", cap.reference, None)
        )
    if engine_cap is not None:
        lines.append(
            f"(b): {engine_cap.rejected_share:.0%} of the requests rejected with 503 by "
            "admission control"
        )
    lines.append(
        "runs interleaved (a) or bracketing the capped engine start (b); tok/s: median "
        "client output tok/s; spread: (max - min) / median over the runs; se: standard "
        "error of the runs' log throughput; of uncapped: "
        "median over median; in flight, client e2e p99 and preempt/s: the median run's; "
        "e2e p99 engine: median of vLLM's own, in brackets over the uncapped median"
    )
    return "\n".join(lines)


def summary(runs: list[RegimeRun], engine_cap: CapRun | None) -> dict[str, Any]:
    """The measured figures as a JSON-ready dict."""
    out: dict[str, Any] = {
        "regimes": {},
        "closed_loop": {},
        "checks": [
            {
                "name": c.name,
                "property": c.what,
                "verdict": c.verdict,
                "note": c.note,
                **asdict(c.ratio),
            }
            for c in checks(runs, engine_cap)
        ],
    }
    for r in runs:
        v = r.verdict
        out["regimes"][r.scenario.name] = {
            "engine_id": r.engine_id,
            "expected": list(r.scenario.expected),
            "correct": r.correct,
            "verdict": v.to_dict(),
            "startup_s": r.startup_s,
            "measured_plateau_tokens_per_s": r.measured_plateau_tokens_per_s,
            "growth_last_doubling_ratio": r.growth_last_doubling,
            "predicted_plateau_tokens_per_s": r.predicted_plateau_tokens_per_s,
            "prediction_error_ratio_vs_client": r.prediction_error_ratio,
            "sweep_drift": r.sweep_drift,
            "closed_loop_drift": r.closed_loop_drift,
            "kv_capacity": r.evidence("kv_capacity"),
            "bottleneck": r.evidence("bottleneck"),
            "levels": [asdict(lv) for lv in r.levels],
            "return_levels": [asdict(lv) for lv in r.return_levels],
        }
        for cap in (r.client_cap, engine_cap if r.scenario.name == "kv-starved" else None):
            if cap is None:
                continue
            out["closed_loop"][f"{r.scenario.name}/{cap.how}"] = {
                "cap": cap.cap,
                "max_relative_error": MAX_RELATIVE_ERROR,
                "capped_runs": [asdict(lv) for lv in cap.capped.runs],
                "capped_tokens_per_s": cap.capped.tokens_per_s,
                "capped_spread": cap.capped.spread,
                "capped_relative_error": cap.capped.relative_error,
                "reference_runs": [asdict(lv) for lv in cap.reference.runs],
                "reference_tokens_per_s": cap.reference.tokens_per_s,
                "reference_spread": cap.reference.spread,
                "reference_relative_error": cap.reference.relative_error,
                "reference_starts_tokens_per_s": list(cap.reference_starts),
                "reference_start_spreads": [g.spread for g in cap.reference_start_runs],
                "start_spread": cap.start_spread,
                "capped_starts": cap.capped_starts,
                "peak_tokens_per_s": cap.peak_tokens_per_s,
                "throughput_fraction": cap.throughput_fraction,
                "plateau_tokens_per_s": cap.plateau_tokens_per_s,
                "plateau_fraction": cap.plateau_fraction,
                "p99_ratio_engine": cap.p99_ratio,
                "p99_ratio_client": cap.client_p99_ratio,
                "predicted_throughput_fraction": cap.predicted_throughput_fraction,
                "predicted_p99_e2e_s": cap.predicted_p99_e2e_s,
                "startup_s": cap.startup_s,
                "flags": cap.flags,
                "rejected_share": cap.rejected_share,
            }
    return json.loads(json.dumps(_nan_to_none(out), default=float))


def _nan_to_none(x: Any) -> Any:
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def format_all(runs: list[RegimeRun], engine_cap: CapRun | None) -> str:
    parts = [regimes_table(runs)]
    kv = next((r for r in runs if r.scenario.name == "kv-starved"), None)
    if kv is not None:
        parts.append(closed_loop_table(kv, engine_cap))
    judged = checks(runs, engine_cap)
    if judged:
        parts.append(checks_table(judged))
    parts += [levels_table(r) for r in runs]
    return "\n\n".join(parts)


def checks_table(judged: list[Check]) -> str:
    """Each property with its ratio, confidence interval and verdict."""
    head = f"{'check':<46} {'property':<56} {'ratio':>6} {'95% CI':>12} {'runs':>6} verdict"
    lines = [head, "-" * len(head)]
    for c in judged:
        r = c.ratio
        runs = f"{r.n_a}" if not r.n_b else f"{r.n_a}/{r.n_b}"
        lines.append(
            f"{c.name[:46]:<46} {c.what[:56]:<56} {r.estimate:>6.2f} "
            f"{f'{r.low:.2f}-{r.high:.2f}':>12} {runs:>6} {c.verdict}"
        )
    lines += [f"{c.name}: {c.note}" for c in judged if c.note]
    lines.append(
        f"capacity model: the prediction within {MAX_PLATEAU_ERROR:.0%} of the runs at the "
        "plateau; ratio: geometric means of the runs; 95% CI: Welch's t interval on their logarithms; "
        "verdict: holds (the interval clears the bound), fails (it lies wholly on the wrong "
        "side: the tests fail), within noise (it straddles the bound: these runs cannot tell)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--workdir",
        default="/tmp/kvscope-advisor-scenarios",
        help="collector store, engine and collector logs (default: %(default)s)",
    )
    p.add_argument("--duration", type=float, default=5.0, help="seconds per sweep level")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per level")
    p.add_argument(
        "--cap-duration",
        type=float,
        default=10.0,
        help="seconds of each capped run (default: %(default)s)",
    )
    p.add_argument(
        "--regimes",
        default=",".join(SCENARIOS),
        help="comma-separated regimes (default: %(default)s)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    p.add_argument("--no-progress", action="store_true", help="no sweep progress bars")
    p.add_argument(
        "--no-return-pass",
        action="store_true",
        help="sweep only upwards (faster; the machine's drift then reads as load's effect)",
    )
    args = p.parse_args(argv)
    names = [n for n in args.regimes.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown regime(s) {unknown}; choose from {list(SCENARIOS)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    runs: list[RegimeRun] = []
    engine_cap: CapRun | None = None
    started = time.monotonic()
    with AdvisorLab(
        args.workdir,
        duration_s=args.duration,
        warmup_s=args.warmup,
        cap_duration_s=args.cap_duration,
        log=log,
        progress=not args.no_progress,
        return_pass=not args.no_return_pass,
    ) as lab:
        for i, name in enumerate(names, 1):
            log(f"== regime {i}/{len(names)}: {name}")
            sc = SCENARIOS[name]
            run = lab.run_regime(sc, cap_by_client=name == "kv-starved")
            runs.append(run)
            if name == "kv-starved":
                log("== closed loop (b): the cap's vLLM flags on a restarted engine")
                engine_cap = lab.run_engine_cap(run)
    print(format_all(runs, engine_cap))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary(runs, engine_cap), indent=2) + "\n")
    failed = [c for c in checks(runs, engine_cap) if c.failed]
    return 0 if all(r.correct for r in runs) and not failed else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
