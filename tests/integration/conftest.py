"""Session fixtures that run the real vLLM CPU engine with the kvscope plugin.

One engine start costs 30-60 s on these machines, so the overload run is made once
per test session and every test reads what it left: the collector's store (through
its HTTP API), vLLM's own /metrics before and after, and the sweep's results.

The advisor scenarios (``bench/advisor_scenarios.py``, run by ``test_advisor_real.py``)
start one engine per regime, once per module; each fixture runs its engine, sweeps it,
asks the advisor, stops the engine and returns the measurements, so no two engines
ever compete for the cores. Their figures are printed in the terminal summary and
written to ``advisor_real.json`` in pytest's base temporary directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.advisor_scenarios import (
    SCENARIOS,
    AdvisorLab,
    CapRun,
    RegimeRun,
    format_all,
    levels_table,
    measure_level,
    summary,
)
from kvscope.advisor import CollectorSource, analyze
from kvscope.collector.process import CollectorProcess
from kvscope.lab.engine import VllmServer, build_model, default_model_dir, vllm_counter_totals
from kvscope.lab.sweep import SweepConfig, SweepResult, run_sweep
from tests._resources import release_after_last_use

MAX_NUM_SEQS = 16
NUM_GPU_BLOCKS = 48
BLOCK_SIZE = 32
POOL = "it-pool"
MODEL_NAME = "kvscope-it"
OVERLOAD_LEVELS = [1, 2, 4, 8, 16, 32]
"""The overload run's sweep: enough levels below and past the knee (8-12 clients on this
engine) for the advisor to see the plateau, not only its far end."""


@dataclass
class OverloadRun:
    collector: CollectorProcess
    server: VllmServer
    sweep: SweepResult
    vllm_before: dict[str, float]
    vllm_after: dict[str, float]
    workdir: Path

    def kvscope_totals(self) -> dict[str, float]:
        return collector_totals(self.collector)

    def diagnosis(self) -> str:
        """The run's own data for a failure message: per sweep level the load generator's
        throughput and the engine's windows (batch, waiting, KV, preemptions), and what
        the advisor makes of the sweep."""
        levels = self.sweep.levels
        since = min(lv.window_start_unix_s for lv in levels) - 1
        until = max(lv.window_end_unix_s for lv in levels) + 1
        src = CollectorSource(self.collector.url)
        w, r = src.windows(since, until), src.requests(since, until)
        lines = ["clients  tok/s  in flight  batch  waiting  KV used  preempt/s"]
        for lv in levels:
            m = measure_level(lv, w, r)
            lines.append(
                f"{m.concurrency:>7} {m.client_tokens_per_s:>6,.0f} {m.load_mean:>10.1f} "
                f"{m.batch_median:>6.1f} {m.waiting_median:>8.1f} "
                f"{m.kv_usage_median:>8.0%} {m.preemptions_per_s:>10.1f}"
            )
        try:
            v = analyze(src, since, until).engines[0]
            lines.append(
                f"advisor on the sweep: {v.bottleneck}, saturated {v.saturated}, knee "
                f"{v.knee_concurrency}, plateau {v.plateau_tokens_per_s}, cap "
                f"{v.recommended_concurrency_cap}"
            )
        except Exception as e:  # the diagnosis must not hide the failure it explains
            lines.append(f"advisor on the sweep failed: {e!r}")
        return "\n".join(lines)

    def settled_totals(self, timeout_s: float = 30.0) -> tuple[dict[str, float], dict[str, float]]:
        """vLLM's counters now and kvscope's stored totals, once they agree (or the
        timeout passes). Other tests may drive more load through this session's engine,
        so the comparison is with vLLM's counters now, not at the fixture's end."""
        return wait_until_equal(
            lambda: vllm_totals(self.server.metrics_text()),
            lambda: collector_totals(self.collector),
            timeout_s=timeout_s,
        )


def collector_totals(collector: CollectorProcess) -> dict[str, float]:
    """Sums over every stored step and request, read through the query API.

    Step sums come from the raw steps and, separately, from the 1-second windows;
    both must agree or the windows are not exact.
    """

    def sums(source: str) -> dict[str, float]:
        rows = collector.get_json("/v1/totals", params={"source": source})["rows"]
        return {
            k: float(sum(r[k] for r in rows))
            for k in (
                "preemptions",
                "prompt_tokens",
                "generation_tokens",
                "prefix_queries",
                "prefix_hits",
            )
        }

    # Two reads are two snapshots: while batches still arrive the windows (read second)
    # may hold more than the steps. Re-read until a window read is bracketed by two
    # equal step reads; then the two sources must agree.
    for _ in range(40):
        from_steps, from_windows = sums("steps"), sums("windows")
        if sums("steps") == from_steps:
            break
        time.sleep(0.25)
    assert from_steps == from_windows, (from_steps, from_windows)
    stats = collector.get_json("/v1/request_stats", params={"since": "0", "group_by": "all"})[
        "rows"
    ]
    from_steps["finished_requests"] = float(stats[0]["n_requests"]) if stats else 0.0
    return from_steps


def vllm_totals(metrics_text: str) -> dict[str, float]:
    t = vllm_counter_totals(metrics_text)
    return {
        "preemptions": t["vllm:num_preemptions_total"],
        "prompt_tokens": t["vllm:prompt_tokens_total"],
        "generation_tokens": t["vllm:generation_tokens_total"],
        "prefix_queries": t["vllm:prefix_cache_queries_total"],
        "prefix_hits": t["vllm:prefix_cache_hits_total"],
        "finished_requests": t["vllm:request_success_total"],
    }


def wait_until_equal(read_a, read_b, timeout_s: float = 20.0) -> tuple[Any, Any]:
    """Poll until two readings agree (the exporter ships every ~1 s) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = read_a(), read_b()
        if a == b or time.monotonic() > deadline:
            return a, b
        time.sleep(0.5)


