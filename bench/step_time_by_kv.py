"""Decode-step time by batch and KV tokens in use, per engine, from a collector's store.

One command, on a store a regimes run kept (``bench/advisor_regimes.py --workdir DIR``
leaves ``DIR/store.duckdb``)::

    .venv/bin/python bench/step_time_by_kv.py DIR/store.duckdb [--pool-like thrash]
        [--batch 4,8,12,32]

What it does
------------
Reads the per-step rows the plugin stored (``steps``: batch, KV blocks in use, prompt
tokens, preemptions, the step's time stamp) and keeps the decode-only steps (no prompt
token computed, no preemption) of engines that were busy: a step's time is the gap to
the engine's next step, and gaps over 0.5 s (idle) are dropped. Per engine it prints
the median step time at each ``--batch`` in bins of KV tokens in use (KV blocks in use
x block size), and the slope of step time per 1,000 KV tokens at one batch (a line
through the bins' medians, weighted by their steps, where they span 1,000 tokens or
more), so whether a decode step's time
grows with the context it reads, and where, can be read off directly.
"""

from __future__ import annotations

import argparse
import itertools

import duckdb
import numpy as np
import pandas as pd

MIN_STEPS = 20
"""Fewer decode steps in a cell leave it out (of the table and of the slope)."""
MIN_SPAN_TOKENS = 1000
"""A slope needs bins whose median KV tokens span at least this many."""
KV_BINS = (0, 256, 512, 1024, 1600, 3200, 6400, 12800, 1_000_000)


def decode_steps(con: duckdb.DuckDBPyConnection, engine_id: str, block_size: int) -> pd.DataFrame:
    s = con.execute(
        "SELECT ts_unix_s, batch_size, kv_blocks_used, prompt_tokens, prefix_hits, preemptions "
        "FROM steps WHERE engine_id = ? ORDER BY ts_unix_s",
        [engine_id],
    ).df()
    s["step_ms"] = (s["ts_unix_s"].shift(-1) - s["ts_unix_s"]) * 1e3
    computed = (s["prompt_tokens"] - s["prefix_hits"].fillna(0)).clip(lower=0)
    keep = (s["batch_size"] > 0) & (computed == 0) & (s["preemptions"].fillna(0) == 0)
    keep &= s["step_ms"].notna() & (s["step_ms"] < 500)
    s = s[keep].copy()
    s["kv_tokens"] = s["kv_blocks_used"] * block_size
    return s


def slope_ms_per_1k(steps: pd.DataFrame) -> tuple[float, int]:
    """Weighted line through the bins' median step times at one batch (ms per 1,000 KV
    tokens), and the number of bins it went through; NaN unless the bins span
    ``MIN_SPAN_TOKENS``."""
    g = steps.groupby("kv_bin", observed=True).agg(
        kv=("kv_tokens", "median"), ms=("step_ms", "median"), n=("step_ms", "size")
    )
    g = g[g["n"] >= MIN_STEPS]
    if len(g) < 2 or g["kv"].max() - g["kv"].min() < MIN_SPAN_TOKENS:
        return float("nan"), len(g)
    slope, _ = np.polyfit(g["kv"] / 1e3, g["ms"], 1, w=np.sqrt(g["n"]))
    return float(slope), len(g)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="a collector's DuckDB store")
    parser.add_argument("--pool-like", default="", help="only pools whose name contains this")
    parser.add_argument(
        "--batch",
        default="1,2,4,8,12,16,32",
        help="batches to show, comma-separated (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    con = duckdb.connect(args.store, read_only=True)
    engines = con.execute(
        "SELECT engine_id, pool, num_gpu_blocks, block_size FROM engines "
        "WHERE pool LIKE ? ORDER BY pool",
        [f"%{args.pool_like}%"],
    ).df()
    labels = [
        f"{lo}-{hi}" if hi < KV_BINS[-1] else f">{lo}" for lo, hi in itertools.pairwise(KV_BINS)
    ]
    for e in engines.itertuples():
        s = decode_steps(con, e.engine_id, int(e.block_size or 16))
        if s.empty:
            continue
        s["kv_bin"] = pd.cut(s["kv_tokens"], KV_BINS, labels=labels)
        cap = int(e.num_gpu_blocks or 0) * int(e.block_size or 0)
        print(f"\n{e.pool} ({e.num_gpu_blocks} blocks, {cap:,} KV tokens): {len(s):,} decode steps")
        shown = s[s["batch_size"].isin(batches)]
        table = shown.pivot_table(
            index="batch_size", columns="kv_bin", values="step_ms", aggfunc="median", observed=True
        )
        counts = shown.pivot_table(
            index="batch_size", columns="kv_bin", values="step_ms", aggfunc="size", observed=True
        )
        table = table.where(counts >= MIN_STEPS)
        print(
            "median decode-step ms by batch (rows) and KV tokens in use (columns), "
            f"cells of {MIN_STEPS} steps or more"
        )
        print(table.round(1).to_string())
        for b in batches:
            slope, bins = slope_ms_per_1k(s[s["batch_size"] == b])
            if np.isfinite(slope):
                print(f"  batch {b}: {slope:+.2f} ms per 1,000 KV tokens ({bins} bins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
