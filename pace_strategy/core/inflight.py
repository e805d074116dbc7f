"""A launched window whose gather is waited for, and the window analysed, on a side thread.

A rank that decides (every rank with the flat exchange, a node leader with ``node_leaders``) launches
each window's all-gather at the window's end and collects it one step later. What it does with the
window in between needs no state: wait for the gather (a node leader: its node's, then the leaders'
all-gather, N - 1 hops), check the step labels, reduce the window to its statistics and to
rebalancing's measure (:meth:`~pace_strategy.core.pacer.Pacer.analyze`). :class:`WindowInFlight` does
that on a thread of its own while the training thread runs the next step; at its end the training
thread takes the result (:meth:`WindowInFlight.result`) and lets the controllers decide, which is the
only part that changes state. The decision is the one the training thread would have taken itself, at
the same step: the same code on the same window, applied where it was applied before.

Why a thread: at 8,192 ranks the analysis is ~15 ms of reductions over a 36 MB window and a leader's
gather ~30 ms of hops (``benchmarks/scale.py``), which the training thread waited out at every
window's collection and its node with it. Numpy's and torch's reductions release the GIL, so the
thread costs the training thread little of its own time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from pace_strategy.core.comm import PendingGather
from pace_strategy.core.errors import PaceTimeoutError

__all__ = ["WindowInFlight"]

T = TypeVar("T")
W = TypeVar("W")


class WindowInFlight(Generic[W, T]):
    """One launched window: its gather, and (``analyze`` given) a daemon thread that runs ``wait()``
    and then ``analyze`` on what it returned.

    Args:
        gather: the gather launched for the window.
        wait: blocks until the window is there (bounded by the exchange's timeouts) and returns it.
        analyze: what to make of the window; ``None``: no thread, the training thread waits itself
            (a rank that is not a node leader only receives its leader's verdict).
    """

    def __init__(
        self, gather: PendingGather, wait: Callable[[], W], analyze: Callable[[W], T] | None
    ) -> None:
        self.gather = gather
        self._wait = wait
        self._outcome: T | None = None
        self._error: BaseException | None = None
        self._gathered = threading.Event()  #: ``wait()`` returned: only the analysis is left
        self._thread: threading.Thread | None = None
        if analyze is not None:
            self._thread = threading.Thread(
                target=self._run, args=(analyze,), name=f"pace-window-{gather.first_step}", daemon=True
            )
            self._thread.start()

    @property
    def threaded(self) -> bool:
        """Whether a side thread waits for and analyses this window."""
        return self._thread is not None

    @property
    def gathered(self) -> bool:
        """Whether the window has been received (without waiting): the rest is local work."""
        return self._gathered.is_set()

    def wait(self) -> W:
        """Without a side thread: wait for the window here."""
        if self._thread is not None:
            raise RuntimeError("this window is waited for on its side thread: use result()")
        return self._wait()

    def result(self, timeout_s: float, rank: int, world_size: int) -> T:
        """The analysis, once the side thread has finished it (raising what the thread raised).

        The thread's waits are bounded by the exchange's own timeouts; ``timeout_s`` bounds this one
        beyond them, so that nothing waits forever on a thread that does not return."""
        if self._thread is None:
            raise RuntimeError("no side thread analyses this window")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise PaceTimeoutError(
                rank,
                world_size,
                f"the side thread of the pace_strategy window for steps {self.gather.first_step}.."
                f"{self.gather.last_step} did not finish within {timeout_s:g} s, although its exchange "
                "waits are bounded by exchange_timeout_s: a peer rank is probably hung. Check the other "
                "ranks' logs.",
            )
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome

    def _run(self, analyze: Callable[[W], T]) -> None:
        try:
            window = self._wait()
            self._gathered.set()
            self._outcome = analyze(window)
        except BaseException as error:  # re-raised on the training thread by result()
            self._error = error
