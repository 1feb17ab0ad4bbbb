"""Seeded synthetic engines with known answers, for tests and examples.

:func:`make_engine` runs a small discrete simulation of one vLLM engine swept through
closed-loop load levels and returns the 1-second windows and finished requests the collector
would hold, with the true answer **measured** from the same simulation (:func:`true_curve`:
the engine run without jitter at every whole load); :func:`make_prefix_pool` a pool of replicas
with prefix-cache reuse and KV-cache events, with its true reuse ratios.

The simulation is a scheduler (vLLM v1's rules, simplified: chunked prefill within the token
budget, KV blocks allocated as tokens need them, the newest request preempted when none is
free), not a formula: it shares nothing with the advisor's models, so a test against it checks
them rather than restating them. Its step time carries an attention term the advisor's linear
fit only approximates, as on a real engine.

See docs/testing.md#synthetic-engines-with-known-answers.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

#: Engines the advisor tells apart. Lengths are ``(low, high)`` token ranges; step
#: costs in seconds: ``a`` per step, ``b`` per sequence, ``c`` per prefill token,
#: ``d`` per context token in the cache.
REGIMES: dict[str, dict[str, Any]] = {
    # 48 blocks of 32 tokens hold about a dozen requests of ~180 tokens at their ends.
    "kv_cache_bound": {
        "num_gpu_blocks": 48,
        "block_size": 32,
        "prompt": (40, 60),
        "gen": (120, 136),
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 3.7e-3,
        "b": 0.25e-3,
        "c": 0.02e-3,
        "d": 0.5e-6,
    },
    # Six sequence slots, a cache with room for hundreds.
    "max_num_seqs_bound": {
        "num_gpu_blocks": 4096,
        "block_size": 32,
        "prompt": (40, 60),
        "gen": (120, 136),
        "max_num_seqs": 6,
        "budget": 2048,
        "a": 3.3e-3,
        "b": 0.29e-3,
        "c": 0.08e-3,
        "d": 0.5e-6,
    },
    # 4,000-token prompts, 20 tokens out: every request needs two steps of the 2,048
    # budget to prefill, and a large per-step cost makes bigger steps pay.
    "token_budget_bound": {
        "num_gpu_blocks": 25000,
        "block_size": 16,
        "prompt": (3800, 4200),
        "gen": (18, 22),
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 10.0e-3,
        "b": 0.2e-3,
        "c": 0.005e-3,
        "d": 0.02e-6,
    },
    # Ample cache and slots; every sequence costs 2 ms a step.
    "compute_bound": {
        "num_gpu_blocks": 100000,
        "block_size": 16,
        "prompt": (40, 60),
        "gen": (120, 136),
        "max_num_seqs": 256,
        "budget": 8192,
        "a": 2.0e-3,
        "b": 2.0e-3,
        "c": 0.05e-3,
        "d": 0.5e-6,
    },
    # A large per-step cost and cheap sequences: throughput still grows at 32.
    "not_saturated": {
        "num_gpu_blocks": 100000,
        "block_size": 16,
        "prompt": (40, 60),
        "gen": (120, 136),
        "max_num_seqs": 256,
        "budget": 8192,
        "a": 8.0e-3,
        "b": 0.05e-3,
        "c": 0.01e-3,
        "d": 0.05e-6,
    },
    # Long outputs on a starved cache: sequences outgrow it while they run, and every
    # preemption recomputes hundreds of tokens (throughput peaks at 4 clients and
    # falls by a third past it).
    "preemption_thrash": {
        "num_gpu_blocks": 96,
        "block_size": 32,
        "prompt": (200, 300),
        "gen": (500, 600),
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 3.7e-3,
        "b": 0.25e-3,
        "c": 1.0e-3,
        "d": 0.5e-6,
        # Requests live ~5 s here: a level must hold several lifetimes to show the
        # thrash it settles into rather than the burst of its start.
        "seconds_per_level": 30,
    },
    # Ample cache and slots, an engine that could serve far more, and a front end that
    # spends 100 ms on each request: it hands the engine at most 10 requests a second.
    "frontend_bound": {
        "num_gpu_blocks": 4096,
        "block_size": 32,
        "prompt": (40, 60),
        "gen": (120, 136),
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 3.7e-3,
        "b": 0.25e-3,
        "c": 0.02e-3,
        "d": 0.5e-6,
        "frontend_s": 0.1,
    },
}

#: Each limit and how the truth lifts it: (key, factor).
_LIMITS = {
    "kv_cache_bound": ("num_gpu_blocks", 8.0),
    "max_num_seqs_bound": ("max_num_seqs", 8.0),
    "token_budget_bound": ("budget", 8.0),
    "frontend_bound": ("frontend_s", 1 / 8),
}


@dataclass
class SyntheticEngine:
    """Frames as the collector's read API returns them, and the true answer."""

    engines: pd.DataFrame
    windows: pd.DataFrame
    requests: pd.DataFrame
    truth: dict[str, Any] = field(default_factory=dict)
    kv_events: pd.DataFrame = field(default_factory=pd.DataFrame)


