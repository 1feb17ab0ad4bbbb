"""What a refused request costs a vLLM API server's CPU, against an admitted one.

    .venv/bin/python bench/refusal_cost.py [--n 300]     # about 2 minutes, engine start included

Behind a gateway with no per-replica limit (vllm-router) the requests a full pool refuses reach
the replicas' API servers: vLLM answers 503 past ``--max-num-queued-reqs``, and the router asks
a worker to tokenize each prompt first (``POST /v1/completions/render``, 403 without
``--enable-scale-out``). On a host whose API servers share cores with the engines that work is
taken from the engines. One real engine (the lab's "mid" model) is started with
``--max-num-seqs 1 --max-num-queued-reqs 1``; first ``--n`` admitted one-token requests run one
after another (the baseline), then one long request holds the engine full and ``--n`` requests
are refused, then ``--n`` render calls are refused. The API server process's CPU time
(``/proc/<pid>/stat``, all its threads) is read around each series; the table gives the CPU
and wall time per request and the ratio to the admitted request's CPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvscope.lab.engine import VllmServer, build_model, default_model_dir

PROMPT = " ".join(["word"] * 25)
"""About the prompt length of the gateway loops' requests."""


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post(port: int, path: str, body: dict[str, object], timeout_s: float = 600.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@dataclass(frozen=True)
class Series:
    statuses: dict[int, int]
    cpu_ms: float
    """The API server's CPU per request."""
    wall_ms: float


def series(port: int, pid: int, path: str, body: dict[str, object], n: int) -> Series:
    """``n`` requests one after another: their statuses, API server CPU and wall time each."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    statuses = [post(port, path, body) for _ in range(n)]
    c1, t1 = cpu_seconds(pid), time.monotonic()
    return Series(
        {s: statuses.count(s) for s in sorted(set(statuses))},
        1000 * (c1 - c0) / n,
        1000 * (t1 - t0) / n,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300, help="requests per series (default: 300)")
    ap.add_argument(
        "--log",
        default="/tmp/kvscope-refusal-cost.log",
        help="the engine's log (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if args.n < 10:
        ap.error("--n must be at least 10: the CPU clock ticks every 10 ms")
    model = build_model(default_model_dir("mid"), "mid")
    name = "kvscope-lab"
    completion = {"model": name, "prompt": PROMPT, "max_tokens": 1}
    print("starting one engine (--max-num-seqs 1 --max-num-queued-reqs 1) ...", file=sys.stderr)
    with VllmServer(
        model,
        served_model_name=name,
        num_gpu_blocks=48,
        max_num_seqs=1,
        extra_args=["--max-num-queued-reqs", "1"],
        log_path=args.log,
    ) as server:
        pid = server.pid
        assert pid is not None
        rows = [
            (
                "admitted, 1 token (baseline)",
                series(server.port, pid, "/v1/completions", completion, args.n),
            )
        ]
        long = {"model": name, "prompt": PROMPT, "max_tokens": 1400, "ignore_eos": True}
        hold = threading.Thread(
            target=post, args=(server.port, "/v1/completions", long), daemon=True
        )
        hold.start()
        time.sleep(3.0)  # the long request is running: the engine is at its admission limit
        refused = {"model": name, "prompt": PROMPT, "max_tokens": 128}
        rows.append(
            (
                "refused (503, engine full)",
                series(server.port, pid, "/v1/completions", refused, args.n),
            )
        )
        rows.append(
            (
                "render call (vllm-router's, 403)",
                series(server.port, pid, "/v1/completions/render", refused, args.n),
            )
        )
    base = rows[0][1].cpu_ms
    print(
        f"| request ({args.n} each) | statuses | API server CPU per request | wall per request "
        "| CPU / admitted |"
    )
    print("|---|---|---|---|---|")
    for label, r in rows:
        ratio = f"{r.cpu_ms / base:.2f}" if base > 0 else "-"
        print(f"| {label} | {r.statuses} | {r.cpu_ms:.2f} ms | {r.wall_ms:.2f} ms | {ratio} |")
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
