"""Ending a finished training process without torch's gloo shutdown abort.

With gloo, a c10d worker thread that still holds the last reference to a Python-owned tensor when
the interpreter's finalization starts aborts the process ("terminate called without an active
exception", SIGABRT; pytorch/pytorch#179291), so a complete run reports a failure to its launcher.
Seen about once in 20-40 runs on a 2-core machine, with plain DDP as with ours (docs/hazards.md).
Finalization is the one step that must be skipped: everything before it (joining the threads the
program started, its exit handlers, flushing) still runs.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_without_finalization", "leave_without_finalization"]


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
