"""The batch builder: drains the engine buffers into encoded batches.

Per engine and cycle, :meth:`BatchBuilder.build` drains the deques; token-only rows
are folded into step rows (:class:`kvscope.engine_plugins._rows.StepFolder`); step
rows of the current, incomplete wall-clock second are held back (the final flush
sends all); the rest becomes one columnar batch per ``MAX_ROWS_PER_BATCH`` rows
(schema envelope, ``seq`` 0, 1, 2, ... per ``(engine_id, boot_id)``, the engine's
exporter counters), JSON, gzip. An idle engine still gets an empty batch for its
hello, every ``HEARTBEAT_S``, and after it dropped something, so that the counters
of the drops arrive.

The hello: whether a batch carries it is decided here, once, when the batch is
built: it does while the collector has not acknowledged the engine's current hello.
The builder keeps, per engine, the hello version the collector acknowledged; the
exporter tells it of acknowledgements and of everything that makes the hello due
again (a failed delivery, a reply asking for it). A batch already built is never
re-encoded: when the collector refuses one for want of the hello,
:meth:`BatchBuilder.hello_batch` builds an empty batch carrying it, to be sent first.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections.abc import Iterable
from typing import Any

from kvscope.engine_plugins._accounting import Accounting
from kvscope.engine_plugins._batch import Batch
from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._rows import ColumnBuilder, StepFolder
from kvscope.engine_plugins.schema import SCHEMA_VERSION

#: Most rows of one kind in one batch (the schema allows more; smaller is kinder).
MAX_ROWS_PER_BATCH = 50_000
#: An idle engine still sends an (empty) batch this often, as a sign of life.
HEARTBEAT_S = 15.0
#: Counters whose change makes an idle engine send a batch without waiting a heartbeat.
LOSS_COUNTERS = ("dropped_steps", "dropped_requests", "dropped_batches", "spool_corrupt_records")
_GZIP_LEVEL = 5


def encode_batch(payload: dict[str, Any]) -> bytes:
    """A batch payload as gzipped compact JSON (deterministic: no gzip timestamp)."""
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return gzip.compress(data, compresslevel=_GZIP_LEVEL, mtime=0)


def is_ready(row: tuple[Any, ...], cutoff_unix_s: float) -> bool:
    """Whether a step row may go now: not of the current second (nor the next one,
    allowing for clock steps); a row stamped further ahead is not held back."""
    ts = row[0]
    return not (isinstance(ts, (int, float)) and cutoff_unix_s <= ts < cutoff_unix_s + 2.0)


class _Stream:
    """The builder's state for one engine: rows between buffer and batch, seq, hello."""

    def __init__(self) -> None:
        self.folder = StepFolder()
        self.held: list[tuple[Any, ...]] = []
        """Step rows drained but held back (the current second)."""
        self.next_seq = 0
        self.last_counters: dict[str, int] = {}
        """The counters carried by the latest batch built."""
        self.last_built_mono_s = -math.inf
        self.hello_acked_version = 0
        """The hello version the collector acknowledged, 0 for none (or no longer)."""


