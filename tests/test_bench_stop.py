"""A bench script stopped with SIGTERM stops what it started.

The benches start a collector and real engines as subprocesses inside ``with`` blocks;
Python's default SIGTERM ends the script without running them, which left a collector
holding its port and store after ``kill``. :func:`run_stoppable` unwinds them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import contextlib, sys, time
from pathlib import Path
from kvscope.cli._lifecycle import run_stoppable

@contextlib.contextmanager
def started(path):
    Path(path).write_text("running")
    try:
        yield
    finally:
        Path(path).write_text("stopped")

def main():
    with started(sys.argv[1]):
        time.sleep(60)
    return 0

raise SystemExit(run_stoppable(main))
"""


def test_a_bench_stopped_with_sigterm_runs_its_exits_and_says_so(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(mark)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (mark.exists() and mark.read_text() == "running"):
        assert proc.poll() is None and time.monotonic() < deadline, "the script did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert mark.read_text() == "stopped"  # the with block's exit ran
    assert "stopped by SIGTERM" in err


def test_every_bench_that_starts_engines_or_a_collector_runs_stoppable() -> None:
    bench = Path(__file__).resolve().parents[1] / "bench"
    for path in sorted(bench.glob("*.py")):
        text = path.read_text()
        if not any(k in text for k in ("AdvisorLab", "VllmServer", "CollectorProcess")):
            continue
        if 'if __name__ == "__main__":' not in text:
            continue  # a module other benches import
        assert "run_stoppable(main)" in text, path.name


FORKING = """
import multiprocessing, sys, time
from kvscope.cli._lifecycle import run_stoppable

def work():
    time.sleep(60)

def main():
    p = multiprocessing.get_context("fork").Process(target=work)
    p.start()
    print("started", flush=True)
    try:
        p.join()
    finally:
        p.join(10)
    return 0

raise SystemExit(run_stoppable(main))
"""


def test_a_forked_worker_sigtermed_with_its_bench_exits_without_a_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)  # as `pkill -f` or a container stop reaches both
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert "Traceback" not in err, err
    assert "stopped by SIGTERM" in err
