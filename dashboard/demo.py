"""Demo data for the dashboard: the bundled real vLLM recordings as a small fleet.

The three recordings of the real vLLM CPU engine (KV-starved, ``max_num_seqs`` 6,
ample KV cache) were each made on ``demo-host:8000:0``. Here each is replayed as its
own engine, through :func:`kvscope.lab.recording.replay` into a collector over HTTP
exactly as ``kvscope demo`` does, so one collector holds a fleet: pool ``demo`` with
the KV-starved and the sequence-capped replica, pool ``demo-ample`` with the one that
has KV cache to spare.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import BUNDLED_RECORDING, Recording, load_recording, replay

RECORDINGS = BUNDLED_RECORDING.parent


@dataclass(frozen=True)
class DemoEngine:
    """One bundled recording replayed as engine ``host:port:0`` of ``pool``."""

    recording: str
    host: str
    port: int
    pool: str

    @property
    def engine_id(self) -> str:
        return f"{self.host}:{self.port}:0"

    @property
    def path(self) -> Path:
        return RECORDINGS / f"{self.recording}.jsonl.gz"


DEMO_FLEET = (
    DemoEngine("overload_kv_starved", "demo-host", 8000, "demo"),
    DemoEngine("seq_capped", "demo-host", 8001, "demo"),
    DemoEngine("ample_kv", "demo-host", 8002, "demo-ample"),
)


def relabeled(recording: Recording, engine: DemoEngine) -> Recording:
    """A copy of ``recording`` whose batches come from ``engine`` (id, host, port, pool)."""
    batches = []
    for b in recording.batches:
        nb = copy.deepcopy(b)
        nb["engine_id"] = engine.engine_id
        if nb.get("hello"):
            nb["hello"].update(
                engine_id=engine.engine_id, host=engine.host, port=engine.port, pool=engine.pool
            )
        batches.append(nb)
    return Recording(dict(recording.header), batches)


def feed_demo_fleet(
    url: str,
    *,
    token: str | None = None,
    end_at_unix_s: float | None = None,
    progress: bool = True,
    fleet: tuple[DemoEngine, ...] = DEMO_FLEET,
) -> dict[str, dict[str, int]]:
    """Replay every recording of ``fleet`` into the collector at ``url``, each ending in
    the second before ``end_at_unix_s`` (default: now). Returns the stored/duplicate
    counts per engine.

    Timestamps move by whole seconds, so every 1-second window holds the same steps
    as in the recorded run and the advisor's verdicts on the demo are the same on
    every replay.
    """
    end = math.floor(time.time() if end_at_unix_s is None else end_at_unix_s) - 1
    out = {}
    for e in fleet:
        rec = relabeled(load_recording(e.path), e)
        _, last = rec.span_unix_s
        out[e.engine_id] = replay(
            rec, url, token=token, end_at_unix_s=end + last % 1.0, progress=progress
        )
    return out


@contextlib.contextmanager
def demo_collector(
    workdir: str | Path | None = None, *, progress: bool = True
) -> Iterator[CollectorProcess]:
    """A collector on a fresh store (in ``workdir``, else a temporary folder) holding the
    demo fleet; stopped, and a temporary folder removed, on exit."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvscope-")))
        else:
            folder = Path(workdir)
            folder.mkdir(parents=True, exist_ok=True)
        store = folder / "dashboard-demo.duckdb"
        for p in (store, Path(f"{store}.wal")):
            p.unlink(missing_ok=True)
        c = stack.enter_context(
            CollectorProcess(store, extra_args=["--raw-retention", "0", "--advise-interval", "0"])
        )
        feed_demo_fleet(c.url, progress=progress)
        yield c
