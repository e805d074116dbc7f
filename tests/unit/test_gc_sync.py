"""gc_sync: the collective decision (synthetic gathered windows through the real decision code), the
due fraction against CPython's own collector on a real heap, bounded memory, and restoring."""

from __future__ import annotations

import gc
from collections import deque

import pytest
import torch

from pace_strategy.core.config import GcSyncConfig, PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.gc_monitor import GcMonitor
from pace_strategy.core.gc_sync import GcSync, collect_decision
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.shares import ShareSchedule


def _window(dues: list[list[float]], first_step: int = 0) -> torch.Tensor:
    """A gathered window ``[ranks, steps, NUM_FIELDS]`` whose GC_DUE column is ``dues[rank][step]``."""
    ranks, steps = len(dues), len(dues[0])
    g = torch.zeros(ranks, steps, NUM_FIELDS, dtype=torch.float64)
    g[:, :, Field.STEP] = torch.arange(first_step, first_step + steps, dtype=torch.float64)
    g[:, :, Field.VALID] = 1.0
    g[:, :, Field.STEP_MS] = 10.0
    g[:, :, Field.GC_DUE] = torch.tensor(dues, dtype=torch.float64)
    return g


def test_collect_when_any_rank_is_due_at_the_windows_end():
    assert collect_decision(_window([[0.1, 0.5], [0.2, 0.9]]), after_step=2, due_fraction=1.0) is None
    decided = collect_decision(_window([[0.1, 0.5], [0.7, 1.3], [0.0, 0.2]]), after_step=2, due_fraction=1.0)
    assert decided is not None and decided.after_step == 2 and decided.due == (0.5, 1.3, 0.2)
    # a rank that was due mid-window but collected since (user code) is not due any more
    assert collect_decision(_window([[1.5, 0.1], [0.3, 0.4]]), after_step=2, due_fraction=1.0) is None
    # a lower fraction collects earlier
    assert collect_decision(_window([[0.1, 0.6], [0.2, 0.4]]), after_step=2, due_fraction=0.5) is not None
    assert collect_decision(_window([[], []]), after_step=0, due_fraction=1.0) is None


def test_every_rank_reaches_the_same_decision_from_the_same_gathered_window():
    g = _window([[0.2, 0.4, 0.6], [0.5, 0.9, 1.1], [0.1, 0.1, 0.1], [0.3, 0.3, 0.95]])
    decisions = {collect_decision(g.clone(), after_step=9, due_fraction=1.0) for _ in range(4)}
    assert len(decisions) == 1 and next(iter(decisions)) is not None


def test_the_pacers_window_decision_carries_the_collection():
    threshold = gc.get_threshold()
    pacer = Pacer(PacingConfig(exchange_every_steps=2, warmup_steps=0, gc_sync=True), None, 0, 1)
    sync = GcSync(
        pacer.config.replace(gc_sync=GcSyncConfig(enabled=pacer.config.gc_sync.enabled, warmup_steps=0))
    )
    pacer.controllers.gc_sync = sync
    try:
        sync.begin_step(0, 0)  # take over
        assert sync.active and sync.synchronized == 0
        calm = pacer._decide(_window([[0.2, 0.3]]))
        assert calm.decision.gc_collect is None
        due = pacer._decide(_window([[0.8, 1.2]], first_step=2))
        assert due.decision.gc_collect is not None and due.decision.gc_collect.due == (1.2,)
        sync.begin_step(5, 5)  # the next step's start: every rank collects here
        assert sync.synchronized == 1 and sync.collected_at == [5]
        sync.begin_step(6, 6)  # once
        assert sync.synchronized == 1
    finally:
        sync.restore()
    assert gc.get_threshold() == threshold


def test_a_collection_stands_beside_held_pacing():
    # The controllers' second rule: a collection moves no delay and no share, so it is kept when
    # rebalancing holds pacing (here: a split decided for a later step than the window's).
    config = PacingConfig(exchange_every_steps=2, warmup_steps=0, gc_sync=True, rebalance=True)
    pacer = Pacer(config, None, 0, 1)
    schedule = ShareSchedule(64, 1)
    pacer.attach_shares(schedule, 0)
    schedule.add(100, (64,), "a later split")
    sync = GcSync(config.replace(gc_sync=GcSyncConfig(enabled=True, warmup_steps=0)))
    pacer.controllers.gc_sync = sync
    try:
        sync.begin_step(0, 0)
        result = pacer._decide(_window([[0.8, 1.2]], first_step=2))
        assert result.decision.reason.startswith("pacing held: the split [64] starts at step 100")
        assert result.decision.gc_collect is not None and result.decision.gc_collect.due == (1.2,)
    finally:
        sync.restore()


