"""How the long-running commands start and stop.

Start: :func:`port_problem` says why a port cannot be listened on, so a command refuses a
busy port before it prints what it is about to serve (or spends a minute feeding a demo).

Stop: :func:`stop_on_sigterm` turns SIGTERM (``kill``, ``docker stop``, systemd,
Kubernetes) into :class:`Terminated`, raised where the command is, the way Ctrl-C raises
:class:`KeyboardInterrupt`. Every ``with`` block on the way out runs its exit, so a
collector started by ``kvscope demo`` or ``kvscope dashboard --demo`` and the dashboard's
Streamlit process stop with the command instead of keeping the port and the store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from kvscope.collector.process import port_problem

__all__ = ["Terminated", "port_problem", "run_stoppable", "stop_on_sigterm"]


class Terminated(BaseException):
    """SIGTERM arrived. A :class:`BaseException`, as :class:`KeyboardInterrupt` is, so no
    ``except Exception`` on the way out swallows it."""


_OWNER_PID: list[int] = []
"""The process whose :func:`stop_on_sigterm` block is open (a forked child inherits the
handler, not the block)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    if _OWNER_PID and os.getpid() != _OWNER_PID[-1]:
        raise SystemExit(143)  # a forked worker: exit quietly, as Python's multiprocessing does
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up
    raise Terminated


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Terminated` (once: further SIGTERMs are
    ignored while the block unwinds); the previous handler is back afterwards. A no-op
    outside the main thread, where Python cannot set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _OWNER_PID.append(os.getpid())
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _OWNER_PID.pop()


def run_stoppable(main: Callable[[], int]) -> int:
    """Run a script's ``main`` with SIGTERM unwinding it (:func:`stop_on_sigterm`): the
    engines and collectors its ``with`` blocks started stop with it, instead of keeping
    their ports, cores and stores. Returns ``main``'s exit code, or 143 on SIGTERM."""
    with stop_on_sigterm():
        try:
            return main()
        except Terminated:
            print("stopped by SIGTERM; what it started is stopped", file=sys.stderr)
            return 143
