"""The advisor on more real engine regimes, each set against a control that lifts the
suspected limit: the ground truth of a regime is what its control measures.

One command (about 6 minutes per regime on a 2-core machine, two engine starts each)::

    .venv/bin/python bench/advisor_regimes.py [--regimes long-context,prefill-bound]
        [--runs 1] [--json out.json]

For each regime of :data:`REGIMES`: the real vLLM CPU engine on the lab's "mid" model
with the regime's flags and the kvscope plugin, a closed-loop sweep of the regime's
workload (prompt and output lengths) up and back down, the advisor's verdict on the
sweep; then the **control**: the same workload on an engine with the suspected limit
lifted (more KV blocks, a larger token budget), ``CONTROL_RUNS`` runs at the regime's
highest load, against at least as many runs of the regime there. A limit that
binds shows as throughput that grows under the control (``grows``: control over regime
at least ``min_ratio``, judged on the 95% interval of the runs, :mod:`bench.noise`); a
limit that does not bind shows as the same throughput (``same``: at most
``max_ratio``). A regime is right when the advisor's verdict is one of its expected
classes and the control agrees.

When the advisor recommends a cap (and the regime is not one that must get none), the
cap is then checked on the same engine: the cap and the regime's highest load
interleaved, ``ROUNDS`` rounds; the cap must keep ``MIN_CAP_FRACTION`` of the
throughput and cut the e2e P99 to ``MAX_CAP_P99_RATIO`` (open loop: the highest rate
with the cap as the benchmark client's concurrency limit, as a gateway's).

When the advisor recommends an engine flag with a predicted throughput gain (more KV
blocks: ``--kv-cache-dtype fp8``, a second GPU's memory, ``--gpu-memory-utilization``; a
larger ``--max-num-batched-tokens``; a larger ``--max-num-seqs``), the **advice check**
applies it: an engine with the change (fp8 and a second GPU as the what-if's block count,
which is what the prediction rests on: the CPU engine has neither), ``CONTROL_RUNS`` runs
at the regime's highest load, against the regime's runs there. The measured ratio must lie
within ``ADVICE_TOLERANCE`` of the predicted one (of its interval where the advisor gives
one): the expected effect an operator is promised, measured. Under open-loop arrivals the
prediction is held to what the highest rate offers (an engine delivers no more tokens than
it is sent requests for).

The regimes:

- ``long-context``: 160 blocks of 32 tokens (5,120 tokens) and prompts of ~1,500
  tokens: three requests fill the cache (KV usage can stay below 90%) and the fourth
  waits: ``kv_cache_bound``. Control: 1,024 blocks, throughput grows.
- ``prefill-bound``: a budget of 256 tokens, prompts of ~1,000 tokens and 16 output
  tokens: steps are full at the budget, but on a CPU step time grows with the tokens
  in the step: not ``token_budget_bound`` (``compute_bound``). Control: a budget of
  2,048, the same throughput.
- ``budget-bound``: a budget of 64 tokens (and ``max_num_seqs`` 64, which vLLM needs
  beside it), prompts of ~300 tokens: a step's fixed cost (reading the weights) dwarfs
  64 tokens of prefill, so bigger steps pay: ``token_budget_bound``. Control: a budget
  of 512, throughput grows.
- ``long-output-thrash``: 48 blocks, outputs of 512 tokens: sequences outgrow the cache
  while they run, vLLM preempts and recomputes: ``kv_cache_bound`` (with preemption
  thrash where throughput falls past its peak). Control: 4,096 blocks, throughput grows.
- ``open-loop-kv``: the KV-starved engine (48 blocks) under open-loop Poisson arrivals
  from vLLM's own benchmark client at 2 to 12 requests/s, 8 and 10 near the engine's
  capacity (~9 requests/s of 30-token prompts and 128 output tokens): past the capacity
  the queue grows without bound; the verdict, knee and cap come from the engine's
  requests in flight (the knee at most where the batch stopped growing while requests
  waited): ``kv_cache_bound``. Control: 4,096 blocks, the highest
  rates' throughput grows.
- ``front-end``: the lab's tiny model (a step of ~1.5 ms) with its API server held to
  ``FRONT_END_CPUS`` of CPU time by a cgroup quota, as a Kubernetes CPU limit on the
  server's container does: the API server tokenises, hands requests over and streams their
  tokens back late, so requests spend much of their life outside the engine core while the
  engine has room: ``frontend_bound``. Control: the same engine with no limit, throughput
  grows. (Leaving the engine core's spin-wait at the API server's priority, the earlier
  construction, starved it too little on vLLM 0.32: 29 of 32 requests still reached the
  engine.) Needs root and a cgroup CPU controller (:func:`kvscope.lab.engine.limit_cpu`).
- ``diurnal-mix``: 4,096 blocks, load from 1 to 8 clients (far below the ~32 where
  this engine's throughput flattens) while the prompts grow from ~25 to ~500 words at
  the top loads, as at a day's peak: generated tokens per request in flight fall, with
  no queue, free blocks and no limit binding: not saturated, **no knee and no cap**.
  Control: the same engine at twice the top loads with the same mix, throughput grows.
- ``ample-high``: 4,096 blocks up to 64 clients: ``compute_bound`` with steps slowing,
  or not saturated while throughput still grows. Control: none (nothing to lift).
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.advisor_scenarios import MAX_ATTEMPTS, ROUNDS, AdvisorLab, LevelMeasure
from bench.noise import FAILS, HOLDS, Ratio, ratio
from kvscope.advisor import CollectorSource, analyze
from kvscope.lab.engine import VllmServer, build_model, default_model_dir
from kvscope.lab.openloop import run_rates
from kvscope.lab.sweep import SweepResult

CONTROL_RUNS = 3
"""Runs of the control at the regime's highest load, and at least as many of the regime
there (the sweep's and the cap check's uncapped runs count)."""
MIN_CAP_FRACTION = 0.9
"""A cap must keep at least this share of the throughput the regime's highest load gives
(measured beside it, interleaved)."""
MAX_CAP_P99_RATIO = 0.5
"""...and cut the e2e P99 to at most this share of that load's."""
FRONT_END_CPUS = 0.05
"""The front-end regime's API server CPU limit (a twentieth of a core). A quarter did not
bind: the tiny model's API server, serving whole (not streamed) completions, delivered
8,292 tok/s at 32 clients under it and 7,952-8,340 without it."""
MAX_CYCLE_S = 90.0
"""The longest warm-up (and measurement window) a closed-loop level is stretched to
(:meth:`RegimeLab._cycle_s`)."""
ADVICE_TOLERANCE = 0.10
"""A recommended flag's measured throughput ratio must lie within this share of its
predicted one (the twin's target for a plateau, docs/twin.md)."""
ADVICE_KINDS = (
    "whatif_kv_cache_dtype_fp8",
    "whatif_gpu_memory_utilization",
    "whatif_tensor_parallel_2",
    "raise_max_num_batched_tokens",
    "raise_max_num_seqs",
)
"""Recommendations the advice check can apply on the lab's engine, in the order tried."""


