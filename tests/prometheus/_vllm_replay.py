"""A vLLM ``/metrics`` endpoint replaying a real engine run, for a real Prometheus to scrape.

The exposition is the real vLLM 0.32 scrape (``tests/fixtures/vllm_metrics_sample.txt``)
line for line, its values replaced by the state of a recorded run (a kvscope
recording: the real engine's every step and finished request) at the replay clock:
gauges from the latest step, counters and histograms cumulated over the steps and
requests so far, on top of the fixture's values (a server that served traffic
before). ``speed`` compresses time (recorded seconds per wall second). Options make
the older vLLM layout (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``) and a
restart half-way (every counter back to zero: a counter reset).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from kvscope.collector.process import free_port
from kvscope.lab.recording import Recording

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics_sample.txt"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

#: vLLM 0.9.1's names for what 0.32 calls otherwise.
OLD_NAMES = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total": "vllm:gpu_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "vllm:gpu_prefix_cache_hits_total",
    "vllm:prefix_cache_queries_created": "vllm:gpu_prefix_cache_queries_created",
    "vllm:prefix_cache_hits_created": "vllm:gpu_prefix_cache_hits_created",
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}


def _labels(text: str | None) -> dict[str, str]:
    return dict(_LABEL.findall(text or ""))


def _fmt(v: float) -> str:
    return repr(float(v))


class _Hist:
    """Cumulative bucket counts of observations sorted by time."""

    def __init__(
        self,
        times: np.ndarray,
        values: np.ndarray,
        les: list[float],
        weights: np.ndarray | None = None,
    ) -> None:
        order = np.argsort(times, kind="stable")
        self.times = np.asarray(times, float)[order]
        v = np.asarray(values, float)[order]
        w = np.ones(len(v)) if weights is None else np.asarray(weights, float)[order]
        self.les = les
        ok = np.isfinite(v)
        per = np.stack([(v <= le) & ok for le in les], axis=1) * w[:, None]
        self.cum = np.vstack([np.zeros(len(les)), np.cumsum(per, axis=0)])
        self.count = np.concatenate([[0.0], np.cumsum(w * ok)])
        self.sum = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0) * w)])

    def at(self, t: float) -> tuple[np.ndarray, float, float]:
        k = int(np.searchsorted(self.times, t, side="right"))
        return self.cum[k], float(self.count[k]), float(self.sum[k])


class VllmReplay:
    """Serves ``GET /metrics`` for one replayed engine (see the module docstring)."""

    def __init__(
        self,
        recording: Recording,
        *,
        speed: float = 1.0,
        old_names: bool = False,
        restart_at: float | None = None,
        model: str | None = None,
        template: Path = FIXTURE,
    ) -> None:
        self.speed = speed
        self.old_names = old_names
        self.restart_at = restart_at  # share of the recording after which counters reset
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.target = f"127.0.0.1:{self.port}"
        steps: dict[str, list[Any]] = {}
        reqs: dict[str, list[Any]] = {}
        self.hello: dict[str, Any] = {}
        for b in recording.batches:
            if b.get("hello"):
                self.hello = dict(b["hello"])
            for k, v in b.get("steps", {}).items():
                steps.setdefault(k, []).extend(v)
            for k, v in b.get("requests", {}).items():
                reqs.setdefault(k, []).extend(v)
        self.model = model or str(self.hello.get("model") or "replayed")
        s = {k: np.asarray(v, dtype=float) for k, v in steps.items() if k != "iteration_s"}
        order = np.argsort(s["ts_unix_s"], kind="stable")
        s = {k: v[order] for k, v in s.items()}
        self.t_first, self.t_last = float(s["ts_unix_s"][0]), float(s["ts_unix_s"][-1])
        self.steps = s
        self.cum = {
            k: np.concatenate([[0.0], np.cumsum(s[k])])
            for k in (
                "prefix_queries",
                "prefix_hits",
                "preemptions",
                "prompt_tokens",
                "generation_tokens",
            )
        }
        r = {k: np.asarray(v, dtype=object) for k, v in reqs.items()}
        fin = np.asarray(r["finished_unix_s"], float)

        def col(name: str) -> np.ndarray:
            return np.array([np.nan if x is None else float(x) for x in r[name]], float)

        e2e, queue, prefill, decode = (
            col("e2e_s"),
            col("queue_s"),
            col("prefill_s"),
            col("decode_s"),
        )
        ttft, p, g, c = (
            col("ttft_s"),
            col("prompt_tokens"),
            col("generation_tokens"),
            col("cached_tokens"),
        )
        self.fin = np.sort(fin)
        self.template = template.read_text().splitlines()
        les = self._bucket_bounds()
        itl = decode / np.maximum(g - 1, 1)
        self.hists = {
            "vllm:iteration_tokens_total": _Hist(
                s["ts_unix_s"],
                s["prompt_tokens"] + s["generation_tokens"],
                les["vllm:iteration_tokens_total"],
            ),
            "vllm:request_prompt_tokens": _Hist(fin, p, les["vllm:request_prompt_tokens"]),
            "vllm:request_generation_tokens": _Hist(fin, g, les["vllm:request_generation_tokens"]),
            "vllm:request_max_num_generation_tokens": _Hist(
                fin, g, les["vllm:request_max_num_generation_tokens"]
            ),
            "vllm:request_params_n": _Hist(fin, np.ones(len(fin)), les["vllm:request_params_n"]),
            "vllm:request_params_max_tokens": _Hist(fin, g, les["vllm:request_params_max_tokens"]),
            "vllm:time_to_first_token_seconds": _Hist(
                fin, ttft, les["vllm:time_to_first_token_seconds"]
            ),
            "vllm:inter_token_latency_seconds": _Hist(
                fin, itl, les["vllm:inter_token_latency_seconds"], np.maximum(g - 1, 0)
            ),
            "vllm:request_time_per_output_token_seconds": _Hist(
                fin, itl, les["vllm:request_time_per_output_token_seconds"]
            ),
            "vllm:e2e_request_latency_seconds": _Hist(
                fin, e2e, les["vllm:e2e_request_latency_seconds"]
            ),
            "vllm:request_queue_time_seconds": _Hist(
                fin, queue, les["vllm:request_queue_time_seconds"]
            ),
            "vllm:request_inference_time_seconds": _Hist(
                fin, prefill + decode, les["vllm:request_inference_time_seconds"]
            ),
            "vllm:request_prefill_time_seconds": _Hist(
                fin, prefill, les["vllm:request_prefill_time_seconds"]
            ),
            "vllm:request_decode_time_seconds": _Hist(
                fin, decode, les["vllm:request_decode_time_seconds"]
            ),
            "vllm:request_num_preemptions": _Hist(
                fin, col("preemptions"), les["vllm:request_num_preemptions"]
            ),
            "vllm:request_prefill_kv_computed_tokens": _Hist(
                fin, p - c, les["vllm:request_prefill_kv_computed_tokens"]
            ),
        }
        self.t0_wall: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.scrapes = 0

    def _bucket_bounds(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for line in self.template:
            m = _SAMPLE.match(line)
            if m and m.group(1).endswith("_bucket"):
                le = _labels(m.group(2))["le"]
                out.setdefault(m.group(1)[: -len("_bucket")], []).append(
                    float("inf") if le == "+Inf" else float(le)
                )
        return out

    # -- the replay clock ----------------------------------------------------------------

    @property
    def duration_wall_s(self) -> float:
        return (self.t_last - self.t_first) / self.speed

    def begin(self) -> None:
        """Start the replay now (before: the fixture's state, nothing of the run yet)."""
        self.t0_wall = time.time()

    def recorded_time(self, wall: float) -> float:
        if self.t0_wall is None:
            return self.t_first - 1.0
        return self.t_first + (wall - self.t0_wall) * self.speed

    def wall_time(self, recorded: float) -> float:
        assert self.t0_wall is not None
        return self.t0_wall + (recorded - self.t_first) / self.speed

    # -- the exposition ------------------------------------------------------------------

    def render(self, wall: float | None = None) -> str:
        t = self.recorded_time(time.time() if wall is None else wall)
        t_reset = (
            self.t_first + self.restart_at * (self.t_last - self.t_first)
            if self.restart_at is not None
            else None
        )
        base = 0.0 if t_reset is not None and t >= t_reset else 1.0  # fixture baseline
        t_from = t_reset if t_reset is not None and t >= t_reset else -np.inf
        k = int(np.searchsorted(self.steps["ts_unix_s"], t, side="right"))
        k0 = int(np.searchsorted(self.steps["ts_unix_s"], t_from, side="right"))
        last = k - 1

        def step_val(name: str) -> float:
            return float(self.steps[name][last]) if last >= 0 else 0.0

        def counter(name: str) -> float:
            return float(self.cum[name][k] - self.cum[name][k0])

        n_fin = float(
            np.searchsorted(self.fin, t, side="right")
            - np.searchsorted(self.fin, t_from, side="right")
        )
        gauges = {
            "vllm:num_requests_running": step_val("batch_size"),
            "vllm:num_requests_waiting": step_val("waiting") + step_val("deferred"),
            "vllm:kv_cache_usage_perc": step_val("kv_usage_ratio"),
        }
        counters = {
            "vllm:prefix_cache_queries_total": counter("prefix_queries"),
            "vllm:prefix_cache_hits_total": counter("prefix_hits"),
            "vllm:num_preemptions_total": counter("preemptions"),
            "vllm:prompt_tokens_total": counter("prompt_tokens"),
            "vllm:generation_tokens_total": counter("generation_tokens"),
        }
        hist_state: dict[str, tuple[np.ndarray, float, float]] = {}
        for name, h in self.hists.items():
            cum, cnt, sm = h.at(t)
            if t_reset is not None and t >= t_reset:
                c0, n0, s0 = h.at(t_reset)
                cum, cnt, sm = cum - c0, cnt - n0, sm - s0
            hist_state[name] = (cum, cnt, sm)
        out: list[str] = []
        for line in self.template:
            out.append(self._line(line, gauges, counters, hist_state, n_fin, base))
        self.scrapes += 1
        return "\n".join(out) + "\n"

    def _rename(self, name: str) -> str:
        if not self.old_names:
            return name
        for new, old in OLD_NAMES.items():
            if name == new or (
                name.startswith(new)
                and name[len(new) :] in ("_bucket", "_sum", "_count", "_created")
            ):
                return old + name[len(new) :]
        return name

    def _line(
        self,
        line: str,
        gauges: dict[str, float],
        counters: dict[str, float],
        hists: dict[str, tuple[np.ndarray, float, float]],
        n_fin: float,
        base: float,
    ) -> str:
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3:
                parts[2] = self._rename(parts[2])
            return " ".join(parts)
        m = _SAMPLE.match(line)
        if not m:
            return line
        name, label_text, value = m.group(1), m.group(2), float(m.group(3))
        labels = _labels(label_text)
        if "model_name" in labels:
            labels["model_name"] = self.model
        if name == "vllm:cache_config_info":
            for key in ("num_gpu_blocks", "block_size", "gpu_memory_utilization"):
                if self.hello.get(key) is not None:
                    labels[key] = str(self.hello[key])
            labels["num_gpu_blocks_override"] = labels.get("num_gpu_blocks", "")
            labels["enable_prefix_caching"] = str(bool(self.hello.get("enable_prefix_caching")))
        elif name in gauges:
            value = gauges[name]
        elif name in counters:
            value = base * value + counters[name]
        elif name == "vllm:num_requests_waiting_by_reason":
            value = (
                gauges["vllm:num_requests_waiting"] if labels.get("reason") == "capacity" else 0.0
            )
        elif name == "vllm:request_success_total":
            value = base * value + (n_fin if labels.get("finished_reason") == "length" else 0)
        else:
            for hname, (cum, cnt, sm) in hists.items():
                if name == hname + "_bucket":
                    le = labels["le"]
                    les = self.hists[hname].les
                    i = les.index(float("inf") if le == "+Inf" else float(le))
                    value = base * value + float(cum[i])
                    break
                if name == hname + "_count":
                    value = base * value + cnt
                    break
                if name == hname + "_sum":
                    value = base * value + sm
                    break
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return (
            f"{self._rename(name)}{{{body}}} {_fmt(value)}"
            if labels
            else f"{self._rename(name)} {_fmt(value)}"
        )

    # -- the server ----------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Replay": "vllm"},
        )

    def start(self) -> VllmReplay:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            loop.run_until_complete(site.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="vllm-replay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the replay server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
