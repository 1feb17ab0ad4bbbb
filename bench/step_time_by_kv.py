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

``--what-if`` checks the advisor's step-time model against it, per regime of a regimes run
whose store also holds the engines the advice and the control ran (pools ``NAME-advice``,
``NAME-control``: the KV regimes' twice the blocks and 4,096 blocks): the model is fitted
on the regime engine's 1-second windows with the per-KV-token cost
(:class:`kvscope.advisor.steptime.StepTimeModel` given the cache's size) and without it,
and each predicts the step time the three engines measured at their top load (their own
batch, KV tokens per sequence, prompt tokens and preemptions per step). The last column is
an independent measurement of the per-KV-token cost: the control's 1-second windows at a
full batch, step time against KV tokens in use. ``--export FILE`` writes those engines'
windows, configurations and the regime engine's finished requests as a test fixture
(``tests/fixtures/kv_thrash_more_blocks.json.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from kvscope.advisor.frames import prepare_windows
from kvscope.advisor.steptime import StepTimeModel
from kvscope.report.sources import StoreSource, open_store

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


def top_load(windows: pd.DataFrame, kv_tokens: float) -> dict[str, float]:
    """What an engine measured at its top load (busy seconds within 10% of its highest
    load): median step time, batch, KV tokens per running sequence and generated tokens/s,
    computed prompt tokens and preemptions per step."""
    w = prepare_windows(windows)
    w = w[(w["busy_ratio"] >= 0.9) & (w["n_steps"] >= 5) & (w["load"] >= 0.9 * w["load"].max())]
    n = w["n_steps"]
    computed = (w["prompt_tokens"] - w["prefix_hits"].fillna(0)).clip(lower=0)
    return {
        "step_s": float((1.0 / w["steps_per_s"]).median()),
        "batch": float(w["batch_mean"].median()),
        "kv_per_seq": float((w["kv_usage_mean"] * kv_tokens / w["batch_mean"]).median()),
        "prompt_per_step": float((computed / n).median()),
        "preemptions_per_step": float((w["preemptions"].fillna(0) / n).mean()),
        "gen_tokens_per_s": float(w["gen_tokens_per_s"].median()),
        "n_windows": len(w),
    }


def full_batch_slope_ms_per_1k(windows: pd.DataFrame, kv_tokens: float) -> float:
    """Step time against KV tokens in use over an engine's seconds at its full batch (the
    largest batch, within half a sequence), ms per 1,000 tokens."""
    w = prepare_windows(windows)
    w = w[(w["busy_ratio"] >= 0.9) & (w["n_steps"] >= 5)]
    w = w[w["batch_mean"] >= w["batch_mean"].max() - 0.5]
    if len(w) < 10:
        return math.nan
    kv = w["kv_usage_mean"] * kv_tokens / 1e3
    return float(np.polyfit(kv, 1e3 / w["steps_per_s"], 1)[0])


def what_if(stores: list[str], pool_like: str, export: str | None) -> int:
    runs: dict[str, dict[str, object]] = {}
    for store in stores:
        runs.update(
            {f"run {len(runs) + j}": r for j, r in enumerate(_what_if(store, pool_like), 1)}
        )
    if export:
        with gzip.open(Path(export), "wt") as f:
            json.dump(
                {"stores": [Path(s).parent.name for s in stores], "runs": runs}, f, default=_plain
            )
        print(f"wrote {export}: {len(runs)} run(s)")
    return 0


def _what_if(store: str, pool_like: str) -> list[dict[str, object]]:
    src = StoreSource(open_store(store))
    engines = src.engines()
    pools = set(engines["pool"])
    runs: list[dict[str, object]] = []
    print(f"\n{store}\n")
    print(
        "| regime | engine | blocks | batch | KV tokens per sequence | step measured | "
        "predicted with the KV term | without |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for pool in sorted(p for p in pools if pool_like in p):
        if f"{pool}-advice" not in pools or f"{pool}-control" not in pools:
            continue
        # Each engine's rows, read once: role -> (pool, engine row, windows, KV tokens).
        trio = {}
        for role, p in (
            ("regime", pool),
            ("advice", f"{pool}-advice"),
            ("control", f"{pool}-control"),
        ):
            e = engines[engines["pool"] == p].iloc[0]
            trio[role] = (p, e, src.windows(pool=p), float(e.num_gpu_blocks * e.block_size))
        _, _, w, kv_tokens = trio["regime"]
        kv_model = StepTimeModel().fit(w, kv_tokens=kv_tokens)
        plain = StepTimeModel().fit(w)
        for role, (_, e, ew, ekv) in trio.items():
            t = top_load(ew, ekv)
            pred = [
                float(m.step_s(t["batch"], t["prompt_per_step"], t["kv_per_seq"]))
                + m.d_s_ * t["preemptions_per_step"]
                for m in (kv_model, plain)
            ]
            print(
                f"| {pool} | {role} | {e.num_gpu_blocks:,} | "
                f"{t['batch']:.1f} | {t['kv_per_seq']:.0f} | {t['step_s'] * 1e3:.2f} ms | "
                f"{pred[0] * 1e3:.2f} ms ({pred[0] / t['step_s']:.2f}) | "
                f"{pred[1] * 1e3:.2f} ms ({pred[1] / t['step_s']:.2f}) |"
            )
        slope = full_batch_slope_ms_per_1k(trio["control"][2], trio["control"][3])
        lo, hi = kv_model.k_interval_s_
        print(
            f"\n{pool}: per KV token {kv_model.k_s_ * 1e6:.2f} us (90%: {lo * 1e6:.2f}-"
            f"{hi * 1e6:.2f}{', not separated: left out' if kv_model.k_s_ == 0 else ''}); "
            f"the control's full batch measures {slope:.2f} ms per 1,000 KV tokens\n"
        )
        runs.append(
            {
                role: {
                    "engines": engines[engines["pool"] == p].to_dict("records"),
                    "windows": ew.to_dict("records"),
                    **(
                        {"requests": src.requests(pool=p).to_dict("records")}
                        if role == "regime"
                        else {}
                    ),
                }
                for role, (p, _, ew, _) in trio.items()
            }
        )
    return runs


def _plain(v: object) -> object:
    """JSON for the values a store's frames hold (NumPy scalars, NaN as null)."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", nargs="+", help="a collector's DuckDB store (more with --what-if)")
    parser.add_argument("--pool-like", default="", help="only pools whose name contains this")
    parser.add_argument(
        "--batch",
        default="1,2,4,8,12,16,32",
        help="batches to show, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="check the step-time model's predictions for the advice's and the control's "
        "engines against their measured steps (module docstring)",
    )
    parser.add_argument("--export", metavar="FILE", help="with --what-if: write a test fixture")
    args = parser.parse_args(argv)
    if args.what_if:
        return what_if(args.store, args.pool_like, args.export)
    if len(args.store) > 1:
        parser.error("one store at a time without --what-if")
    batches = [int(b) for b in args.batch.split(",")]
    con = duckdb.connect(args.store[0], read_only=True)
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
