"""Saturation thresholds for Kubernetes' inference gateways: the Gateway API Inference
Extension's endpoint picker (EPP) and llm-d's workload-variant-autoscaler (WVA).

Neither holds a cap on requests in flight; both decide when a replica counts as full from its
waiting queue and KV-cache use. kvscope sets both thresholds to what the engine showed at its
cap (medians of the windows at that load), the smallest over the pool's replicas, so that a
replica counts as full where its cap is. Only fields read in the projects' own files (at the
commits docs/gateways.md names) are emitted:

* EPP: ``EndpointPickerConfig.saturationDetector`` with ``queueDepthThreshold`` and
  ``kvCacheUtilThreshold`` (the v1.2 schema; the later ``utilization-detector`` plugin form is
  not rendered). A saturated pool drops sheddable requests with 429.
* WVA: an entry of its saturation-scaling ConfigMap (``model_id``, ``namespace``,
  ``kvCacheThreshold``, ``queueLengthThreshold``). WVA scales replicas; it admits and rejects
  nothing.

See docs/gateways.md#the-inference-extensions-endpoint-picker and
docs/gateways.md#llm-d-workload-variant-autoscaler.
"""

from __future__ import annotations

import math
from typing import Any

from kvscope.advisor.gateways.replica import POOL, ReplicaCap, rendering, seconds, worst

EPP_SOURCE = (
    "kubernetes-sigs/gateway-api-inference-extension apix/config/v1alpha1/"
    "endpointpickerconfig_types.go @050687e0 (v1.2 SaturationDetector), "
    "site-src/guides/troubleshooting.md @08eacde9 (429 for sheddable requests)"
)
WVA_MIN_KV = 0.1
"""WVA rejects an entry whose ``kvCacheThreshold`` is below its ``kvSpareTrigger`` (default
0.1); below that the KV threshold is left out."""
WVA_SOURCE = (
    "llm-d/llm-d-workload-variant-autoscaler config/samples/saturation-scaling-config.yaml "
    "@957e147e, docs/saturation-scaling-config.md @2ca0f701"
)


def thresholds(replicas: list[ReplicaCap]) -> tuple[int | None, float | None]:
    """(waiting requests, KV-cache use) at which the pool's replicas count as full: the
    smallest measured at a replica's cap. The waiting threshold is at least 1 (a replica
    whose cap leaves no request waiting counts as full with one waiting); KV use is rounded
    down to a hundredth."""
    waits = [r.waiting_at_cap for r in replicas if math.isfinite(r.waiting_at_cap)]
    kvs = [r.kv_usage_at_cap for r in replicas if math.isfinite(r.kv_usage_at_cap)]
    queue = max(1, math.ceil(min(waits) - 1e-9)) if waits else None
    kv = min(1.0, math.floor(min(kvs) * 100 + 1e-9) / 100) if kvs else None
    if kv is not None and kv <= 0:
        kv = None
    return queue, kv


def _measured(queue: int | None, kv: float | None) -> str:
    parts = []
    if queue is not None:
        parts.append(f"{queue} waiting")
    if kv is not None:
        parts.append(f"KV cache {kv:.0%} used")
    return " or ".join(parts)


def epp(replicas: list[ReplicaCap]) -> dict[str, Any] | None:
    """The EPP's saturation detector at the measured cap (None without a measurement)."""
    queue, kv = thresholds(replicas)
    if queue is None and kv is None:
        return None
    lines = ["saturationDetector:"]
    if queue is not None:
        lines.append(f"  queueDepthThreshold: {queue}")
    if kv is not None:
        lines.append(f"  kvCacheUtilThreshold: {kv}")
    p99 = worst([r.p99_e2e_s_queued for r in replicas])
    excess = (
        "the endpoint picker holds no cap on requests in flight: a replica counts as full at "
        f"{_measured(queue, kv)} (what the engine showed at its cap), and when every replica "
        "is full the picker drops sheddable requests (InferenceObjective priority below 0) "
        "with 429; the others still reach the replicas, whose vLLM flags hold the cap (503 "
        f"past --max-num-queued-reqs). Admitted requests' e2e P99 up to {seconds(p99)}"
    )
    return rendering(
        "\n".join(lines), "yaml", POOL, excess=excess, p99_e2e_s=p99, source=EPP_SOURCE
    )


def wva(pool: str | None, replicas: list[ReplicaCap]) -> dict[str, Any] | None:
    """A per-model entry of WVA's saturation-scaling ConfigMap at the measured cap."""
    queue, kv = thresholds(replicas)
    if queue is None and kv is None:
        return None
    model = next((r.model for r in replicas if r.model), "") or "<model id>"
    lines = [
        "data:",
        f"  kvscope-{pool or 'pool'}: |",
        f"    model_id: {model}",
        "    namespace: <namespace of the model's replicas>",
    ]
    if kv is not None and kv >= WVA_MIN_KV:
        lines.append(f"    kvCacheThreshold: {kv}")
    if queue is not None:
        lines.append(f"    queueLengthThreshold: {queue}")
    excess = (
        "WVA admits and rejects nothing: it counts a replica saturated at "
        f"{_measured(queue, kv)} (its cap) and adds replicas when the spare capacity left "
        "on the others falls below kvSpareTrigger / queueSpareTrigger (left at their "
        "defaults). Until a new replica is serving (its model loaded), the gateway and the "
        "vLLM flags handle the excess. Keep the endpoint picker's thresholds the same"
    )
    return rendering(
        "\n".join(lines), "yaml", POOL, excess=excess, p99_e2e_s=None, source=WVA_SOURCE
    )