@pytest.fixture(scope="session")
def mid_model() -> Path:
    return build_model(default_model_dir("mid"), "mid")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_model(default_model_dir("tiny"), "tiny")


@pytest.fixture(scope="session")
def overload_run(
    mid_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[OverloadRun]:
    """A KV-starved engine (48 blocks of 32 tokens) driven past its plateau; shared by the
    modules that read it, stopped after the last of them (``tests/_resources.py``)."""
    workdir = tmp_path_factory.mktemp("overload")
    collector = CollectorProcess(
        workdir / "store.duckdb",
        log_path=workdir / "collector.log",
        # Verdicts every 10 s rather than the default 60: the Grafana test waits for them.
        extra_args=["--advise-interval-s", "10"],
    )
    collector.start()
    server = VllmServer(
        mid_model,
        served_model_name=MODEL_NAME,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        enable_prefix_caching=True,
        env={
            "KVSCOPE_COLLECTOR_URL": collector.url,
            "KVSCOPE_POOL": POOL,
            "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
        },
        log_path=workdir / "vllm.log",
    )
    run: OverloadRun | None = None

    def stop() -> None:
        server.stop()
        collector.stop()
        if run is not None and run.collector is not collector:
            run.collector.stop()  # a test may have replaced it with a revived one

    release_after_last_use(request, stop)
    try:
        server.start()
        before = vllm_totals(server.metrics_text())
        sweep = run_sweep(
            SweepConfig(
                url=server.url,
                model=MODEL_NAME,
                concurrency=OVERLOAD_LEVELS,
                duration_s=5.0,
                warmup_s=1.0,
                cooldown_s=0.5,
                prompt_words=(8, 40),
                output_tokens=(96, 128),
                shared_prefix_words=64,
                prefix_groups=4,
                seed=7,
                progress=False,
            )
        )
        after, _ = wait_until_equal(
            lambda: vllm_totals(server.metrics_text()),
            lambda: collector_totals(collector),
        )
        run = OverloadRun(collector, server, sweep, before, after, workdir)
        yield run
    finally:
        stop()


@dataclass
class AdvisorFigures:
    """What the advisor scenarios measured in this session (for the summary and JSON)."""

    runs: dict[str, RegimeRun] = field(default_factory=dict)
    engine_cap: CapRun | None = None
    json_path: Path | None = None
    elapsed_s: float = 0.0

    def ordered_runs(self) -> list[RegimeRun]:
        return [self.runs[n] for n in SCENARIOS if n in self.runs]


ADVISOR_FIGURES = pytest.StashKey[AdvisorFigures]()


def _advisor_figures(config: pytest.Config) -> AdvisorFigures:
    if ADVISOR_FIGURES not in config.stash:
        config.stash[ADVISOR_FIGURES] = AdvisorFigures()
    return config.stash[ADVISOR_FIGURES]


def _say(text: str) -> None:
    print(text, flush=True)  # shown with pytest -s


@pytest.fixture(scope="module")
def advisor_lab(
    mid_model: Path, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[AdvisorLab]:
    """A collector process for the advisor scenarios; the figures are written at the end."""
    figures = _advisor_figures(pytestconfig)
    started = time.monotonic()
    lab = AdvisorLab(tmp_path_factory.mktemp("advisor"), model_dir=mid_model, log=_say)
    lab.start()
    try:
        yield lab
    finally:
        lab.close()
        figures.elapsed_s = time.monotonic() - started
        if figures.runs:
            path = tmp_path_factory.getbasetemp() / "advisor_real.json"
            data = summary(figures.ordered_runs(), figures.engine_cap)
            data["elapsed_s"] = figures.elapsed_s
            path.write_text(json.dumps(data, indent=2) + "\n")
            figures.json_path = path


def _regime(lab: AdvisorLab, config: pytest.Config, name: str, **kw: Any) -> RegimeRun:
    run = lab.run_regime(SCENARIOS[name], **kw)
    _advisor_figures(config).runs[name] = run
    return run


@pytest.fixture(scope="module")
def kv_starved_run(advisor_lab: AdvisorLab, pytestconfig: pytest.Config) -> RegimeRun:
    """KV-starved engine (48 blocks of 32): the sweep, the verdict, and the advisor's cap
    applied as client concurrency on the same engine (``run.client_cap``)."""
    return _regime(advisor_lab, pytestconfig, "kv-starved", cap_by_client=True)


@pytest.fixture(scope="module")
def kv_engine_cap_run(
    advisor_lab: AdvisorLab, kv_starved_run: RegimeRun, pytestconfig: pytest.Config
) -> CapRun:
    """The KV-starved engine restarted with ``--max-num-seqs`` = the advisor's cap,
    driven at the sweep's highest concurrency."""
    if kv_starved_run.verdict.recommended_concurrency_cap is None:
        pytest.fail(
            "the advisor recommended no cap for the KV-starved engine; its verdict "
            f"{kv_starved_run.verdict.bottleneck} (saturated "
            f"{kv_starved_run.verdict.saturated}) on this sweep:\n" + levels_table(kv_starved_run)
        )
    cap = advisor_lab.run_engine_cap(kv_starved_run)
    _advisor_figures(pytestconfig).engine_cap = cap
    return cap


@pytest.fixture(scope="module")
def seq_capped_run(advisor_lab: AdvisorLab, pytestconfig: pytest.Config) -> RegimeRun:
    """Ample KV, ``--max-num-seqs 6``."""
    return _regime(advisor_lab, pytestconfig, "seq-capped")


@pytest.fixture(scope="module")
def ample_kv_run(advisor_lab: AdvisorLab, pytestconfig: pytest.Config) -> RegimeRun:
    """Ample KV (4,096 blocks), ``--max-num-seqs 256``."""
    return _regime(advisor_lab, pytestconfig, "ample-kv")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The advisor scenarios' figures, when this session ran them."""
    figures = config.stash.get(ADVISOR_FIGURES, None)
    if figures is None or not figures.runs:
        return
    terminalreporter.section("advisor on the real engine")
    terminalreporter.write_line(format_all(figures.ordered_runs(), figures.engine_cap))
    terminalreporter.write_line(
        f"scenarios took {figures.elapsed_s:.0f} s; figures in {figures.json_path}"
    )
