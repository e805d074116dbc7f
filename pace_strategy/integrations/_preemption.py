"""SIGTERM (a scheduler's preemption) for the adapters: a handler that does local work only (never a
collective: the peers are being stopped too, in whatever state) and then hands the signal on to the
handler that was there before it, so that installing it changes nothing else about the process."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["SigtermHandler", "chain_signal"]

log = logging.getLogger(__name__)

#: what ``signal.getsignal`` returns: a callable, SIG_DFL, SIG_IGN, or None (set outside Python)
Handler = Any


def chain_signal(previous: Handler, signum: int, frame: FrameType | None) -> None:
    """Do what ``previous`` would have done with the signal: call it, ignore the signal (SIG_IGN), or,
    for the default action (SIG_DFL, or a handler set outside Python), restore it and re-raise the
    signal, so that the process ends as it would have without us."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class SigtermHandler:
    """Runs ``on_sigterm(signum)`` when SIGTERM arrives, then the handler found at :meth:`install`
    (or ``chain_to``, when given: what the signal goes on to).

    Python runs signal handlers in the main thread, between two bytecodes of whatever it was doing;
    ``on_sigterm`` must therefore be local and bounded. An exception in it is logged, never raised
    into the interrupted code; the chained handler runs either way.
    """

    def __init__(self, on_sigterm: Callable[[int], None], chain_to: Handler | None = None) -> None:
        self._on_sigterm = on_sigterm
        self._chain_to = chain_to
        self._replaced: Handler | None = None
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> bool:
        """Install the handler (only the main thread can; elsewhere this returns False)."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.info("pace_strategy: not on the main thread: no SIGTERM handler installed")
            return False
        self._replaced = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def remove(self) -> None:
        """Put back the handler that :meth:`install` replaced, unless someone replaced ours since."""
        if not self._installed:
            return
        self._installed = False
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == self._handle
        ):
            previous = self._replaced
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        try:
            self._on_sigterm(signum)
        except Exception:
            log.exception("pace_strategy: the SIGTERM handler failed; passing the signal on")
        chain_signal(self._replaced if self._chain_to is None else self._chain_to, signum, frame)