class BatchBuilder:
    """Turns drained rows into encoded batches and decides which carry the hello."""

    def __init__(self, accounting: Accounting) -> None:
        self._accounting = accounting
        self._columns = ColumnBuilder()
        self._streams: dict[str, _Stream] = {}

    # -- building ------------------------------------------------------------------------

    def build(self, engines: Iterable[EngineBuffer], now_unix_s: float, final: bool) -> list[Batch]:
        """Drain ``engines`` and return their new batches, in order (reported as built)."""
        batches: list[Batch] = []
        for eng in engines:
            batches.extend(self._build_engine(eng, now_unix_s, final))
        self._accounting.values_replaced(self._columns.invalid_values)
        return batches

    def hello_batch(self, eng: EngineBuffer, now_unix_s: float) -> Batch:
        """An empty batch of ``eng`` carrying its current hello (reported as built)."""
        hello_version = eng.hello_version if eng.hello is not None else 0
        return self._batch(
            eng,
            self._stream(eng.engine_id),
            [],
            [],
            now_unix_s,
            self._accounting.counters(eng.engine_id),
            hello_version,
        )

    def _build_engine(self, eng: EngineBuffer, now_unix_s: float, final: bool) -> list[Batch]:
        stream = self._stream(eng.engine_id)
        steps, reqs = self._drain(eng, stream, now_unix_s, final)
        now_mono = time.monotonic()
        counters = self._accounting.counters(eng.engine_id)
        # An idle engine sends an empty batch for its hello, as a heartbeat, and when it
        # dropped something since the last batch was built (e.g. to make room for it).
        last = stream.last_counters
        idle_due = (
            self.hello_due(eng)
            or now_mono - stream.last_built_mono_s >= HEARTBEAT_S
            or any(counters[k] != last.get(k, 0) for k in LOSS_COUNTERS)
        )
        waiting = self._accounting.pending_batches(eng.engine_id)
        if not (steps or reqs or (idle_due and waiting == 0)):
            return []
        stream.last_built_mono_s = now_mono
        batches = []
        for start in range(0, max(len(steps), len(reqs), 1), MAX_ROWS_PER_BATCH):
            hello_version = eng.hello_version if self.hello_due(eng) else 0
            batches.append(
                self._batch(
                    eng,
                    stream,
                    steps[start : start + MAX_ROWS_PER_BATCH],
                    reqs[start : start + MAX_ROWS_PER_BATCH],
                    now_unix_s,
                    counters,
                    hello_version,
                )
            )
        return batches

    def _drain(
        self, eng: EngineBuffer, stream: _Stream, now_unix_s: float, final: bool
    ) -> tuple[list[Any], list[Any]]:
        """Take the buffer's rows; return the step rows ready to go and the request rows."""
        steps, n = eng.steps, len(eng.steps)
        eng.steps_taken += n
        folder, held = stream.folder, stream.held
        for _ in range(n):
            held.extend(folder.feed(steps.popleft()))
        carry = folder.take_carry(now_unix_s, final=final)
        if carry is not None:
            held.append(carry)
        requests, n = eng.requests, len(eng.requests)
        eng.requests_taken += n
        req_rows = [requests.popleft() for _ in range(n)]
        if final:
            ready, stream.held = held, []
        else:
            cutoff = math.floor(now_unix_s)
            ready = [r for r in held if is_ready(r, cutoff)]
            stream.held = (
                [] if len(ready) == len(held) else [r for r in held if not is_ready(r, cutoff)]
            )
        self._accounting.rows_held(
            eng.engine_id, len(stream.held) + folder.carry_rows, folder.merged_rows
        )
        return ready, req_rows

    def _batch(
        self,
        eng: EngineBuffer,
        stream: _Stream,
        steps: list[Any],
        reqs: list[Any],
        now_unix_s: float,
        counters: dict[str, int],
        hello_version: int,
    ) -> Batch:
        """Encode one batch with the next seq."""
        hello = eng.hello
        blocks = hello.get("num_gpu_blocks") if hello else None
        payload = {
            "schema_version": SCHEMA_VERSION,
            "engine_id": eng.engine_id,
            "boot_id": eng.boot_id,
            "seq": stream.next_seq,
            "sent_unix_s": now_unix_s,
            "hello": hello if hello_version else None,
            "steps": self._columns.steps(steps, blocks if isinstance(blocks, int) else None),
            "requests": self._columns.requests(reqs),
            "exporter": counters,
        }
        stream.last_counters = counters
        batch = Batch(
            eng.engine_id,
            eng.boot_id,
            stream.next_seq,
            encode_batch(payload),
            len(steps),
            len(reqs),
            hello_version,
        )
        stream.next_seq += 1
        self._accounting.built(batch)
        return batch

    # -- the hello -----------------------------------------------------------------------

    def hello_due(self, eng: EngineBuffer) -> bool:
        """Whether the collector has not acknowledged the engine's current hello."""
        acked = self._stream(eng.engine_id).hello_acked_version
        return eng.hello is not None and acked != eng.hello_version

    @staticmethod
    def lacks_hello(batch: Batch, eng: EngineBuffer) -> bool:
        """Whether ``batch`` does not carry the engine's current hello (and there is one)."""
        return eng.hello is not None and batch.hello_version != eng.hello_version

    def acknowledged(self, batch: Batch, *, need_hello: bool) -> None:
        """The collector acknowledged ``batch`` (and asked for the hello if ``need_hello``)."""
        stream = self._stream(batch.engine_id)
        if batch.hello_version:
            stream.hello_acked_version = batch.hello_version
        if need_hello:
            stream.hello_acked_version = 0

    def resend_hello(self, engine_id: str | None = None) -> None:
        """Make the hello of ``engine_id`` (default: every engine's) due again."""
        if engine_id is None:
            for stream in self._streams.values():
                stream.hello_acked_version = 0
        elif engine_id in self._streams:
            self._streams[engine_id].hello_acked_version = 0

    def _stream(self, engine_id: str) -> _Stream:
        stream = self._streams.get(engine_id)
        if stream is None:
            stream = self._streams[engine_id] = _Stream()
        return stream
