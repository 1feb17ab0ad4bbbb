"""A small fleet for the live Prometheus test: real vLLM recordings sent to a collector
at their recorded pace, and vLLM's own KV-event publisher beside each engine.

A :class:`Stream` is one recording's batches, moved in time and optionally renamed
(another engine id and port), its hello advertising a KV-event endpoint. Batches
whose (moved) send time has passed are sent at once; the rest when their time comes,
so a collector scraped by Prometheus shows the run as it happened.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.collector.process import free_port
from kvscope.lab.recording import load_recording, post_batch, rebased


@dataclass
class Stream:
    """One engine's recorded batches, moved by ``shift_s``."""

    engine_id: str
    batches: list[dict[str, Any]]
    sent: int = 0

    @classmethod
    def from_recording(
        cls,
        path: Path,
        *,
        shift_s: float,
        engine_id: str | None = None,
        port: int | None = None,
        kv_events_endpoint: str | None = None,
    ) -> Stream:
        rec = load_recording(path)
        out = []
        for b in rebased(rec.batches, shift_s=shift_s, boot_ids={}):
            b = copy.deepcopy(b)
            if engine_id is not None:
                b["engine_id"] = engine_id
            if b.get("hello"):
                h = b["hello"]
                if engine_id is not None:
                    h["engine_id"] = engine_id
                if port is not None:
                    h["port"] = port
                if kv_events_endpoint is not None:
                    h["kv_events_endpoint"] = kv_events_endpoint
            out.append(b)
        out.sort(key=lambda b: b["sent_unix_s"])
        return cls(out[0]["engine_id"], out)

    @property
    def end_unix_s(self) -> float:
        return float(self.batches[-1]["sent_unix_s"])

    def send_due(self, url: str, now: float) -> int:
        """Send every batch whose time has come; return how many."""
        n = 0
        while self.sent < len(self.batches) and self.batches[self.sent]["sent_unix_s"] <= now:
            post_batch(url, self.batches[self.sent])
            self.sent += 1
            n += 1
        return n

    @property
    def done(self) -> bool:
        return self.sent >= len(self.batches)


def first_step_unix_s(path: Path) -> float:
    rec = load_recording(path)
    return rec.span_unix_s[0]


def last_sent_unix_s(path: Path) -> float:
    rec = load_recording(path)
    return max(float(b["sent_unix_s"]) for b in rec.batches)


class KvPublisher:
    """vLLM's own ZMQ KV-event publisher on a free loopback port, as an engine started
    with ``--kv-events-config`` runs it."""

    BLOCK_SIZE = 32

    def __init__(self, hash_base: int) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.port = free_port()
        self.endpoint = f"tcp://*:{self.port}"
        self.pub = ZmqEventPublisher(0, endpoint=self.endpoint, topic="kv-events")
        self._hashes = itertools.count(hash_base)
        self.held: dict[int, list[int]] = {}
        """Prefix group -> the hashes this engine holds it under."""

    def publish(self, events: list[Any]) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=events))

    def store_prefix(self, group: int, n_blocks: int = 2) -> None:
        """Evict this engine's copy of a shared prefix (if any) and compute it again."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        events: list[Any] = []
        if group in self.held:
            events.append(BlockRemoved(block_hashes=self.held.pop(group), medium="GPU"))
        hashes = [next(self._hashes) for _ in range(n_blocks)]
        tokens = [group * 10_000 + i for i in range(n_blocks * self.BLOCK_SIZE)]
        events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=tokens,
                block_size=self.BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        )
        self.held[group] = hashes
        self.publish(events)

    def close(self) -> None:
        self.pub.shutdown()


@dataclass
class SharedPrefixTraffic:
    """Replicas that keep recomputing the same prefixes (as round-robin routing makes
    them): every tick each publisher evicts and stores one of ``groups`` prefixes,
    which the other replica holds at that moment."""

    publishers: list[KvPublisher]
    groups: int = 6
    tick_s: float = 0.25
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    ticks: int = 0

    def start(self) -> SharedPrefixTraffic:
        self._thread = threading.Thread(target=self._run, name="kv-traffic", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            g = self.ticks % self.groups
            for p in self.publishers:
                p.store_prefix(g)
            self.ticks += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
