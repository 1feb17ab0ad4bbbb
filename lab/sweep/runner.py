"""The closed-loop load generator: run each concurrency level, summarise, repeat.

For a level of concurrency ``c``, ``c`` client tasks start together; each sends a
streaming completion, waits for it to finish and sends the next, so ``c`` requests are
in flight at all times. A level is a warm-up, which absorbs the synchronised start,
then a measurement window.

By default (``steady_state``) a level is stretched into its steady state: the warm-up
lasts at least ``warmup_s`` and until every client's first request has returned, the
window at least ``duration_s`` and one cycle of the loop as the warm-up measured it
(each at most ``max_stretch_s``), since a server holding few requests at a time serves
the first wave over a whole cycle. With ``steady_state`` off, or ``max_requests``, a
level lasts exactly ``warmup_s + duration_s``.

At the window's end the requests in flight are **cancelled** (the server aborts them),
not awaited, so the next level starts on an idle server and a level takes a bounded
time; :mod:`kvscope.lab.sweep.stats` counts their tokens inside the window and marks a
percentile they would have raised. ``cooldown_s`` lets the server drop them. A client
whose request failed waits ``error_backoff_s`` before its next one.

Why, and the stretch measured against long levels: docs/sweep.md#steady-state-levels
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvscope.lab.sweep.client import completion_body, stream_completion
from kvscope.lab.sweep.config import SweepConfig
from kvscope.lab.sweep.errors import SweepError
from kvscope.lab.sweep.result import SweepResult
from kvscope.lab.sweep.stats import LevelResult, RequestRecord, steady_window_s, summarize_level
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


@dataclass
class _Level:
    """A level's clock, read by its clients and moved by :func:`_pace_level`."""

    concurrency: int
    start_s: float
    window_start_s: float
    window_end_s: float
    """``inf`` while a steady-state warm-up still waits for the first requests."""
    first_back: int = 0
    """Clients whose first request has returned (answered or failed)."""


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
    start_s = time.perf_counter()
    unix_offset_s = time.time() - start_s
    window_start_s = start_s + config.warmup_s
    stretch = config.steady_state and config.max_requests is None
    level = _Level(
        concurrency,
        start_s,
        window_start_s,
        math.inf if stretch else window_start_s + config.duration_s,
    )
    limit = config.max_requests

    async def client() -> None:
        first = True
        while time.perf_counter() < level.window_end_s and (limit is None or len(records) < limit):
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
            if first:
                first = False
                level.first_back += 1
            if record.error is not None:
                await asyncio.sleep(config.error_backoff_s)

    tasks = [asyncio.create_task(client(), name=f"sweep-client-{i}") for i in range(concurrency)]
    try:
        await _pace_level(config, level, records, tasks, stretch=stretch)
        # every request of a --max-requests level answered before the window's end
        level.window_end_s = max(
            min(level.window_end_s, time.perf_counter()), level.window_start_s + 1e-3
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return summarize_level(
        records,
        concurrency=concurrency,
        level_start_s=start_s,
        window_start_s=level.window_start_s,
        window_end_s=level.window_end_s,
        unix_offset_s=unix_offset_s,
        requests_per_target=list(router.sent) if len(urls) > 1 else None,
    )


async def _pace_level(
    config: SweepConfig,
    level: _Level,
    records: list[RequestRecord],
    tasks: list[asyncio.Task[None]],
    *,
    stretch: bool,
) -> None:
    """Wait out the level's warm-up and window, or until every client has stopped (all
    of a ``max_requests`` level answered). A steady-state warm-up ends once every
    client's first request is back (and ``warmup_s`` has passed), at the latest after
    ``max_stretch_s``; the window is then sized by :func:`steady_window_s`. Updates a
    time-based tqdm bar if enabled."""
    if not stretch and not config.progress:
        await asyncio.wait(tasks, timeout=max(0.0, level.window_end_s - time.perf_counter()))
        return
    warmup_limit_s = level.start_s + max(config.warmup_s, config.max_stretch_s)
    bar = _progress_bar(config, level.concurrency)
    total_s = config.warmup_s + config.duration_s
    try:
        while not all(t.done() for t in tasks):
            now = time.perf_counter()
            warm = level.first_back >= level.concurrency or now >= warmup_limit_s
            if level.window_end_s == math.inf and now >= level.window_start_s and warm:
                back = sum(1 for r in records if r.end_s is not None)
                level.window_start_s = now
                level.window_end_s = now + steady_window_s(
                    level.concurrency,
                    now - level.start_s,
                    back,
                    config.duration_s,
                    config.max_stretch_s,
                )
            if now >= level.window_end_s:
                break
            if bar is not None:
                if level.window_end_s < math.inf:
                    total_s = level.window_end_s - level.start_s
                else:
                    total_s = max(total_s, now - level.start_s + config.duration_s)
                bar.total = round(total_s, 1)
                bar.n = round(now - level.start_s, 1)
                bar.set_postfix_str(_live_status(records, level, now), refresh=True)
            await asyncio.wait(
                tasks, timeout=min(PROGRESS_INTERVAL_S, max(0.0, level.window_end_s - now))
            )
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(config: SweepConfig, concurrency: int) -> Any:
    """A time-based tqdm bar for one level, or ``None`` without ``config.progress``."""
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=round(config.warmup_s + config.duration_s, 1),
        desc=f"concurrency {concurrency:>4}",
        unit="s",
        file=sys.stderr,
        bar_format="{desc} |{bar}| {n:.0f}/{total:.0f} s {postfix}",
        leave=True,
        disable=None,  # only on a terminal: piped, the bar's redraws would garble the log
    )


def _live_status(records: list[RequestRecord], level: _Level, now_s: float) -> str:
    """A short status for the progress bar: warm-up, or tokens/s so far in the window."""
    errors = sum(1 for r in records if r.error is not None)
    if level.window_end_s == math.inf:
        back = min(level.first_back, level.concurrency)
        return f"warm-up, {back}/{level.concurrency} first requests back, errors {errors}"
    if now_s < level.window_start_s:
        return f"warm-up, errors {errors}"
    tokens = sum(n for r in records for t, n in r.token_events if t >= level.window_start_s)
    elapsed_s = max(now_s - level.window_start_s, 1e-9)
    return f"{tokens / elapsed_s:.0f} out tok/s, errors {errors}"