@dataclass(eq=False)
class _Request:
    prompt: int
    gen: int
    arrival: float
    target: int = 0
    """Tokens to have in the cache before the next token is sampled."""
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    queued_at: float = 0.0
    """When the engine core received it (after the front end)."""
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float = 0.0


class _Engine:
    """One simulated engine: a queue, a running list, a block pool and a clock."""

    def __init__(self, p: dict[str, Any], rng: np.random.Generator, noise: float) -> None:
        self.p = p
        self.rng = rng
        self.noise = noise
        self.free = int(p["num_gpu_blocks"])
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.t = 0.0
        # The front end: one worker that spends ``frontend_s`` on each request (render,
        # tokenise, hand over) before the engine core sees it.
        self.frontend_s = float(p.get("frontend_s", 0.0))
        self.frontend_free_at = 0.0
        self.incoming: deque[_Request] = deque()

    def submit(self) -> None:
        lo, hi = self.p["prompt"]
        glo, ghi = self.p["gen"]
        prompt = int(self.rng.integers(lo, hi + 1))
        r = _Request(prompt, int(self.rng.integers(glo, ghi + 1)), self.t, target=prompt)
        if math.ceil((prompt + r.gen) / self.p["block_size"]) > self.p["num_gpu_blocks"]:
            raise ValueError("a request larger than the whole KV cache never finishes")
        if self.frontend_s <= 0:
            r.queued_at = self.t
            self.waiting.append(r)
            return
        self.frontend_free_at = max(self.frontend_free_at, self.t) + self.frontend_s
        r.queued_at = self.frontend_free_at
        self.incoming.append(r)

    def in_flight(self) -> int:
        """Requests the clients have sent and not received back."""
        return len(self.running) + len(self.waiting) + len(self.incoming)

    def _receive(self) -> None:
        """Hand the engine the requests the front end has finished with; idle until the
        next one when the engine has nothing to run."""
        if self.incoming and not self.running and not self.waiting:
            self.t = max(self.t, self.incoming[0].queued_at)
        while self.incoming and self.incoming[0].queued_at <= self.t:
            self.waiting.append(self.incoming.popleft())

    def _blocks_for(self, r: _Request, n: int) -> int:
        return math.ceil((r.computed + n) / self.p["block_size"]) - r.blocks

    def _preempt(self, r: _Request) -> None:
        self.free += r.blocks
        r.blocks = 0
        r.computed = 0
        r.target = r.prompt + r.generated
        r.preemptions += 1
        self.waiting.appendleft(r)

    def step(self) -> tuple[dict[str, float], list[_Request]]:
        """Schedule and run one step; return its row and the requests it finished."""
        p = self.p
        self._receive()
        budget = int(p["budget"])
        sched: list[tuple[_Request, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.target - r.computed, budget) if r.computed < r.target else 1
            need = self._blocks_for(r, n)
            lost = False
            while need > self.free and not lost:
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                lost = victim is r
            if lost:
                break
            self.free -= need
            r.blocks += need
            sched.append((r, n))
            budget -= n
            i += 1
        queries = 0
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < p["max_num_seqs"]
        ):
            r = self.waiting[0]
            n = min(r.target - r.computed, budget)
            need = self._blocks_for(r, n)
            if need > self.free:
                break
            self.waiting.popleft()
            self.free -= need
            r.blocks += need
            self.running.append(r)
            sched.append((r, n))
            budget -= n
            if r.scheduled_at is None:
                r.scheduled_at = self.t
                queries += r.prompt
        batch = len(self.running)
        used = p["num_gpu_blocks"] - self.free
        prefill = sum(n for r, n in sched if r.computed < r.target)
        context = sum(r.computed for r, _ in sched)
        cost = p["a"] + p["b"] * len(sched) + p["c"] * prefill + p["d"] * context
        if self.noise:
            cost *= float(self.rng.lognormal(0.0, self.noise))
        self.t += cost
        done: list[_Request] = []
        prompt_tokens = gen_tokens = 0
        for r, n in sched:
            if r.computed < r.target:
                r.computed += n
                if r.computed < r.target:
                    continue
                if r.first_token_at is None:
                    r.first_token_at = self.t
                    prompt_tokens += r.prompt
            else:
                r.computed += 1
            r.generated += 1
            gen_tokens += 1
            if r.generated >= r.gen:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.free += r.blocks
        row = {
            "ts": self.t,
            "batch": batch,
            "waiting": len(self.waiting),
            "kv": used / p["num_gpu_blocks"],
            "kv_blocks": used,
            "preemptions": preempted,
            "prompt_tokens": prompt_tokens,
            "generation_tokens": gen_tokens,
            "prefix_queries": queries,
            "iteration_s": cost,
        }
        return row, done


