"""Balancing's A/B check: the state machine on synthetic windows, then real Pacers on thread ranks
(real gloo groups) whose data pipeline reads each step's arm from the share schedule, the run record's
lines and what ``pace diagnose`` says of them.

The closed loop models a bulk-synchronous step of two ranks: balanced batches give both ranks the
same compute; plain slices give one rank (alternating with the step, as uneven inputs do) most of
it. The model is time on a manual clock: what is tested is the decision and its plumbing, not a
speed-up (``benchmarks/balance.py`` measures that on real attention)."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

import pytest
import torch

from pace_strategy.core.balance_check import BalanceCheck, BalanceState
from pace_strategy.core.clock import ManualClock
from pace_strategy.core.config import BalanceConfig, PacingConfig
from pace_strategy.core.rebalance import WindowMeasure
from pace_strategy.core.shares import ShareSchedule, SharesEntry
from pace_strategy.core.state import PacingStateError
from pace_strategy.diagnose.findings import diagnose
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.arrays import load_arrays
from pace_strategy.telemetry.run_record import read_run_record
from tests.distributed.ranks import raise_first, run_ranks

K = 8  # steps per window
CFG = PacingConfig(
    mode="monitor",
    balance=BalanceConfig(enabled=True, check_rounds=2, recheck_windows=0),
    exchange_every_steps=K,
    warmup_steps=2,
    ab_windows=2,
)


def measure(first_step: int, step_ms: float, paced: bool = False) -> WindowMeasure:
    return WindowMeasure(
        first_step=first_step,
        last_step=first_step + K - 1,
        shares=(32, 32),
        uniform=True,
        batches=1,
        compute_ms=(step_ms - 5.0, step_ms - 5.0),
        wait_ms=(1.0, 1.0),
        per_sample_ms=(0.5, 0.5),
        step_ms=step_ms,
        paced=paced,
    )


def run_check(check: BalanceCheck, arm_ms: dict[bool, float], windows: int, lookahead_windows: int = 1):
    """Feed ``windows`` windows: each runs at the arm the check scheduled for its first step (a switch
    starts ``lookahead_windows`` windows after the window that decided it)."""
    arms = {0: True}  # the arm from each start step
    steps = []
    for w in range(windows):
        first = w * K
        arm = arms[max(s for s in arms if s <= first)]
        noise = random.Random(w).uniform(-0.2, 0.2)
        step = check.update(measure(first, arm_ms[arm] + noise), (w + 1 + lookahead_windows) * K)
        if step.from_step is not None:
            arms[step.from_step] = step.balanced
        steps.append(step)
    return steps, arms


def test_the_arms_take_turns_at_unbuilt_boundaries_and_a_shorter_balanced_step_is_kept():
    check = BalanceCheck(CFG)
    steps, arms = run_check(check, {True: 20.0, False: 30.0}, windows=20)
    # balanced from 0; each block is 2 counted windows, a switch starts one window later (a window
    # that straddles it, or runs before it, is not counted)
    assert arms == {0: True, 24: False, 48: True, 72: False, 96: True}
    verdict = next(s for s in steps if s.state is BalanceState.KEPT)
    assert verdict.changed and verdict.from_step == 96 and verdict.balanced
    assert verdict.plain_step_ms == pytest.approx(30.0, abs=0.2)
    assert verdict.balanced_step_ms == pytest.approx(20.0, abs=0.2)
    assert "kept" in verdict.reason and "balanced from step 96" in verdict.reason
    assert all(s.state is BalanceState.TRIAL for s in steps[: steps.index(verdict)])
    assert all(
        s.state is BalanceState.KEPT and s.from_step is None for s in steps[steps.index(verdict) + 1 :]
    )
    assert not check.deciding


def test_no_gain_beyond_the_noise_drops_balanced_batches():
    check = BalanceCheck(CFG)
    steps, arms = run_check(check, {True: 20.1, False: 20.0}, windows=20)
    verdict = next(s for s in steps if s.state is BalanceState.DROPPED)
    # the last block is plain: dropping changes nothing from then on
    assert verdict.from_step is None and not verdict.balanced and verdict.changed
    assert "no gain" in verdict.reason and "plain slices" in verdict.reason
    assert arms == {0: True, 24: False, 48: True, 72: False}


def test_warm_up_paced_and_straddling_windows_are_not_counted():
    check = BalanceCheck(CFG)
    assert "not counted" in check.update("no usable steps in the window (warm-up)", 16).reason
    assert "paced window" in check.update(measure(0, 20.0, paced=True), 16).reason
    check.update(measure(8, 20.0), 32)
    switch = check.update(measure(16, 20.0), 40)
    assert switch.from_step == 40 and not switch.balanced
    # windows before the plain arm's start still ran balanced: they wait
    assert "waiting for the plain arm from step 40" in check.update(measure(24, 30.0), 48).reason
    assert "waiting" in check.update(measure(32, 30.0), 56).reason
    assert "plain arm, window 1/2" in check.update(measure(40, 30.0), 64).reason


def test_it_checks_again_after_recheck_windows():
    cfg = dataclasses.replace(CFG, balance=dataclasses.replace(CFG.balance, recheck_windows=5))
    check = BalanceCheck(cfg)
    steps, _ = run_check(check, {True: 20.1, False: 20.0}, windows=40)
    verdicts = [s for s in steps if s.state is not BalanceState.TRIAL and s.changed]
    assert len(verdicts) >= 2 and all(v.state is BalanceState.DROPPED for v in verdicts)
    again = [s for s in steps if "A/B again" in s.reason]
    assert again and again[0].balanced and again[0].from_step is not None  # back to the balanced arm


def test_the_state_round_trips_and_a_damaged_one_changes_nothing():
    check = BalanceCheck(CFG)
    run_check(check, {True: 20.0, False: 30.0}, windows=7)
    state = check.state_dict()
    copy = BalanceCheck(CFG)
    copy.load_state_dict(state)
    assert copy.state_dict() == state
    fresh = BalanceCheck(CFG)
    with pytest.raises(PacingStateError, match="'blocks'"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "blocks"})
    with pytest.raises(PacingStateError, match="does not load"):
        fresh.load_state_dict({**state, "state": "maybe"})
    assert fresh.state_dict() == BalanceCheck(CFG).state_dict()


def test_the_configuration_names_its_fields():
    with pytest.raises(ValueError, match=r"balance\.check_rounds"):
        PacingConfig(balance={"check_rounds": 0})
    with pytest.raises(ValueError, match=r"balance\.verify"):
        PacingConfig(balance={"verify": "yes"})


# ---------------------------------------------------------------------- real Pacers, thread ranks
#: one step of the modelled job: (step, its schedule entry) -> (each rank's compute, ms; its samples)
StepModel = Callable[[int, SharesEntry], tuple[list[float], list[int]]]


def jitter(rank: int, step: int) -> float:
    return 1.0 + random.Random(f"{rank}/{step}").uniform(-0.02, 0.02)


def rank_loop(rank, group, cfg, steps, model: StepModel, run_dir=None, lookahead=3):
    """One rank of a 2-rank job of 64 samples a step on a manual clock: the pipeline builds
    ``lookahead`` steps ahead and reads each step's entry (its shares and arm) from the schedule; the
    step ends 3 ms after the last rank's compute. The schedule's entries, the rebalancing decisions
    and the pacing decisions."""
    clock = ManualClock()
    session = PacingSession(
        cfg,
        rank=rank,
        world_size=2,
        device=torch.device("cpu"),
        group=group,
        framework="test",
        topology=[{"rank": r, "host": "h0", "local_rank": r, "node_rank": 0} for r in range(2)],
        log_dir=run_dir if rank == 0 else None,
        clock=clock,
    )
    schedule = ShareSchedule(64, 2)
    session.pacer.attach_shares(schedule, lookahead)
    built = {}
    for t in range(lookahead + 1):
        built[t] = schedule.entry_for_step(t)
        schedule.note_built(t)
    decisions, pacing = [], []
    for t in range(steps):
        compute, samples = model(t, built.pop(t))
        built[t + lookahead + 1] = schedule.entry_for_step(t + lookahead + 1)
        schedule.note_built(t + lookahead + 1)
        end = max(compute) + 3.0
        session.pacer.begin_step(t)
        session.pacer.set_samples(samples[rank])
        clock.advance(compute[rank])
        session.pacer.enter_sync(bucketed=False)
        clock.advance(end - compute[rank])
        session.pacer.sync_done()
        clock.advance(1.0)
        result = session.end_step()
        if result is not None:
            decisions.append(result.rebalance)
            pacing.append(result.decision)
    session.finish()
    return schedule.entries, decisions, pacing


def uneven_inputs(gain: float) -> StepModel:
    """Balanced: 20 ms of compute each; plain: 20 ms x (1 + ``gain``) on the rank that drew the long
    sequences (alternating), 20 ms x (1 - ``gain``) on the other."""

    def step(t: int, entry: SharesEntry) -> tuple[list[float], list[int]]:
        spread = [1.0, 1.0] if entry.balanced else [1.0 - gain, 1.0 - gain]
        if not entry.balanced:
            spread[t % 2] = 1.0 + gain
        return [20.0 * jitter(r, t) * spread[r] for r in range(2)], [32, 32]

    return step


def closed_loop(gain, run_dir, steps=24 * K, cfg=CFG):
    """Every rank's schedule (from step, balanced), rebalancing decisions and pacing decisions."""
    loop = functools.partial(rank_loop, cfg=cfg, steps=steps, model=uneven_inputs(gain), run_dir=run_dir)
    ranks = raise_first(run_ranks(2, lambda rank, group: loop(rank, group)))
    return [([(e.from_step, e.balanced) for e in entries], d, p) for entries, d, p in ranks]


