"""Cardinality attack on a real collector process: a flood of distinct engine ids,
pools and models with the longest label values the schema allows.

New engine ids are admitted up to ``--max-new-engines-per-minute`` (then 429 with
``Retry-After``, counted, while known engines go on); ``/metrics`` carries per-engine
series for at most ``--max-exported-engines`` (the most recently seen) and counts the
rest; label values stay within 200 characters.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _faults_collector_helpers import batch, counter, post, start_collector

MAX_NEW_PER_MIN = 120
MAX_EXPORTED = 40
N_IDS = 200
LABEL_CHARS = 200  # kvscope.engine_plugins.schema.MAX_LABEL_CHARS


def _flood_batch(i: int, seq: int = 0) -> dict[str, object]:
    eid = f"flood-{i:04d}-" + "e" * 180
    b = batch(eid, "boot-1", seq, with_hello=seq == 0, step_ts=[1.7e9 + seq, 1.7e9 + seq + 0.5])
    if b["hello"] is not None:
        b["hello"]["pool"] = f"pool-{i:04d}-" + "p" * (LABEL_CHARS - 10)
        b["hello"]["model"] = f"model-{i:04d}-" + "m" * (LABEL_CHARS - 11)
    return b


def test_flood_of_engine_ids_is_capped_and_counted(tmp_path: Path) -> None:
    c = start_collector(
        tmp_path / "flood.duckdb",
        "--max-new-engines-per-minute",
        str(MAX_NEW_PER_MIN),
        "--max-exported-engines",
        str(MAX_EXPORTED),
    )
    try:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: post(c.url, _flood_batch(i)), range(N_IDS)))
        statuses = [a[0] for a in answers]
        retry_after = {a[1].get("retry-after", "") for a in answers if a[0] == 429}
        admitted = [i for i in range(N_IDS) if statuses[i] == 200]
        # Engines already admitted keep sending while the flood is refused.
        known = [post(c.url, _flood_batch(i, seq=1))[0] for i in admitted[:5]]
        t = time.perf_counter()
        metrics = c.get_text("/metrics")
        scrape_s = time.perf_counter() - t
        engines = c.get_json("/v1/engines")
    finally:
        c.stop()
    exported = set(re.findall(r'^kvscope_engine_steps_total\{engine="([^"]*)"', metrics, re.M))
    longest = max(len(v) for v in re.findall(r'="([^"]*)"', metrics))
    print(
        f"\n[cardinality] {N_IDS} new engine ids: {statuses.count(200)} admitted, "
        f"{statuses.count(429)} refused (429); /metrics: {len(exported)} engines exported, "
        f"{counter(metrics, 'kvscope_collector_engines_not_exported'):.0f} not exported, "
        f"{len(metrics) / 1024:.0f} KiB in {scrape_s * 1e3:.0f} ms; longest label value "
        f"{longest} chars; store: {engines['n_rows']} engines"
    )
    assert statuses.count(200) == MAX_NEW_PER_MIN
    assert statuses.count(429) == N_IDS - MAX_NEW_PER_MIN
    assert retry_after == {"60"}
    assert known == [200] * 5
    assert (
        counter(metrics, "kvscope_collector_rejected_batches_total", reason="engine_limit")
        == N_IDS - MAX_NEW_PER_MIN
    )
    # The store holds only what was admitted.
    assert engines["n_rows"] == MAX_NEW_PER_MIN
    # /metrics: capped, the most recently seen kept (the 5 that sent again among them).
    assert len(exported) == MAX_EXPORTED
    assert (
        counter(metrics, "kvscope_collector_engines_not_exported") == MAX_NEW_PER_MIN - MAX_EXPORTED
    )
    assert counter(metrics, "kvscope_collector_engines") == MAX_NEW_PER_MIN
    assert {_flood_batch(i)["engine_id"] for i in admitted[:5]} <= exported
    assert longest <= LABEL_CHARS
    # A label value one character too long is refused by the schema.
    b = _flood_batch(admitted[0], seq=2)
    b["hello"] = _flood_batch(admitted[0])["hello"]
    assert isinstance(b["hello"], dict)
    b["hello"]["pool"] = "p" * (LABEL_CHARS + 1)
    c2 = start_collector(tmp_path / "flood.duckdb")
    try:
        status, _, body = post(c2.url, b)
    finally:
        c2.stop()
    assert status == 400 and "hello.pool" in json.loads(body)["error"]
