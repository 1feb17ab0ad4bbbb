"""The ``kvscope`` command line: one parser, a module per subcommand.

A thin layer: parse arguments into settings objects and hand off to library code.
Subcommands import their dependencies lazily (checked by :mod:`kvscope.cli.checks`), so ``pip install kvscope`` (the
engine side only) still gives a working ``kvscope --help`` and a clear message
naming the extra to install.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvscope import __version__
from kvscope.cli import advise, collector, dashboard, lab, lint, report, twin


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