class _Job:
    """A heap of long-lived objects and cyclic garbage that survives two young collections (it lives
    a few steps), so only full collections can free it: what makes a big heap pause."""

    def __init__(self, heap: int, garbage_per_step: int, lifetime_steps: int = 3) -> None:
        self.heap = [[i] for i in range(heap)]
        self.alive: deque[list[object]] = deque(maxlen=lifetime_steps)
        self.garbage_per_step = garbage_per_step

    def step(self) -> None:
        batch: list[object] = []
        for _ in range(self.garbage_per_step):
            a: list[object] = []
            a.append(a)
            batch.append(a)
        batch.append(batch)
        self.alive.append(batch)  # the oldest batch becomes cyclic garbage


def _run(job: _Job, steps: int, sync: GcSync | None, window: int) -> tuple[int, int]:
    """(full collections, most GC-tracked objects seen at a step end) over ``steps`` steps."""
    monitor = GcMonitor(lambda ms, n: None)
    monitor.install()
    peak, dues = 0, []
    try:
        for index in range(steps):
            if sync is not None:
                sync.begin_step(index, index)
            job.step()
            if sync is not None:
                dues.append(sync.due())
                if len(dues) == window:  # one rank's window, decided by the real code
                    sync.decide(_window([dues]), after_step=index)
                    dues = []
            if index % 10 == 0:
                peak = max(peak, len(gc.get_objects()))
    finally:
        monitor.remove()
        if sync is not None:
            sync.restore()
    return monitor.collections[2], peak


@pytest.mark.timeout(60)
def test_never_more_often_than_the_automatic_collector_and_memory_stays_bounded():
    steps, window, heap, garbage = 120, 4, 50_000, 5_000
    # The test process's own objects are frozen, so that the collector's rhythm is the job's alone
    # (however many modules the test session has loaded).
    gc.collect()
    gc.freeze()
    try:
        base = len(gc.get_objects())
        auto_full, auto_peak = _run(_Job(heap, garbage), steps, None, window)
        gc.collect()
        sync = GcSync(PacingConfig(gc_sync=GcSyncConfig(enabled=True, warmup_steps=0)))
        sync_full, sync_peak = _run(_Job(heap, garbage), steps, sync, window)
    finally:
        gc.unfreeze()
    assert auto_full >= 4  # the job does need full collections
    # at most one per automatic one, and not far fewer either
    assert sync.synchronized == sync_full and 1 + auto_full // 2 <= sync_full <= auto_full
    assert sync.other_full == 0 and sync.due_self >= sync.synchronized - 2
    # garbage held: at most about one window's more than the automatic collector holds; never
    # collecting would hold every step's cycles
    assert sync_peak < auto_peak + (window + 2) * 2 * garbage
    assert sync_peak - base < heap + 0.5 * steps * garbage


def test_a_disabled_collector_is_left_alone(caplog):
    gc.disable()
    try:
        sync = GcSync(PacingConfig(gc_sync=GcSyncConfig(enabled=True, warmup_steps=0)))
        sync.begin_step(0, 0)
        assert not sync.active and sync.due() == 0.0 and "disabled" in caplog.text
        sync.restore()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("field", "value"),
    [("enabled", 1), ("freeze", "yes"), ("warmup_steps", -1), ("due_fraction", 0.0)],
)
def test_bad_gc_sync_settings_fail_at_start_naming_the_field(field, value):
    with pytest.raises(PacingConfigError, match=rf"PacingConfig\.gc_sync\.{field}="):
        PacingConfig(gc_sync={field: value})


def test_a_full_collection_by_user_code_is_counted_and_resets_the_due_fraction():
    sync = GcSync(PacingConfig(gc_sync=GcSyncConfig(enabled=True, warmup_steps=0)))
    job = _Job(1_000, 4_000)
    try:
        sync.begin_step(0, 0)
        for _ in range(6):
            job.step()
        assert sync.due() > 0.0
        gc.collect()  # e.g. a checkpoint routine
        assert sync.other_full == 1 and sync.due() == 0.0
    finally:
        sync.restore()
