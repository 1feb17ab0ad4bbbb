"""What checking a batch at the collector's door costs, against parsing it alone.

One command (a few seconds)::

    .venv/bin/python bench/ingest_validate.py

For a batch of 50 steps and 2 finished requests (a second of a busy engine), 5,000 and 100,
and 50,000 and 2,000 (the plugin's largest batch), medians of 5 rounds of: ``json.loads``
alone (the baseline); the pre-scan of the body's structure that bounds what parsing can
allocate (:func:`kvscope.collector._parse_budget.parse_cost`); and the whole door as the
collector runs it (pre-scan, parse, every value against its bound, the arrays built, the
times against the clock). The table gives milliseconds per batch and the ratios to the
baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from kvscope.collector._parse_budget import parse_cost
from kvscope.collector.batch import check_times, parse_body
from kvscope.engine_plugins.schema import SCHEMA_VERSION

T0 = 1_790_000_000.0


def _batch(n_steps: int, n_requests: int) -> bytes:
    steps = {
        "ts_unix_s": [T0 + i / 50 for i in range(n_steps)],
        "step": list(range(n_steps)),
        "batch_size": [i % 32 + 1 for i in range(n_steps)],
        "waiting": [i % 3 for i in range(n_steps)],
        "deferred": [0] * n_steps,
        "kv_usage_ratio": [round((i % 100) / 100, 3) for i in range(n_steps)],
        "kv_blocks_used": [i % 1000 for i in range(n_steps)],
        "prefix_queries": [256 * (i % 2) for i in range(n_steps)],
        "prefix_hits": [128 * (i % 2) for i in range(n_steps)],
        "preemptions": [int(i % 50 == 0) for i in range(n_steps)],
        "prompt_tokens": [512 * (i % 4 == 0) for i in range(n_steps)],
        "generation_tokens": [i % 32 + 1 for i in range(n_steps)],
        "iteration_s": [0.021 + (i % 7) / 1000 for i in range(n_steps)],
    }
    requests = {
        "finished_unix_s": [T0 + i / 2 for i in range(n_requests)],
        "e2e_s": [1.5 + i % 5 for i in range(n_requests)],
        "queue_s": [0.1] * n_requests,
        "prefill_s": [0.2] * n_requests,
        "decode_s": [1.2] * n_requests,
        "ttft_s": [0.3] * n_requests,
        "prompt_tokens": [512] * n_requests,
        "generation_tokens": [128] * n_requests,
        "cached_tokens": [256] * n_requests,
        "preemptions": [0] * n_requests,
        "finish_reason": ["stop"] * n_requests,
    }
    b = {
        "schema_version": SCHEMA_VERSION,
        "engine_id": "host:8000:0",
        "boot_id": "b",
        "seq": 1,
        "sent_unix_s": T0 + n_steps / 50,
        "hello": None,
        "steps": steps,
        "requests": requests,
        "exporter": {},
    }
    return json.dumps(b, separators=(",", ":")).encode()


def _door(body: bytes) -> None:
    parse_cost(body)
    b = parse_body(body, T0 + 3600)
    check_times(b, 300.0, 15 * 86_400.0)


def _time(fn: Callable[[bytes], object], body: bytes, reps: int, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(body)
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds per measure (default 5)")
    args = p.parse_args()
    print(
        f"{'steps':>6} {'requests':>8} {'KiB':>7} {'json.loads ms':>13} {'pre-scan ms':>11} "
        f"{'door ms':>8} {'pre-scan/loads':>14} {'door/loads':>10}"
    )
    for n_steps, n_requests in ((50, 2), (5_000, 100), (50_000, 2_000)):
        body = _batch(n_steps, n_requests)
        reps = max(5, 20_000 // n_steps)
        base = _time(json.loads, body, reps, args.rounds)
        scan = _time(parse_cost, body, reps, args.rounds)
        door = _time(_door, body, reps, args.rounds)
        print(
            f"{n_steps:>6} {n_requests:>8} {len(body) / 1024:>7.0f} {base * 1e3:>13.3f} "
            f"{scan * 1e3:>11.3f} {door * 1e3:>8.3f} {scan / base:>14.2f} {door / base:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
