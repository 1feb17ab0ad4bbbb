"""Load balance across the replicas of a pool.

:class:`LoadBalance` measures each engine's mean requests in flight over the pool's whole
span (a second without a window counts as idle, so a replica idle half the time shows half
the load) and its share of the finished requests. The imbalance, the busiest engine's load
over the pool's mean, is flagged (``load_imbalance``, ``least_loaded_routing``) at
``threshold`` or more when the pool is loaded enough for the ratio to mean something. The
expected gain, ``1 - mean / max``, holds only when the busiest replica is saturated (else 0:
hygiene). Replicas of unequal capacity should carry unequal load; the trade-off says so.

Parameters
----------
threshold : imbalance that is flagged (default 1.25).
min_mean_load : pool mean load, in requests in flight, below which nothing is flagged
    (default 1.0).

See docs/fleet.md#prefill-cost-and-load-balance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.findings import Finding, Recommendation, Scope
from kvscope.advisor.frames import prepare_windows, stepped_seconds


def upstream(engine_id: str) -> str:
    """``host:port`` of an engine id ``host:port:engine_index``."""
    head, sep, tail = engine_id.rpartition(":")
    return head if sep and tail.isdigit() and ":" in head else engine_id


class LoadBalance:
    """Per-engine load and request share in one pool (see the module docstring)."""

    def __init__(self, *, threshold: float = 1.25, min_mean_load: float = 1.0) -> None:
        self.threshold = threshold
        self.min_mean_load = min_mean_load

    def fit(
        self, windows: pd.DataFrame, requests: pd.DataFrame, engine_ids: list[str]
    ) -> LoadBalance:
        w = (
            prepare_windows(windows)
            if len(windows)
            else pd.DataFrame({"engine_id": [], "ts_s": [], "load": []})
        )
        ts = pd.to_numeric(w["ts_s"], errors="coerce")
        # A window read from the 1-minute tier holds the mean load of the seconds its
        # engine stepped in and spans its minute.
        seconds = stepped_seconds(w)
        end = ts + (
            pd.to_numeric(w["resolution_s"], errors="coerce").fillna(1.0)
            if "resolution_s" in w
            else 1.0
        )
        self.span_s_ = float(end.max() - ts.min()) if len(ts) else 0.0
        ids = sorted(engine_ids)
        load_sum = (
            (w["load"] * seconds).groupby(w["engine_id"]).sum()
            if len(w)
            else pd.Series(dtype=float)
        )
        n_req = (
            requests["engine_id"].value_counts()
            if len(requests) and "engine_id" in requests
            else pd.Series(dtype=int)
        )
        total_req = int(sum(int(n_req.get(e, 0)) for e in ids))
        self.engine_ids_ = ids
        self.mean_load_ = {
            e: (float(load_sum.get(e, 0.0)) / self.span_s_ if self.span_s_ else 0.0) for e in ids
        }
        self.n_requests_ = {e: int(n_req.get(e, 0)) for e in ids}
        self.request_share_ = {
            e: (self.n_requests_[e] / total_req if total_req else math.nan) for e in ids
        }
        loads = np.array([self.mean_load_[e] for e in ids], float)
        self.pool_mean_load_ = float(loads.mean()) if len(loads) else 0.0
        self.busiest_ = ids[int(np.argmax(loads))] if len(ids) else None
        self.imbalance_ = (
            float(loads.max()) / self.pool_mean_load_ if self.pool_mean_load_ > 0 else math.nan
        )
        self.flagged_ = bool(
            len(ids) >= 2
            and math.isfinite(self.imbalance_)
            and self.imbalance_ >= self.threshold
            and self.pool_mean_load_ >= self.min_mean_load
        )
        return self

    def _frame(self) -> dict[str, list[Any]]:
        ids = self.engine_ids_
        return {
            "engine_id": ids,
            "mean_load": [self.mean_load_[e] for e in ids],
            "n_requests": [self.n_requests_[e] for e in ids],
            "request_share": [self.request_share_[e] for e in ids],
        }

    def finding(self, scope: Scope) -> Finding:
        loads = ", ".join(f"{e} {self.mean_load_[e]:.1f}" for e in self.engine_ids_)
        shares = ", ".join(
            f"{e} {self.request_share_[e]:.0%}"
            for e in self.engine_ids_
            if math.isfinite(self.request_share_[e])
        )
        verdict = (
            "uneven"
            if self.flagged_
            else "even enough"
            if math.isfinite(self.imbalance_)
            else "no load"
        )
        summary = (
            f"load across {len(self.engine_ids_)} replicas is {verdict}: busiest / mean "
            f"{self.imbalance_:.2f}x (threshold {self.threshold:.2f}x); in flight "
            f"{loads}" + (f"; requests {shares}" if shares else "")
        )
        return Finding(
            kind="load_imbalance",
            scope=scope,
            summary=summary,
            severity="warning" if self.flagged_ else "info",
            confidence=round(min(1.0, self.span_s_ / 60.0), 3),
            evidence={
                "load_imbalance": self.imbalance_,
                "threshold": self.threshold,
                "busiest_engine": self.busiest_,
                "pool_mean_load": self.pool_mean_load_,
                "span_s": self.span_s_,
            },
            frame=self._frame(),
        )

    def recommendation(self, scope: Scope, busiest_saturated: bool) -> Recommendation | None:
        """The ``least_loaded_routing`` recommendation when the imbalance is flagged."""
        if not self.flagged_ or self.busiest_ is None:
            return None
        top = self.mean_load_[self.busiest_]
        gain = 1.0 - self.pool_mean_load_ / top if busiest_saturated and top > 0 else 0.0
        servers = " ".join(f"server {s};" for s in sorted({upstream(e) for e in self.engine_ids_}))
        return Recommendation(
            kind="least_loaded_routing",
            scope=scope,
            summary=(
                f"route to the least-loaded replica: {self.busiest_} carries "
                f"{top:.1f} in flight against a pool mean of {self.pool_mean_load_:.1f} "
                f"({self.imbalance_:.2f}x)"
            ),
            change={
                "router_policy": "least-loaded",
                "gateway": {"nginx_upstream": f"upstream {scope.pool} {{ least_conn; {servers} }}"},
                "router_options": "vLLM production-stack / llm-d: a load-aware scorer "
                "(queue depth, KV usage); prefix-affine routing must "
                "keep a load bound too",
            },
            expected_effect={
                "busiest_load": top,
                "balanced_load": self.pool_mean_load_,
                "busiest_latency_reduction_ratio": gain,
            },
            tradeoff=(
                "replicas of unequal capacity should carry unequal load; weight them "
                "by capacity instead"
                + (
                    ""
                    if busiest_saturated
                    else "; the busiest replica is below its knee, so little latency is won"
                )
            ),
            confidence=round(min(1.0, self.span_s_ / 60.0), 3),
            expected_gain=gain,
            evidence={
                "load_imbalance": self.imbalance_,
                "busiest_engine": self.busiest_,
                "busiest_saturated": busiest_saturated,
            },
        )
