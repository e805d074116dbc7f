"""A rank that decides waits for each window and analyses it on a side thread
(:mod:`pace_strategy.core.inflight`); the controllers decide on the training thread. The decisions
are the ones the training thread takes alone from the same windows, and a side thread that never
returns cannot hang the training thread."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from pace_strategy import PaceTimeoutError
from pace_strategy.core.comm import PendingGather
from pace_strategy.core.inflight import WindowInFlight
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.shares import ShareSchedule
from tests.distributed.ranks import raise_first, run_ranks
from tests.distributed.test_hierarchy import _model
from tests.unit.test_rebalance_policy import CFG, K, rank_loop, splits

WORLD = 3


@pytest.mark.timeout(60)
def test_windows_are_analysed_on_a_side_thread_and_decided_as_the_training_thread_decides(monkeypatch):
    analysed: dict[int, list[str]] = {r: [] for r in range(WORLD)}
    applied: dict[int, list[tuple[str, torch.Tensor, int]]] = {r: [] for r in range(WORLD)}
    real_analyze, real_apply = Pacer.analyze, Pacer._apply

    def analyze(self, gathered, index, nodes=None):
        analysed[self.rank].append(threading.current_thread().name)
        return real_analyze(self, gathered, index, nodes)

    def apply(self, analysis):
        thread = threading.current_thread().name
        applied[self.rank].append((thread, analysis.gathered.clone(), self._last_label))
        return real_apply(self, analysis)

    monkeypatch.setattr(Pacer, "analyze", analyze)
    monkeypatch.setattr(Pacer, "_apply", apply)
    cfg = dataclasses.replace(CFG, mode="forced")  # pacing decides delays every window
    pacing: dict[int, list] = {r: [] for r in range(WORLD)}
    global_batch, lookahead = 32 * WORLD, 3
    model = _model(WORLD, slow=1)
    runs = raise_first(
        run_ranks(
            WORLD,
            lambda rank, group: rank_loop(
                rank, group, model, 8 * K, global_batch, lookahead, cfg=cfg, pacing=pacing[rank]
            ),
        )
    )
    monkeypatch.undo()
    for rank in range(WORLD):
        # the last window is the flush's, taken by the training thread with its side thread
        assert all(name.startswith("pace-window-") for name in analysed[rank]), analysed[rank]
        assert {name for name, _, _ in applied[rank]} == {f"rank{rank}"}
        assert len(analysed[rank]) == len(applied[rank]) == 8
        # the same windows decided start to end on the calling thread, by a Pacer of the same rank
        reference = Pacer(cfg, None, rank, WORLD)
        schedule = ShareSchedule(global_batch, WORLD)
        reference.attach_shares(schedule, lookahead)
        decisions, rebalances = [], []
        for _, gathered, after_step in applied[rank]:
            reference._last_label = after_step
            result = reference._decide(gathered)
            decisions.append(result.decision)
            rebalances.append(result.rebalance)
        assert decisions[: len(pacing[rank])] == pacing[rank] and len(pacing[rank]) == 7  # (not the flush's)
        entries, rebalance, _, _ = runs[rank]
        assert rebalances == rebalance
        assert splits(schedule.entries) == splits(entries)
    # not trivially equal: a split was tried and delays were decided
    assert len(splits(runs[0][0])) > 1
    assert any(any(d > 0 for d in decision.delays_ms) for decision in pacing[0])


@pytest.mark.timeout(30)
def test_a_side_thread_that_does_not_return_fails_the_wait_for_it_and_names_the_window():
    release = threading.Event()
    gather = PendingGather(work=None, outputs=[], first_step=64, last_step=95)
    flight = WindowInFlight(gather, lambda: release.wait(20), lambda window: window)
    assert flight.threaded and not flight.gathered
    started = time.monotonic()
    with pytest.raises(PaceTimeoutError, match=r"steps 64\.\.95 did not finish within 0\.3 s"):
        flight.result(0.3, rank=2, world_size=4)
    assert time.monotonic() - started < 5.0
    release.set()  # the thread returns; its outcome is then there
    assert flight.result(5.0, rank=2, world_size=4) is True and flight.gathered


@pytest.mark.timeout(30)
def test_what_the_side_thread_raises_is_raised_on_the_training_thread():
    def analyze(window):
        raise ValueError(f"bad window {window}")

    gather = PendingGather(work=None, outputs=[], first_step=0, last_step=7)
    flight = WindowInFlight(gather, lambda: "w0", analyze)
    with pytest.raises(ValueError, match="bad window w0"):
        flight.result(5.0, rank=0, world_size=1)
    waited_here = WindowInFlight(gather, lambda: "w1", None)
    assert not waited_here.threaded and waited_here.wait() == "w1"
    with pytest.raises(RuntimeError, match="no side thread"):
        waited_here.result(1.0, rank=0, world_size=1)
