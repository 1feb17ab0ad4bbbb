"""The advisor's run on the demo fleet, with kvscope's numeric kernels against the library
calls they replace, measured in the same run.

One command::

    .venv/bin/python bench/advisor_kernels.py [--runs 5] [--json out.json]

What it does
------------
1. Starts a collector and feeds it the bundled real vLLM recordings as three engines (what
   ``kvscope dashboard --demo`` reads; :func:`kvscope.dashboard.demo.demo_collector`).
2. Runs :func:`kvscope.advisor.analyze` over the last 30 minutes ``--runs`` times each way,
   alternating:

   * **baseline**: a load bin's rate by ``scipy.stats.trim_mean(x, 0.25)`` and the monotone
     fit by scikit-learn's ``IsotonicRegression``, as the advisor computed them before;
   * **kvscope**: the same interquartile mean in numpy, and adjacent violators pooled in
     :func:`kvscope.advisor.frames.isotonic_increasing` (both tested against those
     libraries in ``tests/advisor/test_frames.py``).

   Each run includes the reads over HTTP. The concurrency cap's bootstrap (200 refits of
   every engine's curve) calls both kernels thousands of times per run.
3. A table: median seconds per run, the ratio against the baseline, and whether both ways
   gave the same verdicts, knees and caps (they must).

The dashboard runs the advisor once per read; a read that takes longer than its refresh
period keeps the page busy (docs/dashboard.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscope.advisor import CollectorSource, Report, analyze  # noqa: E402
from kvscope.advisor import cap as cap_mod  # noqa: E402
from kvscope.advisor import curve as curve_mod  # noqa: E402
from kvscope.dashboard.demo import demo_collector  # noqa: E402


def _library_level_rate(values: Any) -> float:
    from scipy import stats

    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    return float(stats.trim_mean(x, 0.25)) if len(x) else math.nan


def _library_isotonic(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    from sklearn.isotonic import IsotonicRegression

    y = np.asarray(y, float)
    if len(y) < 2:
        return y.copy()
    x = np.arange(len(y), dtype=float)
    model = IsotonicRegression(increasing=True, out_of_bounds="clip")
    return np.asarray(model.fit(x, y, sample_weight=np.asarray(weights, float)).predict(x))


@contextlib.contextmanager
def library_kernels() -> Iterator[None]:
    """The advisor with the library calls in place of kvscope's kernels."""
    saved = [
        (m, n, getattr(m, n))
        for m in (cap_mod, curve_mod)
        for n in ("level_rate", "isotonic_increasing")
    ]
    for m, n, _ in saved:
        setattr(m, n, _library_level_rate if n == "level_rate" else _library_isotonic)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def _verdicts(r: Report) -> list[tuple[Any, ...]]:
    return [
        (
            v.engine_id,
            v.bottleneck,
            round(v.knee_concurrency or 0.0, 6),
            v.recommended_concurrency_cap,
        )
        for v in r.engines
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs each way (default: 5)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"baseline": [], "kvscope": []}
    verdicts: dict[str, list[tuple[Any, ...]]] = {}
    with demo_collector(Path(tempfile.mkdtemp(prefix="kvscope-bench-")), progress=True) as c:
        src = CollectorSource(c.url)
        since = time.time() - 1800
        analyze(src, since)  # warm: imports, the collector's caches
        for i in range(args.runs):
            for way in ("baseline", "kvscope"):
                ctx = library_kernels() if way == "baseline" else contextlib.nullcontext()
                with ctx:
                    t0 = time.perf_counter()
                    report = analyze(src, since)
                    times[way].append(time.perf_counter() - t0)
                verdicts[way] = _verdicts(report)
                print(f"run {i + 1}/{args.runs} {way}: {times[way][-1]:.2f} s", file=sys.stderr)
    base = statistics.median(times["baseline"])
    same = verdicts["baseline"] == verdicts["kvscope"]
    print(f"advisor runs on the demo fleet ({len(verdicts['kvscope'])} engines, last 30 min)")
    print(f"{'kernels':<10} {'median s':>9} {'ratio':>7}  runs")
    for way in ("baseline", "kvscope"):
        med = statistics.median(times[way])
        runs = " ".join(f"{t:.2f}" for t in times[way])
        print(f"{way:<10} {med:>9.2f} {med / base:>7.2f}  {runs}")
    print(
        f"speed-up {base / statistics.median(times['kvscope']):.1f}x; same verdicts, knees and caps: {same}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"seconds": times, "same_verdicts": same}, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