def _simulate(
    p: dict[str, Any],
    levels: tuple[int, ...],
    seconds_per_level: float,
    rng: np.random.Generator,
    noise: float,
) -> tuple[pd.DataFrame, list[_Request]]:
    """Closed-loop sweep: ``levels`` clients in turn, ``seconds_per_level`` each."""
    eng = _Engine(p, rng, noise)
    rows: list[dict[str, float]] = []
    finished: list[_Request] = []
    for level in levels:
        for _ in range(level - eng.in_flight()):
            eng.submit()
        end = eng.t + seconds_per_level
        while eng.t < end:
            row, done = eng.step()
            rows.append(row)
            finished.extend(done)
            for r in done:
                r.finished_at = eng.t
                eng.submit()
    return pd.DataFrame(rows), finished


def _windows(steps: pd.DataFrame, t0: int) -> pd.DataFrame:
    """1-second windows of the step rows, with the columns of the collector's reads."""
    s = steps.assign(ts_unix_s=steps["ts"] + t0)
    s["ts_s"] = np.floor(s["ts_unix_s"]).astype(np.int64)
    g = s.groupby("ts_s")
    w = g.agg(
        n_steps=("batch", "size"),
        first_step_unix_s=("ts_unix_s", "min"),
        last_step_unix_s=("ts_unix_s", "max"),
        batch_sum=("batch", "sum"),
        batch_mean=("batch", "mean"),
        batch_min=("batch", "min"),
        batch_max=("batch", "max"),
        kv_usage_mean=("kv", "mean"),
        kv_usage_max=("kv", "max"),
        kv_blocks_max=("kv_blocks", "max"),
        waiting_mean=("waiting", "mean"),
        waiting_max=("waiting", "max"),
        preemptions=("preemptions", "sum"),
        prompt_tokens=("prompt_tokens", "sum"),
        generation_tokens=("generation_tokens", "sum"),
        prefix_queries=("prefix_queries", "sum"),
        iteration_s_mean=("iteration_s", "mean"),
    )
    for name, q in (("batch_p50", 0.5), ("batch_p90", 0.9), ("batch_p99", 0.99)):
        w[name] = g["batch"].quantile(q)
    w["n_parts"] = 1
    w["deferred_mean"] = 0.0
    w["deferred_max"] = 0
    w["prefix_hits"] = 0
    return w.reset_index()


