"""The shared value syntax (kvscope.args): one parser per kind of value, the same answer in
every command; and the command line's parser (whole option names, did-you-mean, ``-1h``)."""

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
        ("1h30m", 5400.0),
        ("1d12h", 129600.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration("--since", text) == seconds
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1y", "-5m", "soon", "nan", "inf", "1h 30m", "h"])
def test_bad_durations_name_the_option_and_the_syntax(text: str) -> None:
    with pytest.raises(ParamError, match=r"^--since: expected a duration such as 90s"):
        parse_duration("--since", text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
        duration(text)


def test_times_are_unix_seconds_now_a_duration_ago_or_iso() -> None:
    now = 1_764_430_000.0
    assert parse_time("since", "now", now) == now
    assert parse_time("since", "2h", now) == now - 7200
    assert parse_time("since", "1764000000", now) == 1_764_000_000.0
    assert parse_time("since", "0", now) == 0.0
    # A duration ago, with or without its sign, or Grafana's now-1h: the same instant.
    for text in ("1h30m", "-1h30m", "now-1h30m", "now - 90m", "-90M"):
        assert parse_time("since", text, now) == now - 5400, text
    # ISO 8601: UTC unless a zone is named; 2026-11-30T08:00Z is 1796025600 (date -d).
    for text in ("2026-11-30T08:00Z", "2026-11-30T08:00:00+00:00", "2026-11-30 08:00"):
        assert parse_time("until", text, now) == 1_796_025_600.0, text
    assert parse_time("until", "2026-11-30T09:00+01:00", now) == 1_796_025_600.0
    assert parse_time("until", "2026-11-30", now) == 1_796_025_600.0 - 8 * 3600
    for bad in ("yesterday", "+1h", "now+1h", "-5", "2026-13-01", "1h ago"):
        with pytest.raises(ParamError, match="since: expected unix seconds, 'now', a duration"):
            parse_time("since", bad, now)


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


def test_lint_takes_a_time_like_the_other_commands() -> None:
    for since in ("6h", "-6h", "now-6h", "2026-11-30T08:00Z"):
        args = build_parser().parse_args(
            ["lint", "d.json", "--prometheus", "http://p:9090", "--since", since]
        )
        assert args.since == since


@pytest.mark.parametrize(
    "argv",
    [
        ["advise", "--since", "-1h", "--until", "-30m"],
        ["advise", "--since=-1h", "--until=-30m"],
        ["report", "--since", "-1h", "--until", "-30m"],
        ["twin", "sweep", "--since", "-1h"],
        ["dashboard", "--since", "-1h"],
    ],
)
def test_a_negative_offset_is_a_value_not_an_option(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.since == "-1h"
    assert getattr(args, "until", "-30m") == "-30m"


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (
            ["advise", "--sinc", "7d"],
            "unrecognized arguments: --sinc 7d (--sinc: did you mean --since?)",
        ),
        (["advise", "--colector", "http://c"], "did you mean --collector?"),
        (["report", "--colector=http://c"], "did you mean --collector?"),
        (["twin", "sweep", "--seconds-per-levl", "2"], "did you mean --seconds-per-level?"),
        (["advice"], "invalid choice: 'advice'; did you mean 'advise'?"),
        (["collector", "--kv-events", "of"], "invalid choice: 'of'; did you mean 'off'?"),
    ],
)
def test_no_abbreviations_and_a_suggestion_for_a_typo(
    argv: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expect in err, err
    if argv[0] != "advice":  # the usage of the subcommand that was meant
        assert f"usage: kvscope {argv[0]}" in err


def _actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """(command path, action) of every option in the ``kvscope`` tree."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, (*path, name))
        elif a.option_strings:
            yield path, a


def test_every_length_of_time_takes_a_duration() -> None:
    """Retentions, intervals, windows, timeouts, refresh and level lengths all take
    ``90s``, ``30m``, ``1h`` as ``--since`` does (a plain number stays seconds); only the
    latency targets (``--slo-*``, a fraction of a second) are written in seconds."""
    checked = []
    for path, a in _actions(build_parser()):
        text = f"{a.help or ''} {a.metavar or ''} {a.dest}".lower()
        timed = a.metavar in ("S", "DURATION") or "seconds" in text or a.dest.endswith("_s")
        if not timed or a.nargs == 0 or a.dest.startswith("slo_") or a.dest in ("since", "until"):
            continue
        opt = a.option_strings[0]
        assert a.metavar == "DURATION", f"kvscope {' '.join(path)} {opt}: metavar {a.metavar}"
        assert callable(a.type) and a.type("1m30s") == 90.0, f"{' '.join(path)} {opt}"
        assert a.type("2") == 2.0, f"{' '.join(path)} {opt}"
        checked.append((path, opt))
    names = {o for _, o in checked}
    assert {"--raw-retention", "--advise-window", "--header-timeout", "--timeout"} <= names
    assert {"--refresh", "--seconds-per-level", "--window-retention"} <= names


def test_the_collectors_seconds_flags_are_still_taken() -> None:
    args = build_parser().parse_args(
        ["collector", "--raw-retention-s", "7200", "--advise-window-s", "600"]
    )
    assert (args.raw_retention_s, args.advise_window_s) == (7200.0, 600.0)
    args = build_parser().parse_args(["collector", "--raw-retention", "2h", "--body-timeout", "1m"])
    assert (args.raw_retention_s, args.body_timeout_s) == (7200.0, 60.0)
