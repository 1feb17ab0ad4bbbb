"""Seeded synthetic engines with known answers, for tests and examples.

:func:`make_engine` simulates the 1-second windows and finished requests of one
engine swept through load levels, in one of the regimes the advisor tells apart,
and returns them with the true answer (bottleneck, knee, plateau);
:func:`make_prefix_pool` a pool of replicas with prefix-cache reuse and KV-cache
events, with its true reuse ratios. The simulation of :func:`make_engine`
is a closed-form steady state per second, not a scheduler:

* the batch is ``min(load, max_num_seqs, KV-bound batch, token-budget batch)``
  where the KV-bound batch is ``KV tokens / (prompt + gen/2 + block/2)`` and the
  token-budget batch ``budget x gen / (prompt + gen)`` (sequences whose decode token
  and amortised prefill fit one step's budget); the rest of the load waits;
* one step takes ``a + b x batch + c x prompt tokens per step``; throughput is
  ``batch / step``;
* ``preemption_thrash`` loses ``thrash_per_request`` of throughput for every
  request in flight beyond the KV-bound batch (down to 40%), at 20 preemptions/s;
* noise: multiplicative Gaussian on steps and load (``noise``), and with
  probability ``lull_prob`` a second in which half the batch finished at once.

The true knee is the smallest load whose noiseless throughput reaches
``knee_fraction`` of the noiseless plateau, on a fine grid over the swept range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

REGIMES: dict[str, dict[str, Any]] = {
    "kv_cache_bound": {
        "num_gpu_blocks": 48,
        "block_size": 32,
        "prompt": 50,
        "gen": 128,
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 3.7e-3,
        "b": 0.25e-3,
        "c": 0.2e-3,
    },
    "max_num_seqs_bound": {
        "num_gpu_blocks": 4096,
        "block_size": 32,
        "prompt": 50,
        "gen": 128,
        "max_num_seqs": 6,
        "budget": 2048,
        "a": 3.3e-3,
        "b": 0.29e-3,
        "c": 0.08e-3,
    },
    "token_budget_bound": {
        "num_gpu_blocks": 25000,
        "block_size": 16,
        "prompt": 4000,
        "gen": 20,
        "max_num_seqs": 256,
        "budget": 2048,
        # A per-step cost that bigger steps amortise (doubling the budget: +29% by this
        # step model); with a = 3 ms and c = 0.01 ms/token prefill dominates the step and
        # doubling gives +6%: that engine is prefill-bound, not budget-bound.
        "a": 10.0e-3,
        "b": 0.2e-3,
        "c": 0.005e-3,
    },
    "compute_bound": {
        "num_gpu_blocks": 100000,
        "block_size": 16,
        "prompt": 50,
        "gen": 128,
        "max_num_seqs": 256,
        "budget": 8192,
        "a": 2.0e-3,
        "b": 2.0e-3,
        "c": 0.05e-3,
    },
    "not_saturated": {
        "num_gpu_blocks": 100000,
        "block_size": 16,
        "prompt": 50,
        "gen": 128,
        "max_num_seqs": 256,
        "budget": 8192,
        "a": 8.0e-3,
        "b": 0.05e-3,
        "c": 0.01e-3,
    },
    "preemption_thrash": {
        "num_gpu_blocks": 48,
        "block_size": 32,
        "prompt": 50,
        "gen": 128,
        "max_num_seqs": 256,
        "budget": 2048,
        "a": 3.7e-3,
        "b": 0.25e-3,
        "c": 0.2e-3,
        "thrash_per_request": 0.03,
    },
}


@dataclass
class SyntheticEngine:
    """Frames as the collector's read API returns them, and the true answer."""

    engines: pd.DataFrame
    windows: pd.DataFrame
    requests: pd.DataFrame
    truth: dict[str, Any] = field(default_factory=dict)
    kv_events: pd.DataFrame = field(default_factory=pd.DataFrame)


def _batch(load: np.ndarray, p: dict[str, Any]) -> tuple[np.ndarray, float]:
    footprint = p["prompt"] + p["gen"] / 2 + p["block_size"] / 2
    kv_batch = p["num_gpu_blocks"] * p["block_size"] / footprint
    budget_batch = p["budget"] * p["gen"] / (p["prompt"] + p["gen"])
    cap = min(kv_batch, p["max_num_seqs"], budget_batch)
    return np.minimum(load, cap), kv_batch