def _requests(finished: list[_Request], t0: int) -> pd.DataFrame:
    rows = []
    for r in finished:
        assert r.scheduled_at is not None and r.first_token_at is not None
        rows.append(
            {
                "finished_unix_s": t0 + r.finished_at,
                "e2e_s": r.finished_at - r.arrival,
                "queue_s": r.scheduled_at - r.queued_at,
                "prefill_s": r.first_token_at - r.scheduled_at,
                "decode_s": r.finished_at - r.first_token_at,
                "ttft_s": r.first_token_at - r.arrival,
                "prompt_tokens": r.prompt,
                "generation_tokens": r.gen,
                "cached_tokens": 0,
                "preemptions": r.preemptions,
                "finish_reason": "length",
            }
        )
    return pd.DataFrame(rows)


def _steady(p: dict[str, Any], load: int, seconds: float = 40.0) -> dict[str, float]:
    """Throughput and state of ``p`` held at ``load`` clients, without jitter: the
    second half of a ``seconds``-long run (the first half fills the pipeline)."""
    steps, finished = _simulate(p, (load,), seconds, np.random.default_rng(12345), 0.0)
    late = steps[steps["ts"] >= seconds / 2]
    span = float(late["ts"].iloc[-1] - late["ts"].iloc[0])
    done = [r for r in finished if r.finished_at >= seconds / 2]
    return {
        "tokens_per_s": float(late["generation_tokens"].sum()) / span,
        "batch": float(late["batch"].mean()),
        "waiting": float(late["waiting"].mean()),
        "preemptions_per_request": float(late["preemptions"].sum()) / max(len(done), 1),
    }


