"""Checkpointable pacing state: the controller's state round-trips through JSON and decides alike,
bad states are refused with the field named, a session restores before its first window (the
record's ``resume`` line), Accelerate's register_for_checkpointing round trip with a real
Accelerator, and SIGTERM closing the record as ``terminated`` without a collective."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.records import PolicyState
from pace_strategy.core.state import STATE_VERSION, PacingStateError
from pace_strategy.integrations.accelerate.attach import PacingHandle, _handle_sigterm
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.run_record import read_run_record
from tests.unit.test_policy import window
from tests.unit.test_session import _train

#: an adaptive controller that runs one A/B trial, finds no gain and cools down (a state far from fresh)
BACKS_OFF = PacingConfig(activate_windows=2, ab_windows=2, cooldown_windows=4)


def _cooling_down() -> PacingPolicy:
    policy = PacingPolicy(BACKS_OFF, 2)
    for i in range(2):
        policy.update(window(i, [30.0, 0.0], step_ms=100.0))  # severe: the trial starts
    for i in range(2, 5):
        policy.update(window(i, [30.0, 0.0], step_ms=101.0))  # paced, and no faster
    assert policy.state is PolicyState.COOLDOWN, policy.last_decision
    return policy


def test_the_controller_state_round_trips_through_json_and_decides_alike():
    policy = _cooling_down()
    saved = json.loads(json.dumps(policy.state_dict()))  # plain JSON-able data, exactly
    restored = PacingPolicy(BACKS_OFF, 2)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert restored.state is PolicyState.COOLDOWN and restored.last_decision == policy.last_decision
    later = [window(i, [30.0, 0.0], step_ms=100.0) for i in range(5, 14)]
    assert [restored.update(w) for w in later] == [policy.update(w) for w in later]
    # a fresh controller would not have been cooling down: the restore is what made them agree
    assert PacingPolicy(BACKS_OFF, 2).update(later[0]).state is PolicyState.MONITOR


def test_bad_states_are_refused_with_the_field_named_and_change_nothing():
    saved = _cooling_down().state_dict()
    fresh = PacingPolicy(BACKS_OFF, 2)
    before = fresh.state_dict()
    with pytest.raises(
        PacingStateError, match=f"state version {STATE_VERSION + 1}; this pace_strategy reads"
    ):
        fresh.load_state_dict({**saved, "version": STATE_VERSION + 1})
    with pytest.raises(PacingStateError, match="saved with world_size 2, this run has 4"):
        PacingPolicy(BACKS_OFF, 4).load_state_dict(saved)
    with pytest.raises(PacingStateError, match="no 'cooldown_len' field"):
        fresh.load_state_dict({k: v for k, v in saved.items() if k != "cooldown_len"})
    with pytest.raises(PacingStateError, match="'severe_streak'=True is not int"):
        fresh.load_state_dict({**saved, "severe_streak": True})
    with pytest.raises(PacingStateError, match="does not load"):
        fresh.load_state_dict({**saved, "state": "sleeping"})
    assert fresh.state_dict() == before


def _session(tmp_path, **config) -> PacingSession:
    cfg = PacingConfig(**{"exchange_every_steps": 4, "warmup_steps": 0, **config})
    return PacingSession.start(
        cfg, rank=0, world_size=1, device=torch.device("cpu"), group=None, framework="test", log_dir=tmp_path
    )


def test_a_restored_session_continues_the_windows_and_its_record_begins_with_a_resume_line(tmp_path):
    first = _session(tmp_path / "a")
    _train(first, 12)
    saved = json.loads(json.dumps(first.state.state_dict(12)))
    first.finish()
    assert saved["step"] == 12 and saved["components"]["pacer"]["window"] == 2

    second = _session(tmp_path / "b")
    assert second.state.load(saved, source="ckpt/step=12.ckpt").restored == ["pacer"]
    assert second.state.state_dict(12) == saved
    assert not (tmp_path / "b").exists()  # still nothing written before the first window
    _train(second, 8)
    second.finish()
    lines = (tmp_path / "b" / "pace_run.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {
        "record": "resume",
        "step": 12,
        "restored": ["pacer"],
        "from": "ckpt/step=12.ckpt",
        "skipped": {},
    }
    record = read_run_record(tmp_path / "b")
    assert record.resume is not None and record.decisions[0]["window"] == 2  # numbering continues


def test_no_state_or_a_newer_one_still_resumes_and_says_what_was_restored(tmp_path, caplog):
    session = _session(tmp_path)
    with caplog.at_level(logging.INFO, logger="pace_strategy"):
        assert session.state.load(None, source="plain.ckpt", step=7).restored == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "restored: nothing" in caplog.text
    newer = {"version": STATE_VERSION + 1, "step": 7, "components": {}}
    with caplog.at_level(logging.WARNING, logger="pace_strategy"):
        assert session.state.load(newer, source="new.ckpt").restored == []
    assert "Upgrade pace_strategy" in caplog.text
    _train(session, 4)
    session.finish()
    resume = read_run_record(tmp_path).resume
    assert resume is not None and resume["step"] == 7 and resume["restored"] == []
    assert "Upgrade pace_strategy" in resume["skipped"]["*"]


def test_a_component_registered_after_the_restore_gets_its_state(tmp_path):
    class Shares:
        def __init__(self) -> None:
            self.value = [0.5, 0.5]

        def state_dict(self) -> dict:
            return {"version": 1, "shares": self.value}

        def load_state_dict(self, state) -> None:
            self.value = list(state["shares"])

    saved = {
        "version": 1,
        "step": 3,
        "world_size": 1,
        "components": {"rebalance": {"version": 1, "shares": [0.6, 0.4]}},
    }
    session = _session(tmp_path)
    assert session.state.load(saved).restored == []
    shares = Shares()
    session.state.register("rebalance", shares)
    assert shares.value == [0.6, 0.4]
    assert session.state.state_dict(3)["components"]["rebalance"]["shares"] == [0.6, 0.4]
    session.close()


@pytest.mark.timeout(60)
def test_accelerate_save_state_and_load_state_round_trip_the_handle(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = torch.nn.Linear(2, 2)
    first = PacingHandle(model, PacingConfig(), _session(tmp_path / "a"))
    assert first.session is not None
    _train(first.session, 12)
    first.steps = 12
    accelerator.register_for_checkpointing(first)
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = first.state_dict()
    first.finish()

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    second = PacingHandle(model, PacingConfig(), _session(tmp_path / "b"))
    accelerator.register_for_checkpointing(second)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert second.steps == 12 and second.state_dict() == saved
    second.finish()
    # without a session (one process), a restored state is carried on to the next checkpoint
    alone = PacingHandle(model, PacingConfig(), None)
    alone.load_state_dict(saved)
    assert alone.state_dict() == saved and alone.steps == 12


def test_sigterm_closes_the_record_as_terminated_and_passes_the_signal_on(tmp_path):
    session = _session(tmp_path, exchange_every_steps=8)
    handle = PacingHandle(torch.nn.Linear(2, 2), session.config, session)
    _train(session, 12)  # one window of 8 exchanged (one process: at once), 4 steps not yet
    received = []

    def previous(signum, frame):
        received.append(signum)

    original = signal.signal(signal.SIGTERM, previous)
    try:
        _handle_sigterm(handle, session)
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM] and session.finished
        handle.detach()  # puts the handler before ours back
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, original)
    record = read_run_record(tmp_path)
    assert record.end is not None and record.end["status"] == "terminated"
    assert record.end["error"] == f"SIGTERM (signal {int(signal.SIGTERM)})"
    assert [s["step"] for s in record.steps] == list(range(8))
    assert [s["step"] for s in record.local_steps] == [8, 9, 10, 11]
    assert record.end["local_steps"] == 4 and all(s["rank"] == 0 for s in record.local_steps)


class _GatedClock:
    """A test double of the clock contract: a mark completes only when the test opens its gate, and
    ``elapsed_ms`` blocks until both marks have completed, as ``CudaEventClock`` does for an event
    queued behind a collective that a dead peer never joins."""

    resolve_lag_steps = 1

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.open_from = 0  # marks with a sequence number below this have completed
        self._sequence = 0

    def mark(self) -> tuple[int, float]:
        self._sequence += 1
        self.now_ms += 1.0
        return (self._sequence, self.now_ms)

    def ready(self, mark: tuple[int, float]) -> bool:
        return mark[0] < self.open_from

    def elapsed_ms(self, start: tuple[int, float], end: tuple[int, float]) -> float:
        deadline = time.monotonic() + 30.0
        while not (self.ready(start) and self.ready(end)):  # a real event would wait for ever
            if time.monotonic() > deadline:
                raise AssertionError("elapsed_ms blocked on a mark that never completes")
            time.sleep(0.01)
        return end[1] - start[1]

    def delay(self, ms: float) -> None:
        self.now_ms += ms

    def now_s(self) -> float:
        return self.now_ms / 1e3


def test_terminate_never_waits_for_a_mark_that_has_not_happened(tmp_path):
    clock = _GatedClock()
    session = PacingSession.start(
        PacingConfig(exchange_every_steps=4, warmup_steps=0),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        group=None,
        framework="test",
        log_dir=tmp_path,
        clock=clock,
    )
    clock.open_from = 10**9  # the first 9 steps' marks complete...
    _train(session, 9)  # two windows of 4 resolved and exchanged; step 8 held back (resolve lag 1)
    clock.open_from = clock._sequence + 1
    _train(session, 3)  # ...then the device is stuck: steps 9-11 have marks that never complete
    started = time.monotonic()
    session.terminate("SIGTERM (test)")
    assert time.monotonic() - started < 5.0  # returned without waiting on the stuck marks
    record = read_run_record(tmp_path)
    assert record.end["status"] == "terminated" and record.end["unresolved_steps_dropped"] == 3
    assert [s["step"] for s in record.steps] == list(range(8))
    assert [s["step"] for s in record.local_steps] == [8]  # the one held back had completed
