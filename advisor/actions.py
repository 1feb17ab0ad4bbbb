"""The weekly action list: what to change, where, what it is expected to do, and where
each piece of advice stands against the week before.

:func:`action_list` lines this week's and the week before's recommendations up by kind and
scope and gives each an :class:`Action` with a ``status``: ``new``, ``open`` (both weeks),
``done`` (last week's, and this week's configuration carries every flag it named, moved as far
as recommended or further) or ``gone`` (no longer made, its flags not in the configuration).
The actions to take come first, grouped by ``gain_kind``
(:data:`~kvscope.advisor.findings.GAIN_KINDS`) and ranked by expected gain within a group only
(a latency cut and a throughput gain are not on one scale); then ``done``, then ``gone``.

See docs/report.md#the-action-list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvscope.advisor.findings import GAIN_KINDS, Recommendation, Report, Scope, _clean

STATUSES = ("new", "open", "done", "gone")
UNQUANTIFIED_KINDS = frozenset({"scale_api_server"})
"""Recommendation kinds whose ``expected_gain`` is no prediction (0 by convention)."""
_ORDER = {k: i for i, k in enumerate((*GAIN_KINDS, "unquantified"))}


@dataclass
class Action:
    """One recommendation as an item of the action list (see the module docstring).

    ``expected_gain`` is None where the advisor does not quantify the effect;
    ``gpu_hours_saved`` / ``usd_saved`` what the change is worth
    (:mod:`kvscope.advisor.gpu_hours`; None for advice without a throughput effect)."""

    recommendation_id: str
    kind: str
    scope: Scope
    summary: str
    flags: list[str]
    gain_kind: str
    expected_gain: float | None
    confidence: float
    status: str
    expected_effect: dict[str, Any] = field(default_factory=dict)
    gpu_hours_saved: float | None = None
    usd_saved: float | None = None

    @property
    def to_take(self) -> bool:
        """Still to do (``new`` or ``open``)."""
        return self.status in ("new", "open")

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Action:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["scope"] = Scope(**d["scope"])
        return cls(**kw)


def _key(r: Recommendation) -> tuple[str, str | None, str | None]:
    return r.kind, r.scope.engine_id, r.scope.pool


def _flags(r: Recommendation) -> list[str]:
    return [str(f) for f in r.change.get("vllm_flags") or []]


def _same(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def _float(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _reached(before: Any, wanted: str, now: Any) -> bool:
    """``now`` is ``wanted``, or a number that moved from ``before`` past ``wanted``."""
    if _same(now, wanted):
        return True
    b, w, n = _float(before), _float(wanted), _float(now)
    if b is None or w is None or n is None or w == b:
        return False
    return (n - b) / (w - b) >= 1.0


def flags_applied(
    flags: list[str], config: dict[str, Any], before: dict[str, Any] | None = None
) -> bool:
    """True when ``config`` carries every ``--name value`` flag (``--max-num-seqs 12``:
    ``max_num_seqs`` is 12, or moved from its value in ``before`` to 12 or beyond); False
    when a flag's field is not in ``config``."""
    if not flags or not config:
        return False
    for flag in flags:
        name, _, value = flag.partition(" ")
        key = name.lstrip("-").replace("-", "_")
        if not value or config.get(key) is None:
            return False
        if not _reached((before or {}).get(key), value.strip(), config[key]):
            return False
    return True


def _action(r: Recommendation, status: str) -> Action:
    quantified = r.kind not in UNQUANTIFIED_KINDS and math.isfinite(r.expected_gain)
    return Action(
        recommendation_id=r.id,
        kind=r.kind,
        scope=r.scope,
        summary=r.summary,
        flags=_flags(r),
        gain_kind=r.gain_kind if quantified else "unquantified",
        expected_gain=float(r.expected_gain) if quantified else None,
        confidence=float(r.confidence),
        status=status,
        expected_effect=dict(r.expected_effect),
    )


def action_list(
    current: Report,
    previous: Report,
    configs: dict[str, dict[str, Any]] | None = None,
    values: dict[str, tuple[float, float | None]] | None = None,
    previous_configs: dict[str, dict[str, Any]] | None = None,
) -> list[Action]:
    """The action list (see the module docstring). ``configs`` and ``previous_configs``
    are each week's configuration per engine id; ``values`` the GPU-hours and USD per
    recommendation id."""
    before = {_key(r): r for r in previous.recommendations}
    now = {_key(r) for r in current.recommendations}
    out = [_action(r, "open" if _key(r) in before else "new") for r in current.recommendations]
    for key, r in before.items():
        if key in now:
            continue
        eid = str(r.scope.engine_id)
        cfg, cfg_before = (configs or {}).get(eid, {}), (previous_configs or {}).get(eid, {})
        done = flags_applied(_flags(r), cfg, cfg_before)
        out.append(_action(r, "done" if done else "gone"))
    for a in out:
        if a.to_take and values and a.recommendation_id in values:
            a.gpu_hours_saved, a.usd_saved = values[a.recommendation_id]

    def rank(a: Action) -> tuple[int, int, float, str, str]:
        group = 0 if a.to_take else STATUSES.index(a.status)
        gain = -(a.expected_gain or 0.0)
        return group, _ORDER.get(a.gain_kind, len(_ORDER)), gain, a.kind, str(a.scope.engine_id)

    return sorted(out, key=rank)
