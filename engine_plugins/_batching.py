"""Batch building: drain an engine's buffers into queued, encoded batches.

Per engine and cycle: token-only rows are folded into step rows
(:class:`kvscope.engine_plugins._rows.StepFolder`); step rows of the current, incomplete
wall-clock second are held back (the final flush sends all); the rest becomes one
columnar batch per ``MAX_ROWS_PER_BATCH`` rows (schema envelope, ``seq`` 0, 1, 2,
... per ``(engine_id, boot_id)``), carrying the hello while it is due and the
engine's exporter counters. An idle engine still gets an empty batch for its hello,
every ``HEARTBEAT_S``, and after it dropped something.
"""

from __future__ import annotations

import math
import time
from typing import Any

from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._exp_state import Batch, ExporterState, encode_batch
from kvscope.engine_plugins.schema import SCHEMA_VERSION

#: Most rows of one kind in one batch (the schema allows more; smaller is kinder).
MAX_ROWS_PER_BATCH = 50_000
#: An idle engine still sends an (empty) batch this often, as a sign of life.
HEARTBEAT_S = 15.0
#: Counters whose change makes an idle engine send a batch without waiting a heartbeat.
LOSS_COUNTERS = ("dropped_steps", "dropped_requests", "dropped_batches",
                 "spool_corrupt_records")  # fmt: skip


def is_ready(row: tuple[Any, ...], cutoff_unix_s: float) -> bool:
    """Whether a step row may go now: not of the current second (nor the next one,
    allowing for clock steps); a row stamped further ahead is not held back."""
    ts = row[0]
    return not (isinstance(ts, (int, float)) and cutoff_unix_s <= ts < cutoff_unix_s + 2.0)


class BatchBuilding(ExporterState):
    """Builds the batches of each engine into the pending queue."""

    def _drain(
        self, eng: EngineBuffer, now_unix_s: float, final: bool
    ) -> tuple[list[Any], list[Any]]:
        steps, n = eng.steps, len(eng.steps)
        eng.steps_taken += n
        folder, held = eng.folder, eng.held_steps
        for _ in range(n):
            row = folder.feed(steps.popleft())
            if row is not None:
                held.append(row)
        carry = folder.take_carry(now_unix_s, final=final)
        if carry is not None:
            held.append(carry)
        requests, n = eng.requests, len(eng.requests)
        eng.requests_taken += n
        req_rows = [requests.popleft() for _ in range(n)]
        if final:
            ready, eng.held_steps = held, []
            return ready, req_rows
        cutoff = math.floor(now_unix_s)
        ready = [r for r in held if is_ready(r, cutoff)]
        eng.held_steps = (
            [] if len(ready) == len(held) else [r for r in held if not is_ready(r, cutoff)]
        )
        return ready, req_rows

    def _build(self, eng: EngineBuffer, now_unix_s: float, final: bool) -> None:
        steps, reqs = self._drain(eng, now_unix_s, final)
        now_mono = time.monotonic()
        counters = eng.counters()
        # An idle engine sends an empty batch for its hello, as a heartbeat, and when it
        # dropped something since the last batch was built (e.g. to make room for it).
        last = eng.last_counters
        idle_due = (eng.hello_due or now_mono - eng.last_built_mono_s >= HEARTBEAT_S
                    or any(counters[k] != last.get(k, 0) for k in LOSS_COUNTERS))  # fmt: skip
        if not (steps or reqs or (idle_due and eng.pending_batches == 0)):
            return
        eng.last_built_mono_s = now_mono
        hello = eng.hello
        blocks = hello.get("num_gpu_blocks") if hello else None
        num_gpu_blocks = blocks if isinstance(blocks, int) else None
        for start in range(0, max(len(steps), len(reqs), 1), MAX_ROWS_PER_BATCH):
            step_chunk = steps[start : start + MAX_ROWS_PER_BATCH]
            req_chunk = reqs[start : start + MAX_ROWS_PER_BATCH]
            hello_version = eng.hello_version if eng.hello_due else 0
            payload = {
                "schema_version": SCHEMA_VERSION,
                "engine_id": eng.engine_id,
                "boot_id": eng.boot_id,
                "seq": eng.next_seq,
                "sent_unix_s": now_unix_s,
                "hello": eng.hello if hello_version else None,
                "steps": self._columns.steps(step_chunk, num_gpu_blocks),
                "requests": self._columns.requests(req_chunk),
                "exporter": counters,
            }
            eng.last_counters = counters
            batch = Batch(eng, eng.next_seq, encode_batch(payload), len(step_chunk),
                           len(req_chunk), hello_version)  # fmt: skip
            eng.next_seq += 1
            eng.batches_built += 1
            eng.pending_batches += 1
            eng.pending_steps += batch.n_steps
            eng.pending_requests += batch.n_requests
            self._pending.append(batch)
            self._pending_bytes += len(batch.body)
            while self._spool is None and self._over_cap():
                self._drop(self._pending.popleft(), "full")
