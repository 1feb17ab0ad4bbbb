"""Query building and reading for :class:`~kvscope.sources.prometheus.source.PrometheusSource`: the
PromQL per quantity, values on the window grid, counter increases, the windows and
pseudo-requests of vLLM's series and of kvscope's (see :mod:`kvscope.sources.prometheus.source` for
what each column means)."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvscope.sources.prometheus.client import PromClient
from kvscope.sources.prometheus.frames import (
    HISTOGRAM_COLUMNS,
    WINDOW_COUNTS,
    footprint_tokens,
    increases,
    infer_max_num_seqs,
    kvscope_windows,
    late_groups,
    pseudo_requests,
    spread_over_groups,
)
from kvscope.sources.prometheus.promql import with_matchers
from kvscope.sources.prometheus.vllm_metrics import HISTOGRAM, ROLES, wire_names

_VLLM_KEYS = ("instance", "pod", "engine")
KV_PREFIX = "kvscope_engine_"
KV_PROBE = "kvscope_engine_steps_total"
KVSCOPE_SMOOTH_STEPS = 2
"""Windows a kvscope counter increase is averaged over at short steps (see Reader.read_kvscope)."""
LATE_MAX_GAP_S = 60.0
"""The longest stretch of windows that a collector's late steps are spread back over (see
:func:`~kvscope.sources.prometheus.frames.late_groups`)."""
_INT_CFG = (
    "num_gpu_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
)


def num(v: Any) -> float:
    """A finite float, else NaN (labels and JSON values)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def _bool(v: Any) -> bool | None:
    s = str(v).strip().lower()
    return True if s == "true" else False if s == "false" else None


@dataclass
class Fetch:
    """Everything read for one time range."""

    since: float
    until: float
    names: set[str]
    vllm: dict[str, list[str]] = field(default_factory=dict)
    kvscope: bool = False
    step_s: int = 0
    kv_step_s: int = 0
    scrape_s: float = math.nan
    fine: bool = True
    windows: pd.DataFrame = field(default_factory=pd.DataFrame)
    requests: pd.DataFrame = field(default_factory=pd.DataFrame)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    request_scale: float = 1.0
    inferred: dict[str, int] = field(default_factory=dict)


