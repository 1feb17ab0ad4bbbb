"""``kvscope lint``: check a Grafana dashboard or Prometheus rules against what a target exposes.

Every PromQL expression of the file (a dashboard's panel targets and templating
queries, including collapsed rows; a rules file's ``expr``, also inside a Kubernetes
``PrometheusRule``) is scanned with :mod:`kvscope.sources.prometheus.promql`; each metric it selects and
each label it matches or groups by is looked up in the target's exposition: a live
``/metrics`` URL, a saved exposition file, or a Prometheus (``--prometheus``: the names
and labels stored there). A problem comes with its fix: the new name of a metric vLLM
renamed (:mod:`kvscope.sources.prometheus.vllm_metrics`), ``add _total`` for a counter, ``_bucket`` for a
histogram, the labels that are there.

Against an exposition (not a Prometheus) the scraper's own labels ``job`` and
``instance`` count as present; ``--extra-labels`` adds those a relabeling adds.
Metric names whose prefix (up to the first ``:`` or ``_``) the target does not expose at
all (another exporter's) are not checked, and are listed as unchecked.
Recording rules' ``record`` names count as present for the other rules.

Exit codes: 0 clean, 1 problems found, 2 bad input (a file that is neither, an
unreachable target).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvscope.args import TIME_SYNTAX, ParamError, parse_time, positive_duration
from kvscope.sources.prometheus.promql import Expr, PromQLError, scan
from kvscope.sources.prometheus.vllm_metrics import change_for, replacement

__all__ = [
    "Exposure",
    "LintError",
    "Problem",
    "Query",
    "add_parser",
    "check",
    "load_queries",
    "run",
]

SCRAPE_LABELS = frozenset({"job", "instance"})
_GRAFANA_VARS = (
    ("$__rate_interval", "1m"),
    ("$__interval", "1m"),
    ("$__range", "1h"),
    ("${__rate_interval}", "1m"),
    ("${__interval}", "1m"),
    ("${__range}", "1h"),
)


class LintError(ValueError):
    """Bad input: an unreadable file, no queries in it, an unreachable target."""


@dataclass(frozen=True)
class Query:
    where: str
    expr: str


@dataclass
class Problem:
    file: str
    where: str
    expr: str
    kind: str
    subject: str
    problem: str
    fix: str = ""

    def line(self) -> str:
        fix = f"\n    fix: {self.fix}" if self.fix else ""
        return f"{self.file}: {self.where}: {self.problem}{fix}"


# -- what the file asks for ------------------------------------------------------------


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        if not isinstance(p, dict):
            continue
        yield p
        yield from _panels(p.get("panels") or [])


def _is_prometheus(ds: Any) -> bool:
    if isinstance(ds, dict) and ds.get("type"):
        return str(ds["type"]) in ("prometheus", "victoriametrics-datasource")
    return True  # default datasource or a ${datasource} variable


def _template_query(q: Any) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query (None when there is none)."""
    text = q.get("query") if isinstance(q, dict) else q
    if not isinstance(text, str) or not text.strip():
        return None
    text = text.strip()
    m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", text, re.S)
    if m:
        return f"group by ({m.group(2)}) ({m.group(1)})"
    if re.fullmatch(r"label_values\(\s*[A-Za-z_][A-Za-z0-9_]*\s*\)", text):
        return None
    m = re.fullmatch(r"query_result\((.*)\)", text, re.S)
    if m:
        return m.group(1)
    if re.match(r"(metrics|label_names)\(", text):
        return None
    return text


