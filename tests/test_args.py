"""The shared value syntax (kvscope.args): one parser per kind of value, the same answer in
every command."""

from __future__ import annotations

import argparse

import pytest

from kvscope.args import (
    ParamError,
    count,
    duration,
    fraction,
    header,
    non_negative,
    parse_duration,
    parse_header,
    parse_time,
    positive,
    ratio,
)
from kvscope.cli.main import build_parser


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("30m", 1800.0),
        ("1h", 3600.0),
        ("2.5h", 9000.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("3600", 3600.0),
        (" 1H ", 3600.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration("--since", text) == seconds
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1y", "-5m", "soon", "nan", "inf", "1h30m"])
def test_bad_durations_name_the_option_and_the_syntax(text: str) -> None:
    with pytest.raises(ParamError, match=r"^--since: expected a duration such as 90s"):
        parse_duration("--since", text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
        duration(text)


def test_times_are_unix_seconds_now_or_a_duration_ago() -> None:
    now = 1_764_430_000.0
    assert parse_time("since", "now", now) == now
    assert parse_time("since", "2h", now) == now - 7200
    assert parse_time("since", "1764000000", now) == 1_764_000_000.0
    with pytest.raises(ParamError, match="since: expected unix seconds, 'now' or a duration"):
        parse_time("since", "yesterday", now)


def test_headers_are_name_colon_value_and_never_echo_the_value() -> None:
    assert parse_header("h", "Authorization: Bearer abc==") == ("Authorization", "Bearer abc==")
    assert header("X-Scope-OrgID:fleet") == ("X-Scope-OrgID", "fleet")
    for bad in ("Authorization=Bearer s3cret", "no colon s3cret", ": s3cret", "Two words: s3cret"):
        with pytest.raises(ParamError, match="expected 'Name: value'") as e:
            parse_header("--prometheus-header", bad)
        assert "s3cret" not in str(e.value)
        with pytest.raises(argparse.ArgumentTypeError, match="expected 'Name: value'"):
            header(bad)


@pytest.mark.parametrize(
    ("fn", "good", "bad"),
    [
        (positive, {"0.5": 0.5, "3": 3.0}, ["0", "-1", "x", "nan", "inf"]),
        (non_negative, {"0": 0.0, "2.5": 2.5}, ["-0.1", "x", "nan"]),
        (fraction, {"1": 1.0, "0.9": 0.9}, ["0", "1.01", "x"]),
        (ratio, {"1": 1.0, "1.25": 1.25}, ["0.99", "x"]),
        (count, {"0": 0, "1_000": 1000}, ["-1", "1.5", "x"]),
    ],
)
def test_validators(fn, good: dict[str, float], bad: list[str]) -> None:  # type: ignore[no-untyped-def]
    for text, value in good.items():
        assert fn(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace(".", r"\.")):
            fn(text)


@pytest.mark.parametrize(
    "command",
    [
        ["advise", "--collector", "c:8844"],
        ["report", "--collector", "c:8844"],
    ],
)
def test_advise_and_report_refuse_the_same_value_the_same_way(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--cap-fraction", "1.5"])
    assert "argument --cap-fraction: must be in (0, 1], got '1.5'" in capsys.readouterr().err


def test_lint_takes_a_duration() -> None:
    args = build_parser().parse_args(
        ["lint", "d.json", "--prometheus", "http://p:9090", "--since", "6h"]
    )
    assert args.since == 6 * 3600.0
