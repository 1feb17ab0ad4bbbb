"""The collector's ``/metrics`` with a fleet registered: scrape time, body size, validity.

One command (about a minute)::

    .venv/bin/python bench/metrics_scrape.py [--engines 1000] [--baseline-engines 10]
        [--scrapes 20] [--json out.json]

What it does
------------
A real collector process on a fresh store. First ``--baseline-engines`` simulated
engines (real plugin exporters, batches from the bundled real recordings, see
:mod:`_fleet`) report for a few seconds and stop; ``/metrics`` is scraped
``--scrapes`` times over HTTP (the full GET, as Prometheus does it). Then
``--engines`` engines (the first ones included) report and stop, and the same
scrapes are made. Each body is checked with ``promtool check metrics`` (Debian's
``prometheus`` package).

Baselines in the same run: the collector with ``--baseline-engines`` engines, and
``prometheus_client``'s own ``generate_latest`` over a registry holding the same
families, label sets and histogram buckets as the large scrape (a fresh
``CollectorRegistry`` with ``Gauge`` / ``Counter`` / ``Histogram`` objects), timed
in this process.

Target: a scrape of 1,000 engines under 250 ms (median), and a valid exposition.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _fleet import dump_json, percentile, run_workers
from tqdm import tqdm

from kvscope.collector.process import CollectorProcess

TARGET_S = 0.25
FLEET_ARGS = ["--max-new-engines-per-minute", "1000000", "--advise-interval-s", "0"]


def scrape(collector: CollectorProcess, n: int, desc: str) -> tuple[list[float], str]:
    times, body = [], ""
    for _ in tqdm(range(n), desc=desc, unit="scrape", file=sys.stderr, leave=False):
        t = time.perf_counter()
        body = collector.get_text("/metrics", timeout_s=60.0)
        times.append(time.perf_counter() - t)
    return times, body


def promtool_check(body: str) -> str:
    """``promtool check metrics`` on ``body``: "ok", or its complaints."""
    exe = shutil.which("promtool")
    if exe is None:
        raise SystemExit(
            "promtool not found: install Debian's `prometheus` package "
            "(apt-get install prometheus), as scripts/test does"
        )
    proc = subprocess.run([exe, "check", "metrics"], input=body, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    return "ok" if proc.returncode == 0 and not out else out[:300] or f"exit {proc.returncode}"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def client_registry(body: str) -> tuple[Any, int]:
    """A prometheus_client registry with the families, label sets and buckets of ``body``."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    types: dict[str, str] = {}
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    buckets: dict[str, set[float]] = {}
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels_text, value = m.groups()
        labels = tuple(_LABEL.findall(labels_text or ""))
        family = name
        for suffix in ("_bucket", "_sum", "_count", "_total"):
            if name.endswith(suffix) and name[: -len(suffix)] in types:
                family = name[: -len(suffix)]
        if types.get(family) == "histogram":
            le = dict(labels).get("le")
            labels = tuple(kv for kv in labels if kv[0] != "le")
            if le is not None and le != "+Inf":
                buckets.setdefault(family, set()).add(float(le))
            series.setdefault(family, {})[labels] = 0.0
        else:
            series.setdefault(family, {})[labels] = float(value)
    reg = CollectorRegistry()
    n = 0
    for family, rows in series.items():
        kind = types.get(family, "gauge")
        names = [k for k, _ in next(iter(rows))]
        base = (
            family[: -len("_total")] if kind == "counter" and family.endswith("_total") else family
        )
        if kind == "histogram":
            metric: Any = Histogram(
                family, "h", names, registry=reg, buckets=sorted(buckets.get(family, {1.0}))
            )
        elif kind == "counter":
            metric = Counter(base, "c", names, registry=reg)
        else:
            metric = Gauge(family, "g", names, registry=reg)
        for labels in rows:
            child = metric.labels(*[v for _, v in labels]) if names else metric
            if kind == "histogram":
                child.observe(1.0)
            elif kind == "counter":
                child.inc(max(rows[labels], 0.0))
            else:
                child.set(rows[labels])
            n += 1
    return reg, n


