"""Without KVSCOPE_COLLECTOR_URL the plugin is loaded, says so once, and stays out of the way."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from kvscope.lab.engine import VllmServer

pytestmark = pytest.mark.engine


def test_plugin_is_inert_without_a_collector_url(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for key in list(os.environ):
        if key.startswith("KVSCOPE_"):
            monkeypatch.delenv(key)
    log = tmp_path / "vllm.log"
    with VllmServer(
        tiny_model, served_model_name="tiny", num_gpu_blocks=64, log_path=log
    ) as server:
        for i in range(3):
            body = json.dumps({"model": "tiny", "prompt": f"one two {i}", "max_tokens": 8}).encode()
            req = urllib.request.Request(
                server.url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
        # Read while the server still runs: stopping the process group may make vLLM
        # log its own shutdown traceback, which says nothing about the plugin.
        text = log.read_text(errors="replace")
    inert_lines = [ln for ln in text.splitlines() if "KVSCOPE_COLLECTOR_URL" in ln]
    assert len(inert_lines) == 1, inert_lines
    assert "inert" in inert_lines[0].lower() or "disabled" in inert_lines[0].lower()
    assert "Traceback" not in text
