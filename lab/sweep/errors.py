"""Exceptions of the sweep package: one base class, mapped to messages by the CLI."""

from __future__ import annotations


class SweepError(RuntimeError):
    """A sweep could not run (bad configuration, unreachable server, unreadable trace)."""


class TraceFormatError(SweepError, ValueError):
    """A trace file is not in a known format or has a bad row."""
