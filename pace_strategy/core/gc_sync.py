"""Synchronized garbage collection (``gc_sync``): every rank runs its full collections at one agreed step.

Why: a full collection pauses a rank for as long as it takes to scan the whole heap (~110 ms for 1.5M
objects here) at a step no other rank shares, so with W ranks the job waits for W pauses where one
would do. Megatron (``--manual-gc``) and torchtnt (``GarbageCollector``) synchronize collection for
the same reason.

How (CPython 3.11's generational collector): after warm-up the third threshold is raised out of
reach, so the collector never starts a full collection by itself; young collections stay automatic
(they scan only recent objects, and they collect most short-lived cycles). Each rank tracks how close
its collector is to the full collection it would have started (CPython's own rule: more young
collections than the third threshold, and objects promoted to the old generation since the last full
collection >= a quarter of the heap that survived it) and reports that *due fraction* in its step row
(``Field.GC_DUE``). At each window every rank reads the same gathered rows and, when any rank was due,
all of them collect at the start of the next step. A collection therefore never comes earlier than
some rank's own collector would have run one (at ``gc_sync_due_fraction=1``), and garbage stays
bounded by one window's worth beyond what the automatic collector would hold.

Raising the threshold was chosen over ``gc.disable()`` plus manual young collections: the young
collector keeps its own timing (per allocation, inside the step, not once per step), so short-lived
garbage never piles up within a long step, and nothing runs per step but one ``gc.get_count()``.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.records import Field, GcCollect

__all__ = ["CollectorSettings", "GcSync", "collect_decision"]

log = logging.getLogger(__name__)

#: the third threshold while gc_sync holds the collector: unreachable in any training run, within C int
_OUT_OF_REACH = 2**30

_OLDEST = 2


@dataclass(frozen=True)
class CollectorSettings:
    """The process's collector settings, captured to be put back exactly."""

    enabled: bool
    threshold: tuple[int, ...]

    @classmethod
    def capture(cls) -> CollectorSettings:
        return cls(enabled=gc.isenabled(), threshold=tuple(gc.get_threshold()))

    def apply(self) -> None:
        gc.set_threshold(*self.threshold)
        if self.enabled:
            gc.enable()
        else:
            gc.disable()


def collect_decision(gathered: torch.Tensor, after_step: int, due_fraction: float) -> GcCollect | None:
    """The synchronized-collection decision of one gathered window ``[world_size, steps, NUM_FIELDS]``.

    Pure, so every rank computes the same answer from the same gathered rows: collect when any rank's
    due fraction at the window's last step is at least ``due_fraction``.
    """
    if gathered.shape[1] == 0:
        return None
    due = tuple(float(v) for v in gathered[:, -1, Field.GC_DUE].tolist())
    if max(due) < due_fraction:
        return None
    return GcCollect(after_step=after_step, due=due)