def _dashboard_queries(doc: dict[str, Any]) -> list[Query]:
    inner = doc.get("dashboard")
    dash: dict[str, Any] = inner if isinstance(inner, dict) else doc
    out: list[Query] = []
    panels = list(dash.get("panels") or [])
    for row in dash.get("rows") or []:  # dashboards before schema 16
        panels.extend(row.get("panels") or [])
    for p in _panels(panels):
        title = p.get("title") or f"panel {p.get('id', '?')}"
        for t in p.get("targets") or []:
            if (
                isinstance(t, dict)
                and isinstance(t.get("expr"), str)
                and t["expr"].strip()
                and _is_prometheus(t.get("datasource", p.get("datasource")))
            ):
                out.append(Query(f"panel {title!r} [{t.get('refId', '?')}]", t["expr"]))
    for v in (dash.get("templating") or {}).get("list") or []:
        if isinstance(v, dict) and v.get("type") == "query" and _is_prometheus(v.get("datasource")):
            expr = _template_query(v.get("query"))
            if expr:
                out.append(Query(f"variable ${v.get('name', '?')}", expr))
    return out


def _rules_queries(doc: Any) -> tuple[list[Query], set[str]]:
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if groups is None and isinstance(doc, dict):
        groups = (doc.get("spec") or {}).get("groups")  # a PrometheusRule resource
    if not isinstance(groups, list):
        raise LintError("no 'groups' in the rules file")
    out, records = [], set()
    for g in groups:
        for r in (g or {}).get("rules") or []:
            if not isinstance(r, dict) or not isinstance(r.get("expr"), str | int | float):
                continue
            name = r.get("alert") or r.get("record") or "?"
            if r.get("record"):
                records.add(str(r["record"]))
            kind = "alert" if r.get("alert") else "record"
            out.append(Query(f"{kind} {name} (group {g.get('name', '?')})", str(r["expr"])))
    return out, records