@dataclass(frozen=True)
class Engine:
    """vLLM flags of one engine start."""

    num_gpu_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    engine_core_nice: int = 19
    """The engine core's nice value after start-up (0: the same priority as the API
    server, which it then starves on two cores; see ``VllmServer``)."""
    api_server_cpus: float | None = None
    """The API server's CPU limit (a cgroup quota, as a container's; ``None``: none)."""

    def extra_args(self) -> tuple[str, ...]:
        if self.max_num_batched_tokens is None:
            return ()
        return ("--max-num-batched-tokens", str(self.max_num_batched_tokens))

    def describe(self) -> str:
        out = f"--num-gpu-blocks-override {self.num_gpu_blocks} --max-num-seqs {self.max_num_seqs}"
        if self.max_num_batched_tokens is not None:
            out += f" --max-num-batched-tokens {self.max_num_batched_tokens}"
        if self.engine_core_nice != 19:
            out += f", engine core at nice {self.engine_core_nice}"
        if self.api_server_cpus is not None:
            out += f", API server held to {self.api_server_cpus:g} CPUs"
        return out


def _flag_value(flags: list[str], name: str) -> int | None:
    for f in flags:
        parts = f.split()
        if len(parts) == 2 and parts[0] == name:
            return int(float(parts[1]))
    return None


def advice_engine(rec: dict[str, Any], base: Engine) -> Engine | None:
    """The engine ``base`` with the recommendation ``rec`` (a ``Recommendation.to_dict()``)
    applied, or ``None`` when it is not one the lab's engine can take (:data:`ADVICE_KINDS`)
    or has no predicted gain. A KV what-if becomes its block count (``evidence``
    ``num_gpu_blocks``), the quantity its prediction rests on."""
    kind = rec.get("kind")
    gain = (rec.get("expected_effect") or {}).get("gain_ratio")
    if kind not in ADVICE_KINDS or gain is None or not math.isfinite(float(gain)):
        return None
    flags = list((rec.get("change") or {}).get("vllm_flags") or [])
    if kind.startswith("whatif_"):
        blocks = (rec.get("evidence") or {}).get("num_gpu_blocks")
        if blocks is None or int(blocks) <= base.num_gpu_blocks:
            return None
        return replace(base, num_gpu_blocks=int(blocks))
    if kind == "raise_max_num_batched_tokens":
        budget = _flag_value(flags, "--max-num-batched-tokens")
        return None if budget is None else replace(base, max_num_batched_tokens=budget)
    seqs = _flag_value(flags, "--max-num-seqs")
    return None if seqs is None else replace(base, max_num_seqs=seqs)


