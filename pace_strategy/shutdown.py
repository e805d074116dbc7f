"""Ending a training process: open pacing sessions closed at exit, and an exit without torch's gloo
shutdown abort.

Sessions not yet finished or closed, whatever adapter started them, are closed by one exit handler
(:func:`close_at_exit`): ``failed`` when the script died of an uncaught exception, else
``incomplete``.

With gloo, a c10d worker thread that still holds the last reference to a Python-owned tensor when
the interpreter's finalization starts aborts the process ("terminate called without an active
exception", SIGABRT; pytorch/pytorch#179291), so a complete run reports a failure to its launcher.
Seen about once in 20-40 runs on a 2-core machine, with plain DDP as with ours (docs/hazards.md).
Finalization is the one step that must be skipped: everything before it (joining the threads the
program started, its exit handlers, flushing) still runs.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import weakref
from typing import NoReturn, Protocol

__all__ = ["close_at_exit", "exit_without_finalization", "leave_without_finalization", "no_longer_open"]


class _Closable(Protocol):
    def fail(self, error: BaseException) -> None: ...
    def close(self, status: str = ...) -> None: ...


#: Sessions not yet finished or closed: closed at interpreter exit.
_OPEN: weakref.WeakSet[_Closable] = weakref.WeakSet()


def close_at_exit(session: _Closable) -> None:
    """Close ``session`` at interpreter exit unless it has ended by then (:func:`no_longer_open`)."""
    _OPEN.add(session)
    _register_once()


def no_longer_open(session: _Closable) -> None:
    """``session`` has ended: nothing to do for it at exit."""
    _OPEN.discard(session)


@functools.cache
def _register_once() -> None:
    atexit.register(_close_open_sessions)


def _close_open_sessions() -> None:
    """At exit, close every open session locally (no collective: the peers may be gone): ``failed``
    when the script died of an uncaught exception (Python sets ``sys.last_value`` before the exit
    handlers run), else ``incomplete``. What was exchanged is written; the steps of the last,
    unexchanged window are lost (a normal end calls ``finish``, which exchanges them)."""
    error = getattr(sys, "last_value", None)
    for session in list(_OPEN):
        if isinstance(error, BaseException):
            session.fail(error)
        else:
            session.close(status="incomplete")


def leave_without_finalization(status: int) -> NoReturn:
    """End the process now with ``status``, after flushing stdout and stderr: no exit handlers, no
    finalization. Call it only when everything is closed and flushed (trackers, run record, process
    groups)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_without_finalization(status: int) -> NoReturn:
    """End the process as the interpreter would at a normal exit, less its finalization: wait for the
    program's non-daemon threads, run the exit handlers (``atexit``: trackers, loggers, our own),
    flush, then leave with ``status``. For a process whose script has returned (``pace launch``'s
    workers) and must not be failed by the abort at finalization."""
    # What Py_FinalizeEx does first, in this order: join non-daemon threads, then the atexit
    # handlers. threading._shutdown is the interpreter's own (private) entry for the first.
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown) and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    leave_without_finalization(status)
