"""``kvscope report``'s command line, in process: ``--out`` is checked before any work,
the progress bar is drawn only on a terminal and never runs into an error message, and
``--gpu-hour-cost`` is parsed."""

from __future__ import annotations

import io
import socket
import sys
from pathlib import Path

import pytest

from kvscope.cli.main import build_parser, main


def _dead_url() -> str:
    """A local port nothing listens on: the collector is unreachable at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(
    monkeypatch: pytest.MonkeyPatch, args: list[str], stderr: io.StringIO
) -> tuple[int, str, str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["report", *args])
    return code, out.getvalue(), stderr.getvalue()


def test_out_is_checked_before_the_analysis(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-folder" / "weekly"
    code, _, err = _run(
        monkeypatch, ["--collector", _dead_url(), "--out", str(missing)], io.StringIO()
    )
    assert code == 2
    assert err == (
        f"kvscope report: cannot write --out {missing}: the folder {missing.parent} does not "
        "exist (create it, or choose another --out)\n"
    )  # the collector, unreachable, was never asked
    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    code, _, err = _run(
        monkeypatch, ["--collector", _dead_url(), "--out", str(a_file)], io.StringIO()
    )
    assert code == 2 and "exists and is not a folder" in err
    assert not missing.parent.exists()


def test_no_progress_text_in_errors_when_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, out, err = _run(
        monkeypatch, ["--collector", _dead_url(), "--out", str(tmp_path / "r")], io.StringIO()
    )
    assert code == 2 and out == ""
    assert err.startswith("kvscope report: ") and err.count("\n") == 1, err
    assert "\r" not in err and "step" not in err and "%|" not in err


def test_on_a_terminal_the_error_starts_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, _, err = _run(
        monkeypatch, ["--collector", _dead_url(), "--out", str(tmp_path / "r")], _Terminal()
    )
    assert code == 2
    assert "step/s]" in err  # the bar was drawn
    last = err.split("\r")[-1]  # what follows the bar's last carriage return (its erasure)
    assert last.startswith("kvscope report: cannot reach the collector"), repr(err)
    assert last.count("\n") == 1 and "step/s" not in last


def test_gpu_hour_cost_option() -> None:
    args = build_parser().parse_args(["report", "--gpu-hour-cost", "2.5"])
    assert args.gpu_hour_cost == 2.5
    assert build_parser().parse_args(["report"]).gpu_hour_cost is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "--gpu-hour-cost", "-1"])


@pytest.mark.parametrize("command", ["report", "advise"])
def test_slo_targets_are_off_unless_given(command: str) -> None:
    from kvscope.cli.advise import analysis_options

    args = build_parser().parse_args([command, "--slo-ttft", "0.5", "--slo-itl", "0.05"])
    assert (args.slo_ttft, args.slo_itl, args.slo_e2e) == (0.5, 0.05, None)
    none = build_parser().parse_args([command])
    assert (none.slo_ttft, none.slo_itl, none.slo_e2e) == (None, None, None)
    if command == "advise":
        opts = analysis_options(args)
        assert (opts["slo_ttft_s"], opts["slo_itl_s"], opts["slo_e2e_s"]) == (0.5, 0.05, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--slo-e2e", "0"])
