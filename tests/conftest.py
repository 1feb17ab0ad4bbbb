"""Test-suite wide hooks."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that start the real vLLM engine last.

    The engine busy-polls a core while it runs; keeping it out of the way lets the
    fast tests (some of which drive small local servers) run on a quiet machine.
    """
    items.sort(key=lambda item: item.get_closest_marker("engine") is not None)
