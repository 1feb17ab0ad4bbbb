"""``pip install kvscope`` puts exactly one import package, ``kvscope``, into site-packages,
and every part works from that install (not only from the checkout).

The wheel is built from the checkout as pip builds it; the install goes to a folder of its
own (``pip install --target``) that the test puts first on ``PYTHONPATH``, so the checkout
and its editable install are not what is imported. The last test starts the real vLLM CPU
engine on that install and checks the plugin delivers its steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"pip wheel failed:\n{p.stdout}\n{p.stderr}"
    (whl,) = out.glob("kvscope-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"pip install --target failed:\n{p.stdout}\n{p.stderr}"
    return target


def _run(installed: Path, code: str, timeout_s: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=installed.parent,
        timeout=timeout_s,
    )
    assert p.returncode == 0, f"{code}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_the_wheel_holds_one_import_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(info).decode().split() == ["kvscope"]
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "kvscope"
    }
    for part in (
        "engine_plugins/plugin.py",
        "collector/server.py",
        "advisor/analyze.py",
        "sources/prometheus/source.py",
        "cli/main.py",
        "dashboard/app.py",
        "dashboard/_pages/overview.py",
        "report/html.py",
        "lab/engine.py",
        "lab/recordings/overload_kv_starved.jsonl.gz",
        "advisor/advise.schema.json",
        "collector/runbooks/KvscopeKvCacheSaturated.md",  # served at /runbooks/<alert>
        "collector/runbooks/README.md",
        "args.py",
        "py.typed",
    ):
        assert f"kvscope/{part}" in names, f"kvscope/{part} missing from {wheel.name}"
    assert "kvscope = kvscope.engine_plugins.plugin:KvscopeStatLogger" in entry_points
    assert "kvscope = kvscope.cli.main:main" in entry_points


def test_the_installed_package_runs_from_its_install(installed: Path) -> None:
    out = _run(
        installed,
        (
            "import kvscope, kvscope.cli.main, kvscope.cli.dashboard\n"
            "import kvscope.lab.recording as r\n"
            "import importlib.metadata as md\n"
            "print(kvscope.__file__)\n"
            "print(r.BUNDLED_RECORDING.is_file())\n"
            "(ep,) = [e for e in md.entry_points(group='vllm.stat_logger_plugins')"
            " if e.name == 'kvscope']\n"
            "print(ep.value, md.distribution('kvscope').locate_file(''))\n"
        ),
    )
    file, recording, entry = out.splitlines()
    assert file.startswith(str(installed)), f"kvscope imported from {file}, not the install"
    assert recording == "True"
    assert entry.startswith("kvscope.engine_plugins.plugin:KvscopeStatLogger")
    assert str(installed) in entry
    env = {**os.environ, "PYTHONPATH": str(installed)}
    p = subprocess.run(
        [sys.executable, "-m", "kvscope", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=installed.parent,
        timeout=60,
    )
    assert p.returncode == 0 and "advise" in p.stdout and "dashboard" in p.stdout, p.stderr


@pytest.fixture
def engine_on_the_install(installed: Path, tmp_path: Path) -> Iterator[tuple[object, object]]:
    from kvscope.collector.process import CollectorProcess
    from kvscope.lab.engine import VllmServer, build_model, default_model_dir

    collector = CollectorProcess(tmp_path / "store.duckdb", log_path=tmp_path / "collector.log")
    collector.start()
    server = VllmServer(
        build_model(default_model_dir("tiny"), "tiny"),
        served_model_name="installed",
        num_gpu_blocks=128,
        max_num_seqs=8,
        env={
            "PYTHONPATH": str(installed),
            "KVSCOPE_COLLECTOR_URL": collector.url,
            "KVSCOPE_POOL": "installed",
        },
        log_path=tmp_path / "vllm.log",
    )
    try:
        server.start()
        yield server, collector
    finally:
        server.stop()
        collector.stop()


@pytest.mark.engine
def test_the_real_engine_loads_the_plugin_from_the_install(
    engine_on_the_install: tuple[object, object], tmp_path: Path
) -> None:
    from kvscope.collector.process import CollectorProcess
    from kvscope.lab.engine import VllmServer
    from kvscope.lab.sweep import SweepConfig, run_sweep

    server, collector = engine_on_the_install
    assert isinstance(server, VllmServer) and isinstance(collector, CollectorProcess)
    run_sweep(
        SweepConfig(
            url=server.url,
            model="installed",
            concurrency=[2],
            duration_s=3.0,
            warmup_s=0.5,
            cooldown_s=0.2,
            prompt_words=(8, 16),
            output_tokens=(16, 16),
            seed=1,
            progress=False,
        )
    )
    deadline = time.monotonic() + 30
    engines: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        engines = collector.get_json("/v1/engines")["rows"]
        if engines:
            break
        time.sleep(0.5)
    assert [e["pool"] for e in engines] == ["installed"], (
        f"no engine reached the collector; see {tmp_path / 'vllm.log'}"
    )
    steps = collector.get_json("/v1/totals", params={"source": "steps"})["rows"]
    assert steps and steps[0]["n_steps"] > 0
