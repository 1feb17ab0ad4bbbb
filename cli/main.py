"""The ``kvscope`` command line: one parser, a module per subcommand.

A thin layer: parse arguments into settings objects and hand off to library code.
Subcommands import their dependencies lazily (checked by :mod:`kvscope.cli.checks`), so ``pip install kvscope`` (the
engine side only) still gives a working ``kvscope --help`` and a clear message
naming the extra to install.

Options are spelled out in full and a mistyped one gets a suggestion
(:class:`~kvscope.cli._parser.KvscopeParser`). A command stops on SIGTERM as on Ctrl-C,
stopping what it started (:mod:`kvscope.cli._lifecycle`); the exit code is then 143
(130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvscope import __version__
from kvscope.cli import advise, collector, dashboard, lab, lint, report, twin
from kvscope.cli._lifecycle import Terminated, stop_on_sigterm
from kvscope.cli._parser import KvscopeParser


def build_parser() -> argparse.ArgumentParser:
    parser = KvscopeParser(
        prog="kvscope",
        description=(
            "kvscope: where a vLLM server's throughput stops growing, why, and what to change."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        lab.add_demo,
        collector.add_parser,
        advise.add_parser,
        report.add_parser,
        dashboard.add_parser,
        lab.add_sweep,
        lab.add_record,
        twin.add_parser,
        lint.add_parser,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with stop_on_sigterm():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143


if __name__ == "__main__":
    sys.exit(main())