def load_queries(path: str | Path) -> tuple[list[Query], set[str]]:
    """The queries of a dashboard JSON or a rules YAML, and the names recording rules add."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise LintError(f"cannot read {p}: {e.strerror or e}") from e
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise LintError(f"{p}: not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise LintError(f"{p}: not a Grafana dashboard (expected a JSON object)")
        queries, records = _dashboard_queries(doc), set[str]()
    else:
        try:
            import yaml
        except ImportError as e:
            raise LintError(
                "reading a rules file needs PyYAML (part of the 'collector' extra): "
                "pip install 'kvscope[collector]'"
            ) from e
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise LintError(f"{p}: not valid YAML: {e}") from e
        queries, records = _rules_queries(doc)
    if not queries:
        raise LintError(
            f"{p}: no PromQL expressions found (panel targets, template queries or rules)"
        )
    return queries, records


# -- what the target exposes -----------------------------------------------------------


@dataclass
class Exposure:
    """Sample names, their label names and families' types, as a target exposes them."""

    source: str
    labels: dict[str, set[str]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    implicit_labels: frozenset[str] = SCRAPE_LABELS
    declared_only: set[str] = field(default_factory=set)

    @classmethod
    def from_text(cls, text: str, source: str) -> Exposure:
        """Read an exposition with ``prometheus_client.parser``; :class:`LintError` if it is
        not one."""
        from prometheus_client.parser import text_string_to_metric_families

        exp = cls(source)
        try:
            for family in text_string_to_metric_families(text):
                if family.type != "unknown":  # declared by a # TYPE line
                    exp.types[family.name] = family.type
                for sample in family.samples:
                    exp.labels.setdefault(sample.name, set()).update(sample.labels)
        except ValueError as e:
            raise LintError(f"{source}: not a Prometheus text exposition: {e}") from None
        if not exp.labels:
            raise LintError(f"{source}: no samples found: is it a Prometheus /metrics exposition?")
        # Families declared without a series yet (a counter nothing incremented, a gauge
        # for a feature not in use): their names exist, their labels are unknown.
        for fam, kind in exp.types.items():
            for name in _wire(fam, kind):
                if name not in exp.labels:
                    exp.labels[name] = set()
                    exp.declared_only.add(name)
        return exp

    @property
    def names(self) -> set[str]:
        return set(self.labels)

    def prefixes(self) -> set[str]:
        return {_prefix(n) for n in self.labels}

    def family_type(self, name: str) -> str | None:
        for fam, kind in self.types.items():
            if name == fam or (
                name.startswith(fam)
                and name[len(fam) :] in ("_total", "_bucket", "_sum", "_count", "_created")
            ):
                return kind
        return None


def _wire(family: str, kind: str) -> tuple[str, ...]:
    if kind == "counter":
        return (family if family.endswith("_total") else f"{family}_total",)
    if kind == "histogram":
        return (f"{family}_bucket", f"{family}_sum", f"{family}_count")
    if kind == "summary":
        return (family, f"{family}_sum", f"{family}_count")
    return (family,)


def _prefix(name: str) -> str:
    return name.split(":", 1)[0] if ":" in name else name.split("_", 1)[0]


def _fetch_text(url: str, timeout_s: float) -> str:
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return str(r.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as e:
        raise LintError(f"{url} answered {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise LintError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from e


def exposure_of_target(target: str, timeout_s: float = 10.0) -> Exposure:
    """A ``/metrics`` URL (http...) or a saved exposition file."""
    if re.match(r"https?://", target):
        return Exposure.from_text(_fetch_text(target, timeout_s), target)
    try:
        return Exposure.from_text(Path(target).read_text(errors="replace"), target)
    except OSError as e:
        raise LintError(f"cannot read {target}: {e.strerror or e}") from e


def exposure_of_prometheus(
    url: str,
    wanted: Iterable[str],
    *,
    selector: str | None = None,
    since_s: float = 3600.0,
    timeout_s: float = 30.0,
    auth: Any = None,
) -> Exposure:
    """Names stored in a Prometheus over the last ``since_s``, with the label names of the
    ``wanted`` ones (those a file references) and the families' types (metadata API)."""
    from kvscope.advisor.sources import SourceError
    from kvscope.sources.prometheus.client import PromClient
    from kvscope.sources.prometheus.promql import matchers_of_selector, with_matchers

    try:
        inner = matchers_of_selector(selector)
    except PromQLError as e:
        raise LintError(str(e)) from e
    client = PromClient(url, timeout_s=timeout_s, auth=auth)
    now = time.time()
    try:
        names = client.label_values(
            "__name__", with_matchers("", inner, '__name__=~".+"'), now - since_s, now
        )
        exp = Exposure(f"Prometheus {url}", implicit_labels=frozenset())
        for n in names:
            exp.labels[n] = set()
        for n in set(wanted) & set(names):
            for lab in client.series(with_matchers(n, inner), now - since_s, now)[:1000]:
                exp.labels[n].update(k for k in lab if k != "__name__")
        with contextlib.suppress(SourceError):  # types only sharpen the messages
            exp.types.update(client.metadata())
    except SourceError as e:
        raise LintError(str(e)) from e
    return exp


# -- the checks ------------------------------------------------------------------------


def _substitute(expr: str) -> str:
    for var, value in _GRAFANA_VARS:
        expr = expr.replace(var, value)
    return expr


def _matches_empty(op: str, value: str) -> bool:
    if op in ("!=", "!~"):
        return True
    if op == "=":
        return value == ""
    try:
        return re.fullmatch(value, "") is not None
    except re.error:
        return False


def _metric_fix(name: str, exp: Exposure) -> tuple[str, str, str]:
    """(kind, problem, fix) for a metric name the target does not expose."""
    have = exp.names
    found = change_for(name)
    if found is not None:
        c, _ = found
        new = replacement(name)
        when = f"deprecated in vLLM {c.deprecated}, removed {c.removed}"
        if new:
            there = "" if new in have else f" (not exposed by {exp.source} either)"
            return (
                "renamed",
                f"{name} is not exposed: vLLM renamed it ({when})",
                f"use {new}{there}" + (f"; {c.note}" if c.note else ""),
            )
        return (
            "removed",
            f"{name} is not exposed: vLLM removed it ({when})",
            (f"use {c.promql}" if c.promql else "no replacement")
            + (f" ({c.note})" if c.note else ""),
        )
    if f"{name}_total" in have:
        return (
            "missing_total",
            f"{name} is not exposed: it is a counter, exposed as {name}_total",
            f"add _total: {name}_total",
        )
    if f"{name}_bucket" in have:
        return (
            "histogram_base",
            f"{name} is not exposed: it is a histogram",
            f"use {name}_bucket (with histogram_quantile), {name}_sum or {name}_count",
        )
    if name.endswith("_total") and name[:-6] in have:
        return ("extra_total", f"{name} is not exposed", f"remove _total: {name[:-6]}")
    close = difflib.get_close_matches(name, sorted(have), n=3, cutoff=0.75)
    return (
        "missing_metric",
        f"{name} is not exposed by {exp.source}",
        f"closest: {', '.join(close)}" if close else "",
    )


def _check_expr(
    file: str, q: Query, exp: Exposure, records: set[str], unchecked: set[str]
) -> list[Problem]:
    try:
        ex: Expr = scan(_substitute(q.expr))
    except PromQLError as e:
        return [
            Problem(file, q.where, q.expr, "parse_error", "", f"cannot read the expression: {e}")
        ]
    out: list[Problem] = []
    prefixes = exp.prefixes()
    found: list[str] = []
    for sel in ex.selectors:
        if sel.templated:
            continue
        if sel.name is None:
            rx = sel.name_regex
            if rx:
                try:
                    ok = any(re.fullmatch(rx, n) for n in exp.names | records)
                except re.error:
                    ok = True
                if not ok:
                    out.append(
                        Problem(
                            file,
                            q.where,
                            q.expr,
                            "regex_no_match",
                            rx,
                            f'{{__name__=~"{rx}"}} matches no exposed metric',
                        )
                    )
            continue
        name = sel.name
        if name in records:
            continue
        if name not in exp.labels:
            if _prefix(name) not in prefixes and change_for(name) is None:
                unchecked.add(name)
                continue
            kind, problem, fix = _metric_fix(name, exp)
            out.append(Problem(file, q.where, q.expr, kind, name, problem, fix))
            continue
        if name in exp.declared_only:
            continue  # no series yet: its labels cannot be checked
        found.append(name)
        have = exp.labels[name] | exp.implicit_labels
        for m in sel.label_matchers():
            if m.label not in have and not _matches_empty(m.op, m.value):
                out.append(
                    Problem(
                        file,
                        q.where,
                        q.expr,
                        "missing_label",
                        f"{name}{{{m.label}}}",
                        f"label {m.label} is not present on {name}",
                        f"available: {', '.join(sorted(have)) or 'none'}",
                    )
                )
    if found:
        have = (
            set().union(*(exp.labels[n] for n in found)) | exp.implicit_labels | ex.created_labels
        )
        for keyword, label in ex.grouping:
            if label not in have and not label.startswith("$"):
                out.append(
                    Problem(
                        file,
                        q.where,
                        q.expr,
                        "grouping_label",
                        label,
                        f"label {label} (in {keyword}(...)) is not present on "
                        f"{', '.join(sorted(set(found)))}",
                        f"available: {', '.join(sorted(have)) or 'none'}",
                    )
                )
    return out


def check(
    file: str, queries: list[Query], exp: Exposure, records: set[str] | None = None
) -> tuple[list[Problem], set[str]]:
    """Problems of every query, and the metric names left unchecked (foreign prefixes)."""
    unchecked: set[str] = set()
    out: list[Problem] = []
    for q in queries:
        out.extend(_check_expr(file, q, exp, records or set(), unchecked))
    return out, unchecked


# -- the command -----------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lint",
        help="check a Grafana dashboard or Prometheus rules against what a target exposes",
        description=(
            "Check every PromQL selector of a Grafana dashboard (JSON) or a Prometheus\n"
            "rules file (YAML) against what a target exposes: each metric that does not\n"
            "exist (renamed by vLLM, a counter without _total, a histogram without _bucket)\n"
            "and each label that is not there is reported with the fix.\n"
            "Exit codes: 0 clean, 1 problems found, 2 bad input."
        ),
        epilog=TIME_SYNTAX,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="DASHBOARD_OR_RULES",
        help="Grafana dashboard JSON or Prometheus rules YAML",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--against",
        metavar="URL_OR_FILE",
        help="a live /metrics URL (http://host:8000/metrics) or a saved exposition",
    )
    from kvscope.sources.prometheus.target import add_prometheus_arguments

    add_prometheus_arguments(p, url_group=where, analysis=False)
    p.add_argument(
        "--since",
        default="1h",
        metavar="TIME",
        help="with --prometheus: look at the series stored since this time, written as "
        "in advise: 30m, 6h, 1h30m, 7d, 2026-11-30T08:00Z (default: 1h)",
    )
    p.add_argument(
        "--extra-labels",
        default="",
        metavar="A,B",
        help="labels the scrape adds besides job and instance (relabeling)",
    )
    p.add_argument("--json", action="store_true", help="print the problems as JSON")
    p.add_argument(
        "--timeout",
        type=positive_duration,
        default=10.0,
        metavar="DURATION",
        help="seconds per HTTP request (default 10)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.cli.checks import require

    require("lint", "collector", also=("promql_parser",))

    def fail(msg: str) -> int:
        print(f"kvscope lint: {msg}", file=sys.stderr)
        return 2

    try:
        now = time.time()
        try:
            history_s = now - parse_time("--since", args.since, now)
        except ParamError as e:
            raise LintError(str(e)) from None
        if history_s <= 0:
            raise LintError(f"--since {args.since} is not in the past; use a duration such as 1h")
        loaded = [(f, *load_queries(f)) for f in args.files]
        if args.prometheus:
            from kvscope.sources.prometheus.target import PromArgError, prometheus_target

            try:
                target = prometheus_target(args)
            except PromArgError as e:
                raise LintError(str(e)) from None
            assert target is not None
            names = {
                s.name for _, qs, _ in loaded for q in qs for s in _safe_selectors(q.expr) if s.name
            }
            exp = exposure_of_prometheus(
                target.url,
                names,
                selector=target.selector,
                since_s=history_s,
                timeout_s=args.timeout,
                auth=target.auth,
            )
        else:
            exp = exposure_of_target(args.against, args.timeout)
    except LintError as e:
        return fail(str(e))
    extra = frozenset(x.strip() for x in args.extra_labels.split(",") if x.strip())
    exp.implicit_labels = exp.implicit_labels | extra
    problems: list[Problem] = []
    unchecked: set[str] = set()
    n_queries = 0
    # A series recorded by any rules file given counts as present in every file: a
    # dashboard may read the recording rules it is shipped with.
    recorded = set().union(*(records for _, _, records in loaded))
    for f, queries, _ in loaded:
        found, skipped = check(f, queries, exp, recorded)
        problems += found
        unchecked |= skipped
        n_queries += len(queries)
    if args.json:
        print(
            json.dumps(
                {
                    "target": exp.source,
                    "queries": n_queries,
                    "problems": [asdict(p) for p in problems],
                    "unchecked_metrics": sorted(unchecked),
                },
                indent=2,
            )
        )
    else:
        for p in problems:
            print(p.line())
        tail = (
            f"; {len(unchecked)} metric(s) of other exporters not checked: "
            f"{', '.join(sorted(unchecked))}"
            if unchecked
            else ""
        )
        verdict = f"{len(problems)} problem(s)" if problems else "clean"
        print(
            f"{verdict}: {n_queries} queries in {len(args.files)} file(s) checked against "
            f"{exp.source}{tail}"
        )
    return 1 if problems else 0


def _safe_selectors(expr: str) -> list[Any]:
    try:
        return scan(_substitute(expr)).selectors
    except PromQLError:
        return []