def predicted_ratio(rec: dict[str, Any]) -> tuple[float, float, float]:
    """The throughput ratio ``rec`` predicts (with it over without): point, low, high (the
    point twice where the advisor gives no interval)."""
    e = rec["expected_effect"]
    g = float(e["gain_ratio"])
    low, high = e.get("gain_ratio_low"), e.get("gain_ratio_high")
    lo = g if low is None or not math.isfinite(float(low)) else float(low)
    hi = g if high is None or not math.isfinite(float(high)) else float(high)
    return 1.0 + g, 1.0 + min(lo, g), 1.0 + max(hi, g)


def within_offered(
    predicted: tuple[float, float, float], ceiling: float | None
) -> tuple[float, float, float]:
    """The predicted ratio no higher than ``ceiling``: under open-loop arrivals the engine
    cannot deliver more than is offered (the highest rate's tokens/s over the regime's
    throughput there), whatever its capacity; ``None``: closed loop, no ceiling."""
    if ceiling is None:
        return predicted
    p, lo, hi = predicted
    return min(p, ceiling), min(lo, ceiling), min(hi, ceiling)


def advice_verdict(measured: Ratio, predicted: tuple[float, float, float]) -> str:
    """Verdict on "the measured ratio lies within :data:`ADVICE_TOLERANCE` of the
    prediction (its interval widened by it)"."""
    _, low, high = predicted
    return measured.within(low * (1 - ADVICE_TOLERANCE), high * (1 + ADVICE_TOLERANCE))


@dataclass(frozen=True)
class Regime:
    name: str
    expected: tuple[str, ...]
    """Verdicts that count as right (``not_saturated`` needs ``approaching`` in it too)."""
    engine: Engine
    prompt_words: tuple[int, int]
    output_tokens: int
    concurrency: tuple[int, ...]
    control: Engine | None = None
    control_expect: str = "grows"
    """``grows``: the lifted limit was binding; ``same``: it was not."""
    min_ratio: float = 1.1
    """``grows``: the control must add at least a tenth, the smallest change that makes a
    limit worth naming. The control answers which limit binds, not how much lifting it
    pays: that depends on how far it is lifted and on the next limit (6.4x the blocks gave
    the long-context engine +16%, 12-20%: its 1,500-token prompts keep compute close), and
    is the advice check's question, against the advisor's own prediction."""
    max_ratio: float = 1.15
    """``same``: the control adds at most this."""
    duration_s: float = 6.0
    why: str = ""
    model: str = "mid"
    """The lab model (``mid``: the engine is the bottleneck; ``tiny``: the front end is)."""
    rates: tuple[float, ...] = ()
    """Open loop: Poisson request rates (requests/s) from vLLM's benchmark client, each
    for about ``duration_s`` seconds of arrivals, instead of the closed-loop sweep."""
    mix: tuple[tuple[int, tuple[int, int]], ...] = ()
    """Prompt words by load: ``(clients, (min, max))`` pairs, each from that load up (a
    request mix that shifts with the day's load); empty: ``prompt_words`` throughout."""
    no_cap: bool = False
    """Right only without a knee or a cap (an engine that never saturated, or one whose
    front end limits)."""
    control_scale: int = 1
    """The control runs the regime's top loads times this (``2`` with the same engine:
    throughput that grows with load shows the engine was not saturated)."""

    def top_load(self, scale: int = 1) -> str:
        """The highest load, times ``scale``, as said in the output."""
        if self.rates:
            return f"{max(self.rates) * scale:g} requests/s"
        return f"{max(self.concurrency) * scale} clients"

    def mix_of(self, clients: int) -> tuple[int, int]:
        """Prompt words at ``clients`` (see ``mix``)."""
        words = self.prompt_words
        for c, w in self.mix:
            if clients >= c:
                words = w
        return words


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime(
            "long-context",
            ("kv_cache_bound",),
            Engine(num_gpu_blocks=160),
            prompt_words=(1400, 1600),
            output_tokens=64,
            concurrency=(1, 2, 3, 4, 6, 8),
            control=Engine(num_gpu_blocks=1024),
            why="three ~1,550-token requests fill 5,120 tokens; the fourth waits",
        ),
        Regime(
            "prefill-bound",
            ("compute_bound",),
            Engine(num_gpu_blocks=4096, max_num_batched_tokens=256),
            prompt_words=(900, 1100),
            output_tokens=16,
            concurrency=(1, 2, 4, 8, 16),
            control=Engine(num_gpu_blocks=4096, max_num_batched_tokens=2048),
            control_expect="same",
            why="steps full at 256 tokens, but step time grows with the tokens in them",
        ),
        Regime(
            "budget-bound",
            ("token_budget_bound",),
            Engine(num_gpu_blocks=4096, max_num_seqs=64, max_num_batched_tokens=64),
            prompt_words=(250, 350),
            output_tokens=16,
            concurrency=(1, 2, 4, 8, 16, 32),
            control=Engine(num_gpu_blocks=4096, max_num_seqs=64, max_num_batched_tokens=512),
            why="64 tokens per step against a step's fixed cost: bigger steps pay",
        ),
        Regime(
            "long-output-thrash",
            ("kv_cache_bound",),
            Engine(num_gpu_blocks=48),
            prompt_words=(8, 40),
            output_tokens=512,
            concurrency=(1, 2, 4, 8, 16, 32),
            control=Engine(num_gpu_blocks=4096),
            duration_s=8.0,
            why="sequences outgrow the 1,536-token cache while they run: preemptions",
        ),
        Regime(
            "open-loop-kv",
            ("kv_cache_bound",),
            Engine(num_gpu_blocks=48),
            prompt_words=(30, 30),
            output_tokens=128,
            concurrency=(),
            rates=(2, 4, 6, 8, 10, 12),
            duration_s=20.0,
            control=Engine(num_gpu_blocks=4096),
            why="Poisson arrivals from vLLM's benchmark client past the KV-bound capacity",
        ),
        Regime(
            "diurnal-mix",
            ("not_saturated", "no_limit", "compute_bound"),
            Engine(num_gpu_blocks=4096),
            prompt_words=(8, 40),
            output_tokens=128,
            concurrency=(1, 2, 3, 4, 6, 8),
            mix=((4, (150, 250)), (6, (400, 600))),
            no_cap=True,
            control=Engine(num_gpu_blocks=4096),
            control_scale=2,
            why="the day's peak, below the knee, brings prompts ten times longer",
        ),
        Regime(
            "front-end",
            ("frontend_bound",),
            Engine(num_gpu_blocks=4096, api_server_cpus=FRONT_END_CPUS),
            prompt_words=(8, 40),
            output_tokens=128,
            concurrency=(1, 2, 4, 8, 16, 32),
            model="tiny",
            no_cap=True,
            control=Engine(num_gpu_blocks=4096),
            why=f"a tiny model's API server held to {FRONT_END_CPUS:g} CPUs, as a container's limit",
        ),
        Regime(
            "ample-high",
            ("compute_bound", "not_saturated"),
            Engine(num_gpu_blocks=4096),
            prompt_words=(8, 40),
            output_tokens=128,
            concurrency=(1, 2, 4, 8, 16, 32, 48, 64),
            why="no limit but the compute of each step",
        ),
    )
}


