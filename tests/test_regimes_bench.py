"""The regimes bench's bookkeeping (``bench/advisor_regimes.py``): which result counts as
right, the request mix by load, the table. The regimes themselves run on the real engine
(``tests/integration/test_advisor_regimes.py``, ``-m matrix``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.advisor_regimes import REGIMES, RegimeResult, table
from bench.noise import FAILS, HOLDS, ratio


def _result(verdict: dict[str, Any], **kw: Any) -> RegimeResult:
    return RegimeResult(
        name="r", expected=kw.pop("expected", ("kv_cache_bound",)), verdict=verdict,
        evidence={}, levels=[], **kw,
    )  # fmt: skip


def _cap(throughput: str, p99: str | None) -> dict[str, Any]:
    r = ratio([0.95, 0.97, 0.96], [1.0, 1.01, 0.99])
    return {
        "throughput": asdict(r),
        "throughput_verdict": throughput,
        "p99": asdict(r),
        "p99_verdict": p99,
    }


def test_a_refuted_cap_makes_the_regime_wrong() -> None:
    v = {"bottleneck": "kv_cache_bound", "knee_concurrency": 8.0, "recommended_concurrency_cap": 9}
    assert _result(v).right and _result(v).cap_holds is None
    assert _result(v, cap=_cap(HOLDS, HOLDS)).right
    assert _result(v, cap=_cap("within noise", HOLDS)).right
    assert not _result(v, cap=_cap(FAILS, HOLDS)).right
    assert not _result(v, cap=_cap(HOLDS, FAILS)).right


def test_an_unsaturated_regime_must_get_no_knee_and_no_cap() -> None:
    expected = ("not_saturated", "no_limit", "compute_bound")
    quiet = {"bottleneck": "not_saturated", "approaching": None, "knee_concurrency": None,
             "recommended_concurrency_cap": None}  # fmt: skip
    assert _result(quiet, expected=expected, no_cap=True).right
    capped = {**quiet, "knee_concurrency": 4.0, "recommended_concurrency_cap": 4}
    assert not _result(capped, expected=expected, no_cap=True).right
    assert not _result({**quiet, "approaching": "kv_cache_bound"}, expected=expected).right


def test_the_diurnal_mix_grows_the_prompts_at_the_peak() -> None:
    r = REGIMES["diurnal-mix"]
    words = [r.mix_of(c) for c in r.concurrency]
    assert words[0] == r.prompt_words
    assert words[-1][0] >= 10 * r.prompt_words[1] // 4  # ten times longer at the peak
    assert words == sorted(words)
    assert r.no_cap and r.control is not None and r.control_scale == 2


def test_the_table_shows_the_cap_check() -> None:
    v = {"bottleneck": "kv_cache_bound", "knee_concurrency": 8.0, "recommended_concurrency_cap": 9}
    text = table([_result(v, cap=_cap(FAILS, HOLDS))])
    row = text.splitlines()[2]
    assert " 9 " in row and "0.96 (" in row and row.rstrip().endswith("NO")
