"""Two generated weeks of fleet telemetry, built from the bundled real vLLM recordings.

Each recording is a real vLLM run (CPU build) swept from 1 to 32 clients. A *run*
here is one recording (or its first part: the low-load levels) re-timed to end at a
chosen moment, given a fresh boot id and the identity of one of three engines, and
sent to a collector as one ingest batch (the plugin's batches of that run, merged).
Engines, pools and what happens to them (the true answers the tests check):

* pool ``chat``, ``chat-a:8000:0``: week 1 the ``seq_capped`` run (``max_num_seqs``
  6: ``max_num_seqs_bound``); from the first day of week 2 the ``ample_kv`` run
  (``max_num_seqs`` 256): a configuration change in the hello, the plateau rises.
* pool ``chat``, ``chat-b:8000:0``: the ``overload_kv_starved`` engine; week 1 light
  traffic only (the first half of the run, load up to ~4: below the knee), week 2
  the full run on weekdays: a new problem (``kv_cache_bound``, load past the knee).
* pool ``batch``, ``batch-a:8000:0``: the ``seq_capped`` run both weeks (stable).

Weekdays (days 0-4 of each week) carry the full run, weekends the first 35%.
Week 2 is the 7 days before ``now``, week 1 the 7 days before that; each run ends a
few hours into its day, so no run straddles a week boundary.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.lab.recording import Recording, load_recording, post_batch, rebased

RECORDINGS = Path(__file__).resolve().parents[2] / "lab" / "recordings"
DAY_S = 86400.0
WEEK_S = 7 * DAY_S

CHAT_A, CHAT_B, BATCH_A = "chat-a:8000:0", "chat-b:8000:0", "batch-a:8000:0"
POOLS = {CHAT_A: "chat", CHAT_B: "chat", BATCH_A: "batch"}
LIGHT, WEEKEND = 0.5, 0.35


@dataclass
class Run:
    engine_id: str
    recording: str
    fraction: float
    end_unix_s: float


@dataclass
class Week:
    """What was laid out (the runs) and when: the test's known answers."""

    now_unix_s: float
    runs: list[Run] = field(default_factory=list)
    config_change_unix_s: float = 0.0
    """Start of chat-a's first ample_kv run (max_num_seqs 6 -> 256)."""


def plan(now_unix_s: float) -> Week:
    week = Week(now_unix_s=now_unix_s)
    start = now_unix_s - 2 * WEEK_S
    for day in range(14):
        second_week, weekday = day >= 7, day % 7 < 5
        full = 1.0 if weekday else WEEKEND
        day0 = start + day * DAY_S
        week.runs.append(
            Run(CHAT_A, "ample_kv" if second_week else "seq_capped", full, day0 + 3 * 3600)
        )
        week.runs.append(
            Run(CHAT_B, "overload_kv_starved", full if second_week else LIGHT, day0 + 5 * 3600)
        )
        week.runs.append(Run(BATCH_A, "seq_capped", full, day0 + 9 * 3600))
    first = min(
        r.end_unix_s for r in week.runs if r.engine_id == CHAT_A and r.recording == "ample_kv"
    )
    week.config_change_unix_s = first - 90.0
    return week


def _cut(rec: Recording, fraction: float) -> list[dict[str, Any]]:
    """The batches of the first ``fraction`` of the run (by step time)."""
    t0, t1 = rec.span_unix_s
    limit = t0 + fraction * (t1 - t0)
    out = []
    for b in rec.batches:
        ts = b.get("steps", {}).get("ts_unix_s") or []
        if ts and min(ts) > limit:
            break
        out.append(b)
    return out


def merged_run(rec: Recording, run: Run) -> dict[str, Any]:
    """One ingest batch holding the (cut) run, re-timed and renamed to ``run.engine_id``."""
    batches = _cut(rec, run.fraction)
    last = max(t for b in batches for t in b.get("steps", {}).get("ts_unix_s", []))
    # A whole number of seconds keeps the steps in the 1-second windows they fell in
    # when recorded: every run of a recording aggregates alike, the answers are stable.
    moved = list(rebased(batches, shift_s=float(round(run.end_unix_s - last)), boot_ids={}))
    out = copy.deepcopy(moved[0])
    hello = next(b["hello"] for b in moved if b.get("hello"))
    for b in moved[1:]:
        for part in ("steps", "requests"):
            for k, v in (b.get(part) or {}).items():
                out.setdefault(part, {}).setdefault(k, []).extend(v)
        if b.get("exporter"):
            out["exporter"] = b["exporter"]
        out["sent_unix_s"] = b["sent_unix_s"]
    host, port, index = run.engine_id.split(":")
    out["engine_id"] = run.engine_id
    out["seq"] = 0
    out["hello"] = {
        **hello,
        "engine_id": run.engine_id,
        "host": host,
        "port": int(port),
        "engine_index": int(index),
        "pool": POOLS[run.engine_id],
        "boot_id": out["boot_id"],
    }
    return out


def generate(url: str, now_unix_s: float) -> Week:
    """Send the two weeks to the collector at ``url``; return what was sent."""
    week = plan(now_unix_s)
    recs = {
        n: load_recording(RECORDINGS / f"{n}.jsonl.gz") for n in {r.recording for r in week.runs}
    }
    for run in week.runs:
        batch = merged_run(recs[run.recording], run)
        answer = post_batch(url, batch, timeout_s=120.0)
        assert answer.get("status") == "stored", answer
    return week
