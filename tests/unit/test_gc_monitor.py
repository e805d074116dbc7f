"""GcMonitor times real collections (any thread), counts them towards the open step, and leaves
``gc.callbacks`` as it found it, also when training fails."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from pace_strategy.core.config import GcSyncConfig, PacingConfig
from pace_strategy.core.gc_monitor import GcMonitor
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import Field
from pace_strategy.session import PacingSession


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_every_collection_is_timed_and_reported_per_generation():
    seen: list[tuple[float, int]] = []
    callbacks_before = list(gc.callbacks)
    monitor = GcMonitor(lambda ms, n: seen.append((ms, n)))
    monitor.install()
    monitor.install()  # idempotent: one callback
    assert len(gc.callbacks) == len(callbacks_before) + 1
    heap = [[i] for i in range(50_000)]  # something for a full collection to scan
    gc.collect(2)
    gc.collect(1)
    monitor.remove()
    gc.collect()
    assert monitor.collections[2] >= 1 and monitor.collections[1] >= 1
    assert len(seen) == sum(monitor.collections)  # nothing reported after remove
    assert all(ms > 0 and n == 1 for ms, n in seen)
    assert monitor.max_ms == max(ms for ms, _ in seen)
    assert sum(monitor.total_ms) == pytest.approx(sum(ms for ms, _ in seen))
    assert gc.callbacks == callbacks_before
    summary = monitor.summary()
    assert summary["collections"] == monitor.collections and summary["max_pause_ms"] > 0
    del heap


def test_a_collection_on_another_thread_is_counted():
    counted: list[float] = []
    monitor = GcMonitor(lambda ms, n: counted.append(ms))
    monitor.install()
    try:
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
    finally:
        monitor.remove()
    assert monitor.collections[2] == 1 and len(counted) == 1


def test_gc_time_lands_in_the_open_steps_row_only():
    pacer = Pacer(PacingConfig(exchange_every_steps=2, warmup_steps=0), None, 0, 1)
    monitor = GcMonitor(pacer.add_gc)
    monitor.install()
    try:
        gc.collect()  # between steps: not counted
        pacer.begin_step(0)
        _cycles(100)
        gc.collect()
        pacer.enter_sync(bucketed=False)
        pacer.sync_done()
        pacer.end_step()
        pacer.begin_step(1)
        pacer.enter_sync(bucketed=False)
        pacer.sync_done()
        pacer.end_step()
    finally:
        monitor.remove()
    (result,) = pacer.flush()
    rows = result.gathered[0]
    assert rows[0, Field.GC_MS] > 0 and rows[0, Field.GC_COLLECTIONS] >= 1
    # step 1 may see an automatic young collection, never the explicit full one of step 0
    assert rows[1, Field.GC_MS] < rows[0, Field.GC_MS] or rows[1, Field.GC_COLLECTIONS] == 0


def _session(tmp_path, **config) -> PacingSession:
    cfg = PacingConfig(exchange_every_steps=4, warmup_steps=0, **config)
    return PacingSession.start(
        cfg, rank=0, world_size=1, device=torch.device("cpu"), group=None, framework="test", log_dir=tmp_path
    )


def _step(session: PacingSession, step: int) -> None:
    session.pacer.begin_step(step)
    session.pacer.enter_sync(bucketed=False)
    session.pacer.sync_done()
    session.end_step()


@pytest.mark.parametrize("freeze", [False, True])
def test_a_failed_run_restores_the_collector(tmp_path, freeze):
    callbacks_before, threshold_before = list(gc.callbacks), gc.get_threshold()
    session = _session(tmp_path, gc_sync=GcSyncConfig(enabled=True, warmup_steps=2, freeze=freeze))
    for step in range(4):
        _step(session, step)
    assert session.pacer.gc_sync is not None and session.pacer.gc_sync.active
    assert gc.get_threshold()[2] > threshold_before[2]  # full collections wait for an agreed step
    assert (gc.get_freeze_count() > 0) == freeze
    session.fail(RuntimeError("injected"))
    assert gc.get_threshold() == threshold_before and gc.isenabled()
    assert gc.callbacks == callbacks_before and gc.get_freeze_count() == 0
    end = [line for line in session.record_path.read_text().splitlines() if '"end"' in line]
    # with freezing, the take-over runs one collection (so that no garbage is frozen); without, none
    assert '"gc":[{"rank":0' in end[0] and f'"synchronized":{int(freeze)}' in end[0]


def test_a_completed_run_restores_the_collector_and_reports_every_rank(tmp_path):
    threshold_before = gc.get_threshold()
    session = _session(tmp_path, gc_sync=GcSyncConfig(enabled=True, warmup_steps=1))
    for step in range(6):
        _step(session, step)
    session.finish()
    assert gc.get_threshold() == threshold_before
    text = session.record_path.read_text()
    assert '"gc_sync":{"synchronized":0' in text  # nothing was due in six steps: nothing collected
