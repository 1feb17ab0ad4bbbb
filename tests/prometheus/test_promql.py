"""PromQL reading (the parser, and the tokenizer for templated expressions): metric
selectors, matchers, grouping and created labels."""

from __future__ import annotations

import pytest

from kvscope.sources.prometheus.promql import (
    PromQLError,
    matchers_of_selector,
    scan,
    scan_tokens,
    tokenize,
    with_matchers,
)


def names(expr: str) -> list[str | None]:
    return [s.name for s in scan(expr).selectors]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("vllm:num_requests_running", ["vllm:num_requests_running"]),
        ('rate(vllm:prompt_tokens_total{model_name="m"}[5m])', ["vllm:prompt_tokens_total"]),
        ("sum by (pool) (rate(a_total[1m])) / ignoring(le) sum(b)", ["a_total", "b"]),
        ("sum(rate(x_bucket[5m])) by (le)", ["x_bucket"]),
        (
            "histogram_quantile(0.99, sum by (le, model_name) (rate(h_bucket[$__rate_interval])))",
            ["h_bucket"],
        ),
        ("rate(x[5m:1m] offset 1h) > bool 3", ["x"]),
        ("a * on(instance) group_left(pool) b unless c or d", ["a", "b", "c", "d"]),
        ("max without (engine) (g @ 1700000000)", ["g"]),
        ('topk(5, count_values("v", build_info))', ["build_info"]),
        ("clamp_min(x, 0) * -1 + 2e3 - 0x1f", ["x"]),
        ("# a comment\nup # another", ["up"]),
        ("absent(nonexistent{job=`raw string`})", ["nonexistent"]),
        ("inf + nan + Inf", []),
    ],
)
def test_metric_names(expr: str, expected: list[str]) -> None:
    assert names(expr) == expected


def test_matchers_and_name_from_matchers() -> None:
    ex = scan('{__name__="vllm:x", job=~"v.*"} + {__name__=~"vllm:.+"} + {"my.metric", a!="b"}')
    a, b, c = ex.selectors
    assert a.name == "vllm:x" and [(m.label, m.op, m.value) for m in a.label_matchers()] == [
        ("job", "=~", "v.*")
    ]
    assert b.name is None and b.name_regex == "vllm:.+"
    assert c.name == "my.metric" and c.label_matchers()[0].op == "!="


def test_grouping_and_created_labels() -> None:
    ex = scan(
        'label_replace(sum by (a, b) (x), "dst", "$1", "a", "(.*)") '
        '* on (c) group_right (d) label_join(y, "joined", ",", "e", "f")'
    )
    assert ex.grouping == [("by", "a"), ("by", "b"), ("on", "c"), ("group_right", "d")]
    assert ex.created_labels == {"dst", "joined"}
    assert names('label_replace(x, "dst", "$1", "src", "(.*)")') == ["x"]


def test_grafana_variables() -> None:
    ex = scan('sum by ($group) (rate(${prefix}_total{pool=~"$pool"}[$__rate_interval])) + z')
    sel = ex.selectors
    assert sel[0].name == "_total" and sel[0].templated
    assert sel[0].matchers[0].value == "$pool"
    assert sel[1].name == "z" and not sel[1].templated
    assert ex.grouping == []  # $group is a variable, not a label name


def test_tokenize_errors() -> None:
    with pytest.raises(PromQLError, match="unterminated string"):
        tokenize('x{a="b}')
    with pytest.raises(PromQLError, match="unexpected character"):
        tokenize("x ; y")
    with pytest.raises(PromQLError, match="inside braces"):
        scan('x{a="b"')
    with pytest.raises(PromQLError, match="unterminated label matchers"):
        scan_tokens('x{a="b"')


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("sum(rate(x[5m])", "unclosed left parenthesis"),
        ("rate(x[5m]) offset 1h", "offset modifier"),
        ("a and on(i) group_left(p) b", "no grouping allowed for 'and'"),
        ('up{__name__="vllm:x"}', "metric name must not be set twice"),
    ],
)
def test_what_prometheus_would_reject_is_an_error(expr: str, message: str) -> None:
    """Mistakes a tokenizer cannot see: the parser names them as Prometheus would."""
    with pytest.raises(PromQLError, match=message):
        scan(expr)
    scan_tokens(expr)  # the tokenizer alone reads them without complaint


def test_templated_expressions_fall_back_to_the_tokenizer() -> None:
    """The parser rejects a variable as a range or glued to a name; scan still reads them."""
    ex = scan("rate(vllm:x_total[$interval]) + rate(${prefix}_total[5m])")
    assert [(s.name, s.templated) for s in ex.selectors] == [
        ("vllm:x_total", False),
        ("_total", True),
    ]
    with pytest.raises(PromQLError, match="unclosed"):
        scan('sum(rate(x{pool=~"$pool"}[5m])')  # a variable, but the parser reads it: its error


@pytest.mark.parametrize(
    ("selector", "inner"),
    [
        (None, ""),
        ("", ""),
        ("{}", ""),
        ('{namespace="prod"}', 'namespace="prod"'),
        ('namespace="prod", job=~"vllm.*"', 'namespace="prod", job=~"vllm.*"'),
        ('{a!="x\\"y"}', 'a!="x\\"y"'),
    ],
)
def test_selector_matchers(selector: str | None, inner: str) -> None:
    assert matchers_of_selector(selector) == inner


@pytest.mark.parametrize("bad", ["foo", '{a="b"} + 1', "{a}", "sum(x)", '{a="b" c="d"}'])
def test_selector_rejects_anything_but_matchers(bad: str) -> None:
    with pytest.raises(PromQLError, match="label matchers"):
        matchers_of_selector(bad)


def test_with_matchers() -> None:
    assert with_matchers("m", "") == "m"
    assert with_matchers("m", 'a="b"') == 'm{a="b"}'
    assert with_matchers("", 'a="b"', '__name__=~"x"') == '{a="b", __name__=~"x"}'
