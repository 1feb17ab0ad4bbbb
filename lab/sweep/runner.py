"""The closed-loop load generator: run each concurrency level, summarise, repeat.

For a level of concurrency ``c``, ``c`` client tasks start together; each sends a
streaming completion, waits for it to finish, and sends the next, so ``c`` requests
are in flight at all times (closed loop). A level lasts ``warmup_s + duration_s``:
the warm-up absorbs the synchronised start, the following ``duration_s`` are the
measurement window. At the window's end the clients stop and the requests still in
flight are **cancelled** (their connections closed, so the server aborts them),
rather than awaited: the next level then starts on an idle server, and a level
takes a fixed time however long its tail latency. Their tokens streamed inside
the window are counted, so throughput is not biased (:mod:`kvscope.lab.sweep.stats`).
A pause of ``cooldown_s`` lets the server drop the aborted requests before the
next level.

A client whose request failed waits ``error_backoff_s`` (0.1 s by default) before its
next one, so a dead server does not turn into a hot loop of errors.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator

import aiohttp

from kvscope.lab.sweep.client import completion_body, stream_completion
from kvscope.lab.sweep.config import SweepConfig
from kvscope.lab.sweep.errors import SweepError
from kvscope.lab.sweep.result import SweepResult
from kvscope.lab.sweep.stats import LevelResult, RequestRecord, summarize_level
from kvscope.lab.sweep.workload import RequestSpec

PROGRESS_INTERVAL_S = 0.25


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def run_sweep(config: SweepConfig) -> SweepResult:
    """Run the sweep ``config`` describes (blocking); writes ``config.out`` if set."""
    return asyncio.run(run_sweep_async(config))


async def run_sweep_async(config: SweepConfig) -> SweepResult:
    """:func:`run_sweep` for callers already inside an event loop."""
    config.validate()
    workload = config.workload()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    started_unix_s = time.time()
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        model = config.model or await first_model(session, api_base(config.url))
        levels = []
        for index, concurrency in enumerate(config.concurrency):
            if index:
                await asyncio.sleep(config.cooldown_s)
            requests = workload.requests(index)
            levels.append(await _run_level(session, config, model, concurrency, requests))
    result = SweepResult(
        url=config.url,
        model=model,
        started_unix_s=started_unix_s,
        finished_unix_s=time.time(),
        config=config.to_dict(),
        levels=levels,
    )
    if config.out:
        result.write_json(config.out)
    return result


async def first_model(session: aiohttp.ClientSession, base: str) -> str:
    """The first model id ``GET {base}/models`` lists; :class:`SweepError` if none."""
    try:
        async with session.get(f"{base}/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return str(data["data"][0]["id"])
    except (
        aiohttp.ClientError,
        asyncio.TimeoutError,
        KeyError,
        IndexError,
        TypeError,
        ValueError,
    ) as exc:
        raise SweepError(f"cannot list models at {base}/models: {exc!r}") from exc


async def _run_level(
    session: aiohttp.ClientSession,
    config: SweepConfig,
    model: str,
    concurrency: int,
    requests: Iterator[RequestSpec],
) -> LevelResult:
    records: list[RequestRecord] = []
    urls = [f"{api_base(u)}/completions" for u in config.targets]
    router = config.router()
    level_start_s = time.perf_counter()
    unix_offset_s = time.time() - level_start_s
    window_start_s = level_start_s + config.warmup_s
    window_end_s = window_start_s + config.duration_s

    limit = config.max_requests

    async def client() -> None:
        while time.perf_counter() < window_end_s and (limit is None or len(records) < limit):
            spec = next(requests)
            body = completion_body(
                model=model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                ignore_eos=config.ignore_eos,
                continuous_usage_stats=config.continuous_usage_stats,
                temperature=config.temperature,
            )
            record = RequestRecord(time.perf_counter(), spec.max_tokens, spec.est_prompt_tokens)
            records.append(record)
            target = router.choose(spec.prompt)
            try:
                await stream_completion(
                    session, urls[target], body, record, timeout_s=config.request_timeout_s
                )
            finally:
                router.done(target)
            if record.error is not None:
                await asyncio.sleep(config.error_backoff_s)

    tasks = [asyncio.create_task(client(), name=f"sweep-client-{i}") for i in range(concurrency)]
    try:
        await _wait_with_progress(
            config, concurrency, records, level_start_s, window_start_s, window_end_s, tasks
        )
        # every request of a --max-requests level answered before the window's end
        window_end_s = max(min(window_end_s, time.perf_counter()), window_start_s + 1e-3)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return summarize_level(
        records,
        concurrency=concurrency,
        level_start_s=level_start_s,
        window_start_s=window_start_s,
        window_end_s=window_end_s,
        unix_offset_s=unix_offset_s,
        requests_per_target=list(router.sent) if len(urls) > 1 else None,
    )


async def _wait_with_progress(
    config: SweepConfig,
    concurrency: int,
    records: list[RequestRecord],
    level_start_s: float,
    window_start_s: float,
    window_end_s: float,
    tasks: list[asyncio.Task[None]],
) -> None:
    """Sleep until ``window_end_s`` or until every client has stopped (all of a
    ``max_requests`` level answered), updating a time-based tqdm bar if enabled."""
    if not config.progress:
        await asyncio.wait(tasks, timeout=max(0.0, window_end_s - time.perf_counter()))
        return
    from tqdm import tqdm

    total_s = window_end_s - level_start_s
    with tqdm(
        total=round(total_s, 1),
        desc=f"concurrency {concurrency:>4}",
        unit="s",
        file=sys.stderr,
        bar_format="{desc} |{bar}| {n:.0f}/{total:.0f} s {postfix}",
        leave=True,
        disable=None,  # only on a terminal: piped, the bar's redraws would garble the log
    ) as bar:
        while (now := time.perf_counter()) < window_end_s and not all(t.done() for t in tasks):
            await asyncio.sleep(min(PROGRESS_INTERVAL_S, window_end_s - now))
            now = time.perf_counter()
            bar.n = round(min(now, window_end_s) - level_start_s, 1)
            bar.set_postfix_str(_live_status(records, window_start_s, now), refresh=True)


def _live_status(records: list[RequestRecord], window_start_s: float, now_s: float) -> str:
    """A short status for the progress bar: warm-up, or tokens/s so far in the window."""
    errors = sum(1 for r in records if r.error is not None)
    if now_s < window_start_s:
        return f"warm-up, errors {errors}"
    tokens = sum(n for r in records for t, n in r.token_events if t >= window_start_s)
    elapsed_s = max(now_s - window_start_s, 1e-9)
    return f"{tokens / elapsed_s:.0f} out tok/s, errors {errors}"
