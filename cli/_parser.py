"""The ``kvscope`` argument parser: whole option names only, a suggestion for a mistyped
option or subcommand, and time offsets such as ``-1h`` taken as values.

argparse alone takes ``--sinc 7d`` for ``--since`` (it accepts abbreviations), answers
``--colector`` with "unrecognized arguments" and nothing else, and reads ``--since -1h``
as a second option ("expected one argument"). :class:`KvscopeParser` turns abbreviations
off, names the closest option or choice (:func:`difflib.get_close_matches`) and hands an
option that takes one value a following ``-1h``, ``-90m`` or ``-1h30m`` as that value.
argparse builds every subcommand's parser with the class of its parent, so the whole
``kvscope`` tree behaves this way.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["KvscopeParser"]

_OFFSET = re.compile(r"^-(?:\d+(?:\.\d+)?[smhdwSMHDW])+$")
"""A time offset (``-1h``, ``-1h30m``), which argparse would take for an option."""


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


class KvscopeParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` with ``allow_abbrev=False`` by default, did-you-mean
    messages, and ``--since -1h`` read as ``--since=-1h``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._commands: argparse._SubParsersAction | None = None

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._join_offsets(argv), namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._innermost(ns)
            parser.error(parser._unrecognized(extras))
        return ns

    def _join_offsets(self, argv: list[str]) -> list[str]:
        """``--since -1h`` as ``--since=-1h`` for every option of this parser that takes one
        value; nothing after ``--`` changes."""
        out: list[str] = []
        i = 0
        while i < len(argv):
            tok = argv[i]
            if tok == "--":
                out.extend(argv[i:])
                break
            action = self._option_string_actions.get(tok)
            if (
                action is not None
                and action.nargs is None
                and i + 1 < len(argv)
                and _OFFSET.match(argv[i + 1])
            ):
                out.append(f"{tok}={argv[i + 1]}")
                i += 2
                continue
            out.append(tok)
            i += 1
        return out

    def _innermost(self, ns: argparse.Namespace) -> KvscopeParser:
        """The parser of the (sub)subcommand the arguments chose: it owns the options."""
        parser: KvscopeParser = self
        while parser._commands is not None:
            name = getattr(ns, parser._commands.dest, None)
            child = parser._commands.choices.get(name) if isinstance(name, str) else None
            if not isinstance(child, KvscopeParser):
                break
            parser = child
        return parser

    def _unrecognized(self, extras: list[str]) -> str:
        options = [o for o in self._option_string_actions if o.startswith("--")]
        hints = []
        for tok in extras:
            name = tok.split("=", 1)[0]
            if name.startswith("--"):
                close = _closest(name, options)
                if close:
                    hints.append(f"{name}: did you mean {close}?")
        text = f"unrecognized arguments: {' '.join(extras)}"
        return f"{text} ({'; '.join(hints)})" if hints else text

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            names = [str(c) for c in choices]
            close = _closest(value, names)
            if close:
                raise argparse.ArgumentError(
                    action,
                    f"invalid choice: {value!r}; did you mean {close!r}? "
                    f"(choose from {', '.join(map(repr, names))})",
                )
        super()._check_value(action, value)
