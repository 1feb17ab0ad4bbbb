"""The engine twin against the real engine: calibrate on one run, predict the others.

One command (about 25 minutes on a 2-core machine with the default two runs of each
configuration)::

    .venv/bin/python bench/twin_vs_real.py [--configs blocks-x2,cap] [--json out.json]

1. **Calibration**: the real vLLM CPU engine (the lab's "mid" model, the kvscope plugin,
   a collector) runs the baseline configuration through a closed-loop sweep of
   :data:`LEVELS`, with vLLM's per-step details on. The twin's step-time model is fitted
   on that run's steps (``--step-fit``: by default the step cycle, the time from one
   step's stats to the next, against the work of the step; or vLLM's reported
   execution time; or the advisor's fit on 1-second windows); nothing else is taken
   from it.
2. **Predictions**, made before any other engine starts: for each configuration of
   :data:`CONFIGS` the twin (vLLM's scheduler, the fitted step time, the engine's own
   hello for blocks, block size, budget and ``max_num_seqs``) runs the same sweep on
   the same workload, tokenized with the model's tokenizer, so the prefix cache sees
   the engine's tokens, and feeds the collector through the plugin (pool
   ``<config>-twin``).
3. **Measurements**: the real engine runs each configuration's sweep, ``--repeats``
   times on fresh engines in rounds over the configurations (a 2-core machine moves
   the same configuration's throughput by up to 20% from one engine start to the
   next); the twin is judged against the per-level median, and each row states the
   runs' spread.
4. The advisor reads both pools; the table sets, per configuration, the twin's
   plateau, knee, e2e P99 and preemptions per finished request against the real
   engine's, with the targets of :data:`TARGETS`.

Configurations (the workload: prompts of 20-300 random words, ~20-300 tokens, 64
output tokens; the pool's prompts share one of four 150-word prefixes):

- ``baseline``: 128 blocks of 32 tokens (4,096 tokens), ``max_num_seqs`` 256: KV-bound
  at ~14 requests. The calibration run, and predicted by the twin like the others.
- ``blocks-x2``: 256 blocks, what fp8 KV would give.
- ``cap``: 128 blocks and ``--max-num-seqs`` set to the advisor's cap on the baseline.
- ``small-budget``: 1,024 blocks, ``--max-num-batched-tokens 64`` (and ``max_num_seqs``
  64, which vLLM needs beside it): prompts prefill in chunks over several steps.
- ``pool-rr``: two baseline engines under round robin with prefix-sharing prompts,
  each engine bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``; by default
  vLLM binds every engine to core 0), as each GPU replica has its own device. The
  calibrated engine had core 0 to itself, its API server and the load generator on
  core 1; here the second engine shares core 1 with both API servers and the load
  generator (the engines run at nice 19, so those come first): the twin, which gives
  each replica the calibrated step time, is expected high by what they take.

Levels (:data:`LEVELS` clients): by default each is stretched into its steady state on
both sides, as ``kvscope sweep`` and ``kvscope twin sweep`` do: the warm-up lasts at least
:data:`WARMUP_S` and until every client's first request has returned, the window at least
:data:`DURATION_S` and one cycle of the loop, each at most :data:`MAX_STRETCH_S`; the same
rule on the real clock and on the twin's. ``--fixed-windows``: :data:`WARMUP_S` then
:data:`DURATION_S` on both sides, shorter than a request at the top loads (e2e 10-13 s on
an AVX2 machine), so those levels read the first wave's transient.

The plateau of a side is the mean generated tokens/s of its top three levels (measured,
whatever the advisor decides); knee, bottleneck and cap are the advisor's on each side.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.advisor_scenarios import MODEL_NAME, AdvisorLab
from kvscope.advisor import CollectorSource, analyze
from kvscope.advisor.steptime import StepTimeModel
from kvscope.lab.sweep import SweepConfig, run_sweep
from kvscope.lab.sweep.workload import Workload

LEVELS = (2, 4, 8, 12, 16, 24, 32)
DURATION_S = 10.0
WARMUP_S = 3.0
MAX_STRETCH_S = 4 * DURATION_S
"""Steady-state levels (the default): the longest warm-up, and the longest window."""
PROMPT_WORDS = (20, 300)
OUTPUT_TOKENS = 64
BLOCK_SIZE = 32

TARGETS = {
    "plateau": 0.10,
    "knee_levels": 1,
    "e2e_p99": 0.25,
    "preemptions_per_request": 0.30,
}
"""The issue's targets: plateau within 10%, knee within one load level, e2e P99 within
25%, preemptions per finished request within 30% (of the real engine's)."""


@dataclass(frozen=True)
class Config:
    name: str
    num_gpu_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    replicas: int = 1
    shared_prefix_words: int = 0
    prefix_groups: int = 1

    def flags(self) -> tuple[str, ...]:
        if self.max_num_batched_tokens is None:
            return ()
        return ("--max-num-batched-tokens", str(self.max_num_batched_tokens))


CONFIGS: dict[str, Config] = {
    "baseline": Config("baseline", 128),
    "blocks-x2": Config("blocks-x2", 256),
    "cap": Config("cap", 128, max_num_seqs=0),  # the advisor's cap on the baseline
    "small-budget": Config("small-budget", 1024, 64, 64),
    "pool-rr": Config("pool-rr", 128, replicas=2, shared_prefix_words=150, prefix_groups=4),
}


@dataclass
class Level:
    concurrency: int
    tokens_per_s: float
    e2e_p99_s: float | None
    preemptions_per_request: float | None
    finished: int
    prefix_hit_rate: float | None = None
    client_tokens_per_s: float | None = None
    """Real side: the load generator's streamed tokens/s over the same window."""
    seconds_with_steps: int | None = None
    """Real side: the level's seconds in which a step ended (those with a 1-second window)."""


@dataclass
class Side:
    """One configuration as measured (real) or predicted (twin)."""

    levels: list[Level]
    bottleneck: str | None = None
    knee: float | None = None
    plateau_tokens_per_s: float | None = None
    cap: int | None = None


@dataclass
class Comparison:
    config: Config
    real: Side
    twin: Side
    twin_wall_s: float = 0.0
    twin_sim_s: float = 0.0
    checks: dict[str, Any] = field(default_factory=dict)
    real_runs: list[Side] = field(default_factory=list)
    """Every real run of the configuration; ``real`` is their per-level median."""


def _median(values: list[float | None]) -> float | None:
    vs = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vs) if vs else None