@functools.lru_cache(maxsize=64)
def _truth_cached(regime: str, lo: int, hi: int, knee_fraction: float) -> dict[str, Any]:
    p = REGIMES[regime]
    loads = np.arange(lo, hi + 1)
    states = [_steady(p, int(x)) for x in loads]
    tput = np.array([s["tokens_per_s"] for s in states])
    plateau = float(tput.max())
    top = states[-1]
    thrash = bool(tput[-1] < 0.9 * plateau and top["preemptions_per_request"] >= 0.5)
    # The limit, measured as a real engine's would be: lift each one eightfold at the
    # top load; the one whose lifting raises throughput by more than 10% is binding.
    lifted = {
        name: _steady({**p, key: p.get(key, 0.0) * f}, hi)["tokens_per_s"] / top["tokens_per_s"]
        for name, (key, f) in _LIMITS.items()
    }
    binding = [name for name, gain in lifted.items() if gain > 1.1]
    half = _steady(p, max(lo, hi // 2))["tokens_per_s"]
    growth = top["tokens_per_s"] / half
    if len(binding) == 1:
        bottleneck = binding[0]
    elif binding:
        raise ValueError(f"{regime}: more than one limit binds ({lifted})")
    else:
        bottleneck = "compute_bound" if growth < 1.1 else "not_saturated"
    return {
        "regime": regime,
        "bottleneck": bottleneck,
        # The engine's own curve flattens (a front end that limits leaves it room).
        "saturated": bottleneck not in ("not_saturated", "frontend_bound"),
        "knee": float(loads[np.argmax(tput >= knee_fraction * plateau)]),
        "plateau_tokens_per_s": plateau,
        "kv_batch": top["batch"] if bottleneck == "kv_cache_bound" else None,
        "thrash": thrash,
        "lifted_gain": lifted,
        "growth_last_doubling": growth,
        "curve": dict(zip(loads.tolist(), tput.tolist(), strict=True)),
    }


def true_curve(regime: str, levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> dict[int, float]:
    """The regime's noiseless generated tokens/s at every whole load over ``levels``."""
    return dict(_truth_cached(regime, min(levels), max(levels), 0.9)["curve"])


def make_engine(
    regime: str,
    *,
    seed: int = 0,
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    seconds_per_level: int | None = None,
    noise: float = 0.04,
    knee_fraction: float = 0.9,
    engine_id: str = "synth:8000:0",
    pool: str = "synth",
    t0: int = 1_700_000_000,
) -> SyntheticEngine:
    """Simulate one engine swept through ``levels`` clients (requests in flight), each
    held ``seconds_per_level`` (the regime's own, 12 s unless it says)."""
    p = REGIMES[regime]
    hold = seconds_per_level or p.get("seconds_per_level", 12)
    steps, finished = _simulate(
        p, tuple(int(x) for x in levels), hold, np.random.default_rng(seed), noise
    )
    windows = _windows(steps, t0)
    # The last partial second and the seconds a level change split are left in, as
    # the collector would hold them.
    windows = windows.assign(engine_id=engine_id, pool=pool, model="synthetic")
    requests = _requests(finished, t0).assign(engine_id=engine_id, boot_id="synthetic")
    engines = pd.DataFrame(
        [
            {
                "engine_id": engine_id,
                "pool": pool,
                "model": "synthetic",
                "num_gpu_blocks": p["num_gpu_blocks"],
                "block_size": p["block_size"],
                "max_num_seqs": p["max_num_seqs"],
                "max_num_batched_tokens": p["budget"],
                "max_model_len": 8192,
                "enable_prefix_caching": True,
                "kv_cache_dtype": "auto",
                "gpu_memory_utilization": 0.9,
                "tensor_parallel_size": 1,
            }
        ]
    )
    truth = dict(_truth_cached(regime, int(min(levels)), int(max(levels)), knee_fraction))
    return SyntheticEngine(engines=engines, windows=windows, requests=requests, truth=truth)


def make_prefix_pool(
    *,
    seed: int = 0,
    hit_rates: tuple[float, ...] = (0.4, 0.2),
    dup_ratios: tuple[float, ...] = (0.2, 0.2),
    evict_ratios: tuple[float, ...] = (0.05, 0.05),
    loads: tuple[float, ...] = (8.0, 2.0),
    block_size: int = 16,
    queries_per_s: int = 2000,
    seconds: int = 60,
    requests_per_s: int = 4,
    prefill_s_per_token: float = 2e-4,
    ttft_base_s: float = 0.05,
    with_events: bool = True,
    pool: str = "px",
    t0: int = 1_700_000_000,
) -> SyntheticEngine:
    """A pool of replicas with prefix-cache reuse and KV-cache events, and its true answer.

    Engine ``i`` (id ``px{i}:8000:0``) looks up about ``queries_per_s`` prompt tokens a
    second, finds ``hit_rates[i]`` of them, and stores blocks of which ``dup_ratios[i]``
    (of its lookups, in tokens) another replica held and ``evict_ratios[i]`` more had
    been seen before and evicted. Its load is ``loads[i]`` in flight. Requests have
    prompts of 200-2000 tokens, a cached part on ``hit_rates[i]`` of them, a prefill
    of ``ttft_base_s + prefill_s_per_token x computed tokens`` (10% lognormal noise,
    and 5% stragglers 0.2-1 s slower) and a queue wait (exponential, mean 10 ms per
    request in flight, and 5% of requests queued 1-3 s); TTFT is queue + prefill.
    ``truth``: the delivered, routing-loss, eviction-loss, captured and available
    ratios computed from the generated counts, the predicted hit rate under
    prefix-affine routing, the slope, and the load imbalance.
    """
    rng = np.random.default_rng(seed)
    n = len(hit_rates)
    ts = t0 + np.arange(seconds)
    windows, requests, events, engines = [], [], [], []
    tot = dict.fromkeys(("q", "x", "dup", "reseen"), 0.0)
    for i in range(n):
        eid = f"px{i}:8000:0"
        q = rng.integers(int(queries_per_s * 0.8), int(queries_per_s * 1.2) + 1, seconds)
        x = np.round(q * hit_rates[i]).astype(int)
        dup = np.round(q * dup_ratios[i] / block_size).astype(int)
        reseen = dup + np.round(q * evict_ratios[i] / block_size).astype(int)
        stored = np.ceil((q - x) / block_size).astype(int)
        tot["q"] += q.sum()
        tot["x"] += x.sum()
        tot["dup"] += dup.sum() * block_size
        tot["reseen"] += reseen.sum() * block_size
        load = loads[i] * (1 + rng.normal(0, 0.05, seconds))
        windows.append(
            pd.DataFrame(
                {
                    "engine_id": eid,
                    "ts_s": ts,
                    "n_steps": 40,
                    "n_parts": 1,
                    "first_step_unix_s": ts + 0.01,
                    "last_step_unix_s": ts + 0.99,
                    "batch_mean": load,
                    "batch_p50": load,
                    "batch_p90": load,
                    "batch_max": load,
                    "waiting_mean": 0.0,
                    "deferred_mean": 0.0,
                    "kv_usage_mean": 0.5,
                    "kv_usage_max": 0.6,
                    "preemptions": 0,
                    "prompt_tokens": q - x,
                    "generation_tokens": np.round(load * 30).astype(int),
                    "prefix_queries": q,
                    "prefix_hits": x,
                }
            )
        )
        events.append(
            pd.DataFrame(
                {
                    "engine_id": eid,
                    "ts_s": ts,
                    "stored_blocks": stored,
                    "dup_blocks": dup,
                    "reseen_blocks": reseen,
                    "orphan_blocks": 0,
                    "removed_blocks": stored,
                    "cleared_events": 0,
                    "missed_batches": 0,
                    "held_blocks": 500,
                    "held_shared_blocks": 100,
                    "block_size": block_size,
                }
            )
        )
        k = seconds * requests_per_s
        prompt = rng.integers(200, 2001, k)
        cached = np.where(
            rng.random(k) < hit_rates[i], np.round(prompt * rng.uniform(0.3, 0.9, k)), 0
        ).astype(int)
        queue = rng.exponential(0.01 * loads[i], k) + np.where(
            rng.random(k) < 0.05, rng.uniform(1.0, 3.0, k), 0.0
        )
        prefill = (ttft_base_s + prefill_s_per_token * (prompt - cached)) * rng.lognormal(
            0, 0.1, k
        ) + np.where(rng.random(k) < 0.05, rng.uniform(0.2, 1.0, k), 0.0)
        ttft = queue + prefill
        requests.append(
            pd.DataFrame(
                {
                    "engine_id": eid,
                    "boot_id": "synthetic",
                    "finished_unix_s": np.repeat(ts, requests_per_s) + rng.random(k),
                    "e2e_s": ttft + 1.0,
                    "queue_s": queue,
                    "prefill_s": prefill,
                    "decode_s": 1.0,
                    "ttft_s": ttft,
                    "prompt_tokens": prompt,
                    "generation_tokens": 30,
                    "cached_tokens": cached,
                    "preemptions": 0,
                    "finish_reason": "length",
                }
            )
        )
        engines.append(
            {
                "engine_id": eid,
                "pool": pool,
                "model": "synthetic",
                "num_gpu_blocks": 4096,
                "block_size": block_size,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
                "enable_prefix_caching": True,
            }
        )
    h = tot["x"] / tot["q"]
    loss = tot["dup"] / tot["q"]
    evict = (tot["reseen"] - tot["dup"]) / tot["q"]
    mean_load = float(np.mean(loads))
    truth = {
        "hit_rate": h,
        "routing_loss": loss,
        "eviction_loss": evict,
        "captured": h + evict,
        "available": h + evict + loss,
        "predicted_hit_rate_affine": h + loss,
        "prefill_s_per_token": prefill_s_per_token,
        "prefix_queries": tot["q"],
        "n_requests": n * seconds * requests_per_s,
        "imbalance": max(loads) / mean_load,
    }
    return SyntheticEngine(
        engines=pd.DataFrame(engines),
        windows=pd.concat(windows, ignore_index=True),
        requests=pd.concat(requests, ignore_index=True),
        truth=truth,
        kv_events=(pd.concat(events, ignore_index=True) if with_events else pd.DataFrame()),
    )
