"""Fixtures: a live collector on a loopback port with a fresh store file."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _collector_helpers import LiveCollector

from kvscope.collector.settings import Settings


@pytest.fixture
def store_path(tmp_path: Path) -> str:
    return str(tmp_path / "kvscope.duckdb")


@pytest.fixture
def make_collector(store_path: str) -> Iterator[Callable[..., LiveCollector]]:
    started: list[LiveCollector] = []

    def make(**over: Any) -> LiveCollector:
        # Test data uses old timestamps: keep raw steps unless a test asks for retention.
        over.setdefault("raw_step_retention_s", 0)
        over.setdefault("max_backfill_s", 0)  # and accept them at the door
        settings = Settings(port=0, store_path=over.pop("store_path", store_path), **over)
        lc = LiveCollector(settings)
        started.append(lc)
        return lc

    yield make
    for lc in started:
        lc.stop()


@pytest.fixture
def collector(make_collector: Callable[..., LiveCollector]) -> LiveCollector:
    return make_collector()
