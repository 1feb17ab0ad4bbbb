"""PromQL for the linter and the query builder: the metric selectors and labels an expression
uses, read with a real parser (``promql-parser``, the Python binding of the Rust crate), with a
small tokenizer of our own for what that parser cannot read.

:func:`scan` returns, for one expression, its **selectors** (metric name and label matchers;
``{__name__="x"}`` and ``{"x"}`` name the metric too), its **grouping labels** (``by``,
``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``) and its **created labels**
(``label_replace`` / ``label_join`` destinations, ``count_values``' label).

The parser rejects what Prometheus would, which a tokenizer cannot see. The tokenizer stays for
Grafana's template variables: for an expression the parser rejects *and* that holds a variable
outside its strings, :func:`scan` falls back to it and marks a selector glued to a variable
``templated``. One known difference: the parser applies escapes inside backtick strings.

See docs/prometheus.md#the-parser-and-the-tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import promql_parser

__all__ = [
    "Expr",
    "Matcher",
    "PromQLError",
    "Selector",
    "Token",
    "matchers_of_selector",
    "scan",
    "scan_tokens",
    "tokenize",
    "with_matchers",
]


class PromQLError(ValueError):
    """Text that is not PromQL (the parser's message, or the tokenizer's: an unterminated
    string, a stray character)."""


@dataclass(frozen=True)
class Token:
    kind: str  # ident, string, number, op, var
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass
class Selector:
    """A metric selector: its name (None when only a regex on ``__name__`` names it)."""

    name: str | None
    matchers: list[Matcher] = field(default_factory=list)
    start: int = 0
    templated: bool = False

    @property
    def name_regex(self) -> str | None:
        for m in self.matchers:
            if m.label == "__name__" and m.op == "=~":
                return m.value
        return None

    def label_matchers(self) -> list[Matcher]:
        return [m for m in self.matchers if m.label != "__name__"]


@dataclass
class Expr:
    """What :func:`scan` found in one expression."""

    selectors: list[Selector] = field(default_factory=list)
    grouping: list[tuple[str, str]] = field(default_factory=list)  # (keyword, label)
    created_labels: set[str] = field(default_factory=set)


_AGGREGATORS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = _GROUPING | frozenset(
    {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}
)
_OPS = (
    "=~",
    "!~",
    "!=",
    "==",
    ">=",
    "<=",
    "=",
    ">",
    "<",
    "+",
    "-",
    "*",
    "/",
    "%",
    "^",
    ",",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "@",
    ":",
)
_NUMBER = re.compile(
    r"0[xX][0-9a-fA-F]+|(?:\d+(?:ms|[smhdwy]))+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_VAR = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\]")


def _string_end(text: str, i: int) -> int:
    q = text[i]
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\" and q != "`":
            j += 2
            continue
        if c == q:
            return j + 1
        j += 1
    raise PromQLError(f"unterminated string starting at offset {i}")


def tokenize(text: str) -> list[Token]:
    """Tokens of a PromQL expression (comments and whitespace dropped)."""
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl + 1
            continue
        if c in "\"'`":
            j = _string_end(text, i)
            out.append(Token("string", _unquote(text[i:j]), i, j))
            i = j
            continue
        m = _VAR.match(text, i)
        if m:
            out.append(Token("var", m.group(0), i, m.end()))
            i = m.end()
            continue
        m = _NUMBER.match(text, i)
        if m and (c.isdigit() or c == "."):
            out.append(Token("number", m.group(0), i, m.end()))
            i = m.end()
            continue
        m = _IDENT.match(text, i)
        if m:
            out.append(Token("ident", m.group(0), i, m.end()))
            i = m.end()
            continue
        for op in _OPS:
            if text.startswith(op, i):
                out.append(Token("op", op, i, i + len(op)))
                i += len(op)
                break
        else:
            raise PromQLError(f"unexpected character {c!r} at offset {i}")
    return out


def _unquote(s: str) -> str:
    body = s[1:-1]
    if s[0] == "`":
        return body
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _skip_brackets(toks: list[Token], i: int) -> int:
    """Index after the ``]`` matching the ``[`` at ``i``."""
    depth = 0
    while i < len(toks):
        t = toks[i]
        if t.kind == "op" and t.text == "[":
            depth += 1
        elif t.kind == "op" and t.text == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _matchers(toks: list[Token], i: int) -> tuple[list[Matcher], str | None, int]:
    """Matchers of the ``{`` at ``i``; the quoted metric name if any; index after ``}``."""
    out: list[Matcher] = []
    quoted: str | None = None
    i += 1
    while i < len(toks):
        t = toks[i]
        if t.kind == "op" and t.text == "}":
            return out, quoted, i + 1
        if (
            t.kind in ("ident", "string")
            and i + 2 < len(toks)
            and toks[i + 1].kind == "op"
            and toks[i + 1].text in ("=", "!=", "=~", "!~")
            and toks[i + 2].kind in ("string", "var")
        ):
            out.append(Matcher(t.text, toks[i + 1].text, toks[i + 2].text))
            i += 3
            continue
        if t.kind == "string":
            quoted = t.text
        i += 1
    raise PromQLError("unterminated label matchers '{'")


def _paren_list(toks: list[Token], i: int) -> tuple[list[str], int]:
    """Identifiers of the ``( a, b )`` at ``i``; index after ``)``."""
    labels: list[str] = []
    i += 1
    while i < len(toks) and not (toks[i].kind == "op" and toks[i].text == ")"):
        if toks[i].kind in ("ident", "string"):
            labels.append(toks[i].text)
        i += 1
    return labels, i + 1


def _created_label(toks: list[Token], i: int, fn: str) -> str | None:
    """The label created by the ``label_replace``/``label_join``/``count_values`` call whose
    ``(`` is at ``i``."""
    want_comma = 0 if fn == "count_values" else 1
    depth, commas = 0, 0
    for t in toks[i:]:
        if t.kind == "op" and t.text in "([{":
            depth += 1
        elif t.kind == "op" and t.text in ")]}":
            depth -= 1
            if depth == 0:
                return None
        elif depth == 1 and t.kind == "op" and t.text == ",":
            commas += 1
        elif depth == 1 and t.kind == "string" and commas == want_comma:
            return t.text
    return None


def _glued(a: Token | None, b: Token | None) -> bool:
    return a is not None and b is not None and a.end == b.start


def scan(text: str) -> Expr:
    """Selectors, grouping labels and created labels of a PromQL expression.

    Read by the parser; by the tokenizer (:func:`scan_tokens`) only when the parser rejects
    an expression holding a Grafana template variable. :class:`PromQLError` otherwise."""
    import promql_parser

    try:
        tree = promql_parser.parse(text)
    except ValueError as exc:
        if _VAR.search(_STRINGS.sub('""', text)):
            return scan_tokens(text)
        raise PromQLError(str(exc)) from None
    return _expr_of_tree(tree)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCH_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}
_BY_KEYWORD = {"By": "by", "Without": "without", "Include": "on", "Exclude": "ignoring"}
_CREATES = {"label_replace": 1, "label_join": 1}  # index of the destination label argument


def _matchers_of(node: promql_parser.VectorSelector) -> list[Matcher]:
    return [
        Matcher(m.name, _MATCH_OPS[str(m.op).rpartition(".")[2]], m.value)
        for m in node.matchers.matchers
    ]


def _expr_of_tree(tree: promql_parser.Expr) -> Expr:
    import promql_parser as pp

    ex = Expr()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, pp.VectorSelector):
            ms = _matchers_of(node)
            name = node.name or next(
                (m.value for m in ms if m.label == "__name__" and m.op == "="), None
            )
            ex.selectors.append(Selector(name, ms))
        elif isinstance(node, pp.AggregateExpr):
            agg = node.modifier
            if agg is not None:
                kw = _BY_KEYWORD[str(agg.type).rpartition(".")[2]]
                ex.grouping.extend((kw, lab) for lab in agg.labels)
            if str(node.op) == "count_values" and isinstance(node.param, pp.StringLiteral):
                ex.created_labels.add(node.param.val)
        elif isinstance(node, pp.BinaryExpr) and node.modifier is not None:
            binary = node.modifier
            if binary.matching is not None:
                kw = _BY_KEYWORD[str(binary.matching.type).rpartition(".")[2]]
                ex.grouping.extend((kw, lab) for lab in binary.matching.labels)
            side = {"ManyToOne": "group_left", "OneToMany": "group_right"}.get(
                str(binary.card).rpartition(".")[2]
            )
            if side:
                ex.grouping.extend((side, lab) for lab in binary.group_labels or ())
        elif isinstance(node, pp.Call) and node.func.name in _CREATES:
            arg = node.args[_CREATES[node.func.name]] if len(node.args) > 1 else None
            if isinstance(arg, pp.StringLiteral):
                ex.created_labels.add(arg.val)

    pp.walk(tree, None, visit)  # children first: left to right, inner before outer
    return ex


def scan_tokens(text: str) -> Expr:
    """:func:`scan` by the tokenizer alone: reads expressions with Grafana template variables
    the parser rejects, and marks a selector glued to a variable ``templated``."""
    toks = tokenize(text)
    ex = Expr()
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.kind == "op" and t.text == "[":
            i = _skip_brackets(toks, i)
            continue
        if t.kind == "op" and t.text == "{":
            ms, quoted, j = _matchers(toks, i)
            name = quoted or next(
                (m.value for m in ms if m.label == "__name__" and m.op == "="), None
            )
            ex.selectors.append(Selector(name, ms, t.start))
            i = j
            continue
        if t.kind != "ident":
            i += 1
            continue
        low = t.text.lower()
        is_open = nxt is not None and nxt.kind == "op" and nxt.text == "("
        if low in _GROUPING:
            if is_open:
                labels, i = _paren_list(toks, i + 1)
                ex.grouping.extend((low, lab) for lab in labels)
            else:
                i += 1
            continue
        if is_open or (
            low in _AGGREGATORS
            and nxt is not None
            and nxt.kind == "ident"
            and nxt.text.lower() in ("by", "without")
        ):
            if t.text in ("label_replace", "label_join", "count_values") and is_open:
                created = _created_label(toks, i + 1, t.text)
                if created:
                    ex.created_labels.add(created)
            i += 1
            continue
        if low in _KEYWORDS:
            i += 1
            continue
        prev = toks[i - 1] if i else None
        sel = Selector(
            t.text,
            [],
            t.start,
            templated=(prev is not None and prev.kind == "var" and _glued(prev, t))
            or (nxt is not None and nxt.kind == "var" and _glued(t, nxt)),
        )
        i += 1
        if nxt is not None and nxt.kind == "op" and nxt.text == "{":
            sel.matchers, _, i = _matchers(toks, i)
        ex.selectors.append(sel)
    return ex


def matchers_of_selector(selector: str | None) -> str:
    """The matcher text inside a user's selector (``{namespace="prod"}`` -> ``namespace="prod"``).

    Accepts ``None``, ``""``, ``{}``, ``{a="b",c=~"d"}`` or the bare ``a="b",c=~"d"``.
    Raises :class:`PromQLError` for anything else (a metric name, functions, ...).
    """
    s = (selector or "").strip()
    if not s or s == "{}":
        return ""
    if not s.startswith("{"):
        s = "{" + s + "}"
    toks = tokenize(s)
    bad = PromQLError(
        f"selector {selector!r}: expected only label matchers such as "
        '{namespace="prod", job=~"vllm.*"}'
    )
    if toks[0].text != "{" or toks[-1].text != "}":
        raise bad
    body, ms = toks[1:-1], []
    i = 0
    while i < len(body):
        if i + 3 > len(body):
            raise bad
        lab, op, val = body[i : i + 3]
        if (
            lab.kind not in ("ident", "string")
            or op.text not in ("=", "!=", "=~", "!~")
            or val.kind != "string"
        ):
            raise bad
        ms.append(Matcher(lab.text, op.text, val.text))
        i += 3
        if i < len(body):
            if body[i].text != ",":
                raise bad
            i += 1
    return ", ".join(f"{m.label}{m.op}{_quote(m.value)}" for m in ms)


def _quote(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def with_matchers(name: str, inner: str, extra: str = "") -> str:
    """``name{inner, extra}`` (either part may be empty)."""
    parts = [p for p in (inner, extra) if p]
    return f"{name}{{{', '.join(parts)}}}" if parts else name
