"""Garbage-collector pauses of one rank: a ``gc.callbacks`` start/stop pair that times every collection.

Nothing runs per step: the cost is one callback pair per collection, ~3 us (docs/overhead.md). A
collection can be triggered on any thread (the telemetry thread allocates too); it holds the GIL
while it runs, so the training thread is paused just the same and the pause is counted wherever it
started.
"""

from __future__ import annotations

import gc
import inspect
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["GENERATIONS", "GcMonitor", "GcSink"]

#: CPython's generations: 0 and 1 (young, cheap) and 2 (the full collection, which scans the whole heap)
GENERATIONS = 3

#: receives (milliseconds, collections) for each finished collection: ``Pacer.add_gc``
GcSink = Callable[[float, int], None]


class GcMonitor:
    """Times every garbage collection of this process and reports it to ``sink``.

    Use as :meth:`install` ... :meth:`remove` (idempotent; the session removes it at finish, close
    and failure). Totals since installation are kept per generation, for the run record's end line.

    Args:
        sink: called after each collection with its duration (milliseconds) and ``1``; the Pacer's
            ``add_gc`` counts it towards the open step (outside a step, nothing is counted there).
            A bound method is held weakly: a session dropped without being closed leaves a callback
            that does nothing (it cannot keep its Pacer alive).
    """

    def __init__(self, sink: GcSink) -> None:
        self._sink: Callable[[], GcSink | None] = (
            weakref.WeakMethod(sink) if inspect.ismethod(sink) else lambda: sink
        )
        self._installed = False
        #: collections seen, per generation (index 0..2)
        self.collections = [0] * GENERATIONS
        #: time spent in those collections, per generation, milliseconds
        self.total_ms = [0.0] * GENERATIONS
        #: the longest single pause seen, milliseconds
        self.max_ms = 0.0
        self._hook = self._make_hook()

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._hook)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks[:] = [c for c in gc.callbacks if c is not self._hook]
            self._installed = False

    def _make_hook(self) -> Callable[[str, dict[str, Any]], None]:
        # One closure over locals: every collection of the process calls it twice, so it avoids
        # attribute look-ups and a second Python frame (~1 us of the ~3 us a pair costs).
        counts, totals, sink_of, perf = self.collections, self.total_ms, self._sink, time.perf_counter_ns
        started = [0]
        monitor = self

        def hook(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[0] = perf()
                return
            if not started[0]:  # installed in the middle of a collection
                return
            ms = (perf() - started[0]) / 1e6
            started[0] = 0
            generation = info["generation"]
            counts[generation] += 1
            totals[generation] += ms
            if ms > monitor.max_ms:
                monitor.max_ms = ms
            sink = sink_of()
            if sink is not None:
                sink(ms, 1)

        return hook

    def report(self, rank: int, sync: Any = None) -> dict[str, Any]:
        """One rank's line of the record's GC totals: :meth:`summary`, and what ``sync`` (the
        Pacer's :class:`~pace_strategy.core.gc_sync.GcSync`, if any) did."""
        return {"rank": rank, **self.summary(), "gc_sync": None if sync is None else sync.summary()}

    def summary(self) -> dict[str, Any]:
        """Totals since installation: collections and milliseconds per generation, the longest pause."""
        return {
            "collections": list(self.collections),
            "ms": [round(v, 3) for v in self.total_ms],
            "max_pause_ms": round(self.max_ms, 3),
        }