@dataclass
class RegimeResult:
    name: str
    expected: tuple[str, ...]
    verdict: dict[str, Any]
    evidence: dict[str, Any]
    levels: list[dict[str, Any]]
    control_levels: list[dict[str, Any]] = field(default_factory=list)
    control: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    run: int = 0
    no_cap: bool = False
    cap: dict[str, Any] = field(default_factory=dict)
    """The cap check (``RegimeLab._cap_check``); empty when the advisor gave no cap."""
    advice: dict[str, Any] = field(default_factory=dict)
    """The advice check (``RegimeLab._advice_check``); empty when the advisor recommended
    no flag the lab can apply."""

    @property
    def verdict_right(self) -> bool:
        v = self.verdict
        if v["bottleneck"] not in self.expected:
            return False
        # ``no_limit`` in ``expected``: not saturated with no limit in sight is right.
        approaching = v.get("approaching") or "no_limit"
        return v["bottleneck"] != "not_saturated" or approaching in self.expected

    @property
    def control_agrees(self) -> bool | None:
        c = self.control
        return None if not c else c["verdict"] != FAILS

    @property
    def cap_holds(self) -> bool | None:
        """``None`` without a cap check; else no refuted property."""
        c = self.cap
        if not c:
            return None
        return FAILS not in (c["throughput_verdict"], c.get("p99_verdict"))

    @property
    def advice_holds(self) -> bool | None:
        """``None`` without an advice check; else its prediction not refuted."""
        return None if not self.advice else self.advice["verdict"] != FAILS

    @property
    def knee_and_cap_right(self) -> bool:
        """For an engine that never saturated or whose front end limits: no knee, no cap."""
        v = self.verdict
        return not self.no_cap or (
            v.get("knee_concurrency") is None and v.get("recommended_concurrency_cap") is None
        )

    @property
    def right(self) -> bool:
        return (
            self.verdict_right
            and self.knee_and_cap_right
            and self.control_agrees is not False
            and self.cap_holds is not False
            and self.advice_holds is not False
        )


