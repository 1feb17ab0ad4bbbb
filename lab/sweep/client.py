"""One streaming ``/v1/completions`` request, recorded as it arrives.

The request asks for ``stream: true`` with ``stream_options.include_usage``, and by
default vLLM's ``continuous_usage_stats`` so that every chunk carries the exact
cumulative ``usage.completion_tokens``. Without per-chunk usage, each chunk with a
choice counts as one token (vLLM streams one chunk per token, even when the
token's text is empty), and a final usage chunk corrects the total.

Failures never raise: they set :attr:`RequestRecord.error` to a kind. Cancellation
(the end of a level) propagates, and the closed connection makes the server abort
the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from kvscope.lab.sweep.stats import RequestRecord


def completion_body(
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool,
    continuous_usage_stats: bool,
    temperature: float,
) -> dict[str, Any]:
    """The JSON body of a streaming completion request."""
    stream_options: dict[str, bool] = {"include_usage": True}
    if continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": stream_options,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    timeout_s: float,
) -> None:
    """POST ``body`` to ``url`` and fill ``record`` from the event stream."""
    try:
        record.error = await _read_stream(session, url, body, record, timeout_s)
    except asyncio.TimeoutError:
        record.error = "timeout"
        record.error_detail = f"no answer within {timeout_s:g} s"
    except aiohttp.ClientResponseError as exc:
        record.error = f"http_{exc.status}"
        record.error_detail = _describe(exc)
    except aiohttp.ClientError as exc:
        record.error = "connection"
        record.error_detail = _describe(exc)
    except (ValueError, TypeError, AttributeError) as exc:
        record.error = "protocol"
        record.error_detail = _describe(exc)
    record.end_s = time.perf_counter()  # not reached when cancelled


def _describe(exc: BaseException, max_chars: int = 200) -> str:
    """``ExceptionType: message``, short enough for a summary line."""
    text = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    cause = exc.__cause__
    if cause is not None:  # aiohttp wraps the OS error: say which one it was
        text += f" ({type(cause).__name__}: {cause})".replace(": )", ")")
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


async def _read_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    timeout_s: float,
) -> str | None:
    """Stream one completion into ``record``; returns an error kind or ``None``."""
    counted_chunks = 0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url, json=body, timeout=timeout) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode("utf-8", errors="replace").strip()
            record.error_detail = f"HTTP {resp.status}: {text[:160]}" if text else None
            return f"http_{resp.status}"
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                record.error_detail = str(chunk["error"])[:200]
                return "server_error"
            now = time.perf_counter()
            choices = chunk.get("choices") or []
            for choice in choices:
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                if usage.get("prompt_tokens") is not None:
                    record.prompt_tokens = int(usage["prompt_tokens"])
                record.add_tokens(now, int(usage["completion_tokens"]) - record.output_tokens)
            elif choices:
                counted_chunks += 1
                record.add_tokens(now, counted_chunks - record.output_tokens)
    record.error_detail = f"the stream ended without [DONE] after {record.output_tokens} tokens"
    return "incomplete"
