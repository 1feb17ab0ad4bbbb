"""Seeded synthetic engines with known answers, for tests and examples.

:func:`make_engine` simulates the 1-second windows and finished requests of one
engine swept through load levels, in one of the regimes the advisor tells apart,
and returns them with the true answer (bottleneck, knee, plateau). The simulation
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
    "kv_cache_bound": {"num_gpu_blocks": 48, "block_size": 32, "prompt": 50, "gen": 128,
                       "max_num_seqs": 256, "budget": 2048, "a": 3.7e-3, "b": 0.25e-3,
                       "c": 0.2e-3},
    "max_num_seqs_bound": {"num_gpu_blocks": 4096, "block_size": 32, "prompt": 50,
                           "gen": 128, "max_num_seqs": 6, "budget": 2048, "a": 3.3e-3,
                           "b": 0.29e-3, "c": 0.08e-3},
    "token_budget_bound": {"num_gpu_blocks": 25000, "block_size": 16, "prompt": 4000,
                           "gen": 20, "max_num_seqs": 256, "budget": 2048, "a": 3.0e-3,
                           "b": 0.2e-3, "c": 0.01e-3},
    "compute_bound": {"num_gpu_blocks": 100000, "block_size": 16, "prompt": 50, "gen": 128,
                      "max_num_seqs": 256, "budget": 8192, "a": 2.0e-3, "b": 2.0e-3,
                      "c": 0.05e-3},
    "not_saturated": {"num_gpu_blocks": 100000, "block_size": 16, "prompt": 50, "gen": 128,
                      "max_num_seqs": 256, "budget": 8192, "a": 8.0e-3, "b": 0.05e-3,
                      "c": 0.01e-3},
    "preemption_thrash": {"num_gpu_blocks": 48, "block_size": 32, "prompt": 50, "gen": 128,
                          "max_num_seqs": 256, "budget": 2048, "a": 3.7e-3, "b": 0.25e-3,
                          "c": 0.2e-3, "thrash_per_request": 0.03},
}


@dataclass
class SyntheticEngine:
    """Frames as the collector's read API returns them, and the true answer."""

    engines: pd.DataFrame
    windows: pd.DataFrame
    requests: pd.DataFrame
    truth: dict[str, Any] = field(default_factory=dict)


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


def make_engine(regime: str, *, seed: int = 0, levels: tuple[float, ...] = (1, 2, 4, 8, 16, 32),
                seconds_per_level: int = 12, noise: float = 0.04, lull_prob: float = 0.05,
                knee_fraction: float = 0.9, engine_id: str = "synth:8000:0",
                pool: str = "synth", t0: int = 1_700_000_000) -> SyntheticEngine:
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
    windows = pd.DataFrame({
        "engine_id": engine_id, "ts_s": ts, "n_steps": n_steps, "n_parts": 1,
        "first_step_unix_s": ts + 0.002, "last_step_unix_s": ts + 0.995,
        "batch_sum": np.round(batch * n_steps).astype(int), "batch_mean": batch,
        "batch_min": np.floor(batch * 0.8), "batch_max": np.ceil(batch),
        "batch_p50": batch, "batch_p90": np.minimum(np.ceil(batch), batch * 1.05),
        "batch_p99": np.ceil(batch), "kv_usage_mean": kv_usage,
        "kv_usage_max": np.minimum(1.0, kv_usage * 1.04),
        "kv_blocks_max": np.ceil(kv_usage * p["num_gpu_blocks"]).astype(int),
        "waiting_mean": waiting, "waiting_max": np.ceil(waiting), "deferred_mean": 0.0,
        "deferred_max": 0, "preemptions": preempt, "prompt_tokens": prompt,
        "generation_tokens": gen, "prefix_queries": prompt, "prefix_hits": 0,
        "iteration_s_mean": None, "pool": pool, "model": "synthetic",
    })
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
            rows.append({"engine_id": engine_id, "boot_id": "synthetic",
                         "finished_unix_s": float(t) + rng.random(), "e2e_s": float(e2e[j]),
                         "queue_s": float(queue[j]), "prefill_s": 0.02,
                         "decode_s": float(e2e[j] - queue[j]),
                         "ttft_s": float(queue[j]) + 0.02, "prompt_tokens": p["prompt"],
                         "generation_tokens": p["gen"], "cached_tokens": 0,
                         "preemptions": 0, "finish_reason": "length"})
    requests = pd.DataFrame(rows)
    engines = pd.DataFrame([{
        "engine_id": engine_id, "pool": pool, "model": "synthetic",
        "num_gpu_blocks": p["num_gpu_blocks"], "block_size": p["block_size"],
        "max_num_seqs": p["max_num_seqs"], "max_num_batched_tokens": p["budget"],
        "max_model_len": 8192, "enable_prefix_caching": True, "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1,
    }])
    grid = np.linspace(min(levels), max(levels), 2000)
    clean = _throughput(grid, p)
    plateau = float(clean.max())
    knee = float(grid[np.argmax(clean >= knee_fraction * plateau)])
    truth = {"regime": regime, "bottleneck": "not_saturated" if regime == "not_saturated"
             else ("kv_cache_bound" if regime == "preemption_thrash" else regime),
             "knee": knee, "plateau_tokens_per_s": plateau, "kv_batch": kv_batch,
             "thrash": thrash, "saturated": regime != "not_saturated"}
    return SyntheticEngine(engines=engines, windows=windows, requests=requests, truth=truth)