class RegimeLab(AdvisorLab):
    """An :class:`AdvisorLab` whose sweeps carry a regime's workload.

    Every closed-loop level (the sweep's, the cap check's, the control's, the advice
    check's) is measured in the loop's steady state: its warm-up and its measurement
    window each last at least one **cycle**, the time a request spends in the system at
    that load by Little's law (clients over the requests/s the same engine finished at
    that load or the nearest below it, :meth:`_cycle_s`). A closed loop starts with every
    client's request at once; until each has come back once, the requests finished are
    the first ones served, and a window shorter than a cycle counts only those: the
    long-output regime's 32 clients (~1 request/s, ~35 s in the system) measured an e2e
    P99 of 12.4 s in 13-second runs, the run's length rather than the overload's tail."""

    _request_rates: dict[str, dict[int, float]]
    """Requests/s per engine (the first one: the regime's) and per load level."""

    def _cycle_s(self, engine_id: str, concurrency: int) -> float:
        """Seconds a request spends in the system at ``concurrency`` clients (Little's
        law), from the slowest request rate engine ``engine_id`` finished at that load or
        the nearest below it; an engine with none there (a control's or a flag's first run)
        takes the regime's engine's, which has the limit they lift. 0 before any level was
        measured. At most :data:`MAX_CYCLE_S`."""
        engines = getattr(self, "_request_rates", {})
        for rates in (engines.get(engine_id, {}), next(iter(engines.values()), {})):
            below = [c for c in rates if c <= concurrency]
            if below:
                return min(MAX_CYCLE_S, concurrency / rates[max(below)])
        return 0.0

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
        """:meth:`AdvisorLab._level` with its warm-up and window stretched to a cycle, the
        one this bench measured at that load (``steady_state`` is not used: it would
        measure the cycle again within the level)."""
        cycle = self._cycle_s(engine_id, concurrency)
        if cycle > max(duration_s, warmup_s):
            self._say(
                f"{concurrency} clients: {cycle:.0f} s of warm-up and of measurement "
                "(a request's time in the system there)"
            )
        level, sweep = super()._level(
            server,
            engine_id,
            concurrency,
            max(duration_s, cycle),
            max(warmup_s, cycle),
            seed,
            attempts,
            admit_limit,
        )
        if level.delivered and level.client_tokens_per_s > 0 and self.output_tokens:
            rate = level.client_tokens_per_s / self.output_tokens
            rates = self._request_rates.setdefault(engine_id, {})
            # The slowest seen: the machine's speed drifts, and a warm-up too long costs
            # only time.
            rates[concurrency] = min(rates.get(concurrency, rate), rate)
        return level, sweep

    def _levels(
        self,
        server: VllmServer,
        pool: str,
        levels: tuple[int, ...],
        duration_s: float,
        seed: int,
        *,
        back: bool = False,
        mix: Callable[[int], tuple[int, int]] | None = None,
    ) -> tuple[list[LevelMeasure], float, float]:
        engine_id = self._engine_id(pool)
        out: list[LevelMeasure] = []
        since = until = math.nan
        order = list(levels)
        if back and self.return_pass:  # up and back down: the machine's drift cancels
            top = max(levels)
            order += sorted((c for c in levels if top > c and 4 * c >= top), reverse=True)
        for i, c in enumerate(order):
            if mix is not None:  # the request mix of this load level
                self.prompt_words = mix(c)
            level, sweep = self._level(server, engine_id, c, duration_s, self.warmup_s, seed + i, 2)
            out.append(level)
            if i == 0:
                since = sweep.started_unix_s
            until = sweep.finished_unix_s + 1.0
        return out, since, until

    def _open_loop(
        self, server: VllmServer, pool: str, regime: Regime, rates: tuple[float, ...], seed: int
    ) -> tuple[list[dict[str, Any]], list[float], float, float]:
        assert self.model_dir is not None
        got = run_rates(
            server.url,
            "kvscope-advisor",
            self.model_dir,
            list(rates),
            seconds=regime.duration_s,
            input_len=regime.prompt_words[1],
            output_len=regime.output_tokens,
            seed=seed,
            workdir=self.workdir / f"openloop-{pool}",
            log=self._say,
        )
        for r in got:
            self._say(
                f"{pool}: {r.rate:g} requests/s: {r.output_tokens_per_s:,.0f} tok/s, "
                f"e2e P99 {r.e2e_p99_s:.2f} s, {r.completed} completed, {r.failed} failed"
            )
        rows = [asdict(r) for r in got]
        return (
            rows,
            [r.output_tokens_per_s for r in got],
            got[0].started_unix_s,
            (got[-1].finished_unix_s + 1.0),
        )

    def run(self, regime: Regime, run_index: int = 0) -> RegimeResult:
        """One run of a regime and its control, on the regime's lab model."""
        mid_dir = self.model_dir
        try:
            if regime.model != "mid":
                self.model_dir = build_model(default_model_dir(regime.model), regime.model)
            return self._run(regime, run_index)
        finally:
            self.model_dir = mid_dir

    def _run(self, regime: Regime, run_index: int) -> RegimeResult:
        started = time.monotonic()
        self.prompt_words, self.output_tokens = regime.prompt_words, regime.output_tokens
        self._request_rates = {}
        seed = self.seed + 1000 * run_index
        pool = f"regime-{regime.name}-{run_index}"
        with self._started(pool, regime.engine) as server:
            at: list[float]
            if regime.rates:
                self._say(f"{pool}: {regime.why}; open loop at {regime.rates} requests/s")
                rows, tput, since, until = self._open_loop(server, pool, regime, regime.rates, seed)
                at = list(regime.rates)
            else:
                self._say(f"{pool}: {regime.why}; sweeping {regime.concurrency}")
                levels, since, until = self._levels(
                    server,
                    pool,
                    regime.concurrency,
                    regime.duration_s,
                    seed,
                    back=True,
                    mix=regime.mix_of,
                )
                rows = [asdict(lv) for lv in levels]
                tput = [lv.client_tokens_per_s for lv in levels]
                at = [float(lv.concurrency) for lv in levels]
            report = analyze(CollectorSource(self._collector.url), since, until, pool=pool)
            v = report.engines[0]
            recs = [r.to_dict() for r in report.recommendations]
            found = report.findings_of("bottleneck")
            res = RegimeResult(
                name=regime.name,
                expected=regime.expected,
                verdict=v.to_dict(),
                evidence=found[0].evidence if found else {},
                levels=rows,
                run=run_index + 1,
                no_cap=regime.no_cap,
            )
            self._say(
                f"{pool}: advisor says {v.bottleneck}"
                f"{'' if v.saturated else f' (approaching {v.approaching})'}, knee "
                f"{'-' if v.knee_concurrency is None else f'{v.knee_concurrency:.1f}'}, cap "
                f"{'-' if v.recommended_concurrency_cap is None else v.recommended_concurrency_cap}"
                f"; {found[0].summary if found else ''}"
            )
            cap = v.recommended_concurrency_cap
            if cap is not None and not regime.no_cap:
                res.cap = self._cap_check(server, pool, regime, cap, seed + 700)
            # The regime's runs at its highest load, for the control to be set against:
            # the sweep's and the cap check's uncapped runs, or two more.
            top_load = max(at)
            top_runs = [t for load, t in zip(at, tput, strict=True) if load == top_load]
            top_runs += res.cap.get("uncapped_runs_tokens_per_s", [])
            advice = self._advice_of(regime, recs)
            if (regime.control is not None or advice) and len(top_runs) < CONTROL_RUNS:
                top_runs += self._top_runs(
                    server, pool, regime, CONTROL_RUNS - len(top_runs), seed + 800
                )[1]
        if regime.control is not None:
            res.control, res.control_levels = self._control(regime, pool, top_runs, seed + 500)
        if advice:
            res.advice = self._advice_check(regime, pool, *advice, top_runs, seed + 900)
        res.seconds = time.monotonic() - started
        return res

    def _cap_check(
        self, server: VllmServer, pool: str, regime: Regime, cap: int, seed: int
    ) -> dict[str, Any]:
        """The advisor's cap against the regime's highest load on the same engine, the two
        interleaved for ``ROUNDS`` rounds (more while noisy, as the lab's closed loop):
        throughput kept (at least ``MIN_CAP_FRACTION``) and vLLM's e2e P99 cut (at most
        ``MAX_CAP_P99_RATIO``). Open loop: the highest rate with the cap as the client's
        concurrency limit (a gateway's) against the same rate uncapped."""
        if regime.rates:
            top_rate = max(regime.rates)
            self._say(f"{pool}: cap {cap} against {top_rate:g} requests/s uncapped, interleaved")
            capped: list[tuple[float, float]] = []
            uncapped: list[tuple[float, float]] = []
            for r in range(ROUNDS):
                for limit, out in ((cap, capped), (None, uncapped)):
                    got = run_rates(
                        server.url,
                        "kvscope-advisor",
                        self.model_dir or "",
                        [top_rate],
                        seconds=regime.duration_s,
                        input_len=regime.prompt_words[1],
                        output_len=regime.output_tokens,
                        seed=seed + 10 * r,
                        workdir=self.workdir / f"openloop-{pool}-cap",
                        max_concurrency=limit,
                    )[0]
                    out.append((got.output_tokens_per_s, got.e2e_p99_s))
                self._say(
                    f"{pool}: round {r + 1}: cap {capped[-1][0]:,.0f} tok/s "
                    f"(P99 {capped[-1][1]:.2f} s), uncapped {uncapped[-1][0]:,.0f} tok/s "
                    f"(P99 {uncapped[-1][1]:.2f} s)"
                )
            load = f"{top_rate:g} requests/s"
            p99_from = "the benchmark client's"
        else:
            top = max(regime.concurrency)
            self._say(f"{pool}: cap {cap} against {top} clients, interleaved")
            reps = self._repeated(
                server,
                self._engine_id(pool),
                [(f"cap {cap}", cap, None), (f"{top} clients", top, None)],
                seed,
            )
            capped = [
                (lv.client_tokens_per_s, lv.engine_e2e_p99_s or math.nan) for lv in reps[0].runs
            ]
            uncapped = [
                (lv.client_tokens_per_s, lv.engine_e2e_p99_s or math.nan) for lv in reps[1].runs
            ]
            load = f"{top} clients"
            p99_from = "vLLM's"
        tp = ratio([t for t, _ in capped], [t for t, _ in uncapped])
        pa = [p for _, p in capped if math.isfinite(p) and p > 0]
        pb = [p for _, p in uncapped if math.isfinite(p) and p > 0]
        p99 = ratio(pa, pb) if pa and pb else None
        out: dict[str, Any] = {
            "cap": cap,
            "against": load,
            "capped_tokens_per_s": statistics.median(t for t, _ in capped),
            "uncapped_tokens_per_s": statistics.median(t for t, _ in uncapped),
            "capped_p99_e2e_s": statistics.median(pa) if pa else None,
            "uncapped_p99_e2e_s": statistics.median(pb) if pb else None,
            "p99_from": p99_from,
            "uncapped_runs_tokens_per_s": [t for t, _ in uncapped],
            "throughput": asdict(tp),
            "throughput_verdict": tp.at_least(MIN_CAP_FRACTION),
            "p99": None if p99 is None else asdict(p99),
            "p99_verdict": None if p99 is None else p99.at_most(MAX_CAP_P99_RATIO),
        }
        self._say(
            f"{pool}: cap {cap} keeps {tp.describe()} of the throughput at {load} "
            f"-> {out['throughput_verdict']}; e2e P99 {'-' if p99 is None else p99.describe()} "
            f"-> {out['p99_verdict']}"
        )
        return out

    @contextmanager
    def _started(self, pool: str, e: Engine) -> Iterator[VllmServer]:
        """The engine ``e`` under ``pool``, warmed up."""
        with self.engine(
            pool,
            num_gpu_blocks=e.num_gpu_blocks,
            max_num_seqs=e.max_num_seqs,
            extra_args=e.extra_args(),
            engine_core_nice=e.engine_core_nice,
            api_server_cpus=e.api_server_cpus,
        ) as server:
            self._warm(server)
            yield server

    def _top_runs(
        self, server: VllmServer, pool: str, regime: Regime, n: int, seed: int, scale: int = 1
    ) -> tuple[list[dict[str, Any]], list[float]]:
        """``n`` runs at the regime's highest load (clients or rate) times ``scale``, with
        the request mix of the highest load: their rows and client output tok/s."""
        if regime.rates:
            rows, tput, _, _ = self._open_loop(
                server, pool, regime, (max(regime.rates) * scale,) * n, seed
            )
            return rows, tput
        top = max(regime.concurrency)
        self.prompt_words = regime.mix_of(top)
        levels = [
            self._level(
                server, self._engine_id(pool), top * scale, regime.duration_s, self.warmup_s,
                seed + i, 2,
            )[0]
            for i in range(n)
        ]  # fmt: skip
        return [asdict(lv) for lv in levels], [lv.client_tokens_per_s for lv in levels]

    def _control(
        self, regime: Regime, pool: str, regime_runs: list[float], seed: int
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The control engine at the regime's highest load (times ``control_scale``),
        ``CONTROL_RUNS`` runs, against the regime's runs at that load (see the module
        docstring)."""
        c = regime.control
        assert c is not None
        scale = regime.control_scale
        cpool = f"{pool}-control"
        unit = regime.top_load(scale)
        with self._started(cpool, c) as server:
            what = c.describe() + (f", {scale}x the load" if scale != 1 else "")
            self._say(f"{cpool}: the control ({what}) at {unit}, {CONTROL_RUNS} runs")
            crows, ctput = self._top_runs(server, cpool, regime, CONTROL_RUNS, seed, scale)
        r = ratio(ctput, regime_runs)
        if regime.control_expect == "grows":
            judged, what = r.at_least(regime.min_ratio), f">= {regime.min_ratio:g}"
        else:
            judged, what = r.at_most(regime.max_ratio), f"<= {regime.max_ratio:g}"
        self._say(f"{cpool}: control / regime {r.describe()} -> {judged}")
        return (
            {
                "engine": c.describe(),
                "expect": regime.control_expect,
                "property": f"control / regime throughput at {unit} {what}",
                "ratio": asdict(r),
                "verdict": judged,
                "control_runs_tokens_per_s": ctput,
                "regime_runs_tokens_per_s": regime_runs,
            },
            crows,
        )

    @staticmethod
    def _advice_of(
        regime: Regime, recs: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], Engine] | None:
        """The first recommendation (in :data:`ADVICE_KINDS` order) the lab can apply, with
        the engine it gives."""
        for kind in ADVICE_KINDS:
            for rec in recs:
                if rec["kind"] == kind and (e := advice_engine(rec, regime.engine)) is not None:
                    return rec, e
        return None

    def _advice_check(
        self,
        regime: Regime,
        pool: str,
        rec: dict[str, Any],
        engine: Engine,
        regime_runs: list[float],
        seed: int,
    ) -> dict[str, Any]:
        """The recommendation applied (``engine``): ``CONTROL_RUNS`` runs at the regime's
        highest load against the regime's runs there, the ratio against the predicted one
        (see the module docstring)."""
        apool = f"{pool}-advice"
        unit = regime.top_load()
        predicted = predicted_ratio(rec)
        if regime.rates:
            offered = max(regime.rates) * regime.output_tokens
            predicted = within_offered(predicted, offered / statistics.geometric_mean(regime_runs))
        with self._started(apool, engine) as server:
            self._say(
                f"{apool}: the advice {rec['change']['vllm_flags']} ({engine.describe()}), "
                f"predicted x{predicted[0]:.2f}, at {unit}, {CONTROL_RUNS} runs"
            )
            rows, tput = self._top_runs(server, apool, regime, CONTROL_RUNS, seed)
        r = ratio(tput, regime_runs)
        judged = advice_verdict(r, predicted)
        self._say(
            f"{apool}: with the advice / without {r.describe()} against predicted "
            f"x{predicted[0]:.2f} ({predicted[1]:.2f}-{predicted[2]:.2f}) -> {judged}"
        )
        return {
            "kind": rec["kind"],
            "flags": rec["change"]["vllm_flags"],
            "engine": engine.describe(),
            "summary": rec["summary"],
            "predicted_ratio": predicted[0],
            "predicted_low": predicted[1],
            "predicted_high": predicted[2],
            "property": (
                f"throughput with the advice / without at {unit} within "
                f"{ADVICE_TOLERANCE:.0%} of the predicted"
            ),
            "ratio": asdict(r),
            "verdict": judged,
            "advice_runs_tokens_per_s": tput,
            "regime_runs_tokens_per_s": regime_runs,
            "levels": rows,
        }


def _ci(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    x = Ratio(**r)
    return f"{x.estimate:.2f} ({x.low:.2f}-{x.high:.2f})"


def table(results: list[RegimeResult]) -> str:
    head = (
        f"{'regime':<19} {'run':>3} {'expected':<31} {'verdict':<36} {'knee':>5} {'cap':>4} "
        f"{'cap keeps':>17} {'cap P99':>17} {'control / regime':>17} {'control':<13} "
        f"{'advice':<26} {'predicted':>9} {'measured':>17} {'advice':<13} right"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        v = r.verdict
        verdict = v["bottleneck"] + (
            f" -> {v.get('approaching')}" if v["bottleneck"] == "not_saturated" else ""
        )
        knee = v.get("knee_concurrency")
        cap = v.get("recommended_concurrency_cap")
        ctl, cc, ad = r.control, r.cap, r.advice
        pred = f"x{ad['predicted_ratio']:.2f}" if ad else "-"
        lines.append(
            f"{r.name:<19} {r.run:>3} {' | '.join(r.expected):<31} {verdict:<36} "
            f"{'-' if knee is None else f'{knee:.1f}':>5} {'-' if cap is None else cap:>4} "
            f"{_ci(cc.get('throughput')):>17} {_ci(cc.get('p99')):>17} "
            f"{_ci(ctl.get('ratio')):>17} "
            f"{ctl.get('verdict', '-') if ctl else '-':<13} "
            f"{', '.join(ad.get('flags', [])) or '-':<26} "
            f"{pred:>9} {_ci(ad.get('ratio')):>17} "
            f"{ad.get('verdict', '-') if ad else '-':<13} {'yes' if r.right else 'NO'}"
        )
    lines.append(
        f"cap keeps / cap P99: throughput and e2e P99 at the cap over the regime's highest load "
        f"(at least {MIN_CAP_FRACTION:g}, at most {MAX_CAP_P99_RATIO:g}; 95% interval); "
        "control / regime: client throughput at the regime's highest load with the "
        "suspected limit lifted, over the regime's there; control: "
        f"{HOLDS} / {FAILS} / within noise for the regime's expectation (grows or same); "
        "advice: the advisor's recommended flag applied at the regime's highest load, its "
        f"predicted throughput ratio and the measured one (within {ADVICE_TOLERANCE:.0%}); "
        "right: the verdict expected, no knee or cap where none is due, and nothing refuted"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--workdir", default="/tmp/kvscope-advisor-regimes")
    p.add_argument(
        "--regimes",
        default=",".join(REGIMES),
        help="comma-separated regimes (default: %(default)s)",
    )
    p.add_argument("--runs", type=int, default=1, help="runs of each regime (default: 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no sweep progress bars")
    args = p.parse_args(argv)
    names = [n for n in args.regimes.split(",") if n]
    unknown = [n for n in names if n not in REGIMES]
    if unknown:
        p.error(f"unknown regime(s) {unknown}; choose from {list(REGIMES)}")
    if args.runs < 1:
        p.error("--runs must be at least 1")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results: list[RegimeResult] = []
    lab = RegimeLab(args.workdir, log=log, progress=not args.no_progress)
    with lab:
        for run in range(args.runs):
            for name in names:
                log(f"== {name}, run {run + 1}/{args.runs}")
                results.append(lab.run(REGIMES[name], run))
                if args.json:
                    Path(args.json).write_text(
                        json.dumps([asdict(r) for r in results], indent=2, default=float) + "\n"
                    )
    print(table(results))
    right = sum(r.right for r in results)
    print(
        f"\n{right} of {len(results)} right; median {statistics.median(r.seconds for r in results):.0f} s per regime run"
    )
    return 0 if right == len(results) else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