@pytest.mark.timeout(60)
def test_every_rank_switches_arms_at_the_same_steps_and_keeps_balancing_that_helps(tmp_path):
    (entries, decisions, pacing), (entries1, decisions1, _) = closed_loop(0.5, tmp_path)
    assert entries == entries1 and decisions == decisions1  # the same decisions from the same windows
    assert [b for _, b in entries] == [True, False, True, False, True]
    kept = next(d for d in decisions if d.balance == "kept")
    assert kept.trial_step_ms < 0.8 * kept.baseline_step_ms and kept.balanced
    # pacing waits while the check runs (forced pacing would credit itself the arms' difference)
    trial = [p for p, d in zip(pacing, decisions, strict=True) if d.balance == "trial"]
    assert trial and all(p.reason.startswith("pacing held: balancing's A/B check") for p in trial)
    # the record: every change of arm and the verdict, each with its reason; the diagnosis reports it
    record = read_run_record(tmp_path)
    lines = [(x["balance"], x["balanced"], x["from_step"]) for x in record.shares if x.get("balance")]
    starts = [(f, b) for _, b, f in lines if f is not None]
    assert starts == [(s, b) for s, b in entries[1:]]
    assert lines[-1][0] == "kept"
    result = diagnose(load_arrays(tmp_path), project_ranks=None)
    note = next(n for n in result.notes if n.startswith("cost-balanced batches kept"))
    assert "of the step recovered" in note and result.stats["balance"]["recovered_fraction"] > 0.2
    assert "rebalance" not in result.stats  # the check's lines are not rebalancing's