def median_side(runs: list[Side]) -> Side:
    """The per-level median of repeated real runs of one configuration (the advisor's
    knee and cap their medians, its verdict the most frequent)."""
    if len(runs) == 1:
        return runs[0]
    levels = []
    for per in zip(*(r.levels for r in runs), strict=True):
        tps = _median([lv.tokens_per_s for lv in per])
        levels.append(
            Level(
                per[0].concurrency,
                math.nan if tps is None else tps,
                _median([lv.e2e_p99_s for lv in per]),
                _median([lv.preemptions_per_request for lv in per]),
                int(statistics.median(lv.finished for lv in per)),
                _median([lv.prefix_hit_rate for lv in per]),
                _median([lv.client_tokens_per_s for lv in per]),
                None,
            )
        )
    verdicts = [r.bottleneck for r in runs]
    cap = _median([float(r.cap) for r in runs if r.cap is not None])
    return Side(
        levels,
        bottleneck=max(set(verdicts), key=verdicts.count),
        knee=_median([r.knee for r in runs]),
        plateau_tokens_per_s=_median([r.plateau_tokens_per_s for r in runs]),
        cap=None if cap is None else round(cap),
    )


# -- the real engine ---------------------------------------------------------------------


class TwinLab(AdvisorLab):
    prompt_words = PROMPT_WORDS
    output_tokens = OUTPUT_TOKENS
    steady = True
    """Steady-state levels on the real engine (``--fixed-windows``: False)."""

    def __enter__(self) -> TwinLab:
        super().__enter__()
        return self

    def real(
        self, cfg: Config, seed: int, run: int = 0
    ) -> tuple[Side, dict[str, Any], float, float]:
        """Run ``cfg``'s sweep on the real engine(s), fresh ones for each ``run`` (pool
        ``<config>`` for the first, ``<config>-r<run>`` after); the side, one engine's
        hello, and the sweep's time range."""
        from contextlib import ExitStack

        pool = cfg.name if run == 0 else f"{cfg.name}-r{run}"

        with ExitStack() as stack:
            servers = [
                stack.enter_context(
                    self.engine(
                        pool,
                        num_gpu_blocks=cfg.num_gpu_blocks,
                        max_num_seqs=cfg.max_num_seqs,
                        # vLLM's per-step iteration time, for the twin's step-time fit
                        extra_args=(*cfg.flags(), "--enable-logging-iteration-details"),
                        # vLLM binds an engine to core 0 by default (the last core is kept
                        # for other processes): a pool's engines get a core each.
                        env=({"VLLM_CPU_OMP_THREADS_BIND": str(i)} if cfg.replicas > 1 else None),
                        replica=i if cfg.replicas > 1 else None,
                    )
                )
                for i in range(cfg.replicas)
            ]
            for s in servers:
                self._warm(s)
            ids = self._engine_ids(pool, cfg.replicas)
            result = run_sweep(
                SweepConfig(
                    url=servers[0].url,
                    replicas=[s.url for s in servers[1:]],
                    routing="round-robin",
                    model=MODEL_NAME,
                    concurrency=list(LEVELS),
                    duration_s=DURATION_S,
                    warmup_s=WARMUP_S,
                    cooldown_s=1.0,
                    prompt_words=PROMPT_WORDS,
                    output_tokens=(OUTPUT_TOKENS, OUTPUT_TOKENS),
                    shared_prefix_words=cfg.shared_prefix_words,
                    prefix_groups=cfg.prefix_groups,
                    seed=seed,
                    progress=self.progress,
                    steady_state=self.steady,
                    max_stretch_s=MAX_STRETCH_S,
                )
            )
            for s in servers:  # an engine id is host:port:index
                self._drain(s, next(i for i in ids if f":{s.port}:" in i))
        src = CollectorSource(self._collector.url)
        since, until = result.started_unix_s, time.time()
        w = src.windows(since, until, pool=pool)
        r = src.requests(since, until, pool=pool)
        levels = [
            _level(
                lv.concurrency,
                w,
                r,
                lv.window_start_unix_s,
                lv.window_end_unix_s,
                client=lv.output_tokens_per_s,
            )
            for lv in result.levels
        ]
        hello = next(
            e for e in self._collector.get_json("/v1/engines")["rows"] if e["engine_id"] == ids[0]
        )
        side = _advised(Side(levels), self._collector.url, since, until, pool)
        return side, hello, since, until

    def _engine_ids(self, pool: str, n: int) -> list[str]:
        deadline = time.monotonic() + 30.0
        while True:
            rows = self._collector.get_json("/v1/engines")["rows"]
            ids = [r["engine_id"] for r in rows if r.get("pool") == pool]
            if len(ids) >= n:
                return [str(i) for i in ids[-n:]]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} engines of pool {pool} did not reach the collector")
            time.sleep(0.5)


