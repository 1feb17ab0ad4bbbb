"""A large fleet store generated from the bundled real vLLM recordings, in DuckDB SQL.

For benchmarks and tests of the read and analysis paths at fleet scale. Each recording
is ingested once through the collector's own write path into an in-memory store; its
1-second windows become a *template* of ``L`` seconds. An engine of the generated fleet
replays one template for the whole span: second ``t`` shows template second ``(t +
phase) mod L`` (``phase`` drawn per engine), its token counts scaled by a per-engine
speed factor (0.85 to 1.15) and a per-window jitter (+-5%), so engines of a pool differ
and no two seconds are copies; seconds without a window stay empty.

Finished requests are re-timed the same way, for one replay in ``request_every`` only
(all of them would be hundreds of millions of rows a fleet-week). Engines and their
hellos carry the recording's configuration under the new identity; raw steps are not
generated (the advisor and the report do not read them). Pool ``i`` (``pool-i``) replays
recording ``i mod 3`` (``overload_kv_starved``, ``seq_capped``, ``ample_kv``); engine
``j`` belongs to pool ``j mod n_pools``.

The store's size and what is measured on it:
docs/benchmarks.md#weekly-report-and-advisor-at-fleet-scale
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from kvscope.collector.batch import prepare_batch
from kvscope.collector.store import Store
from kvscope.collector.tables import ENGINE_COLUMNS, HELLO_DATA_COLUMNS, TABLES, WINDOW_COLUMNS
from kvscope.engine_plugins.schema import REQUEST_FIELDS
from kvscope.lab.recording import load_recording

RECORDINGS_DIR = Path(__file__).resolve().parent / "recordings"
TEMPLATES = ("overload_kv_starved", "seq_capped", "ample_kv")
DAY_S = 86400


@dataclass
class FleetSpec:
    """What to generate: ``n_engines`` in ``n_pools`` pools, ``days`` of 1-second windows
    ending at ``end_unix_s`` (a whole second), finished requests of one replay in
    ``request_every``; ``seed`` fixes phases, speeds and jitter."""

    n_engines: int = 100
    n_pools: int = 4
    days: float = 7.0
    end_unix_s: int = 1_800_000_000
    request_every: int = 50
    seed: int = 7

    @property
    def start_unix_s(self) -> int:
        return self.end_unix_s - round(self.days * DAY_S)


def _templates() -> dict[str, dict[str, pd.DataFrame]]:
    """Per recording: its windows, requests and engine row, stored by the collector's
    own ingest path (an in-memory store)."""
    out: dict[str, dict[str, pd.DataFrame]] = {}
    for name in TEMPLATES:
        rec = load_recording(RECORDINGS_DIR / f"{name}.jsonl.gz")
        store = Store(":memory:")
        try:
            for b in rec.batches:
                store.ingest_one(prepare_batch(b, float(b["sent_unix_s"])))
            out[name] = {
                "windows": store.windows(),
                "requests": store.requests(),
                "engines": store.engines(),
                "configs": store.engine_configs(),
            }
        finally:
            store.close()
    return out


def _engines(spec: FleetSpec, tpl: dict[str, dict[str, pd.DataFrame]]) -> pd.DataFrame:
    rng = np.random.default_rng(spec.seed)
    rows = []
    for j in range(spec.n_engines):
        pool = j % spec.n_pools
        name = TEMPLATES[pool % len(TEMPLATES)]
        w = tpl[name]["windows"]
        length = int(w["ts_s"].max() - w["ts_s"].min() + 1)
        rows.append(
            {
                "engine_id": f"fleet-{j:03d}:8000:0",
                "host": f"fleet-{j:03d}",
                "pool": f"pool-{pool}",
                "template": name,
                "tpl_len": length,
                "phase": int(rng.integers(0, length)),
                "speed": float(rng.uniform(0.85, 1.15)),
                "req_offset": int(rng.integers(0, spec.request_every)),
                "boot_id": uuid.UUID(int=int(rng.integers(0, 2**62))).hex,
            }
        )
    return pd.DataFrame(rows)


def generate_fleet_store(
    path: str | Path,
    spec: FleetSpec | None = None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> FleetSpec:
    """Write a new store file at ``path`` (which must not exist) holding the fleet of
    ``spec`` (see the module docstring); ``progress(stage, done, total)`` is called as
    engines are written. Returns the spec."""
    spec = spec or FleetSpec()
    p = Path(path)
    if p.exists():
        raise FileExistsError(f"{p} exists; generate into a new path")
    tpl = _templates()
    eng = _engines(spec, tpl)
    Store(str(p)).close()  # the schema, as the collector creates it
    con = duckdb.connect(str(p))
    try:
        _write(con, spec, tpl, eng, progress)
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return spec


def _write(
    con: duckdb.DuckDBPyConnection,
    spec: FleetSpec,
    tpl: dict[str, dict[str, pd.DataFrame]],
    eng: pd.DataFrame,
    progress: Callable[[str, int, int], None] | None,
) -> None:
    wcols = [c for c in WINDOW_COLUMNS if c not in ("engine_id", "ts_s")]
    tw = []
    tr = []
    for name, t in tpl.items():
        w = t["windows"]
        t0 = int(w["ts_s"].min())
        tw.append(w[wcols].assign(template=name, k=(w["ts_s"] - t0).astype("int64"), t0=float(t0)))
        r = t["requests"]
        tr.append(
            r[[f.name for f in REQUEST_FIELDS]].assign(
                template=name, rel_s=r["finished_unix_s"] - float(t0)
            )
        )
    tpl_windows = pd.concat(tw, ignore_index=True)  # noqa: F841 (read by DuckDB)
    tpl_requests = pd.concat(tr, ignore_index=True)  # noqa: F841
    engines_df = eng  # noqa: F841
    n_seconds = spec.end_unix_s - spec.start_unix_s
    jit = "(1.0 + 0.1 * ((hash(e.engine_id, s.t) % 1000000) / 1000000.0 - 0.5))"
    scaled = {"prompt_tokens", "generation_tokens", "prefix_queries", "prefix_hits"}
    sel = []
    for c in wcols:
        if c in scaled:
            sel.append(f"CAST(round(w.{c} * e.speed * {jit}) AS BIGINT) AS {c}")
        elif c in ("first_step_unix_s", "last_step_unix_s"):
            sel.append(f"w.{c} - w.t0 - w.k + {spec.start_unix_s} + s.t AS {c}")
        else:
            sel.append(f"w.{c}")
    sql = (
        f"INSERT INTO windows_1s (engine_id, ts_s, {', '.join(wcols)}) "
        f"SELECT e.engine_id, {spec.start_unix_s} + s.t, {', '.join(sel)} "
        "FROM engines_df e CROSS JOIN (SELECT range AS t FROM range(?)) s "
        "JOIN tpl_windows w ON w.template = e.template AND w.k = (s.t + e.phase) % e.tpl_len "
        "WHERE e.engine_id = ? ORDER BY s.t"
    )
    total = len(eng)
    for i, eid in enumerate(eng["engine_id"]):
        con.execute(sql, [n_seconds, eid])
        if progress:
            progress("windows", i + 1, total)
    rcols = [f.name for f in REQUEST_FIELDS]
    rsel = [
        f"{spec.start_unix_s} + r.rel_s - e.phase + rep.r * e.tpl_len"
        if c == "finished_unix_s"
        else f"r.{c}"
        for c in rcols
    ]
    reps = math.ceil(n_seconds / eng["tpl_len"].min()) + 2
    con.execute(
        f"INSERT INTO requests (engine_id, boot_id, {', '.join(rcols)}) "
        f"SELECT e.engine_id, e.boot_id, {', '.join(rsel)} FROM engines_df e "
        f"CROSS JOIN (SELECT range AS r FROM range({reps})) rep "
        "JOIN tpl_requests r ON r.template = e.template "
        f"WHERE rep.r % {spec.request_every} = e.req_offset "
        f"AND {spec.start_unix_s} + r.rel_s - e.phase + rep.r * e.tpl_len "
        f"BETWEEN {spec.start_unix_s} AND {spec.end_unix_s - 1} "
        f"ORDER BY 3"
    )
    if progress:
        progress("requests", 1, 1)
    _write_engines(con, spec, tpl, eng)


def _write_engines(
    con: duckdb.DuckDBPyConnection,
    spec: FleetSpec,
    tpl: dict[str, dict[str, pd.DataFrame]],
    eng: pd.DataFrame,
) -> None:
    now = time.time()
    erows, crows = [], []
    for e in eng.itertuples():
        base = tpl[str(e.template)]["engines"].iloc[0].to_dict()
        hello = {
            **{c: base.get(c) for c in HELLO_DATA_COLUMNS},
            "host": e.host,
            "port": 8000,
            "engine_index": 0,
            "pool": e.pool,
            "started_unix_s": float(spec.start_unix_s),
        }
        erows.append(
            {
                **{c: base.get(c) for c in ENGINE_COLUMNS},
                **hello,
                "engine_id": e.engine_id,
                "boot_id": e.boot_id,
                "has_hello": True,
                "hello_unix_s": float(spec.start_unix_s),
                "first_seen_unix_s": float(spec.start_unix_s),
                "last_seen_unix_s": now,
                "last_step_unix_s": float(spec.end_unix_s - 1),
                "last_boot_id": e.boot_id,
            }
        )
        crows.append(
            {
                "engine_id": e.engine_id,
                "boot_id": e.boot_id,
                "received_unix_s": float(spec.start_unix_s),
                **hello,
            }
        )
    for table, rows in (("engines", erows), ("engine_configs", crows)):
        cols = [c for c, _ in TABLES[table]["cols"]]
        frame = pd.DataFrame(rows)[cols]  # noqa: F841 (read by DuckDB)
        con.execute(f"INSERT INTO {table} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM frame")