@pytest.mark.timeout(60)
def test_balancing_that_does_not_shorten_the_step_is_dropped_on_every_rank(tmp_path):
    (entries, decisions, _), (entries1, _, _) = closed_loop(0.0, tmp_path)
    assert entries == entries1 and [b for _, b in entries] == [True, False, True, False]
    dropped = next(d for d in decisions if d.balance == "dropped")
    assert not dropped.balanced and "no gain" in dropped.reason
    note = next(n for n in diagnose(load_arrays(tmp_path), project_ranks=None).notes if "dropped" in n)
    assert note.startswith("cost-balanced batches dropped by their A/B check") and "no gain" in note


@pytest.mark.timeout(60)
def test_unchecked_balancing_stays_on_and_writes_no_check_line(tmp_path):
    cfg = dataclasses.replace(CFG, balance=dataclasses.replace(CFG.balance, verify=False))
    (entries, decisions, _), _ = closed_loop(0.0, tmp_path, steps=8 * K, cfg=cfg)
    assert entries == [(0, True)] and all(d is None for d in decisions)
    assert read_run_record(tmp_path).shares == []


# ---------------------------------------------------------------------- with rebalancing
def slow_device_balanced(t: int, entry: SharesEntry) -> tuple[list[float], list[int]]:
    """Cost-balanced batches: each rank's cost follows its share, its count the lengths drawn (here
    60-140% of the share); rank 1's device takes 2x as long per unit of cost."""
    skew = random.Random(t).uniform(0.6, 1.4)  # the lengths drawn move the counts, not the costs
    first = round(entry.samples[0] * skew)
    return [(0.5, 1.0)[r] * entry.samples[r] * jitter(r, t) for r in range(2)], [first, 64 - first]


@pytest.mark.timeout(60)
def test_rebalancing_reads_balanced_steps_per_share_and_moves_work_to_the_faster_rank():
    # Per sample, the counts would say nothing (they follow the lengths); per share, rank 1 is 2x
    # slower: the split moves to the one proportional to speed and is kept, on every rank alike
    cfg = PacingConfig(
        mode="monitor",
        rebalance={"enabled": True, "quantum": 8, "cooldown_windows": 4},
        balance={"enabled": True, "verify": False},
        exchange_every_steps=K,
        warmup_steps=2,
    )
    loop = functools.partial(rank_loop, cfg=cfg, steps=16 * K, model=slow_device_balanced)
    (entries, decisions, _), (entries1, _, _) = raise_first(run_ranks(2, lambda r, g: loop(r, g)))
    assert entries == entries1 and entries[-1].samples == (40, 24), entries
    assert not any(d.state.value == "off" for d in decisions), [
        d.reason for d in decisions if d.state.value == "off"
    ]
    kept = [d for d in decisions if d.changed and "kept" in d.reason]
    assert kept and kept[-1].balanced is True and kept[-1].per_sample_ms[1] > 1.8 * kept[-1].per_sample_ms[0]