def _level(
    c: int, w: pd.DataFrame, r: pd.DataFrame, a: float, b: float, client: float | None = None
) -> Level:
    ts = pd.to_numeric(w["ts_s"]) if len(w) else pd.Series(dtype=float)
    ww = w[(ts >= a) & (ts + 1.0 <= b + 0.5)] if len(w) else w
    # Every second of the level, not only those with a window: a second in which no step
    # ended (inside a prefill step longer than a second, common on a CPU) has no 1-second
    # window, and the tokens of that step land in the second it ended in.
    seconds = max(0, math.floor(b - 0.5) - math.ceil(a) + 1)
    gen = float(pd.to_numeric(ww["generation_tokens"]).sum()) if len(ww) else 0.0
    fin = pd.to_numeric(r["finished_unix_s"]) if len(r) else pd.Series(dtype=float)
    done = r[(fin >= a) & (fin < b) & (r["finish_reason"] != "abort")] if len(r) else r
    e2e = float(pd.to_numeric(done["e2e_s"]).quantile(0.99)) if len(done) else None
    pre = float(pd.to_numeric(done["preemptions"]).mean()) if len(done) else None
    q = float(pd.to_numeric(ww["prefix_queries"]).sum()) if len(ww) else 0.0
    h = float(pd.to_numeric(ww["prefix_hits"]).sum()) if len(ww) else 0.0
    return Level(
        c,
        gen / seconds if seconds else math.nan,
        e2e,
        pre,
        len(done),
        h / q if q else None,
        client,
        int(ww["ts_s"].nunique()) if len(ww) else 0,
    )


