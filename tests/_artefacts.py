"""Files a test run keeps for people to look at: the browser tests' screenshots and pages,
the weekly report it rendered.

Pytest's temp dirs are pruned after a few runs and are per worker; the kept copies go to
one folder of the clone, ``build/test-artefacts/<group>/`` (``$KVSCOPE_TEST_ARTEFACTS``
instead when set), which ``scripts/test`` empties before a run and lists after it, so a CI
job can collect them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def artefact_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_TEST_ARTEFACTS") or ROOT / "build" / "test-artefacts")


def keep(path: Path, group: str) -> Path:
    """A copy of ``path`` (a file) under the artefact folder's ``group``; its path."""
    dest = artefact_dir() / group / path.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, dest)
    return dest
