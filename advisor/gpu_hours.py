"""GPU-hours per pool in a week, their cost, and what throughput advice is worth in them.

* **Engine-hours**: from an engine's first to its last second with steps (the data has no
  up-time of its own); the seconds with steps (``active_hours``) are reported beside.
* **GPU-hours**: engine-hours times ``tensor_parallel_size x pipeline_parallel_size`` (1 where
  unknown, ``gpus_per_engine_known`` False).
* **Cost**: GPU-hours times ``gpu_hour_cost``, when given.
* **Worth**: a plateau gain ``g`` saves ``g / (1 + g)`` of the GPU-hours; a change that
  multiplies the GPUs by ``f`` is worth ``1 - f / (1 + g)``. The value at the same load for a
  pool sized for its peak, not a measured saving; per pool, the best advice of each engine is
  summed. Latency advice has no value here.

See docs/report.md#gpu-hours-and-cost-per-pool.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvscope.advisor.findings import Recommendation, Report, _clean
from kvscope.advisor.usage import Usage

HOUR_S = 3600.0


@dataclass
class PoolHours:
    """One pool's week in engine-hours and GPU-hours (see the module docstring)."""

    pool: str | None
    n_engines: int
    engine_hours: float
    active_hours: float
    gpu_hours: float
    gpus_per_engine_known: bool
    cost_usd: float | None = None
    saving_gpu_hours: float | None = None
    """The best throughput advice per engine, summed (None: no throughput advice)."""
    saving_usd: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolHours:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def gpus_per_engine(config: dict[str, Any]) -> float | None:
    """``tensor_parallel_size x pipeline_parallel_size`` (None when neither is known)."""
    tp, pp = _num(config.get("tensor_parallel_size")), _num(config.get("pipeline_parallel_size"))
    if tp is None and pp is None:
        return None
    return (tp or 1.0) * (pp or 1.0)


def gpu_factor(r: Recommendation, config: dict[str, Any]) -> float:
    """How many times the GPUs of one engine the change takes (``--tensor-parallel-size``)."""
    for flag in r.change.get("vllm_flags") or []:
        name, _, value = str(flag).partition(" ")
        new = _num(value)
        if name == "--tensor-parallel-size" and new is not None:
            return new / (_num(config.get("tensor_parallel_size")) or 1.0)
    return 1.0


def saving_share(gain: float, factor: float = 1.0) -> float:
    """The share of GPU-hours a throughput gain ``gain`` saves at the same load."""
    return 1.0 - factor / (1.0 + gain)


def gpu_hours(
    usage: Usage,
    report: Report,
    configs: dict[str, dict[str, Any]] | None = None,
    gpu_hour_cost: float | None = None,
) -> tuple[list[PoolHours], dict[str, tuple[float, float | None]]]:
    """Per pool: its :class:`PoolHours`; per throughput recommendation id: the GPU-hours it
    is worth and their USD (None without ``gpu_hour_cost``). ``configs``: each engine's
    configuration this week, by engine id."""
    configs = configs or {}
    hours: dict[str, float] = {}
    gpus: dict[str, float] = {}
    pools: dict[str | None, PoolHours] = {}
    for v in report.engines:
        row = usage.engine(v.engine_id)
        first, last = _num(row.get("first_window_s")), _num(row.get("last_window_s"))
        up = (last - first + 1.0) / HOUR_S if first is not None and last is not None else 0.0
        n_gpus = gpus_per_engine(configs.get(v.engine_id, {}))
        hours[v.engine_id], gpus[v.engine_id] = up, n_gpus or 1.0
        p = pools.setdefault(v.pool, PoolHours(v.pool, 0, 0.0, 0.0, 0.0, True))
        p.n_engines += 1
        p.engine_hours += up
        p.active_hours += float(row.get("active_s") or 0.0) / HOUR_S
        p.gpu_hours += up * gpus[v.engine_id]
        p.gpus_per_engine_known = p.gpus_per_engine_known and n_gpus is not None
    values: dict[str, tuple[float, float | None]] = {}
    best: dict[tuple[str | None, str | None], float] = {}
    for r in report.recommendations:
        if r.gain_kind != "throughput" or not math.isfinite(r.expected_gain):
            continue
        if r.expected_gain <= 0 or r.kind == "scale_api_server":
            continue
        eid = r.scope.engine_id
        if eid is not None and eid in hours:
            basis = hours[eid] * gpus[eid]
            factor = gpu_factor(r, configs.get(eid, {}))
        elif eid is None and r.scope.pool in pools:
            basis, factor = pools[r.scope.pool].gpu_hours, 1.0
        else:
            continue
        saved = basis * saving_share(r.expected_gain, factor)
        values[r.id] = (saved, saved * gpu_hour_cost if gpu_hour_cost is not None else None)
        key = (r.scope.pool, eid)
        best[key] = max(best.get(key, -math.inf), saved)
    for (pool, _), saved in best.items():
        p = pools[pool]  # advice that costs more than it saves is best left undone: 0
        p.saving_gpu_hours = (p.saving_gpu_hours or 0.0) + max(0.0, saved)
    for p in pools.values():
        if gpu_hour_cost is not None:
            p.cost_usd = p.gpu_hours * gpu_hour_cost
            if p.saving_gpu_hours is not None:
                p.saving_usd = p.saving_gpu_hours * gpu_hour_cost
    return sorted(pools.values(), key=lambda p: str(p.pool)), values