def _throughput(load: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    batch, kv_batch = _batch(load, p)
    step = p["a"] + p["b"] * batch + p["c"] * batch * p["prompt"] / p["gen"]
    t = batch / step
    if p.get("thrash_per_request"):
        t = t * np.clip(1 - p["thrash_per_request"] * np.maximum(load - kv_batch, 0), 0.4, 1)
    return np.asarray(t)


def make_engine(
    regime: str,
    *,
    seed: int = 0,
    levels: tuple[float, ...] = (1, 2, 4, 8, 16, 32),
    seconds_per_level: int = 12,
    noise: float = 0.04,
    lull_prob: float = 0.05,
    knee_fraction: float = 0.9,
    engine_id: str = "synth:8000:0",
    pool: str = "synth",
    t0: int = 1_700_000_000,
) -> SyntheticEngine:
    """Simulate one engine swept through ``levels`` (requests in flight)."""
    p = REGIMES[regime]
    rng = np.random.default_rng(seed)
    loads = np.repeat(np.asarray(levels, float), seconds_per_level)
    loads = loads * (1 + rng.normal(0, noise / 2, len(loads)))
    lull = rng.random(len(loads)) < lull_prob
    loads = np.where(lull, loads * 0.5, loads).clip(min=0.6)
    batch, kv_batch = _batch(loads, p)
    tput = _throughput(loads, p) * (1 + rng.normal(0, noise, len(loads)))
    n_steps = np.maximum(1, np.round(tput / np.maximum(batch, 1e-9))).astype(int)
    gen = np.round(n_steps * batch).astype(int)
    prompt = np.round(gen * p["prompt"] / p["gen"]).astype(int)
    kv_tokens = p["num_gpu_blocks"] * p["block_size"]
    footprint = p["prompt"] + p["gen"] / 2 + p["block_size"] / 2
    kv_usage = np.minimum(1.0, batch * footprint / kv_tokens)
    thrash = bool(p.get("thrash_per_request"))
    pre_rate = np.where(loads > kv_batch * 1.05, 20.0 if thrash else 8.0, 0.0)
    preempt = rng.poisson(pre_rate)
    ts = t0 + np.arange(len(loads))
    waiting = loads - batch
    windows = pd.DataFrame(
        {
            "engine_id": engine_id,
            "ts_s": ts,
            "n_steps": n_steps,
            "n_parts": 1,
            "first_step_unix_s": ts + 0.002,
            "last_step_unix_s": ts + 0.995,
            "batch_sum": np.round(batch * n_steps).astype(int),
            "batch_mean": batch,
            "batch_min": np.floor(batch * 0.8),
            "batch_max": np.ceil(batch),
            "batch_p50": batch,
            "batch_p90": np.minimum(np.ceil(batch), batch * 1.05),
            "batch_p99": np.ceil(batch),
            "kv_usage_mean": kv_usage,
            "kv_usage_max": np.minimum(1.0, kv_usage * 1.04),
            "kv_blocks_max": np.ceil(kv_usage * p["num_gpu_blocks"]).astype(int),
            "waiting_mean": waiting,
            "waiting_max": np.ceil(waiting),
            "deferred_mean": 0.0,
            "deferred_max": 0,
            "preemptions": preempt,
            "prompt_tokens": prompt,
            "generation_tokens": gen,
            "prefix_queries": prompt,
            "prefix_hits": 0,
            "iteration_s_mean": None,
            "pool": pool,
            "model": "synthetic",
        }
    )
    # Requests: Little's law per second: time in system = load / request rate.
    req_rate = gen / p["gen"]
    rows = []
    for i, t in enumerate(ts):
        k = int(min(4, rng.poisson(max(req_rate[i], 0.0) / 4)))
        if k == 0:
            continue
        e2e = loads[i] / max(req_rate[i], 1e-6) * rng.lognormal(0, 0.15, k)
        queue = e2e * waiting[i] / loads[i]
        for j in range(k):
            rows.append(
                {
                    "engine_id": engine_id,
                    "boot_id": "synthetic",
                    "finished_unix_s": float(t) + rng.random(),
                    "e2e_s": float(e2e[j]),
                    "queue_s": float(queue[j]),
                    "prefill_s": 0.02,
                    "decode_s": float(e2e[j] - queue[j]),
                    "ttft_s": float(queue[j]) + 0.02,
                    "prompt_tokens": p["prompt"],
                    "generation_tokens": p["gen"],
                    "cached_tokens": 0,
                    "preemptions": 0,
                    "finish_reason": "length",
                }
            )
    requests = pd.DataFrame(rows)
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
    grid = np.linspace(min(levels), max(levels), 2000)
    clean = _throughput(grid, p)
    plateau = float(clean.max())
    knee = float(grid[np.argmax(clean >= knee_fraction * plateau)])
    truth = {
        "regime": regime,
        "bottleneck": "not_saturated"
        if regime == "not_saturated"
        else ("kv_cache_bound" if regime == "preemption_thrash" else regime),
        "knee": knee,
        "plateau_tokens_per_s": plateau,
        "kv_batch": kv_batch,
        "thrash": thrash,
        "saturated": regime != "not_saturated",
    }
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
