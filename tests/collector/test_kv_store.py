"""The store's KV-event side: a store made before it opens and migrates; windows merge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pytest
from _collector_helpers import batch, hello

from kvscope.collector.batch import prepare_batch
from kvscope.collector.store import Store
from kvscope.collector.tables import KV_EVENT_COLUMNS, TABLES

T0 = 1_700_000_000.0
NEW_COLUMNS = {"kv_events_endpoint"}
NEW_TABLES = {"kv_event_windows", "windows_1m"}


def _old_store(path: str) -> None:
    """A store file as the collector made it before KV events: the same tables without
    the new column and without the new table, holding one engine."""
    con = duckdb.connect(path)
    for name, spec in TABLES.items():
        if name in NEW_TABLES:
            continue
        cols = [f"{c} {t}" for c, t in spec["cols"] if c not in NEW_COLUMNS]
        if spec.get("pk"):
            cols.append(f"PRIMARY KEY ({', '.join(spec['pk'])})")
        con.execute(f"CREATE TABLE {name} ({', '.join(cols)})")
    con.execute("INSERT INTO meta VALUES ('store_schema_version', '1')")
    con.execute("INSERT INTO engines (engine_id, pool, has_hello) VALUES ('old', 'p', true)")
    con.execute("INSERT INTO engine_configs (engine_id, boot_id, pool) VALUES ('old', 'b0', 'p')")
    con.close()


def _columns(path: str, table: str) -> set[str]:
    con = duckdb.connect(path)
    try:
        return {
            r[0]
            for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]
            ).fetchall()
        }
    finally:
        con.close()


def test_store_made_before_kv_events_opens_and_migrates(tmp_path: Path) -> None:
    path = str(tmp_path / "old.duckdb")
    _old_store(path)
    assert "kv_events_endpoint" not in _columns(path, "engines")
    s = Store(path)
    try:
        old = s.engines().set_index("engine_id").loc["old"]
        assert pd.isna(old["kv_events_endpoint"]) and old["pool"] == "p"
        h = hello("e1", "boot-1", kv_events_endpoint="tcp://*:5557")
        s.ingest_one(prepare_batch(batch(engine_id="e1", hello=h), T0))
        eng = s.engines().set_index("engine_id")
        assert eng.loc["e1", "kv_events_endpoint"] == "tcp://*:5557"
        cfg = s.engine_configs("e1")
        assert cfg["kv_events_endpoint"].tolist() == ["tcp://*:5557"]
        assert s.write_kv_event_windows(_rows(("e1", 100, 3, 4, 16))) == 1
        assert len(s.kv_event_windows()) == 1
    finally:
        s.close()
    for table in ("engines", "engine_configs"):
        assert "kv_events_endpoint" in _columns(path, table)
    Store(path).close()  # opening again changes nothing and does not fail


def _rows(*rows: tuple[str, int, int, int, int | None]) -> pd.DataFrame:
    """(engine_id, ts_s, stored_blocks, held_blocks, block_size) rows, other counters 1."""
    out = []
    for engine_id, ts_s, stored, held, bs in rows:
        r: dict[str, Any] = dict.fromkeys(KV_EVENT_COLUMNS, 1)
        r.update(
            engine_id=engine_id, ts_s=ts_s, stored_blocks=stored, held_blocks=held, block_size=bs
        )
        out.append(r)
    df = pd.DataFrame(out)
    df["block_size"] = df["block_size"].astype("Int64")
    return df


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(str(tmp_path / "s.duckdb"))
    yield s
    s.close()


def test_kv_event_windows_merge_counts_and_keep_the_latest_held(store: Store) -> None:
    store.write_kv_event_windows(_rows(("e1", 100, 3, 10, 16), ("e2", 100, 1, 1, 16)))
    store.write_kv_event_windows(_rows(("e1", 100, 2, 7, None), ("e1", 101, 5, 12, 16)))
    w = store.kv_event_windows(engine_id="e1").set_index("ts_s")
    assert w.loc[100, "stored_blocks"] == 5 and w.loc[100, "n_batches"] == 2
    assert w.loc[100, "dup_blocks"] == 2 and w.loc[100, "missed_batches"] == 2
    assert w.loc[100, "held_blocks"] == 7 and w.loc[100, "held_shared_blocks"] == 1
    assert w.loc[100, "block_size"] == 16  # a part without stored blocks keeps the size
    assert list(store.kv_event_windows(since_unix_s=101)["ts_s"]) == [101]
    assert len(store.kv_event_windows(since_unix_s=100.5)) == 3  # floor(since), as windows
    t = store.kv_event_totals().set_index("engine_id")
    assert t.loc["e1", "stored_blocks"] == 10 and t.loc["e2", "stored_blocks"] == 1
    assert "held_blocks" not in t.columns


def test_kv_event_retention(store: Store) -> None:
    store.write_kv_event_windows(
        _rows(("e1", int(T0) - 7200, 1, 1, 16), ("e1", int(T0) - 10, 1, 1, 16))
    )
    assert store.apply_kv_event_retention(0, now_unix_s=T0) == {"kv_event_windows": 0}
    assert store.apply_kv_event_retention(3600, now_unix_s=T0) == {"kv_event_windows": 1}
    assert list(store.kv_event_windows()["ts_s"]) == [int(T0) - 10]
