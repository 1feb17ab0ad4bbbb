"""What every rendering starts from: one replica's cap and what the engine showed at it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvscope.advisor.balance import upstream
from kvscope.advisor.findings import Recommendation

REPLICA = "replica"
POOL = "pool"


@dataclass(frozen=True)
class ReplicaCap:
    """One replica's concurrency cap (requests in flight at one vLLM server) and the numbers
    the renderings are set from. Latencies are e2e P99s in seconds as the engine showed them
    at that many requests in flight (NaN when unknown)."""

    address: str
    """``host:port`` the gateway sends the replica's requests to."""
    cap: int
    """``C``: requests in flight (running and waiting) the replica is held to."""
    max_num_seqs: int
    """The rendered ``--max-num-seqs``: at most this many run; the rest of ``C`` waits."""
    queue: int
    """``Q``: requests vLLM may keep waiting beyond ``C`` before it rejects."""
    p99_e2e_s: float = math.nan
    """At load ``C`` (a gateway that holds the cap)."""
    p99_e2e_s_queued: float = math.nan
    """At load ``C + Q`` (vLLM's own admission limit, its queue full)."""
    p99_e2e_s_uncapped: float = math.nan
    """At the highest load seen (no cap)."""
    waiting_at_cap: float = math.nan
    """Requests waiting in vLLM (median of the windows) at load ``C``."""
    kv_usage_at_cap: float = math.nan
    """KV-cache use (0-1, median of the windows) at load ``C``."""
    engine_id: str = ""
    model: str = ""

    @property
    def max_num_queued_reqs(self) -> int:
        """vLLM's admission limit: it counts running and waiting requests together."""
        return self.cap + self.queue

    @classmethod
    def from_recommendation(cls, rec: Recommendation) -> ReplicaCap:
        """The replica of a ``concurrency_cap`` recommendation (its change and evidence)."""
        ch, ev, ef = rec.change, rec.evidence, rec.expected_effect
        cap = int(ch["concurrency_cap"])
        eid = str(rec.scope.engine_id or "")
        return cls(
            address=upstream(eid) if eid else "",
            cap=cap,
            max_num_seqs=int(ev.get("max_num_seqs") or cap),
            queue=int(ev.get("vllm_queue") or 0),
            p99_e2e_s=_float(ef.get("p99_e2e_s")),
            p99_e2e_s_queued=_float(ev.get("p99_e2e_s_queued")),
            p99_e2e_s_uncapped=_float(ef.get("p99_e2e_s_uncapped")),
            waiting_at_cap=_float(ev.get("cap_waiting")),
            kv_usage_at_cap=_float(ev.get("cap_kv_usage_ratio")),
            engine_id=eid,
            model=str(ev.get("model") or ""),
        )


def _float(v: Any) -> float:
    try:
        return math.nan if v is None else float(v)
    except (TypeError, ValueError):
        return math.nan


def by_address(replicas: list[ReplicaCap]) -> dict[str, int]:
    """Cap per ``host:port``: engines behind one API server (data parallel) add up."""
    out: dict[str, int] = {}
    for r in replicas:
        out[r.address] = out.get(r.address, 0) + r.cap
    return dict(sorted(out.items()))


def worst(values: list[float]) -> float:
    """The largest finite value (NaN when there is none): a pool's P99 is its slowest
    replica's."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def seconds(v: float) -> str:
    return f"{v:.2f} s" if math.isfinite(v) else "unknown"


def ident(pool: str | None) -> str:
    """An nginx-safe name for a pool: ``vllm_`` and the pool's name, other characters ``_``."""
    return "vllm_" + re.sub(r"[^A-Za-z0-9_]", "_", pool or "pool")


def rendering(
    config: str,
    fmt: str,
    scope: str,
    *,
    source: str,
    excess: str | None = None,
    effect: str | None = None,
    p99_e2e_s: float | None = None,
    worker_flags: list[str] | None = None,
    replica_flags: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """One gateway's rendering: the text to paste (``config``, in ``fmt``: nginx, yaml or
    bash), whether it is per ``replica`` or per ``pool``, where its fields were verified
    (``source``); for a cap what happens to the requests beyond it (``excess``) and the e2e
    P99 the admitted ones can expect (``p99_e2e_s``; None: the rendering does not bound it),
    for routing what it changes (``effect``); ``worker_flags``: vLLM flags every replica behind
    the gateway needs for the rendering to do what it says; ``replica_flags``: the vLLM flags
    of each replica (``host:port``) behind it, where they differ from the replica's own cap
    rendering."""
    out: dict[str, Any] = {"config": config, "format": fmt, "scope": scope}
    if excess is not None:
        out["excess"] = excess
        out["p99_e2e_s"] = (
            float(p99_e2e_s) if p99_e2e_s is not None and math.isfinite(p99_e2e_s) else None
        )
    if effect is not None:
        out["effect"] = effect
    if worker_flags:
        out["worker_flags"] = list(worker_flags)
    if replica_flags:
        out["replica_flags"] = {a: list(f) for a, f in replica_flags.items()}
    out["source"] = source
    return out