def _advised(side: Side, url: str, since: float, until: float, pool: str) -> Side:
    report = analyze(CollectorSource(url), since, until, pool=pool)
    pv = report.pools[0] if report.pools else None
    if report.engines:
        v = report.engines[0]
        side.bottleneck = v.bottleneck
        side.knee = v.knee_concurrency
        side.cap = v.recommended_concurrency_cap
    if pv is not None:  # a pool's plateau is its engines' sum
        side.plateau_tokens_per_s = pv.plateau_tokens_per_s
    return side


# -- the twin -------------------------------------------------------------------------------


def tokenized_stream(model_dir: Path, cfg: Config, seed: int, n: int = 4000) -> list[Any]:
    """``n`` requests of the lab workload, with the token ids the engine will see."""
    from transformers import AutoTokenizer

    from kvscope.twin.streams import TwinRequest

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    wl = Workload(
        prompt_words=PROMPT_WORDS,
        output_tokens=(OUTPUT_TOKENS, OUTPUT_TOKENS),
        shared_prefix_words=cfg.shared_prefix_words,
        prefix_groups=cfg.prefix_groups,
        seed=seed,
    )
    out: list[Any] = []
    per_level = -(-n // len(LEVELS))
    for level in range(len(LEVELS)):
        stream = wl.requests(level)
        for _ in range(per_level):
            spec = next(stream)
            ids = tuple(tok(spec.prompt)["input_ids"])
            out.append(TwinRequest(len(ids), spec.max_tokens, None, (), 1, len(out), ids))
    return out


def predict(
    cfg: Config,
    hello: dict[str, Any],
    cost: Any,
    stream: list[Any],
    url: str,
    start: float,
    steady: bool = True,
) -> tuple[Side, float, float]:
    from kvscope.twin.feed import CollectorFeed
    from kvscope.twin.shape import EngineShape, build_vllm_config, model_shape
    from kvscope.twin.sim import Twin, TwinPool
    from kvscope.twin.streams import ClosedLoop

    shape = EngineShape(
        model_shape("lab-mid"),
        num_gpu_blocks=cfg.num_gpu_blocks,
        block_size=int(hello["block_size"]),
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens or int(hello["max_num_batched_tokens"]),
        # The lab's rule (VllmServer): 2,048 tokens, less when the cache is smaller.
        max_model_len=min(2048, (cfg.num_gpu_blocks - 1) * BLOCK_SIZE),
        enable_prefix_caching=True,
    )
    pool = f"{cfg.name}-twin"
    twins = []
    for i in range(cfg.replicas):
        t = Twin(shape, cost, start_unix_s=start)
        t.sink = CollectorFeed(
            url,
            build_vllm_config(shape),
            engine_id=f"twin-{cfg.name}:{i}",
            pool=pool,
            start_unix_s=start,
        )
        twins.append(t)
    seconds = DURATION_S + WARMUP_S
    per = len(stream) // len(LEVELS)
    phases = [
        ClosedLoop(
            stream[i * per : (i + 1) * per],
            c,
            duration_s=DURATION_S if steady else seconds,
            steady_state=steady,
            warmup_s=WARMUP_S,
            max_stretch_s=MAX_STRETCH_S,
        )
        for i, c in enumerate(LEVELS)
    ]
    wall = time.perf_counter()
    results = TwinPool(twins, routing="round-robin", start_unix_s=start).run(*phases)
    wall = time.perf_counter() - wall
    starts = results[0].extra["phase_starts"]
    windows = (
        results[0].extra["phase_windows"]
        if steady
        else [(s0 + WARMUP_S, s0 + seconds) for s0 in starts]
    )
    steps = pd.concat([r.steps for r in results])
    reqs = pd.concat([r.requests for r in results])
    levels = []
    for c, (a, b) in zip(LEVELS, windows, strict=True):
        st = steps[(steps["t_end"] > a) & (steps["t_end"] <= b)]
        done = reqs[(reqs["finish"] > a) & (reqs["finish"] <= b)]
        q = float(st["prefix_queries"].sum())
        levels.append(
            Level(
                c,
                float(st["generated"].sum()) / (b - a),
                float(done["e2e_s"].quantile(0.99)) if len(done) else None,
                float(done["preemptions"].mean()) if len(done) else None,
                len(done),
                float(st["prefix_hits"].sum()) / q if q else None,
            )
        )
    end = max(r.end_unix_s for r in results)
    side = _advised(Side(levels), url, start, end + 1, pool)
    return side, wall, end - start


# -- comparison -------------------------------------------------------------------------------


def _rel(twin: float | None, real: float | None) -> float | None:
    if twin is None or real is None or not real or not math.isfinite(real):
        return None
    return twin / real - 1.0


def _level_index(knee: float | None) -> float | None:
    """Position of a knee on the level ladder (fractional between levels)."""
    if knee is None or not math.isfinite(knee):
        return None
    xs = [math.log(c) for c in LEVELS]
    k = math.log(max(knee, LEVELS[0]))
    for i in range(len(xs) - 1):
        if k <= xs[i + 1]:
            return i + (k - xs[i]) / (xs[i + 1] - xs[i])
    return float(len(xs) - 1)


PLATEAU_LEVELS = 3
"""The measured plateau: mean generated tokens/s of the top levels (16, 24 and 32
clients), on each side, whatever the advisor decides about saturation."""


def plateau(side: Side) -> float:
    return statistics.fmean(lv.tokens_per_s for lv in side.levels[-PLATEAU_LEVELS:])


def judge(cmp: Comparison) -> None:
    real, twin = cmp.real, cmp.twin
    top_r, top_t = real.levels[-1], twin.levels[-1]
    plateau_err = _rel(plateau(twin), plateau(real))
    ki, kj = _level_index(real.knee), _level_index(twin.knee)
    if real.knee is None and twin.knee is None:
        knee_apart: float | None = 0.0  # neither saturated: no knee on either side
    else:
        knee_apart = None if ki is None or kj is None else abs(ki - kj)
    e2e = _rel(top_t.e2e_p99_s, top_r.e2e_p99_s)
    pr, pt = top_r.preemptions_per_request, top_t.preemptions_per_request
    if pr is not None and pt is not None and max(pr, pt) < 0.05:
        pre: float | None = 0.0  # both (close to) none
    else:
        pre = _rel(pt, pr)
    hr, ht = top_r.prefix_hit_rate, top_t.prefix_hit_rate
    runs = [plateau(r) for r in cmp.real_runs] or [plateau(real)]
    cmp.checks = {
        "plateau_real": plateau(real),
        "plateau_real_runs": runs,
        # the real engine's own run-to-run spread: (max - min) / median of its runs
        "plateau_real_spread": (max(runs) - min(runs)) / statistics.median(runs),
        "plateau_twin": plateau(twin),
        "plateau_error": plateau_err,
        "plateau_ok": plateau_err is not None and abs(plateau_err) <= TARGETS["plateau"],
        "prefix_hit_rate_real": hr,
        "prefix_hit_rate_twin": ht,
        "knee_levels_apart": knee_apart,
        "knee_ok": knee_apart is not None and knee_apart <= TARGETS["knee_levels"],
        "e2e_p99_error": e2e,
        "e2e_p99_ok": e2e is not None and abs(e2e) <= TARGETS["e2e_p99"],
        "preemptions_error": pre,
        "preemptions_ok": pre is not None and abs(pre) <= TARGETS["preemptions_per_request"],
        "bottleneck_same": real.bottleneck == twin.bottleneck,
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def _f(v: float | None, spec: str = ",.0f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def table(results: list[Comparison]) -> str:
    lines = [
        "| config | flags | real plateau (runs) | twin | err | real knee | twin | levels apart | "
        "real e2e P99 (top) | twin | err | real preempt/req (top) | twin | real prefix hits "
        "| twin | real verdict | twin verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results:
        k = c.checks
        cfg = c.config
        flags = f"{cfg.num_gpu_blocks} blocks, seqs {cfg.max_num_seqs}"
        if cfg.max_num_batched_tokens:
            flags += f", budget {cfg.max_num_batched_tokens}"
        if cfg.replicas > 1:
            flags += f", {cfg.replicas} replicas RR"
        runs = ", ".join(_f(v) for v in k["plateau_real_runs"])
        spread = (
            f"; spread {k['plateau_real_spread']:.0%}" if len(k["plateau_real_runs"]) > 1 else ""
        )
        lines.append(
            f"| {cfg.name} | {flags} | {_f(k['plateau_real'])} ({runs}{spread}) | "
            f"{_f(k['plateau_twin'])} | {_pct(k['plateau_error'])} | "
            f"{_f(c.real.knee, '.1f')} | {_f(c.twin.knee, '.1f')} | {_f(k['knee_levels_apart'], '.1f')} | "
            f"{_f(c.real.levels[-1].e2e_p99_s, '.2f')} s | {_f(c.twin.levels[-1].e2e_p99_s, '.2f')} s | "
            f"{_pct(k['e2e_p99_error'])} | {_f(c.real.levels[-1].preemptions_per_request, '.2f')} | "
            f"{_f(c.twin.levels[-1].preemptions_per_request, '.2f')} | "
            f"{_f(k['prefix_hit_rate_real'], '.0%')} | {_f(k['prefix_hit_rate_twin'], '.0%')} | "
            f"{c.real.bottleneck} | {c.twin.bottleneck} |"
        )
    return "\n".join(lines)


def level_table(c: Comparison) -> str:
    lines = [f"{c.config.name}: generated tok/s per level, real / twin"]
    for r, t in zip(c.real.levels, c.twin.levels, strict=True):
        lines.append(
            f"  {r.concurrency:>3} clients: {_f(r.tokens_per_s):>6} / {_f(t.tokens_per_s):>6} "
            f"({_pct(_rel(t.tokens_per_s, r.tokens_per_s))}), e2e P99 "
            f"{_f(r.e2e_p99_s, '.2f')} / {_f(t.e2e_p99_s, '.2f')} s, preempt/req "
            f"{_f(r.preemptions_per_request, '.2f')} / {_f(t.preemptions_per_request, '.2f')}"
            + (
                f"; real client side {_f(r.client_tokens_per_s)} tok/s"
                if r.client_tokens_per_s is not None
                else ""
            )
            + (
                f", steps ended in {r.seconds_with_steps} of the level's seconds"
                if r.seconds_with_steps is not None
                else ""
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="configurations to compare")
    ap.add_argument("--workdir", default=".kvscope/bench-twin")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--step-fit",
        choices=("cycle", "steps", "windows"),
        default="cycle",
        help="fit the step time on the baseline's step cycle (time between consecutive "
        "steps, the default), on vLLM's reported per-step execution times, or on its "
        "1-second windows (the advisor's fit)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="real runs of each configuration, each on a fresh engine, in rounds over the "
        "configurations; the twin is judged against their per-level median and each "
        "row states their spread (the baseline's first run is the calibration)",
    )
    ap.add_argument(
        "--fixed-windows",
        action="store_true",
        help=f"levels of {WARMUP_S:g} s warm-up and {DURATION_S:g} s window on both sides (runs "
        "1-10 of docs/twin.md), not stretched into their steady state: a level whose "
        "requests take longer than its window measures its first wave",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    out: list[Comparison] = []
    with TwinLab(args.workdir, log=log, progress=not args.no_progress) as lab:
        assert lab.model_dir is not None
        lab.steady = not args.fixed_windows
        base = CONFIGS["baseline"]
        log("calibration: the baseline on the real engine")
        base_real, hello, since, until = lab.real(base, args.seed)
        src = CollectorSource(lab._collector.url)
        from kvscope.twin.steptime import LinearStepCost, fit_steps

        windows_fit = LinearStepCost.from_fit(
            StepTimeModel().fit(src.windows(since, until, pool=base.name)),
            source="the baseline run's 1-second windows",
        )
        log(f"step time fitted on the baseline's windows: {windows_fit.describe()}")
        cost: Any = windows_fit
        if args.step_fit != "windows":
            cost = fit_steps(
                src.steps(since, until, pool=base.name), cycle=args.step_fit == "cycle"
            )
            log(f"step time fitted on the baseline's steps ({args.step_fit}): {cost.describe()}")
        cfgs = []
        for n in names:
            cfg = CONFIGS[n]
            if n == "cap":
                cap = base_real.cap or 8
                cfg = Config("cap", base.num_gpu_blocks, max_num_seqs=cap)
            cfgs.append(cfg)
        predictions: dict[str, tuple[Side, float, float]] = {}
        for cfg in cfgs:
            log(f"twin: predicting {cfg.name}")
            stream = tokenized_stream(lab.model_dir, cfg, args.seed)
            # simulated time ends before the real runs begin: the twin's longest sweep
            start = time.time() - 2 * len(LEVELS) * (MAX_STRETCH_S + WARMUP_S) - 600
            predictions[cfg.name] = predict(
                cfg, hello, cost, stream, lab._collector.url, start, steady=lab.steady
            )
        runs: dict[str, list[Side]] = {cfg.name: [] for cfg in cfgs}
        if "baseline" in runs:
            runs["baseline"].append(base_real)
        for k in range(args.repeats):  # rounds: every configuration once per round
            for cfg in cfgs:
                if len(runs[cfg.name]) > k:
                    continue  # the calibration run is the baseline's first
                log(f"real engine: {cfg.name}, run {k + 1} of {args.repeats}")
                try:
                    runs[cfg.name].append(lab.real(cfg, args.seed, run=k)[0])
                except RuntimeError as exc:  # one configuration's failure loses no other
                    log(f"{cfg.name}: run {k + 1} not measured: {exc}")
        for cfg in cfgs:
            if not runs[cfg.name]:
                continue
            twin, wall, sim = predictions[cfg.name]
            cmp = Comparison(cfg, median_side(runs[cfg.name]), twin, wall, sim)
            cmp.real_runs = runs[cfg.name]
            judge(cmp)
            out.append(cmp)
            log(level_table(cmp))
    print(table(out))
    ok = sum(all(v for k, v in c.checks.items() if k.endswith("_ok")) for c in out)
    print(f"\n{ok} of {len(out)} configurations within every target; step time: {cost.describe()}")
    med = statistics.median(c.twin_sim_s / max(c.twin_wall_s, 1e-9) for c in out)
    print(f"twin speed: median {med:,.0f}x real time")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"step_time": cost.describe(), "results": [asdict(c) for c in out]},
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