class Reader:
    """Reads one range of series for a source (its client, selector and pool label)."""

    def __init__(
        self, client: PromClient, inner: str, pool_label: str | None, max_requests: int
    ) -> None:
        self.client = client
        self.inner = inner
        self.pool_label = pool_label
        self.max_requests = max_requests

    def sel(self, fams: list[str], kind: str, suffix: str = "") -> str:
        wires = [(f + suffix) if kind == HISTOGRAM else wire_names(f, kind)[0] for f in fams]
        if len(wires) == 1:
            return with_matchers(wires[0], self.inner)
        alt = "|".join(w.replace(".", "\\\\.") for w in wires)
        return with_matchers("", self.inner, f'__name__=~"{alt}"')

    @staticmethod
    def dur(seconds: float) -> str:
        return f"{max(1, round(seconds * 1000))}ms"

    def gauge(self, sel: str, by: str, f: Fetch, agg: str = "avg") -> str:
        """A gauge per window: the scraped value, or its ``agg`` over the window."""
        if f.fine:
            return f"max by ({by}) ({sel})"
        return f"max by ({by}) ({agg}_over_time({sel}[{self.dur(f.step_s)}]))"

    @staticmethod
    def raw(sel: str, by: str) -> str:
        """A counter's latest value at each grid point (differenced here, see _counters)."""
        return f"max by ({by}) ({sel})"

    def scrape_interval(self, probe: str, since: float, until: float) -> float:
        """Median gap between raw samples of ``probe`` (at the end of the range, else its
        start); 15 s when no series has two samples there."""
        span = min(600.0, max(1.0, until - since))
        for at in (until, min(until, since + span)):
            gaps: list[float] = []
            for _, pts in self.client.raw_samples(f"{probe}[{self.dur(span)}]", at):
                ts = [t for t, _ in pts]
                gaps.extend(b - a for a, b in itertools.pairwise(ts) if b > a)
            if gaps:
                return float(statistics.median(gaps))
        return 15.0

    def grid(self, f: Fetch) -> np.ndarray:
        """Window end times ``t_k``; window ``k`` covers ``(t_k - step, t_k]``."""
        step = f.step_s
        first = math.ceil(f.since / step) * step + step
        last = math.floor(f.until / step) * step
        return np.arange(first, last + step, step, dtype=float) if last >= first else np.zeros(0)

    def on_grid(
        self, expr: str, grid: np.ndarray, f: Fetch, lead: int = 1
    ) -> list[tuple[dict[str, str], np.ndarray]]:
        """Each series of ``expr`` at ``lead`` points before the grid and on it (NaN where
        the backend has no value): the points before the first window are for differences."""
        if not len(grid):
            return []
        t0 = float(grid[0]) - lead * f.step_s
        n = len(grid) + lead
        out = []
        for labels, pts in self.client.query_range(expr, t0, float(grid[-1]), f.step_s):
            arr = np.full(n, math.nan)
            for t, v in pts:
                k = round((t - t0) / f.step_s)
                if 0 <= k < n:
                    arr[k] = v
            out.append((labels, arr))
        return out

    @staticmethod
    def smoothed(arr: np.ndarray, intervals: int, groups: np.ndarray | None = None) -> np.ndarray:
        """Increases per window, averaged over the last ``intervals`` grid intervals (NaN
        ones left out); ``arr`` has ``intervals`` leading points. ``groups``: increases
        counted late shared first over the intervals they belong to
        (:func:`~kvscope.sources.prometheus.frames.late_groups`)."""
        d = increases(arr)
        if groups is not None:
            d = spread_over_groups(d, groups)
        if intervals == 1:
            return d
        stack = np.stack([d[i : len(d) - intervals + 1 + i] for i in range(intervals)])
        ok = np.isfinite(stack)
        n = ok.sum(axis=0)
        total = np.where(ok, stack, 0.0).sum(axis=0)
        return np.where(n > 0, total / np.maximum(n, 1), math.nan)

    def engine_id(self, labels: dict[str, str], kind: str) -> str:
        if kind == "kvscope":
            return labels.get("engine", "")
        where = labels.get("instance") or labels.get("pod") or labels.get("job") or "?"
        return f"{where}:{labels.get('engine') or '0'}"

    def pool_of(self, labels: dict[str, str], kind: str) -> str:
        label = self.pool_label or ("pool" if kind == "kvscope" else "model_name")
        return labels.get(label) or labels.get("job") or "default"

    def columns(
        self,
        gauges: dict[str, str],
        counters: dict[str, str],
        grid: np.ndarray,
        f: Fetch,
        kind: str,
        ids: dict[str, dict[str, str]],
        smooth: int = 1,
        late: dict[str, np.ndarray] | None = None,
        marks: dict[str, np.ndarray] | None = None,
    ) -> dict[str, dict[str, np.ndarray]]:
        """Per engine, per column, one value per window: gauges as read, counters as their
        increase over the window (reset-aware, see :func:`~kvscope.sources.prometheus.frames.increases`;
        averaged over ``smooth`` windows). ``late``: given, it is filled with each engine's
        :func:`~kvscope.sources.prometheus.frames.late_groups` (from its ``n_steps`` counter
        and its latest step's time in ``marks``, both at the grid's points with the
        ``smooth`` before it; up to ``LATE_MAX_GAP_S`` of grid), and every counter of the
        engine is spread over them before the average."""
        raw: dict[str, dict[str, np.ndarray]] = {}
        for col, expr in (*gauges.items(), *counters.items()):
            for labels, arr in self.on_grid(expr, grid, f, lead=smooth):
                eid = self.engine_id(labels, kind)
                ids.setdefault(eid, labels)
                raw.setdefault(eid, {})[col] = arr
        out: dict[str, dict[str, np.ndarray]] = {}
        gap = int(LATE_MAX_GAP_S // f.step_s)
        points = (
            np.concatenate([grid[0] - f.step_s * np.arange(smooth, 0, -1), grid])
            if len(grid)
            else grid
        )
        for eid, by_col in raw.items():
            groups = None
            mark = (marks or {}).get(eid)
            if late is not None and "n_steps" in by_col and mark is not None:
                steps = increases(by_col["n_steps"])
                groups = late[eid] = late_groups(steps, mark, points, gap)
            out[eid] = {
                col: self.smoothed(arr, smooth, groups) if col in counters else arr[smooth:]
                for col, arr in by_col.items()
            }
        return out

    def buckets(
        self,
        sel: str,
        by: str,
        grid: np.ndarray,
        f: Fetch,
        kind: str = "vllm",
        smooth: int = 1,
        late: dict[str, np.ndarray] | None = None,
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per engine: bucket bounds and per-window cumulative counts (windows x buckets);
        ``late``: the engines' groups of late increases (see :meth:`columns`)."""
        per: dict[str, dict[float, np.ndarray]] = {}
        late = late or {}
        for labels, arr in self.on_grid(self.raw(sel, f"{by}, le"), grid, f, lead=smooth):
            le = num(labels.get("le", "nan").replace("+Inf", "inf"))
            if not math.isnan(le):
                eid = self.engine_id(labels, kind)
                per.setdefault(eid, {})[le] = self.smoothed(arr, smooth, late.get(eid))
        out = {}
        for eid, by_le in per.items():
            les = np.array(sorted(by_le))
            out[eid] = (les, np.stack([by_le[x] for x in les], axis=1))
        return out

    def reasons(
        self, sel: str, by: str, grid: np.ndarray, f: Fetch
    ) -> dict[str, tuple[list[str], np.ndarray]]:
        """Per engine: the finish reasons and their increases per window (windows x
        reasons), from vLLM's ``request_success`` counter by ``finished_reason``."""
        per: dict[str, dict[str, np.ndarray]] = {}
        for labels, arr in self.on_grid(self.raw(sel, f"{by}, finished_reason"), grid, f):
            reason = labels.get("finished_reason")
            if reason:
                eid = self.engine_id(labels, "vllm")
                per.setdefault(eid, {})[reason] = self.smoothed(arr, 1)
        return {
            eid: (sorted(by_r), np.stack([by_r[r] for r in sorted(by_r)], axis=1))
            for eid, by_r in per.items()
        }

    def read_vllm(self, f: Fetch, grid: np.ndarray) -> None:
        roles = f.vllm
        keys = [*_VLLM_KEYS, "model_name"]
        if self.pool_label and self.pool_label not in keys:
            keys.append(self.pool_label)
        by = ", ".join(keys)

        def sel(role: str, suffix: str = "") -> str:
            return self.sel(roles[role], ROLES[role].kind, suffix)

        gauges = {
            "snapshot": self.gauge(sel("running"), by, f),
            "batch_max": self.gauge(sel("running"), by, f, "max"),
        }
        if "waiting" in roles:
            gauges["waiting_mean"] = self.gauge(sel("waiting"), by, f)
        if "kv_usage" in roles:
            gauges["kv_usage_sampled"] = self.gauge(sel("kv_usage"), by, f)
            gauges["kv_usage_max"] = self.gauge(sel("kv_usage"), by, f, "max")
        counters: dict[str, str] = {
            col: self.raw(sel(col), by)
            for col in (
                "preemptions",
                "prompt_tokens",
                "generation_tokens",
                "prefix_queries",
                "prefix_hits",
                "spec_accepted",
            )
            if col in roles
        }
        if "iterations" in roles:
            counters["n_steps"] = self.raw(sel("iterations", "_count"), by)
        for role in ("request_prompt_tokens", "request_generation_tokens"):
            if role in roles:
                counters[f"{role}:sum"] = self.raw(sel(role, "_sum"), by)
                counters[f"{role}:count"] = self.raw(sel(role, "_count"), by)
        ids: dict[str, dict[str, str]] = {}
        cols = self.columns(gauges, counters, grid, f, "vllm", ids)
        hists = {
            role: self.buckets(sel(role, "_bucket"), by, grid, f)
            for role in set(HISTOGRAM_COLUMNS.values())
            if role in roles
        }
        reasons = (
            self.reasons(sel("request_success"), by, grid, f) if "request_success" in roles else {}
        )
        configs = self.vllm_configs(f.since, f.until)
        totals = {eid: np.nansum(h[1][:, -1]) for eid, h in hists.get("e2e", {}).items()}
        f.request_scale = min(1.0, self.max_requests / max(1.0, sum(totals.values())))
        frames, reqs = [], []
        for eid, c in cols.items():
            if "snapshot" not in c:
                continue
            cfg = self.identity(ids[eid], "vllm")
            cfg.update(configs.get(self.config_key(ids[eid]), {}))
            r = (
                self.pseudo_requests_of(eid, c, hists, grid, f, reasons.get(eid))
                if eid in hists.get("e2e", {})
                else pd.DataFrame()
            )
            w = self.vllm_windows(c, grid, f, cfg, r)
            if not len(w):
                continue
            w.insert(0, "engine_id", eid)
            frames.append(w)
            if len(r):
                reqs.append(r)
            m = infer_max_num_seqs(
                c["batch_max"],
                c.get("waiting_mean", np.zeros(len(grid))),
                w.set_index("ts_s")["kv_usage_mean"]
                .reindex((grid - f.step_s).astype("int64"))
                .to_numpy(float),
                w.set_index("ts_s")["preemptions"]
                .reindex((grid - f.step_s).astype("int64"))
                .to_numpy(float),
            )
            if m is not None:
                cfg["max_num_seqs"] = m
                f.inferred[eid] = m
            cfg["last_step_unix_s"] = float(w["ts_s"].max() + f.step_s)
            f.engines[eid] = cfg
        if frames:
            f.windows = pd.concat([f.windows, *frames], ignore_index=True)
        if reqs:
            f.requests = pd.concat([f.requests, *reqs], ignore_index=True)

    @staticmethod
    def vllm_windows(
        c: dict[str, np.ndarray],
        grid: np.ndarray,
        f: Fetch,
        cfg: dict[str, Any],
        requests: pd.DataFrame,
    ) -> pd.DataFrame:
        n, step = len(grid), f.step_s
        nan = np.full(n, math.nan)
        snap = c["snapshot"]
        rate = {
            k: c[k] / step if k in c else nan
            for k in (
                "n_steps",
                "preemptions",
                "prompt_tokens",
                "generation_tokens",
                "prefix_queries",
                "prefix_hits",
                "spec_accepted",
            )
        }
        gen, steps = rate["generation_tokens"], rate["n_steps"]
        # With speculative decoding a sequence gains 1 + its accepted draft tokens per step:
        # the batch is the generated tokens less the accepted drafts, per step.
        decode = gen - np.nan_to_num(rate["spec_accepted"], nan=0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            if "n_steps" not in c:  # no iteration histogram: one token per sequence per step
                steps = decode / np.where(snap > 0, snap, math.nan)
                batch = snap
            else:  # decode tokens per step: the batch averaged over every step
                batch = np.where(
                    (steps >= 1) & np.isfinite(decode),
                    decode / np.where(steps >= 1, steps, 1.0),
                    snap,
                )
            kv_tokens = num(cfg.get("num_gpu_blocks")) * num(cfg.get("block_size"))
            est = (
                np.minimum(
                    1.0, batch * footprint_tokens(requests, num(cfg.get("block_size"))) / kv_tokens
                )
                if len(requests) and kv_tokens > 0
                else nan
            )
        # KV usage is vLLM's own gauge (sampled once per scrape, between steps); the
        # footprint estimate is kept beside it for display, never in its place, so a
        # verdict does not restate the advisor's own model. A full cache between samples
        # shows in the preemptions, which the bottleneck classifier reads.
        sampled = c.get("kv_usage_sampled", nan)
        kv = sampled
        # The fewer requests running at the two scrapes bounding the window (at coarser
        # steps unknown). vLLM steps back to back while it holds a request, so where
        # requests ran at these and at the neighbours' edges it worked through the second
        # (prepare_windows' running-across-edges rule, as for the collector's windows): a
        # second with few steps there is long steps (a KV-starved engine recomputing
        # preempted requests), not idle time, and stays in the curve. The step-count
        # estimate of the busy share took those seconds for idle and dropped the slowest
        # seconds of the saturated level (its plateau read 1.10-1.20x the collector's).
        running_min = np.minimum(snap, np.concatenate(([math.nan], snap[:-1]))) if f.fine else nan
        w = pd.DataFrame(
            {
                "ts_s": (grid - step).astype("int64"),
                "n_steps": steps,
                "batch_mean": batch,
                "batch_p50": batch,
                "batch_p90": c["batch_max"],
                "batch_max": c["batch_max"],
                "batch_min": running_min,
                "batch_sum": batch * steps,
                "waiting_mean": c.get("waiting_mean", np.zeros(n)),
                "deferred_mean": np.zeros(n),
                "kv_usage_mean": kv,
                "kv_usage_max": np.fmax(c.get("kv_usage_max", nan), kv),
                "kv_usage_sampled": sampled,
                "kv_usage_estimated": est,
                **{k: rate[k] for k in WINDOW_COUNTS},
                "first_step_unix_s": nan,
                "last_step_unix_s": nan,
            }
        )
        return w[np.isfinite(snap)].reset_index(drop=True)

    def pseudo_requests_of(
        self,
        eid: str,
        c: dict[str, np.ndarray],
        hists: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]],
        grid: np.ndarray,
        f: Fetch,
        reasons: tuple[list[str], np.ndarray] | None = None,
    ) -> pd.DataFrame:
        buckets = {role: h[eid] for role, h in hists.items() if eid in h}
        counts = buckets["e2e"][1][:, -1]
        nan = np.full(len(grid), math.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = {
                "request_generation_tokens": c.get("request_generation_tokens:sum", nan)
                / c.get("request_generation_tokens:count", nan)
            }
            prompt = c.get("request_prompt_tokens:sum", nan) / c.get(
                "request_prompt_tokens:count", nan
            )
        fallback = float(np.nanmean(prompt)) if np.isfinite(prompt).any() else math.nan
        prompt = np.where(np.isfinite(prompt), prompt, fallback)
        q = float(np.nansum(c.get("prefix_queries", np.zeros(1))))
        hit = float(np.nansum(c.get("prefix_hits", np.zeros(1))))
        share = min(1.0, hit / q) if q > 0 else 0.0
        return pseudo_requests(
            eid,
            grid - f.step_s,
            counts,
            buckets,
            means,
            scale=f.request_scale,
            prompt_tokens=prompt,
            cached_share=share,
            reasons=reasons,
        )

    def read_kvscope(self, f: Fetch, grid: np.ndarray) -> None:
        keys = ["engine", "pool", "model"]
        if self.pool_label and self.pool_label not in keys:
            keys.append(self.pool_label)
        by = ", ".join(keys)

        def s(name: str) -> str:
            return with_matchers(KV_PREFIX + name, self.inner)

        gauges = {
            "waiting_mean": self.gauge(s("waiting_requests"), by, f),
            "deferred_mean": self.gauge(s("deferred_requests"), by, f),
        }
        counters = {
            col: self.raw(s(name), by)
            for col, name in (
                ("batch:sum", "step_batch_size_sum"),
                ("batch:count", "step_batch_size_count"),
                ("kv:sum", "step_kv_usage_ratio_sum"),
                ("kv:count", "step_kv_usage_ratio_count"),
                ("n_steps", "steps_total"),
                ("preemptions", "preemptions_total"),
                ("prompt_tokens", "prompt_tokens_total"),
                ("generation_tokens", "generation_tokens_total"),
                ("prefix_queries", "prefix_cache_query_tokens_total"),
                ("prefix_hits", "prefix_cache_hit_tokens_total"),
                ("waiting:sum", "waiting_request_steps_total"),
                ("deferred:sum", "deferred_request_steps_total"),
            )
        }
        ids: dict[str, dict[str, str]] = {}
        # A collector's counters move once per plugin batch (about a second): at steps that
        # short a window holds zero or two batches. Counting each window's increase as the
        # mean over two steps takes the jitter out (at 1 s: a 2 s moving average).
        # Steps that reach the collector late (the plugin's batches sent together after it
        # was unreachable) are put back over the seconds they left without a step first;
        # the collector's latest step time, scraped with its counters, tells which.
        smooth = KVSCOPE_SMOOTH_STEPS if f.step_s < 2 * KVSCOPE_SMOOTH_STEPS else 1
        late: dict[str, np.ndarray] = {}
        marks = {
            self.engine_id(labels, "kvscope"): arr
            for labels, arr in self.on_grid(
                self.raw(s("last_step_timestamp_seconds"), by), grid, f, lead=smooth
            )
        }
        cols = self.columns(gauges, counters, grid, f, "kvscope", ids, smooth, late, marks)
        batch_b = self.buckets(s("step_batch_size_bucket"), by, grid, f, "kvscope", smooth, late)
        kv_b = self.buckets(s("step_kv_usage_ratio_bucket"), by, grid, f, "kvscope", smooth, late)
        infos = {
            lab.get("engine", ""): lab for lab in self.client.series(s("info"), f.since, f.until)
        }
        frames = []
        for eid, c in cols.items():
            if not eid or "batch:sum" not in c:
                continue
            w = kvscope_windows(c, grid, f.step_s, batch_b.get(eid), kv_b.get(eid))
            w = w[np.isfinite(w["batch_mean"].to_numpy(float))].reset_index(drop=True)
            if not len(w):
                continue
            # A vLLM engine with the same id: the per-step windows replace its gauges.
            if len(f.windows) and eid in set(f.windows["engine_id"]):
                f.windows = f.windows[f.windows["engine_id"] != eid]
            w.insert(0, "engine_id", eid)
            frames.append(w)
            cfg = self.identity(ids[eid], "kvscope")
            for k, v in infos.get(eid, {}).items():
                if k in _INT_CFG or k == "gpu_memory_utilization":
                    cfg[k] = num(v)
                elif k == "enable_prefix_caching":
                    cfg[k] = _bool(v)
                elif k in ("host", "vllm_version", "kv_cache_dtype", "kvscope_version"):
                    cfg[k] = v or None
            cfg["last_step_unix_s"] = float(w["ts_s"].max() + f.step_s)
            f.engines[eid] = {**f.engines.get(eid, {}), **cfg}
        if frames:
            f.windows = pd.concat([f.windows, *frames], ignore_index=True)

    def identity(self, labels: dict[str, str], kind: str) -> dict[str, Any]:
        eid = self.engine_id(labels, kind)
        inst = labels.get("instance", "")
        host, _, port = inst.rpartition(":") if ":" in inst else (inst, "", "")
        return {
            "engine_id": eid,
            "pool": self.pool_of(labels, kind),
            "model": labels.get("model_name" if kind == "vllm" else "model") or None,
            "host": host or labels.get("pod") or None,
            "port": int(port) if port.isdigit() else None,
            "engine_index": int(labels["engine"])
            if kind == "vllm" and labels.get("engine", "").isdigit()
            else None,
            "instance": inst or None,
            "job": labels.get("job") or None,
            "series": "kvscope" if kind == "kvscope" else "vllm",
        }

    @staticmethod
    def config_key(labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(k, "") for k in _VLLM_KEYS)

    def vllm_configs(self, since: float, until: float) -> dict[tuple[str, ...], dict[str, Any]]:
        """``vllm:cache_config_info`` labels per (instance, pod, engine)."""
        out: dict[tuple[str, ...], dict[str, Any]] = {}
        match = with_matchers("vllm:cache_config_info", self.inner)
        for lab in self.client.series(match, since, until):
            out[self.config_key(lab)] = {
                "num_gpu_blocks": num(lab.get("num_gpu_blocks")),
                "block_size": num(lab.get("block_size")),
                "enable_prefix_caching": _bool(lab.get("enable_prefix_caching")),
                "kv_cache_dtype": lab.get("cache_dtype") or None,
                "gpu_memory_utilization": num(lab.get("gpu_memory_utilization")),
            }
        return out
