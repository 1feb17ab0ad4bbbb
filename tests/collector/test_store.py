"""The DuckDB store: windows against hand computation, retention, configs, re-open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest
from _collector_helpers import batch, hello, steps

from kvscope.collector.batch import PreparedBatch, prepare_batch
from kvscope.collector.store import Store, StoreVersionError
from kvscope.collector.tables import STORE_SCHEMA_VERSION

T0 = 1_700_000_000.0


def _prep(obj: dict[str, Any], received: float = T0 + 1000) -> PreparedBatch:
    return prepare_batch(obj, received)


def _custom(
    seq: int, ts: list[float], batch_sizes: list[int], engine: str = "e1", **cols: list[Any]
) -> PreparedBatch:
    b = batch(engine_id=engine, seq=seq)
    b["steps"] = steps(ts, batch=batch_sizes, **cols)
    return _prep(b)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(str(tmp_path / "s.duckdb"))
    yield s
    s.close()


def _window(store: Store, ts_s: int, engine: str = "e1") -> dict[str, Any]:
    w = store.windows(engine_id=engine)
    rows = w[w["ts_s"] == ts_s].to_dict("records")
    assert len(rows) == 1
    return rows[0]


def test_window_matches_hand_computation(store: Store) -> None:
    rng = np.random.default_rng(7)
    n = 40
    ts = sorted((T0 + rng.uniform(0, 1, n)).tolist())
    bs = rng.integers(0, 64, n).tolist()
    kv = np.round(rng.uniform(0, 1, n), 4).tolist()
    waiting = rng.integers(0, 9, n).tolist()
    it = [None if i % 4 == 0 else float(v) for i, v in enumerate(rng.uniform(0.01, 0.05, n))]
    store.ingest_one(_custom(0, ts, bs, kv_usage_ratio=kv, waiting=waiting, iteration_s=it))
    w = _window(store, int(T0))
    a = np.array(bs, dtype=float)
    assert w["n_steps"] == n and w["n_parts"] == 1
    assert w["batch_sum"] == a.sum()
    assert w["batch_mean"] == pytest.approx(a.mean())
    assert (w["batch_min"], w["batch_max"]) == (a.min(), a.max())
    for p in (50, 90, 99):
        assert w[f"batch_p{p}"] == pytest.approx(np.percentile(a, p))
    assert w["kv_usage_mean"] == pytest.approx(np.mean(kv))
    assert w["kv_usage_max"] == pytest.approx(max(kv))
    assert w["waiting_mean"] == pytest.approx(np.mean(waiting))
    assert w["waiting_max"] == max(waiting)
    its = [v for v in it if v is not None]
    assert w["iteration_n"] == len(its)
    assert w["iteration_s_mean"] == pytest.approx(np.mean(its))
    assert (w["first_step_unix_s"], w["last_step_unix_s"]) == (ts[0], ts[-1])


def test_the_streams_of_an_engines_api_servers_merge_into_its_windows(store: Store) -> None:
    # vllm serve --api-server-count 2: each API server process sends the steps whose
    # stats vLLM handed it, under the engine's id, each its own boot, interleaved in time.
    ts_a, ts_b = [T0 + 0.1 * i for i in range(0, 10, 2)], [T0 + 0.1 * i for i in range(1, 10, 2)]
    for boot, ts, bs in (("api0", ts_a, [4, 4, 5, 5, 6]), ("api1", ts_b, [4, 5, 5, 6, 6])):
        b = batch(engine_id="e1", boot_id=boot, seq=0, with_hello=True)
        b["hello"]["pid"] = 100 + len(boot)
        b["steps"] = steps(ts, batch=bs, generation_tokens=bs)
        store.ingest_one(_prep(b))
    w = _window(store, int(T0))
    assert w["n_steps"] == 10 and w["n_parts"] == 2
    assert w["batch_mean"] == pytest.approx(5.0) and w["generation_tokens"] == 50
    assert (w["first_step_unix_s"], w["last_step_unix_s"]) == (ts_a[0], ts_b[-1])
    assert list(store.engines()["engine_id"]) == ["e1"]
    assert sorted(store.engine_configs()["boot_id"]) == ["api0", "api1"]


def test_split_second_merges_exactly_except_percentiles(store: Store) -> None:
    ts_a = [T0 + 0.1 * i for i in range(6)]  # 0.0 .. 0.5
    ts_b = [T0 + 0.55 + 0.1 * i for i in range(4)] + [T0 + 1.2]  # rest of the second, next one
    bs_a = [1, 2, 3, 4, 5, 6]
    bs_b = [40, 50, 60, 70, 9]
    pre_a = [1, 0, 0, 2, 0, 0]
    pre_b = [0, 3, 0, 0, 1]
    store.ingest_one(_custom(0, ts_a, bs_a, preemptions=pre_a))
    store.ingest_one(_custom(1, ts_b, bs_b, preemptions=pre_b))
    w = _window(store, int(T0))
    merged = np.array(bs_a + bs_b[:4], dtype=float)
    assert w["n_steps"] == 10 and w["n_parts"] == 2
    assert w["batch_sum"] == merged.sum()
    assert w["batch_mean"] == pytest.approx(merged.mean())
    assert (w["batch_min"], w["batch_max"]) == (1, 70)
    assert w["preemptions"] == sum(pre_a) + sum(pre_b[:4])
    assert w["prefix_queries"] == 100 * 10
    assert (w["first_step_unix_s"], w["last_step_unix_s"]) == (ts_a[0], ts_b[3])
    # Percentiles: the step-count-weighted mean of the parts' percentiles.
    pa, pb = np.percentile(bs_a, 50), np.percentile(bs_b[:4], 50)
    assert w["batch_p50"] == pytest.approx((pa * 6 + pb * 4) / 10)
    assert (
        min(pa, pb) <= w["batch_p99"] <= max(np.percentile(bs_a, 99), np.percentile(bs_b[:4], 99))
    )
    nxt = _window(store, int(T0) + 1)
    assert (nxt["n_steps"], nxt["batch_max"], nxt["n_parts"]) == (1, 9, 1)
    # Totals from windows equal totals from raw steps.
    by_steps = store.totals("steps").set_index("engine_id")
    by_windows = store.totals("windows").set_index("engine_id")
    assert by_steps.equals(by_windows)
    assert by_steps.loc["e1", "preemptions"] == sum(pre_a) + sum(pre_b)


def test_split_second_in_one_group_is_exact(store: Store) -> None:
    a = _custom(0, [T0 + 0.1, T0 + 0.2], [1, 2])
    b = _custom(1, [T0 + 0.7, T0 + 0.8, T0 + 0.9], [10, 20, 30])
    res = store.ingest([a, b])
    assert [r.status for r in res] == ["stored", "stored"]  # type: ignore[union-attr]
    w = _window(store, int(T0))
    assert w["n_parts"] == 1
    assert w["batch_p90"] == pytest.approx(np.percentile([1, 2, 10, 20, 30], 90))


def test_group_with_a_failing_batch_stores_the_others(store: Store) -> None:
    good1 = _custom(0, [T0 + 0.1], [1])
    good2 = _custom(1, [T0 + 1.1], [2])
    bad = _custom(2, [T0 + 2.1, T0 + 2.2], [3, 4])
    bad.steps["batch_size"] = np.array([3], dtype=np.int64)  # columns of unequal length
    res = store.ingest([good1, bad, good2])
    assert isinstance(res[1], Exception)
    assert [getattr(r, "status", None) for r in (res[0], res[2])] == ["stored", "stored"]
    assert store.table_counts()["ingested_batches"] == 2
    assert sorted(store.steps()["batch_size"]) == [1, 2]


def test_duplicates_within_and_across_groups(store: Store) -> None:
    a = _custom(0, [T0 + 0.1], [1])
    res = store.ingest([a, a, _custom(1, [T0 + 0.2], [2])])
    assert [r.status for r in res] == ["stored", "duplicate", "stored"]  # type: ignore[union-attr]
    assert store.ingest_one(a).status == "duplicate"
    assert len(store.steps()) == 2
    assert _window(store, int(T0))["n_steps"] == 2


def test_retention_deletes_only_old_steps(store: Store) -> None:
    store.ingest_one(_custom(0, [T0 - 7200, T0 - 3601, T0 - 10, T0], [1, 2, 3, 4]))
    n_windows = len(store.windows())
    deleted = store.apply_retention(raw_step_retention_s=3600, ledger_retention_s=0, now_unix_s=T0)
    assert deleted == {"steps": 2, "ingested_batches": 0}
    assert sorted(store.steps()["batch_size"]) == [3, 4]
    assert len(store.windows()) == n_windows  # windows are kept
    # 0 keeps forever.
    assert store.apply_retention(0, 0, now_unix_s=T0 + 1e9) == {"steps": 0, "ingested_batches": 0}
    assert len(store.steps()) == 2


def test_ledger_retention(store: Store) -> None:
    store.ingest_one(_prep(batch(seq=0, step_ts=[T0]), received=T0))
    store.ingest_one(_prep(batch(seq=1, step_ts=[T0 + 1]), received=T0 + 100))
    assert store.apply_retention(0, 50, now_unix_s=T0 + 120)["ingested_batches"] == 1
    assert store.table_counts()["ingested_batches"] == 1


def test_engine_config_history_and_current(store: Store) -> None:
    h1 = hello("e1", "boot-1", started_unix_s=T0, max_num_seqs=128)
    h2 = hello("e1", "boot-2", started_unix_s=T0 + 500, max_num_seqs=256, pool="pool-b")
    store.ingest_one(_prep(batch(engine_id="e1", boot_id="boot-2", seq=0, hello=h2)))
    # A late hello of the older boot does not replace the current configuration.
    store.ingest_one(_prep(batch(engine_id="e1", boot_id="boot-1", seq=5, hello=h1)))
    eng = store.engines().set_index("engine_id").loc["e1"]
    assert (eng["boot_id"], eng["max_num_seqs"], eng["pool"]) == ("boot-2", 256, "pool-b")
    hist = store.engine_configs("e1")
    assert hist["boot_id"].tolist() == ["boot-1", "boot-2"]
    assert hist["max_num_seqs"].tolist() == [128, 256]
    # A resent hello for a known boot adds no history row.
    store.ingest_one(_prep(batch(engine_id="e1", boot_id="boot-2", seq=1, hello=h2)))
    assert len(store.engine_configs()) == 2
    assert store.has_hello("e1", "boot-2") and not store.has_hello("e1", "boot-3")


def test_hello_with_null_fields(store: Store) -> None:
    h = hello(
        "e1",
        "boot-1",
        num_gpu_blocks=None,
        kv_cache_dtype=None,
        enable_prefix_caching=None,
        gpu_memory_utilization=None,
    )
    store.ingest_one(_prep(batch(engine_id="e1", hello=h)))
    row = store.engines().iloc[0]
    assert pd.isna(row["num_gpu_blocks"])
    assert pd.isna(row["kv_cache_dtype"])


def test_exporter_counters_merge_with_max(store: Store) -> None:
    ex1 = {
        "dropped_steps": 5,
        "dropped_requests": 1,
        "dropped_batches": 0,
        "send_failures": 2,
        "record_errors": 0,
    }
    ex0 = {**ex1, "dropped_steps": 3, "send_failures": 4}
    store.ingest_one(_prep(batch(seq=1, exporter=ex1)))
    store.ingest_one(_prep(batch(seq=0, exporter=ex0)))  # arrives late, older counters
    row = store.exporter_stats().iloc[0]
    assert (row["dropped_steps"], row["send_failures"]) == (5, 4)


def test_request_stats(store: Store) -> None:
    b = batch(engine_id="e1", req_ts=[T0 + i for i in range(10)])
    store.ingest_one(_prep(b))
    stats = store.request_stats(group_by="engine")
    r = stats.iloc[0]
    e2e = np.array(b["requests"]["e2e_s"])
    ttft = np.array([v for v in b["requests"]["ttft_s"] if v is not None])
    assert r["n_requests"] == 10
    assert r["e2e_s_p90"] == pytest.approx(np.percentile(e2e, 90))
    assert r["ttft_s_p50"] == pytest.approx(np.percentile(ttft, 50))
    assert r["generation_tokens_sum"] == sum(b["requests"]["generation_tokens"])
    assert r["n_preempted"] == 5
    only = store.request_stats(since_unix_s=T0 + 5, group_by="all")
    assert only["n_requests"].tolist() == [5]
    assert store.request_stats(since_unix_s=T0 + 100, group_by="all").empty


def test_reopen_keeps_data_and_works(tmp_path: Path) -> None:
    path = str(tmp_path / "re.duckdb")
    s = Store(path)
    s.ingest_one(_prep(batch(with_hello=True, step_ts=[T0, T0 + 0.5])))
    s.save_state("k", "v")
    s.close()
    s.close()  # idempotent
    s = Store(path)
    try:
        assert s.table_counts()["steps"] == 2
        assert s.has_hello("host-a:8000:0", "boot-1")
        assert s.ingest_one(_prep(batch(with_hello=True, step_ts=[T0]))).status == "duplicate"
        assert s.ingest_one(_prep(batch(seq=1, step_ts=[T0 + 0.7]))).status == "stored"
        assert _window(s, int(T0), "host-a:8000:0")["n_steps"] == 3
        assert s.take_state("k") == "v" and s.take_state("k") is None
    finally:
        s.close()
    con = duckdb.connect(path)
    assert con.execute("SELECT value FROM meta WHERE key = 'store_schema_version'").fetchone() == (
        str(STORE_SCHEMA_VERSION),
    )
    con.close()


def test_store_from_newer_kvscope_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "new.duckdb")
    Store(path).close()
    con = duckdb.connect(path)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'store_schema_version'")
    con.close()
    with pytest.raises(StoreVersionError, match="999"):
        Store(path)


def test_missing_column_added_on_open(tmp_path: Path) -> None:
    path = str(tmp_path / "old.duckdb")
    Store(path).close()
    con = duckdb.connect(path)
    con.execute("ALTER TABLE steps DROP COLUMN iteration_s")
    con.close()
    s = Store(path)
    try:
        s.ingest_one(_prep(batch(step_ts=[T0, T0 + 0.1])))
        assert "iteration_s" in s.steps().columns
    finally:
        s.close()


def test_closed_store_refuses(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "c.duckdb"))
    s.close()
    assert s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.engines()
    with pytest.raises(RuntimeError, match="closed"):
        s.ingest([_prep(batch(step_ts=[T0]))])


def test_windows_random_groups_match_pandas(store: Store) -> None:
    """Several engines, seconds split at random over groups: windows equal a groupby
    over all steps (exactly, and percentiles too where the window has one part)."""
    rng = np.random.default_rng(11)
    batches = []
    for e in range(3):
        ts = np.sort(T0 + rng.uniform(0, 6, 90))
        for k, chunk in enumerate(np.array_split(np.arange(90), 7)):
            bs = rng.integers(0, 100, len(chunk)).tolist()
            batches.append(
                _custom(
                    k,
                    ts[chunk].tolist(),
                    bs,
                    engine=f"e{e}",
                    prompt_tokens=rng.integers(0, 50, len(chunk)).tolist(),
                )
            )
    order = rng.permutation(len(batches))
    groups = np.array_split(order, 5)
    for g in groups:
        res = store.ingest([batches[i] for i in g])
        assert all(getattr(r, "status", None) == "stored" for r in res)
    steps_df = store.steps()
    steps_df["ts_s"] = np.floor(steps_df["ts_unix_s"]).astype(int)
    expect = steps_df.groupby(["engine_id", "ts_s"]).agg(
        n_steps=("batch_size", "size"),
        batch_sum=("batch_size", "sum"),
        batch_max=("batch_size", "max"),
        batch_min=("batch_size", "min"),
        prompt_tokens=("prompt_tokens", "sum"),
        kv_usage_max=("kv_usage_ratio", "max"),
        first_step_unix_s=("ts_unix_s", "min"),
        last_step_unix_s=("ts_unix_s", "max"),
        batch_p90=("batch_size", lambda s: np.percentile(s, 90)),
    )
    got = store.windows().set_index(["engine_id", "ts_s"]).sort_index()
    assert list(got.index) == list(expect.index)
    for col in expect.columns:
        if col == "batch_p90":
            exact = got["n_parts"] == 1
            assert exact.any()
            np.testing.assert_allclose(got.loc[exact, col], expect.loc[exact, col])
        else:
            np.testing.assert_allclose(got[col].astype(float), expect[col].astype(float))
    assert (got["batch_mean"] * got["n_steps"]).round(6).equals(got["batch_sum"].astype(float))


def test_late_earlier_second_is_inserted(store: Store) -> None:
    store.ingest_one(_custom(0, [T0 + 5.5], [5]))
    store.ingest_one(_custom(1, [T0 + 1.5, T0 + 1.6], [1, 3]))  # earlier, new second
    w = _window(store, int(T0) + 1)
    assert (w["n_steps"], w["n_parts"], w["batch_p50"]) == (2, 1, 2.0)
    store.ingest_one(_custom(2, [T0 + 6.1], [6]))
    assert _window(store, int(T0) + 6)["n_steps"] == 1