def time_generate_latest(reg: Any, n: int) -> list[float]:
    from prometheus_client import generate_latest

    times = []
    for _ in range(n):
        t = time.perf_counter()
        generate_latest(reg)
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for the method."
    )
    parser.add_argument(
        "--engines",
        type=int,
        default=1000,
        help="engines registered for the measured scrapes (default: 1000)",
    )
    parser.add_argument(
        "--baseline-engines",
        type=int,
        default=10,
        help="engines registered for the baseline scrapes (default: 10)",
    )
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes per case (default: 20)")
    parser.add_argument(
        "--report-s",
        type=float,
        default=6.0,
        help="seconds the engines report before the scrapes (default: 6)",
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.baseline_engines < args.engines:
        parser.error("need 1 <= --baseline-engines < --engines")
    if args.scrapes < 2:
        parser.error("--scrapes must be >= 2")

    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvscope-scrape-") as tmp,
        CollectorProcess(Path(tmp) / "s.duckdb", extra_args=FLEET_ARGS) as collector,
    ):
        for n in (args.baseline_engines, args.engines):
            print(f"{n} engines reporting for {args.report_s:g} s ...", file=sys.stderr)
            fleet = run_workers(collector.url, n, args.report_s)
            retried = sum(1 for p in fleet.posts if p[2] != 200)
            registered = collector.get_json("/healthz")["engines"]
            if registered < n:
                raise SystemExit(
                    f"only {registered} of {n} engines registered; see the "
                    f"collector log: {collector.log_path}"
                )
            if retried:
                tqdm.write(
                    f"{retried} POSTs were retried (the collector was slow to answer a "
                    "fleet registering at once)",
                    file=sys.stderr,
                )
            times, body = scrape(collector, args.scrapes, f"/metrics, {n} engines")
            n_samples = sum(1 for ln in body.splitlines() if ln and not ln.startswith("#"))
            rows.append(
                {
                    "case": f"kvscope /metrics, {n} engines",
                    "engines": n,
                    "median_s": statistics.median(times),
                    "p90_s": percentile(times, 0.9),
                    "bytes": len(body.encode()),
                    "samples": n_samples,
                    "promtool": promtool_check(body),
                }
            )
        reg, n_series = client_registry(body)
        gl = time_generate_latest(reg, args.scrapes)
        from prometheus_client import generate_latest

        gl_body = generate_latest(reg)
        rows.append(
            {
                "case": f"prometheus_client generate_latest, same {n_series} series",
                "engines": args.engines,
                "median_s": statistics.median(gl),
                "p90_s": percentile(gl, 0.9),
                "bytes": len(gl_body),
                "samples": sum(1 for ln in gl_body.splitlines() if ln and not ln.startswith(b"#")),
                "promtool": promtool_check(gl_body.decode()),
            }
        )

    print()
    header = f"{'case':<58} {'median ms':>9} {'p90 ms':>8} {'KiB':>7} {'samples':>8}  promtool"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<58} {r['median_s'] * 1e3:>9.1f} {r['p90_s'] * 1e3:>8.1f} "
            f"{r['bytes'] / 1024:>7.0f} {r['samples']:>8}  {r['promtool']}"
        )
    small, big, client = rows
    print()
    print(
        f"ratio {args.engines} / {args.baseline_engines} engines: "
        f"{big['median_s'] / small['median_s']:.1f}x the time for "
        f"{big['bytes'] / small['bytes']:.1f}x the bytes; kvscope / prometheus_client on "
        f"the same series: {big['median_s'] / client['median_s']:.2f}"
    )
    ok = big["median_s"] < TARGET_S and big["promtool"] == "ok"
    print(
        f"target: median scrape of {args.engines} engines under {TARGET_S * 1e3:.0f} ms and "
        f"promtool clean: {'met' if ok else 'MISSED'}"
    )
    dump_json(args.json, {"rows": rows, "args": vars(args)})
    return 0 if ok else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))
