"""The advisor on more real engine regimes, each against a control that lifts the
suspected limit, and its recommended flag applied to measure the effect it predicts
(``bench/advisor_regimes.py``): every regime x ``KVSCOPE_REGIME_RUNS``
runs (default 3). A long matrix (5 to 20 minutes per regime run), run only when asked::

    scripts/test -m matrix tests/integration/test_advisor_regimes.py -s

The figures are printed in the terminal summary and written to ``advisor_regimes.json``
under pytest's base temporary directory; the latest are in docs/testing.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.advisor_regimes import REGIMES, RegimeLab, RegimeResult, table

pytestmark = [pytest.mark.engine, pytest.mark.matrix]

RUNS = int(os.environ.get("KVSCOPE_REGIME_RUNS", "3"))
RUN_TIMEOUT_S = 40 * 60
"""The longest one regime run may take (the long-output regime's, each level measured
in its steady state: ~20 min): the suite's 900 s per test would stop a regime's runs."""


@pytest.fixture(scope="module")
def regime_lab(mid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegimeLab]:
    lab = RegimeLab(tmp_path_factory.mktemp("regimes"), model_dir=mid_model, log=print)
    results: list[RegimeResult] = []
    lab.results = results  # type: ignore[attr-defined]
    with lab:
        yield lab
    if results:
        path = tmp_path_factory.getbasetemp() / "advisor_regimes.json"
        path.write_text(json.dumps([r.__dict__ for r in results], indent=2, default=float))
        print("\n" + table(results))


@pytest.mark.timeout(RUNS * RUN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(REGIMES))
def test_regime_verdict_matches_its_control(regime_lab: RegimeLab, name: str) -> None:
    runs = [regime_lab.run(REGIMES[name], i) for i in range(RUNS)]
    regime_lab.results.extend(runs)  # type: ignore[attr-defined]
    for r in runs:
        ctl = r.control
        assert r.verdict_right, (
            f"{name}: expected {r.expected}, the advisor said {r.verdict['bottleneck']} "
            f"(approaching {r.verdict.get('approaching')}); evidence {r.evidence}"
        )
        assert r.control_agrees is not False, f"{name}: the control disagrees: {ctl}"
        assert r.knee_and_cap_right, f"{name}: an engine that never saturated got {r.verdict}"
        assert r.cap_holds is not False, f"{name}: the cap's runs refute it: {r.cap}"
        assert r.advice_holds is not False, (
            f"{name}: the recommended flag's measured effect refutes its prediction: "
            f"{ {k: v for k, v in r.advice.items() if k != 'levels'} }"
        )
