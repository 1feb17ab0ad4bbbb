"""Tests of the sweep: trace formats, workloads, statistics, and the load generator
against a small local server that speaks the OpenAI streaming completion protocol.

The real trace files are the slices of public traces in the repository's ``traces/``
folder (the first 1,000 rows of each; see ``traces/README.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from kvscope.lab.sweep import (
    SweepConfig,
    SweepError,
    SweepResult,
    TraceFormatError,
    TraceRow,
    Workload,
    add_sweep_arguments,
    config_from_args,
    format_table,
    load_trace,
    percentile,
    run_sweep_async,
    summarize_level,
)
from kvscope.lab.sweep.prompts import WORDS
from kvscope.lab.sweep.routing import Router
from kvscope.lab.sweep.stats import RequestRecord
from kvscope.lab.sweep.traces import MOONCAKE_BLOCK_TOKENS

TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.fixture
def traces_dir() -> Path:
    """The public trace slices; their absence is a failure, not a skip."""
    assert TRACES.is_dir(), (
        f"trace folder {TRACES} not found: these tests read the public trace slices "
        "in the repository's traces/ folder"
    )
    return TRACES


needs_traces = pytest.mark.usefixtures("traces_dir")


# --- traces -------------------------------------------------------------------------


@needs_traces
@pytest.mark.parametrize(
    ("name", "rows", "first"),
    [
        ("mooncake_conversation_trace.jsonl", 1_000, (6758, 500)),
        ("mooncake_synthetic_trace.jsonl", 1_000, (40160, 6)),
        ("AzureLLMInferenceTrace_code.csv", 1_000, (4808, 10)),
        ("AzureLLMInferenceTrace_conv.csv", 1_000, (374, 44)),
        ("sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 1_000, (74, 918)),
        ("arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 1_000, (3772, 54)),
    ],
)
def test_real_trace_files_parse(name: str, rows: int, first: tuple[int, int]) -> None:
    trace = load_trace(TRACES / name)
    assert len(trace) == rows
    assert (trace[0].input_tokens, trace[0].output_tokens) == first
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in trace)
    if name.startswith("mooncake"):
        # Every row has one prefix block id per started 512-token block.
        assert all(len(r.block_ids) == -(-r.input_tokens // MOONCAKE_BLOCK_TOKENS) for r in trace)
    else:
        assert all(r.block_ids == () for r in trace)


@needs_traces
def test_trace_limit_reads_only_the_first_rows() -> None:
    assert len(load_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=5)) == 5
    assert len(load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv", limit=7)) == 7


def test_trace_formats_from_small_files(tmp_path: Path) -> None:
    moon = tmp_path / "m.jsonl"
    moon.write_text(
        '{"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 5, "input_length": 0, "output_length": 3, "hash_ids": []}\n'
        '{"timestamp": 3500, "input_length": 9, "output_length": 1}\n'
    )
    # The zero-length row is skipped; times are milliseconds, from the first kept row.
    assert load_trace(moon) == [TraceRow(600, 3, (0, 1), 0.0), TraceRow(9, 1, (), 2.5)]
    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:05.0299600,11,3\n"
    )
    rows = load_trace(azure)
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(10, 2), (11, 3)]
    assert rows[0].arrival_s == 0.0 and rows[1].arrival_s == pytest.approx(1.05, abs=1e-6)
    lengths = tmp_path / "l.csv"
    lengths.write_text(
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n7,9,16,0.7\n"
    )
    assert load_trace(lengths) == [TraceRow(7, 9)]


def test_trace_errors_name_the_problem(tmp_path: Path) -> None:
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError, match="unknown CSV trace header"):
        load_trace(bad_header)
    bad_row = tmp_path / "r.jsonl"
    bad_row.write_text('{"input_length": 5, "output_length": 1}\n{"input_length": "x"}\n')
    with pytest.raises(TraceFormatError, match="line 2"):
        load_trace(bad_row)
    empty = tmp_path / "e.csv"
    empty.write_text("ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="no rows"):
        load_trace(empty)
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")


# --- workloads ----------------------------------------------------------------------


def take(workload: Workload, level: int, n: int) -> list:
    stream = workload.requests(level)
    return [next(stream) for _ in range(n)]


def test_length_distribution_is_seeded_and_in_range() -> None:
    w = Workload(prompt_words=(8, 40), output_tokens=(100, 140), seed=3)
    specs = take(w, 0, 300)
    assert specs == take(Workload(prompt_words=(8, 40), output_tokens=(100, 140), seed=3), 0, 300)
    assert specs != take(w, 1, 300)  # levels have their own prompts
    words = [len(s.prompt.split(" ")) for s in specs]
    assert words == [s.prompt_words for s in specs]
    assert min(words) == 8 and max(words) == 40
    assert all(100 <= s.max_tokens <= 140 for s in specs)
    assert all(set(s.prompt.split(" ")) <= set(WORDS) for s in specs)


def test_shared_prefix_groups() -> None:
    w = Workload(prompt_words=(5, 10), shared_prefix_words=30, prefix_groups=3, seed=1)
    prefixes = [w.prefix(0, g) for g in range(3)]
    assert len(set(prefixes)) == 3 and all(len(p.split(" ")) == 30 for p in prefixes)
    specs = take(w, 0, 200)
    used = [next(i for i, p in enumerate(prefixes) if s.prompt.startswith(p + " ")) for s in specs]
    assert set(used) == {0, 1, 2}
    assert all(35 <= s.prompt_words <= 40 for s in specs)
    assert all(len(s.prompt.split(" ")) == s.prompt_words for s in specs)
    bodies = {s.prompt[len(prefixes[g]) :] for s, g in zip(specs, used, strict=True)}
    assert len(bodies) > 190  # bodies are the requests' own
    assert w.prefix(1, 0) not in prefixes  # another level, other prefixes


def test_clamps_apply_to_prompt_and_output() -> None:
    trace = [TraceRow(50_000, 5_000), TraceRow(20, 4)]
    w = Workload(
        trace=trace,
        trace_order="sequential",
        max_prompt_tokens=500,
        max_output_tokens=64,
        shared_prefix_words=100,
        tokens_per_word=1.0,
    )
    big, small = take(w, 0, 2)
    assert (big.prompt_words, big.max_tokens) == (500, 64)
    assert (small.prompt_words, small.max_tokens) == (120, 4)


def test_trace_scale_and_order() -> None:
    trace = [TraceRow(1000, 200), TraceRow(2000, 400), TraceRow(3000, 600)]
    seq = take(
        Workload(trace=trace, trace_order="sequential", trace_scale=0.1, tokens_per_word=1.0), 0, 4
    )
    assert [s.prompt_words for s in seq] == [100, 200, 300, 100]
    assert [s.max_tokens for s in seq] == [20, 40, 60, 20]
    sampled = take(Workload(trace=trace, trace_order="sample", seed=5), 0, 60)
    assert {s.max_tokens for s in sampled} == {200, 400, 600}


def test_mooncake_blocks_become_shared_prefixes() -> None:
    trace = [TraceRow(600, 1, (7, 8)), TraceRow(1000, 1, (7, 9)), TraceRow(300, 1, (10,))]
    w = Workload(trace=trace, trace_order="sequential", tokens_per_word=1.0)
    a, b, c = (s.prompt.split(" ") for s in take(w, 0, 3))
    assert (len(a), len(b), len(c)) == (600, 1000, 300)
    assert a[:512] == b[:512]  # same first block id, same first 512 words
    assert a[512:600] != b[512:600]  # different second block
    assert a[:300] != c  # a different block


# --- statistics ---------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def record(
    start: float,
    tokens: list[float],
    end: float | None,
    *,
    prompt: int = 10,
    error: str | None = None,
) -> RequestRecord:
    rec = RequestRecord(start_s=start, max_tokens=len(tokens), est_prompt_tokens=99)
    rec.prompt_tokens = prompt
    for t in tokens:
        rec.add_tokens(t, 1)
    rec.end_s, rec.error = end, error
    return rec


def test_summarize_level_counts_only_the_window() -> None:
    # Window [10, 20). One request straddles its start, one finishes inside, one is
    # cancelled at the end, one fails, one lies entirely in the warm-up.
    records = [
        record(0.0, [1.0, 2.0], 3.0),  # warm-up only
        record(8.0, [9.0, 11.0, 12.0], 12.5),  # first token in warm-up: no TTFT, no prompt
        record(12.5, [13.0, 14.0, 15.0, 16.0], 16.5),  # all inside
        record(16.5, [17.0, 19.0, 21.0], None),  # cancelled at 20: 2 tokens inside
        record(9.5, [], 10.5, error="http_503"),
    ]
    lv = summarize_level(
        records, concurrency=2, level_start_s=0.0, window_start_s=10.0, window_end_s=20.0
    )
    assert lv.duration_s == 10.0 and lv.warmup_s == 10.0
    assert lv.output_tokens == 2 + 4 + 2
    assert lv.output_tokens_per_s == pytest.approx(0.8)
    assert lv.prompt_tokens == 20  # requests 3 and 4
    assert lv.total_tokens_per_s == pytest.approx(2.8)
    assert (lv.requests_started, lv.requests_completed, lv.requests_cancelled) == (5, 2, 1)
    assert lv.requests_per_s == pytest.approx(0.2)
    assert lv.errors == {"http_503": 1} and lv.error_count == 1
    assert lv.ttft_p50_s == pytest.approx(0.5)
    assert lv.e2e_p50_s == pytest.approx((4.5 + 4.0) / 2)
    # busy time inside the window: 2.5 + 4.0 + 3.5 + 0.5 = 10.5 s over 10 s
    assert lv.mean_in_flight == pytest.approx(1.05)


def test_a_p99_the_window_cut_off_is_marked_as_a_lower_bound() -> None:
    """Window [10, 20). Completed requests took 2 s each; requests cancelled at 20 that
    had been in flight 5 s (longer than every completed one) show the tail was longer
    than the window saw, once there are two of them (one may be chance)."""
    done = [record(10.0 + i, [11.0 + i], 12.0 + i) for i in range(8)]  # e2e 2 s

    def level(older: int, younger: int) -> bool:
        cancelled = [record(15.0, [16.0], None) for _ in range(older)]  # 5 s old at 20
        cancelled += [record(19.0, [], None) for _ in range(younger)]  # 1 s old
        lv = summarize_level(
            done + cancelled,
            concurrency=10,
            level_start_s=0.0,
            window_start_s=10.0,
            window_end_s=20.0,
        )
        assert lv.e2e_p99_s == pytest.approx(2.0)
        return lv.e2e_p99_truncated

    assert level(older=2, younger=0)
    assert not level(older=1, younger=0)
    assert not level(older=0, younger=5)  # young requests say nothing of the tail

    # TTFT: the completed requests waited 1 s for their first token; two requests still
    # waiting for theirs at 20, for 3 s, cut its P99 off; two that got theirs do not.
    waiting = [record(17.0, [], None) for _ in range(2)]
    served = [record(17.0, [17.5], None) for _ in range(2)]
    for extra, cut in ((waiting, True), (served, False)):
        lv = summarize_level(
            done + extra, concurrency=10, level_start_s=0.0, window_start_s=10.0, window_end_s=20.0
        )
        assert lv.ttft_p99_s == pytest.approx(1.0)
        assert lv.ttft_p99_truncated is cut
        assert lv.e2e_p99_truncated  # both kinds are 3 s in flight: past the 2 s e2e P99


def test_summarize_level_falls_back_to_estimated_prompt_tokens() -> None:
    rec = RequestRecord(start_s=0.5, max_tokens=1, est_prompt_tokens=42)
    rec.add_tokens(1.0, 1)
    rec.end_s = 1.0
    lv = summarize_level(
        [rec], concurrency=1, level_start_s=0.0, window_start_s=0.0, window_end_s=2.0
    )
    assert lv.prompt_tokens == 42


# --- configuration ------------------------------------------------------------------


def test_arguments_fill_a_validated_config() -> None:
    parser = add_sweep_arguments(argparse.ArgumentParser())
    cfg = config_from_args(
        parser.parse_args(
            [
                "--concurrency",
                "1,4",
                "--prompt-words",
                "10-20",
                "--output-tokens",
                "64",
                "--shared-prefix-words",
                "50",
                "--prefix-groups",
                "4",
                "--no-progress",
                "--max-prompt-tokens",
                "1000",
                "--no-continuous-usage",
                "--error-backoff",
                "0.5",
            ]
        )
    )
    assert cfg.error_backoff_s == 0.5
    assert (
        cfg.concurrency == [1, 4] and cfg.prompt_words == (10, 20) and cfg.output_tokens == (64, 64)
    )
    assert (cfg.shared_prefix_words, cfg.prefix_groups, cfg.max_prompt_tokens) == (50, 4, 1000)
    assert not cfg.progress and not cfg.continuous_usage_stats and cfg.ignore_eos
    default = config_from_args(parser.parse_args([]))
    assert default.concurrency == [1, 2, 4, 8, 16, 32] and default.prompt_words == (8, 40)
    for bad in (["--prompt-words", "40-8"], ["--concurrency", "0,2"], ["--output-tokens", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(SweepError, match="shared prefix"):
        SweepConfig(shared_prefix_words=500, max_prompt_tokens=100).validate()


# --- the load generator against a fake OpenAI server ----------------------------------

TOKEN_INTERVAL_S = 0.01
PROMPT_TOKENS = 5


def fake_openai_app(*, usage_per_chunk: bool = True, fail_every: int = 0) -> web.Application:
    """An OpenAI-style server: streams ``max_tokens`` tokens, one per 10 ms."""
    calls = {"n": 0}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        calls["n"] += 1
        if fail_every and calls["n"] % fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        assert body["stream"] is True and body["ignore_eos"] is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(1, n + 1):
            await asyncio.sleep(TOKEN_INTERVAL_S)
            chunk: dict = {
                "choices": [
                    {"index": 0, "text": " w", "finish_reason": "length" if i == n else None}
                ]
            }
            if usage_per_chunk:
                chunk["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": i}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def sweep_against(app: web.Application, **overrides: object) -> SweepResult:
    async def go() -> SweepResult:
        async with serving(app) as url:
            cfg = SweepConfig(
                url=url,
                concurrency=[1, 4],
                duration_s=1.0,
                warmup_s=0.2,
                cooldown_s=0.0,
                output_tokens=(10, 10),
                progress=False,
            )
            for key, value in overrides.items():
                setattr(cfg, key, value)
            return await run_sweep_async(cfg)

    return asyncio.run(go())


def test_sweep_against_fake_server(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    before = time.time()
    result = sweep_against(fake_openai_app(), out=str(out))
    assert (
        before
        < result.levels[0].window_start_unix_s
        < result.levels[1].window_end_unix_s
        < time.time()
    )
    assert result.model == "fake-model"
    one, four = result.levels
    assert [lv.concurrency for lv in result.levels] == [1, 4]
    for lv in result.levels:
        assert lv.errors == {}
        assert lv.window_end_unix_s - lv.window_start_unix_s == pytest.approx(1.0)
        # each client streams ~1 token per 10 ms (timer slack makes it a little less)
        assert 50 * lv.concurrency < lv.output_tokens_per_s <= 105 * lv.concurrency
        assert lv.mean_in_flight == pytest.approx(lv.concurrency, rel=0.05)
        assert lv.ttft_p50_s is not None and 0.005 < lv.ttft_p50_s < 0.1
        assert lv.e2e_p50_s is not None and 0.09 < lv.e2e_p50_s < 0.3
        # prompts count (as the server reports them) when their first token is in the window
        assert lv.prompt_tokens % PROMPT_TOKENS == 0
        # Prompt tokens count the requests whose first token came inside the window, the
        # completed ones those that ended inside it: at most `concurrency` requests cross
        # each edge of the window, so the two counts differ by at most that.
        prompted = lv.prompt_tokens / PROMPT_TOKENS
        assert prompted <= lv.requests_started
        assert abs(lv.requests_completed - prompted) <= lv.concurrency
    assert four.output_tokens_per_s > 3 * one.output_tokens_per_s
    assert SweepResult.read_json(out) == result
    assert json.loads(out.read_text())["schema_version"] == 1
    table = format_table(result)
    assert "fake-model" in table and len(table.splitlines()) == 5


def test_sweep_counts_chunks_without_usage_and_errors_by_kind() -> None:
    result = sweep_against(fake_openai_app(usage_per_chunk=False, fail_every=3), concurrency=[2])
    (lv,) = result.levels
    assert set(lv.errors) == {"http_503"} and lv.error_count >= 3
    assert lv.requests_completed > 5
    assert 50 < lv.output_tokens_per_s < 210
    assert "errors by kind: http_503=" in format_table(result)
    # the first refusal, when it came and the server's own words
    assert lv.error_examples["http_503"].startswith("at 0.")
    assert "HTTP 503" in lv.error_examples["http_503"]
    assert "first http_503 at 0." in format_table(result)


def test_refused_clients_wait_the_error_backoff() -> None:
    """Every request refused: a client sends one per backoff, about 1 / backoff a second."""
    counts = {}
    for backoff in (0.05, 0.5):
        result = sweep_against(
            fake_openai_app(fail_every=1), concurrency=[2], error_backoff_s=backoff
        )
        (lv,) = result.levels
        assert lv.requests_completed == 0 and set(lv.errors) == {"http_503"}
        counts[backoff] = lv.error_count
    # 2 clients over the 1.2 s level: up to ~48 refusals at 0.05 s, ~5-6 at 0.5 s.
    assert counts[0.5] <= 2 * (1.2 / 0.5 + 1), counts
    assert counts[0.05] >= 4 * counts[0.5], counts
    with pytest.raises(SweepError, match="error_backoff_s"):
        SweepConfig(error_backoff_s=-1).validate()


def queueing_app(slots: int, service_s: list[float]) -> web.Application:
    """An OpenAI-style server that serves ``slots`` requests at a time, first come first
    served, the others waiting (as an engine whose KV cache holds ``slots`` requests);
    each service time (from its slot to its last token) is appended to ``service_s``."""
    inner = {r.resource.canonical: r.handler for r in fake_openai_app().router.routes()}
    gate = asyncio.Semaphore(slots)

    async def completions(request: web.Request) -> web.StreamResponse:
        async with gate:
            began = time.perf_counter()
            resp = await inner["/v1/completions"](request)
            service_s.append(time.perf_counter() - began)
            return resp

    app = web.Application()
    app.router.add_get("/v1/models", inner["/v1/models"])
    app.router.add_post("/v1/completions", completions)
    return app


def test_a_steady_state_level_measures_the_queue_a_fixed_one_cuts_off() -> None:
    """Eight clients on a server that holds two requests at a time: in steady state a
    request waits for three rounds of service before its own, so its e2e is four
    service times (~2 s). The clients start together, so the first wave takes those
    2 s to serve: a fixed level of 0.2 + 1 s completes only the first wave's luckiest
    requests, and its P99 is cut off at about half the truth (and marked so)."""
    service_s: list[float] = []
    load = {"concurrency": [8], "output_tokens": (50, 50)}
    fixed = sweep_against(queueing_app(2, service_s), steady_state=False, **load)
    steady = sweep_against(queueing_app(2, service_s), duration_s=1.2, **load)
    truth_s = 8 / 2 * float(np.median(service_s))
    (cut,) = fixed.levels
    (lv,) = steady.levels
    assert cut.warmup_s + cut.duration_s == pytest.approx(1.2)
    assert cut.e2e_p99_s is not None and cut.e2e_p99_s < 0.65 * truth_s
    assert cut.e2e_p99_truncated
    assert "lower bound" in format_table(fixed) and ">" in format_table(fixed)
    # the warm-up waited for the whole first wave; the window holds one cycle or more
    assert lv.warmup_s >= 0.95 * truth_s and lv.duration_s >= 0.95 * truth_s
    assert lv.e2e_p50_s == pytest.approx(truth_s, rel=0.15)
    assert lv.e2e_p99_s == pytest.approx(truth_s, rel=0.15)
    assert not lv.e2e_p99_truncated
    # Little's law holds in steady state: in flight = throughput x time in the system
    assert lv.requests_per_s * lv.e2e_p50_s == pytest.approx(8, rel=0.2)


@pytest.mark.parametrize(
    "overrides",
    [{"steady_state": False}, {"max_stretch_s": 1.5}],
    ids=["fixed-windows", "steady-state-bounded"],
)
def test_sweep_cancels_in_flight_requests_at_the_window_end(overrides: dict[str, Any]) -> None:
    """10 s requests are not awaited, nor is a steady-state level stretched past its
    bound for them."""
    started = time.perf_counter()
    result = sweep_against(
        fake_openai_app(), concurrency=[3], output_tokens=(1000, 1000), **overrides
    )
    assert time.perf_counter() - started < 8.0
    (lv,) = result.levels
    assert lv.requests_completed == 0 and lv.requests_cancelled == 3
    assert 0 < lv.output_tokens_per_s <= 310  # tokens of unfinished requests count


def test_unreachable_server_is_a_sweep_error() -> None:
    async def go() -> None:
        await run_sweep_async(SweepConfig(url="http://127.0.0.1:9", progress=False))

    with pytest.raises(SweepError, match="cannot list models"):
        asyncio.run(go())


def test_connection_errors_are_counted_not_raised() -> None:
    result = asyncio.run(_sweep_dead_server())
    (lv,) = result.levels
    assert lv.output_tokens == 0 and lv.errors == {"connection": lv.error_count}
    assert 2 <= lv.error_count <= 30  # backoff keeps a dead server from a hot loop
    # what aiohttp said, so a user can tell a refused connection from a dropped stream
    assert "ClientConnectorError" in lv.error_examples["connection"], lv.error_examples


async def _sweep_dead_server() -> SweepResult:
    cfg = SweepConfig(
        url="http://127.0.0.1:9",
        model="m",
        concurrency=[1],
        duration_s=0.5,
        warmup_s=0.0,
        progress=False,
    )
    return await run_sweep_async(cfg)


# --- several replicas and routing policies -------------------------------------------


def test_router_policies() -> None:
    rr = Router(3, "round-robin")
    assert [rr.choose("a b c") for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    affine = Router(2, "prefix-affine", affinity_words=2)
    first = affine.choose("alpha beta one")
    assert all(affine.choose(f"alpha beta {w}") == first for w in ("two", "three", "four"))
    targets = {affine.choose(f"group{g} x tail") for g in range(20)}
    assert targets == {0, 1}  # distinct prefixes spread over both replicas
    least = Router(3, "least-loaded")
    a, b = least.choose("p"), least.choose("p")
    assert a != b
    least.done(a)
    assert least.choose("p") in ({0, 1, 2} - {b})  # never the one still busy
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, "random")
    with pytest.raises(SweepError, match="routing"):
        SweepConfig(routing="hash").validate()


def test_arguments_with_replicas_and_routing() -> None:
    parser = add_sweep_arguments(argparse.ArgumentParser())
    cfg = config_from_args(
        parser.parse_args(
            [
                "--url",
                "http://a:8000",
                "--url",
                "http://b:8000",
                "--routing",
                "prefix-affine",
                "--shared-prefix-words",
                "40",
            ]
        )
    )
    assert cfg.targets == ["http://a:8000", "http://b:8000"] and cfg.routing == "prefix-affine"
    assert cfg.router().affinity_words == 40
    assert config_from_args(parser.parse_args([])).targets == [SweepConfig.url]


def prompt_recording_app(
    seen: list[str], *, token_interval_s: float = TOKEN_INTERVAL_S
) -> web.Application:
    """A fake server that streams 3 tokens and remembers each prompt it was sent."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, 4):
            await asyncio.sleep(token_interval_s)
            chunk = {
                "choices": [{"index": 0, "text": " w", "finish_reason": None}],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": i},
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def _sweep_two_replicas(routing: str) -> tuple[SweepResult, list[list[str]]]:
    seen: list[list[str]] = [[], []]

    async def go() -> SweepResult:
        async with (
            serving(prompt_recording_app(seen[0])) as a,
            serving(prompt_recording_app(seen[1])) as b,
        ):
            cfg = SweepConfig(
                url=a,
                replicas=[b],
                routing=routing,
                concurrency=[4],
                duration_s=0.6,
                warmup_s=0.1,
                cooldown_s=0.0,
                output_tokens=(3, 3),
                shared_prefix_words=6,
                prefix_groups=8,
                progress=False,
            )
            return await run_sweep_async(cfg)

    return asyncio.run(go()), seen


def test_sweep_spreads_requests_over_replicas_by_policy() -> None:
    result, seen = _sweep_two_replicas("round-robin")
    (lv,) = result.levels
    assert lv.requests_per_target is not None
    assert lv.requests_per_target == [len(seen[0]), len(seen[1])]
    assert abs(len(seen[0]) - len(seen[1])) <= 4 and min(map(len, seen)) > 10
    prefixes = [{" ".join(p.split()[:6]) for p in s} for s in seen]
    assert prefixes[0] & prefixes[1]  # round robin sends each prefix group everywhere
    assert "+ 1 more, round-robin routing" in format_table(result)
    assert "requests per server" in format_table(result)

    result, seen = _sweep_two_replicas("prefix-affine")
    prefixes = [{" ".join(p.split()[:6]) for p in s} for s in seen]
    assert not prefixes[0] & prefixes[1]  # each group meets one replica only
    assert all(prefixes) and len(prefixes[0] | prefixes[1]) == 8


def test_max_requests_ends_the_level_once_its_requests_are_answered() -> None:
    """Two runs with one seed and a request count serve the same prompts, one of them on
    a server three times slower, and each ends when its last request is answered."""
    runs = []
    for token_interval_s in (TOKEN_INTERVAL_S, 3 * TOKEN_INTERVAL_S):
        seen: list[str] = []
        app = prompt_recording_app(seen, token_interval_s=token_interval_s)
        started = time.perf_counter()
        result = sweep_against(
            app,
            concurrency=[3],
            warmup_s=0.0,
            duration_s=30.0,
            max_requests=25,
            output_tokens=(3, 3),
        )
        elapsed_s = time.perf_counter() - started
        (lv,) = result.levels
        assert elapsed_s < 10.0, elapsed_s  # not the 30 s window
        assert lv.requests_started == lv.requests_completed == len(seen) == 25
        assert lv.requests_cancelled == 0 and lv.errors == {}
        assert lv.duration_s < elapsed_s
        runs.append((sorted(seen), lv.duration_s))
    (fast, fast_s), (slow, slow_s) = runs
    assert fast == slow
    assert slow_s > 2 * fast_s
    with pytest.raises(SweepError, match="max_requests"):
        SweepConfig(max_requests=0).validate()
