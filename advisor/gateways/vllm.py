"""The cap in vLLM's own flags: the replica holds it without any gateway.

``--max-num-queued-reqs`` is vLLM's admission limit in the API server: it counts every
unfinished request (running and waiting) and answers the next one 503 at once. vLLM checks
it twice: before a response starts (503) and again when it hands the request to the engine
(``AsyncLLM.check_admission`` from ``_add_request``, vLLM 0.32). A streaming request that
passed the first check while others were being admitted fails the second after its 200
has gone out, and gets an error event in the stream instead of a 503 (behind vllm-router
with 64 clients on two replicas: 244 of 972 refusals, ``bench/gateway_loops.py``), which
no gateway can retry by status.
``--max-num-seqs`` bounds the running batch; what is admitted beyond it waits in vLLM's
queue, and that wait is in the admitted requests' latency."""

from __future__ import annotations

from typing import Any

from kvscope.advisor.gateways.replica import REPLICA, ReplicaCap, rendering, seconds


def vllm_flags(r: ReplicaCap) -> list[str]:
    return [f"--max-num-seqs {r.max_num_seqs}", f"--max-num-queued-reqs {r.max_num_queued_reqs}"]


def vllm_replica(r: ReplicaCap) -> dict[str, Any]:
    excess = (
        f"vLLM admits {r.max_num_queued_reqs} unfinished requests ({r.cap} for the cap and "
        f"{r.queue} waiting beyond it) and answers the next one 503 at once (a streaming "
        "request admitted in a race gets 200 and then an error event in the stream); at most "
        f"{r.max_num_seqs} run, the rest wait in vLLM's queue. With these flags alone the "
        f"queue stays full under overload: admitted requests' e2e P99 "
        f"{seconds(r.p99_e2e_s_queued)} (the engine at {r.max_num_queued_reqs} in flight), "
        f"against {seconds(r.p99_e2e_s)} with a gateway holding {r.cap} and "
        f"{seconds(r.p99_e2e_s_uncapped)} uncapped"
    )
    return rendering(
        " ".join(vllm_flags(r)),
        "bash",
        REPLICA,
        excess=excess,
        p99_e2e_s=r.p99_e2e_s_queued,
        source="vLLM engine arguments (--max-num-seqs, --max-num-queued-reqs)",
    )