class GcSync:
    """This rank's side of ``gc_sync``: takes the collector over after warm-up, reports how due it is,
    collects when the window decides so, and restores the collector (:meth:`restore`, idempotent).

    Driven by the Pacer: :meth:`begin_step` (every step), :meth:`due` (at each step's end),
    :meth:`decide` (once per gathered window, identically on every rank).
    """

    def __init__(self, config: PacingConfig) -> None:
        self.config = config
        self._saved: CollectorSettings | None = None
        self._froze = False
        self._froze_once = False
        self._third_threshold = 10
        self._collect_next = False
        self._young = 0  #: objects in the young generations when the current collection started
        self._pending = 0  #: objects promoted to the old generation since the last full collection
        self._long_lived = 0  #: objects that survived the last full collection (frozen ones excluded)
        self._stale = False  #: a full collection ran that we did not measure after (user code)
        self._frozen_before = 0  #: objects someone else had frozen before the take-over
        self._ours = False  #: inside our own gc.collect
        self._hook = self._callback
        self._skipped = False
        #: full collections this rank ran at agreed steps (with gc_sync.freeze, the take-over's too)
        self.synchronized = 0
        #: of those, how many this rank was due itself (its own collector would have run one)
        self.due_self = 0
        #: full collections that started otherwise while gc_sync held the collector (user code)
        self.other_full = 0
        #: step labels at whose start the synchronized collections ran
        self.collected_at: list[int] = []
        #: the largest promoted-object count seen at a step's end: garbage held for the next collection
        self.max_pending = 0

    @property
    def active(self) -> bool:
        return self._saved is not None

    # ------------------------------------------------------------------ per step
    def begin_step(self, index: int, step: int) -> None:
        """Step number ``index`` (0-based, counted by the Pacer: the same on every rank), labelled
        ``step``, has begun: take over at the end of warm-up, or run the collection a window decided."""
        if self._saved is None:
            if index >= self.config.gc_sync.warmup_steps and not self._skipped:
                self._take_over(step)
            return
        if self._collect_next:
            self._collect_next = False
            self._collect(step)

    def due(self) -> float:
        """How close this rank's collector is to the full collection it would have started by itself:
        ``min(young collections since the last full one / (threshold + 1), promoted objects /
        (long-lived heap / 4))``; 0 while gc_sync is not active."""
        if self._saved is None:
            return 0.0
        if self._stale:  # mid-step, the young generations are not empty: count the old one alone
            self._stale = False
            self._long_lived = len(gc.get_objects(_OLDEST))
        self.max_pending = max(self.max_pending, self._pending)
        count = gc.get_count()[_OLDEST] / (self._third_threshold + 1)
        quarter = self._long_lived / 4
        promoted = self._pending / quarter if quarter > 0 else (1.0 if self._pending > 0 else 0.0)
        return min(count, promoted)

    def decide(self, gathered: torch.Tensor, after_step: int) -> GcCollect | None:
        """The window's decision (identical on every rank); a collection runs at the next step's start."""
        if self._saved is None:
            return None
        decision = collect_decision(gathered, after_step, self.config.gc_sync.due_fraction)
        if decision is not None:
            self._collect_next = True
        return decision

    def follow(self) -> None:
        """A window's collection decided by this rank's node leader: it runs at the next step's start."""
        if self._saved is not None:
            self._collect_next = True

    # ------------------------------------------------------------------ collector
    def _take_over(self, step: int) -> None:
        if not gc.isenabled():
            # The user runs without automatic collection: nothing to synchronize (and nothing would
            # ever be due), so leave the collector alone.
            log.warning("pace_strategy: gc_sync is on but the garbage collector is disabled; not taking over")
            self._skipped = True
            return
        self._saved = CollectorSettings.capture()
        self._third_threshold = self._saved.threshold[_OLDEST]
        self._frozen_before = gc.get_freeze_count()
        gc.callbacks.append(self._hook)
        if self.config.gc_sync.freeze and self._frozen_before == 0:
            # Collect first (at the same step on every rank), so that no garbage is frozen for good.
            self._collect(step, decided=False)
            gc.freeze()
            self._froze = self._froze_once = True
            self._long_lived = 0  # what a full collection scans from now on
        else:
            if self.config.gc_sync.freeze:  # unfreezing at the end would undo someone else's freeze
                log.warning("pace_strategy: gc_sync.freeze skipped: objects are frozen already")
            # No collection here (it would cost a light job a full pause for nothing): the old
            # generation is counted once, and promotions from now on. CPython's own pending count
            # is not readable, so this rank's first due comes up to one cycle later than its
            # collector's would: later, never earlier.
            self._long_lived = len(gc.get_objects(_OLDEST))
        t0, t1 = self._saved.threshold[0], self._saved.threshold[1]
        gc.set_threshold(t0, t1, _OUT_OF_REACH)

    def _collect(self, step: int, decided: bool = True) -> None:
        self.synchronized += 1
        if decided and self.due() >= self.config.gc_sync.due_fraction:
            self.due_self += 1
        self.collected_at.append(step)
        self._ours = True
        try:
            gc.collect(_OLDEST)
        finally:
            self._ours = False
        self._long_lived = self._old_size()

    def _old_size(self) -> int:
        """Objects in the old generation right after a full collection: the heap the next one scans
        (CPython keeps this count; Python cannot read it, so it is measured)."""
        if self._froze or self._frozen_before:
            # Frozen: the old generation holds only what survived since, a short list to build.
            return len(gc.get_objects(_OLDEST))
        # Counting a linked list in C (~12 ms for 1.5M objects) beats building a Python list of it
        # (~37 ms); right after a full collection the young generations are empty, so the freeze
        # moves only the old generation, and unfreeze puts it back there.
        gc.freeze()
        size = gc.get_freeze_count()
        gc.unfreeze()
        return size

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        generation = int(info.get("generation", _OLDEST))
        if generation == 0:
            return
        if generation == _OLDEST:
            if phase == "stop":
                self._pending = 0
                if not self._ours:
                    self.other_full += 1
                    self._stale = True
            return
        if phase == "start":
            # CPython merges generation 0 into 1 and collects both: these are the candidates.
            self._young = len(gc.get_objects(0)) + len(gc.get_objects(1))
            return
        # What survives a generation-1 collection is promoted: CPython's "long-lived pending" count.
        dead = int(info.get("collected", 0)) + int(info.get("uncollectable", 0))
        self._pending += max(self._young - dead, 0)

    def restore(self) -> None:
        """Put the collector back as it was (thresholds, enabled, unfreeze what we froze); idempotent."""
        if self._saved is None:
            return
        saved, self._saved = self._saved, None
        gc.callbacks[:] = [c for c in gc.callbacks if c is not self._hook]
        if self._froze:
            gc.unfreeze()
            self._froze = False
        saved.apply()

    def summary(self) -> dict[str, Any]:
        """What gc_sync did on this rank (the run record's end line)."""
        return {
            "synchronized": self.synchronized,
            "due_self": self.due_self,
            "other_full": self.other_full,
            "collected_at": list(self.collected_at),
            "max_pending_objects": self.max_pending,
            "froze": self._froze_once,
        }
