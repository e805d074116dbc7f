"""Rebalancing decisions: the split arithmetic, the controller on synthetic windows, and the real Pacer
on thread ranks with real gloo groups closing the loop through a ShareSchedule.

The closed loop models each rank's compute as ``fixed_ms + per_sample_ms * samples`` (plus a
deterministic +-3% jitter), a start gap and a data wait before the batch is ready, and a bulk-
synchronous step that ends when the last rank arrives. Each rank's pipeline builds
``lookahead`` batches ahead, as a DataLoader does, and reads its shares from the schedule when it
builds a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.config import PacingConfig, RebalanceConfig
from pace_strategy.core.errors import PaceDistributedError, PacingConfigError
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.rebalance import (
    RebalancePolicy,
    RebalanceState,
    best_split,
    first_boundary,
    measure_window,
    memory_caps,
    resolve_quantum,
)
from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.state import PacingStateError
from pace_strategy.data import restore_schedule
from pace_strategy.diagnose.findings import Mode, diagnose
from pace_strategy.integrations.env import config_from_env
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.arrays import load_arrays
from pace_strategy.telemetry.run_record import RunRecordError, read_run_record
from pace_strategy.telemetry.schema import batch_share_tag
from tests.distributed.ranks import raise_first, run_ranks

DOCS = Path(__file__).resolve().parents[2] / "docs"
K = 8  # steps per window: short windows keep the loops short
CFG = PacingConfig(
    mode="monitor",  # pacing stays out of the way; rebalancing works beside any mode
    # the arithmetic below is pinned in quanta of 8 ("auto" would take 4 here)
    rebalance=RebalanceConfig(enabled=True, cooldown_windows=4, quantum=8),
    exchange_every_steps=K,
    warmup_steps=2,
    max_cooldown_windows=16,
)


# ---------------------------------------------------------------------- the split arithmetic
def test_best_split_is_proportional_to_speed_in_whole_quanta():
    shares, predicted = best_split([0.5, 1.0], 64, 8)
    assert shares == (40, 24) and predicted == 24.0  # ideal 42.7 / 21.3, whole quanta
    assert best_split([1.0, 1.0, 1.0, 1.0], 64, 8)[0] == (16, 16, 16, 16)
    assert best_split([1.0, 1.0, 1.0, 1.5], 128, 8)[0] == (40, 32, 32, 24)  # ties: the lowest rank first
    shares, _ = best_split([1.0, 100.0], 64, 8)
    assert shares == (56, 8)  # every rank keeps at least one quantum
    shares, _ = best_split([1.0, 0.5, 1.0], 100, 8)  # 12 quanta + 4 samples: the rest to the fastest
    assert sum(shares) == 100 and shares[1] % 8 == 4 and all(s % 8 == 0 for s in (shares[0], shares[2]))


def test_best_split_refuses_a_batch_smaller_than_one_quantum_per_rank():
    with pytest.raises(PacingConfigError, match=r"rebalance\.quantum=8 x 4 ranks.*at most 4"):
        best_split([1.0] * 4, 16, 8)


def test_first_boundary_is_a_window_start_at_or_after_the_bound():
    assert first_boundary(31, 32, 20) == 32
    assert first_boundary(31, 32, 32) == 32
    assert first_boundary(31, 32, 33) == 64
    assert first_boundary(31, 32, 97) == 128


# ---------------------------------------------------------------------- synthetic windows
def window(first_step, shares, compute_ms, steps=K, step_ms=None, delay_ms=0.0, batches=1):
    """A gathered window ``[W, steps, NUM_FIELDS]``: rank r trains on ``shares[r]`` samples in
    ``compute_ms[r]`` ms every step (``batches`` micro-batches of that split: gradient accumulation);
    the collective takes 4 ms once the last rank is there."""
    world = len(shares)
    g = torch.zeros(world, steps, NUM_FIELDS, dtype=torch.float64)
    g[:, :, Field.STEP] = torch.arange(first_step, first_step + steps, dtype=torch.float64)
    g[:, :, Field.VALID] = 1.0
    g[:, :, Field.SAMPLES] = batches * torch.tensor(shares, dtype=torch.float64).unsqueeze(1)
    compute = batches * torch.tensor(compute_ms, dtype=torch.float64)
    g[:, :, Field.COMPUTE_MS] = compute.unsqueeze(1)
    g[:, :, Field.WAIT_MS] = (compute.max() - compute + 4.0).unsqueeze(1)  # the last to arrive waits least
    g[:, :, Field.STEP_MS] = max(compute_ms) + 5.0 if step_ms is None else step_ms
    g[:, :, Field.DELAY_MS] = delay_ms
    return g


def test_measure_window_says_why_no_step_is_usable():
    g = window(0, (32, 32), (10.0, 20.0))
    g[:, :, Field.SAMPLES] = 0.0
    assert "set_samples" in measure_window(g, 64)
    g = window(0, (32, 16), (10.0, 20.0))
    assert "global batch of 64" in measure_window(g, 64)
    m = measure_window(window(8, (40, 24), (20.0, 24.0)), 64)
    assert m.per_sample_ms == (0.5, 1.0) and m.shares == (40, 24) and m.step_ms == 29.0


def feed(policy, windows, *, start=0):
    """Feed windows as the Pacer does: a new split starts at the next window boundary."""
    out = []
    for i, g in enumerate(windows):
        last = int(g[0, -1, Field.STEP])
        out.append(policy.update(g, start + i, first_boundary(last, K, last + 1)))
    return out


@pytest.mark.parametrize("batches", [1, 3], ids=["one-batch", "accumulating-3"])
def test_a_persistent_imbalance_is_tried_only_after_it_persists(batches):
    policy = RebalancePolicy(CFG, 64, 2)
    slow = [
        window(i * K, (32, 32), (16.0, 32.0), batches=batches) for i in range(CFG.rebalance.persist_windows)
    ]
    decisions = feed(policy, slow)
    assert [d.state for d in decisions] == [RebalanceState.WATCH] * 2 + [RebalanceState.TRIAL]
    assert all(d.from_step is None for d in decisions[:-1])
    trial = decisions[-1]
    assert trial.shares == (40, 24) and trial.from_step == 3 * K and trial.changed
    assert "imbalanced for 3 windows" in trial.reason
    assert f"save {8.0 * batches:.2f} ms" in trial.reason  # 32 -> 24 samples of rank 1, per micro-batch
    # the trial: every micro-batch at the new split, the compute falls as predicted
    d = feed(
        policy, [window((3 + i) * K, (40, 24), (20.0, 24.0), batches=batches) for i in range(2)], start=3
    )
    assert "kept" in d[-1].reason and policy.shares == (40, 24)


def test_a_transient_imbalance_is_not_rebalanced():
    policy = RebalancePolicy(CFG, 64, 2)
    windows = [window(i * K, (32, 32), (16.0, 32.0 if i % 2 else 16.5)) for i in range(8)]
    assert all(d.state is RebalanceState.WATCH and d.from_step is None for d in feed(policy, windows))


def test_a_pipeline_that_ignores_the_schedule_turns_rebalancing_off():
    policy = RebalancePolicy(CFG, 64, 2)
    feed(policy, [window(i * K, (32, 32), (16.0, 32.0)) for i in range(3)])
    d = feed(policy, [window(3 * K, (32, 32), (16.0, 32.0))], start=3)[0]  # still even at the trial
    assert d.state is RebalanceState.OFF and "does not follow the share schedule" in d.reason


def test_a_split_scheduled_by_someone_else_is_followed():
    policy = RebalancePolicy(CFG, 64, 2)
    feed(policy, [window(i * K, (32, 32), (16.0, 32.0)) for i in range(2)])
    assert policy.follow(2 * K, (48, 16)) and not policy.follow(2 * K, (48, 16))
    d = feed(policy, [window(2 * K, (48, 16), (24.0, 16.0))], start=2)[0]
    assert d.state is RebalanceState.WATCH and d.shares == (48, 16) and "at [48, 16]" in d.reason


def test_a_paced_window_does_not_count_towards_the_trial():
    policy = RebalancePolicy(CFG, 64, 2)
    feed(policy, [window(i * K, (32, 32), (16.0, 32.0), step_ms=40.0) for i in range(3)])
    paced = window(3 * K, (40, 24), (20.0, 24.0), step_ms=30.0, delay_ms=2.0)
    assert feed(policy, [paced], start=3)[0].state is RebalanceState.TRIAL
    d = feed(policy, [window((4 + i) * K, (40, 24), (20.0, 24.0), step_ms=30.0) for i in range(2)], start=4)
    assert d[-1].state is RebalanceState.WATCH and "kept" in d[-1].reason


def test_a_split_that_does_not_shorten_the_step_is_reverted():
    policy = RebalancePolicy(CFG, 64, 2)
    noisy = [window(i * K, (32, 32), (16.0, 32.0), step_ms=40.0 + (i % 2) * 0.2) for i in range(3)]
    # the compute falls as predicted, but the step does not get shorter (something else sets it)
    same = [window((3 + i) * K, (40, 24), (20.0, 24.0), step_ms=40.05) for i in range(2)]
    d = feed(policy, noisy + same)[-1]
    assert d.state is RebalanceState.COOLDOWN and d.shares == (32, 32) and d.from_step == 5 * K
    assert d.reason.startswith("A/B: step 40.05 ms vs 40.10 ms") and "no gain of 0.20 ms" in d.reason


def test_a_trial_that_pacing_never_leaves_is_reverted():
    policy = RebalancePolicy(CFG, 64, 2)
    feed(policy, [window(i * K, (32, 32), (16.0, 32.0), step_ms=40.0) for i in range(3)])
    limit = CFG.rebalance.persist_windows + CFG.ab_windows
    paced = [window((3 + i) * K, (40, 24), (20.0, 24.0), step_ms=30.0, delay_ms=2.0) for i in range(limit)]
    decisions = feed(policy, paced, start=3)
    assert all(d.state is RebalanceState.TRIAL for d in decisions[:-1])
    assert decisions[-1].state is RebalanceState.COOLDOWN and decisions[-1].shares == (32, 32)
    assert "pacing stayed on for 5 windows" in decisions[-1].reason


def test_state_dict_round_trip_takes_the_same_decisions():
    # three imbalanced windows start a trial from step 24; three windows at the new split follow
    windows = [window(i * K, (32, 32), (16.0, 32.0), step_ms=40.0 + (i % 2) * 0.1) for i in range(3)]
    windows += [window((3 + i) * K, (40, 24), (20.0, 24.0), step_ms=30.0) for i in range(3)]
    ref = RebalancePolicy(CFG, 64, 2)
    expected = feed(ref, windows)
    first = RebalancePolicy(CFG, 64, 2)
    feed(first, windows[:4])
    restored = RebalancePolicy(CFG, 64, 2)
    restored.load_state_dict(first.state_dict())
    decisions = feed(restored, windows[4:], start=4)
    assert decisions == expected[4:] and "kept" in decisions[0].reason
    with pytest.raises(PacingStateError, match="global_batch 64, this run has 128"):
        RebalancePolicy(CFG, 128, 2).load_state_dict(first.state_dict())


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enabled", 1),
        ("quantum", 0),
        ("min_imbalance", 0.0),
        ("persist_windows", 0),
        ("min_scaling", 1.5),
        ("cooldown_windows", -1),
    ],
)
def test_bad_rebalance_fields_fail_at_start_naming_the_field(field, value):
    with pytest.raises(PacingConfigError, match=rf"PacingConfig.rebalance.{field}="):
        PacingConfig(rebalance=RebalanceConfig(**{field: value}))
    with pytest.raises(PacingConfigError, match=rf"PacingConfig.rebalance.{field}="):  # a mapping too
        PacingConfig(rebalance={field: value})


def test_rebalance_reaches_the_workers_by_environment():
    cfg = config_from_env({"PACE_REBALANCE": "1", "PACE_REBALANCE__QUANTUM": "4"})
    assert cfg is not None and cfg.rebalance.enabled and cfg.rebalance.quantum == 4
    with pytest.raises(PacingConfigError, match="PACE_REBALANCE__MIN_SCALING='2'"):
        config_from_env({"PACE_REBALANCE__MIN_SCALING": "2"})


def test_attach_shares_checks_the_schedule_against_the_job():
    pacer = Pacer(CFG, None, 0, 1)
    with pytest.raises(PacingConfigError, match="over 2 ranks but this job has 1"):
        pacer.attach_shares(ShareSchedule(64, 2), 2)
    with pytest.raises(PacingConfigError, match=r"rebalance\.quantum=8 x 1 ranks"):
        pacer.attach_shares(ShareSchedule(4, 1), 2)
    with pytest.raises(ValueError, match="lookahead_steps"):
        pacer.attach_shares(ShareSchedule(64, 1), -1)
    plain = Pacer(dataclasses.replace(CFG, rebalance=RebalanceConfig()), None, 0, 1)
    schedule = ShareSchedule(64, 1)
    plain.attach_shares(schedule, 2)
    # attached, but not rebalanced
    assert plain.shares is schedule and plain.controllers.rebalance.policy is None


# ---------------------------------------------------------------------- the closed loop, real Pacers
@dataclasses.dataclass(frozen=True)
class Model:
    """Per-rank costs of one step, ms."""

    per_sample_ms: Sequence[float]
    fixed_ms: Sequence[float] = (1.0, 1.0)
    gap_ms: Sequence[float] = (0.0, 0.0)  #: late start (a slow network path finishing the last collective)
    data_ms: Sequence[float] = (0.0, 0.0)  #: blocked waiting for input
    transfer_ms: float = 4.0
    optimizer_ms: float = 1.0

    def compute_ms(self, rank: int, samples: int, step: int) -> float:
        jitter = 1.0 + random.Random(f"{rank}/{step}").uniform(-0.03, 0.03)
        return (self.fixed_ms[rank] + self.per_sample_ms[rank] * samples) * jitter


def rank_loop(
    rank,
    group,
    model,
    steps,
    global_batch=64,
    lookahead=3,
    built_extra=0,
    cfg=CFG,
    run_dir=None,
    tags=None,
    pacing=None,
    hierarchy=None,
    finished=None,
):
    """One rank's schedule entries, decisions and per-step times after ``steps`` steps (its pipeline
    builds ``built_extra`` batches beyond the ``lookahead`` it declares). With ``run_dir``, through a
    PacingSession whose rank 0 writes the run record there and logs its tags into ``tags``, and
    ``finished(rank)`` is called as soon as the session has finished; the pacing decisions go into
    ``pacing``, if given."""
    world = len(model.per_sample_ms)
    clock = ManualClock()
    session = None
    if run_dir is None:
        pacer = Pacer(cfg, group, rank, world, clock, hierarchy=hierarchy)
    else:
        session = PacingSession(
            cfg,
            rank=rank,
            world_size=world,
            device=torch.device("cpu"),
            group=group,
            framework="test",
            topology=[{"rank": r, "host": "h0", "local_rank": r, "node_rank": 0} for r in range(world)],
            log_dir=run_dir if rank == 0 else None,
            metrics_sink=lambda metrics, step: tags.append((step, dict(metrics))),
            clock=clock,
            hierarchy=hierarchy,
        )
        pacer = session.pacer
    schedule = ShareSchedule(global_batch, world)
    pacer.attach_shares(schedule, lookahead)
    built: dict[int, tuple[int, ...]] = {}

    def build(t):  # the pipeline reads the shares of a step when it builds its batch
        built[t] = schedule.shares_for_step(t)
        schedule.note_built(t)

    for t in range(lookahead + 1 + built_extra):
        build(t)
    decisions, step_ms = [], []
    for t in range(steps):
        shares = built.pop(t)
        build(t + lookahead + 1 + built_extra)
        # bulk-synchronous: the step ends when the last rank has arrived and the collective is done
        arrival = [
            model.data_ms[r] + model.gap_ms[r] + model.compute_ms(r, shares[r], t) for r in range(world)
        ]
        end = max(arrival) + model.transfer_ms
        clock.advance(model.data_ms[rank])
        pacer.add_data_wait(model.data_ms[rank])
        clock.advance(model.gap_ms[rank])
        pacer.begin_step(t)
        pacer.set_samples(shares[rank])
        for _ in range(2):  # two micro-batches of 64 tokens a sample
            pacer.add_tokens(64 * shares[rank])
        clock.advance(arrival[rank] - model.data_ms[rank] - model.gap_ms[rank])
        pacer.enter_sync(bucketed=False)
        clock.advance(end - arrival[rank])
        pacer.sync_done()
        clock.advance(model.optimizer_ms)
        step_ms.append(end + model.optimizer_ms)
        result = pacer.end_step() if session is None else session.end_step()
        if result is not None:
            decisions.append(result.rebalance)
            if pacing is not None:
                pacing.append(result.decision)
    if session is not None:
        state = pacer.state_dict()
        session.finish()
        if finished is not None:
            finished(rank)
        return schedule.entries, decisions, step_ms, state
    decisions += [r.rebalance for r in pacer.flush()]
    return schedule.entries, decisions, step_ms, pacer.state_dict()


def closed_loop(model: Model, steps: int, **kwargs):
    """Every rank's :func:`rank_loop` result, from real Pacers on thread ranks."""
    world = len(model.per_sample_ms)
    return raise_first(run_ranks(world, lambda rank, group: rank_loop(rank, group, model, steps, **kwargs)))


def splits(entries):
    return [(e.from_step, e.samples) for e in entries]


@pytest.fixture(scope="module")
def slow_device():
    """Rank 1 twice as slow per sample: 2 ranks, 64 samples per step."""
    return closed_loop(Model(per_sample_ms=(0.5, 1.0)), steps=12 * K)


@pytest.mark.timeout(60)
def test_a_slow_device_gets_fewer_samples_on_every_rank_alike(slow_device):
    (entries, decisions, step_ms, _), (entries1, decisions1, _, _) = slow_device
    assert entries == entries1 and decisions == decisions1  # the same decisions from the same windows
    assert splits(entries) == [(0, (32, 32)), (4 * K, (40, 24))]
    trial = next(d for d in decisions if d.from_step is not None)
    # decided after window 2 (steps 16..23) at the end of step 24: 24 + lookahead 3 + 2 = 29 -> boundary 32
    assert trial.window == 2 and trial.from_step == 32
    kept = decisions[5]
    assert kept.state is RebalanceState.WATCH and "kept" in kept.reason and kept.changed
    assert kept.baseline_step_ms is not None and kept.trial_step_ms < kept.baseline_step_ms
    before, after = statistics.median(step_ms[8:32]), statistics.median(step_ms[32:])
    # 2 x (1 + 32) -> max(1 + 40 x 0.5, 1 + 24) = 25 ms of compute: the step falls from ~38 to ~30 ms
    assert after < 0.85 * before, (before, after)
    assert all(d.state is RebalanceState.WATCH for d in decisions[5:])  # kept, and stays balanced


@pytest.mark.timeout(60)
def test_pacing_is_held_while_the_split_changes_and_starts_over_after():
    # Forced pacing would pace rank 0 (it leads) in every window; a rebalancing trial holds it, so
    # that neither A/B check credits the other's effect.
    pacing = []
    loop = functools.partial(rank_loop, model=Model(per_sample_ms=(0.5, 1.0)), steps=8 * K)
    cfg = dataclasses.replace(CFG, mode="forced")
    raise_first(run_ranks(2, lambda r, g: loop(r, g, cfg=cfg, pacing=pacing if r == 0 else None)))
    held = [d.window for d in pacing if d.reason.startswith("pacing held")]
    assert held == [2, 3, 4]  # decided after window 2, tried in windows 4 and 5 (from step 32)
    assert all(d.delays_ms == (0.0, 0.0) for d in pacing if d.window in held)
    assert "trial of the split [40, 24]" in pacing[2].reason
    assert pacing[5].state.value == "pacing" and pacing[1].pacing_active  # forced pacing, before and after


@pytest.mark.timeout(60)
def test_four_ranks_one_slow_by_half():
    model = Model(
        per_sample_ms=(0.5, 0.5, 0.5, 0.75), fixed_ms=(1.0,) * 4, gap_ms=(0.0,) * 4, data_ms=(0.0,) * 4
    )
    per_rank = closed_loop(model, steps=8 * K, global_batch=128)
    entries = per_rank[0][0]
    assert all(r[0] == entries for r in per_rank)
    shares = splits(entries)[-1][1]
    assert shares[3] == 24 and sorted(shares[:3]) == [32, 32, 40]  # the jitter breaks the others' tie


@pytest.mark.timeout(60)
def test_a_fixed_per_step_cost_is_reverted_to_even_and_retried_ever_more_rarely():
    # Rank 1 sleeps 24 ms every step whatever its samples: fewer samples hardly shorten its compute.
    model = Model(per_sample_ms=(0.5, 0.5), fixed_ms=(1.0, 25.0))
    (entries, decisions, _, _), _ = closed_loop(model, 24 * K)
    # tried from step 32; judged after windows 4 and 5, at the end of step 48: back to even from 56
    assert splits(entries)[:3] == [(0, (32, 32)), (4 * K, (48, 16)), (7 * K, (32, 32))]
    assert [e.samples for e in entries[3:]] == [(48, 16), (32, 32)]  # the second trial, reverted too
    reverted = [d for d in decisions if d.state is RebalanceState.COOLDOWN and d.from_step is not None]
    assert all("fixed per-step cost" in d.reason for d in reverted)
    assert "cool-down of 4 windows" in reverted[0].reason and "cool-down of 8 windows" in reverted[1].reason


@pytest.mark.parametrize(
    "model",
    [
        Model(per_sample_ms=(0.5, 0.5)),  # clean
        Model(per_sample_ms=(0.5, 0.5), gap_ms=(0.0, 20.0)),  # late start: a slow network path
        Model(per_sample_ms=(0.5, 0.5), data_ms=(0.0, 20.0)),  # a data stall on one rank
        # rank 1 is slow per sample, but rank 0 starts every step 40 ms late (its network path) and
        # sets the step: moving samples to rank 0 could only make it longer
        Model(per_sample_ms=(0.5, 1.0), gap_ms=(40.0, 0.0)),
    ],
    ids=["clean", "late-start", "data-stall", "slow-rank-behind-a-late-start"],
)
@pytest.mark.timeout(60)
def test_stays_even_when_the_lateness_is_not_per_sample_compute(model):
    (entries, decisions, _, _), _ = closed_loop(model, 8 * K)
    assert splits(entries) == [(0, (32, 32))]
    assert all(d.state is RebalanceState.WATCH for d in decisions)
    assert "balanced" in decisions[-1].reason


@pytest.mark.timeout(60)
def test_a_pipeline_that_builds_further_ahead_than_declared_is_an_error():
    model = Model(per_sample_ms=(0.5, 1.0))
    results = run_ranks(2, lambda r, g: rank_loop(r, g, model, 12 * K, lookahead=0, built_extra=20))
    assert all(isinstance(r, PaceDistributedError) for r in results), results
    assert "already built step" in str(results[0]) and "lookahead_steps" in str(results[0])


def test_the_pacer_state_carries_the_controller_and_the_sampler_the_splits(slow_device):
    # One owner for the schedule: its splits are the data pipeline's to save (the sampler's state),
    # the pacer saves the controller. A state written before (splits in the pacer's state too) still
    # restores them, once, whichever comes first.
    entries, _, _, state = slow_device[1]
    assert set(state["rebalance"]) == {"version", "policy"}
    saved = [{"from_step": e.from_step, "samples": list(e.samples), "reason": e.reason} for e in entries]
    old = {**state, "rebalance": {**state["rebalance"], "entries": saved}}
    for attach_first in (True, False):
        for loaded, want in ((state, [(0, (32, 32))]), (old, splits(entries))):
            target, fresh = Pacer(CFG, None, 1, 2), ShareSchedule(64, 2)
            if attach_first:
                target.attach_shares(fresh, 3)
            target.load_state_dict(loaded)
            if not attach_first:
                target.attach_shares(fresh, 3)
            restore_schedule(fresh, saved)  # the sampler's own restore: held already, not added twice
            assert splits(fresh.entries) == splits(entries) and want[-1] in splits(fresh.entries)
            policy = target.controllers.rebalance.policy
            assert policy is not None and policy.shares == (40, 24)
            assert target.state_dict() == state


# ---------------------------------------------------------------------- telemetry and diagnosis
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The slow device through real sessions, rebalanced and not: run directories and rank 0's tags."""
    out = {}
    for name, cfg in (("rebalanced", CFG), ("plain", dataclasses.replace(CFG, rebalance=False))):
        run_dir, tags = tmp_path_factory.mktemp(name), []
        loop = functools.partial(rank_loop, model=Model(per_sample_ms=(0.5, 1.0)), steps=12 * K, cfg=cfg)
        raise_first(run_ranks(2, lambda r, g, loop=loop, d=run_dir, t=tags: loop(r, g, run_dir=d, tags=t)))
        out[name] = run_dir, tags
    return out


@pytest.mark.timeout(60)
def test_every_share_change_is_in_the_run_record_with_its_reason(recorded):
    run_dir, tags = recorded["rebalanced"]
    record = read_run_record(run_dir)
    lines = [(x["state"], x["samples"], x["from_step"]) for x in record.shares]
    assert lines == [("watch", [32, 32], None), ("trial", [40, 24], 32), ("watch", [40, 24], None)]
    assert "imbalanced for 3 windows" in record.shares[1]["reason"] and "kept" in record.shares[2]["reason"]
    assert record.steps[-1]["ranks"]["samples"] == [40, 24]
    shares = {step: (m[batch_share_tag(0)], m[batch_share_tag(1)]) for step, m in tags}
    assert shares[31] == (32.0, 32.0) and shares[32] == (40.0, 24.0) and len(shares) == 12 * K
    _, plain_tags = recorded["plain"]
    assert not any(batch_share_tag(0) in m for _, m in plain_tags)  # only with rebalancing on
    assert "`pace/batch_share/rank_{r}`" in (DOCS / "telemetry.md").read_text()


@pytest.mark.timeout(60)
def test_diagnosis_reports_the_split_and_the_recovered_time(recorded):
    arrays = load_arrays(recorded["rebalanced"][0])
    result = diagnose(arrays, project_ranks=None)
    note = next(n for n in result.notes if n.startswith("rebalanced:"))
    assert "[40, 24] samples per rank per step from step 32 (was [32, 32])" in note
    outcome = result.stats["rebalance"]
    assert outcome["samples"] == [40, 24] and outcome["recovered_fraction"] > 0.15
    assert outcome["before_ms"] > outcome["after_ms"]
    # the findings are read at the kept split: the steps before it are what the split removed
    after = int((arrays.step >= 32).sum())
    assert 0 < after < arrays.steps and result.stats["steps"] == after
    notes = "\n".join(result.notes)
    assert f"diagnosed at the kept split: the {after:,} usable steps from step 32 on" in notes


@pytest.mark.timeout(60)
def test_a_persistent_compute_straggler_is_told_to_rebalance(recorded):
    result = diagnose(load_arrays(recorded["plain"][0]), project_ranks=None)
    finding = next(f for f in result.findings if f.mode is Mode.PERSISTENT_STRAGGLER)
    assert finding.ranks == [1] and "PacingConfig(rebalance=True)" in finding.action
    assert "per sample 1.0" in finding.evidence and "(1.9x)" in finding.evidence
    assert "rebalance" not in result.stats


def test_a_damaged_rebalancing_state_changes_nothing(slow_device):
    state = slow_device[1][3]
    damaged = {**state, "rebalance": {**state["rebalance"], "entries": [{"from_step": "x"}]}}
    target, fresh = Pacer(CFG, None, 1, 2), ShareSchedule(64, 2)
    target.attach_shares(fresh, 3)
    with pytest.raises(PacingStateError, match="entries do not load"):
        target.load_state_dict(damaged)
    assert target.state_dict()["window"] == 0 and len(fresh.entries) == 1
    late, schedule = Pacer(CFG, None, 1, 2), ShareSchedule(64, 2)
    late.load_state_dict(damaged)  # not attached yet: the pacing part loads, the rest waits
    late.attach_shares(schedule, 3)  # ... and starts fresh, with a warning
    policy = late.controllers.rebalance.policy
    assert policy is not None and policy.shares == (32, 32) and len(schedule.entries) == 1


def test_the_reader_checks_shares_lines(recorded, tmp_path):
    lines = (recorded["rebalanced"][0] / "pace_run.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"record":"shares"' in line)
    for bad, field in (('"samples":[32,32]', '"samples":[64]'), ('"from_step":null', '"from_step":"x"')):
        path = tmp_path / "pace_run.jsonl"
        path.write_text("\n".join([*lines[:at], lines[at].replace(bad, field), *lines[at + 1 :]]) + "\n")
        with pytest.raises(RunRecordError, match=f"line {at + 1}: shares"):
            read_run_record(path)


def test_no_rank_takes_more_than_the_max_share_of_the_even_split():
    assert best_split([1.0, 100.0], 64, 8)[0] == (56, 8)  # uncapped: nearly all to the fast rank
    shares, slowest = best_split([1.0, 100.0], 64, 8, max_share=1.5)
    assert shares == (48, 16) and slowest == 1600.0  # 1.5 x the even 32: the slow rank keeps the rest
    # a cap never stops the even split: 3 ranks, 100 samples, cap rounded to at least the even quanta
    assert sum(best_split([1.0, 1.0, 9.0], 100, 8, max_share=1.0)[0]) == 100
    with pytest.raises(PacingConfigError, match=r"rebalance\.max_share"):
        PacingConfig(rebalance=RebalanceConfig(max_share=0.9))


# ---------------------------------------------------------------------- quantum and device memory
def test_the_auto_quantum_follows_the_even_share():
    assert resolve_quantum(8, 64, 2) == 8 and resolve_quantum(3, 64, 2) == 3  # a number is used as is
    # 8 from 64 samples per rank; below, the largest power of two up to an eighth of the even share
    assert [resolve_quantum("auto", 2 * even, 2) for even in (512, 64, 63, 32, 16, 12, 8, 4, 1)] == [
        8,
        8,
        4,
        4,
        2,
        1,
        1,
        1,
        1,
    ]
    auto = dataclasses.replace(CFG, rebalance=dataclasses.replace(CFG.rebalance, quantum="auto"))
    assert RebalancePolicy(auto, 64, 2).quantum == 4
    # at 32 samples per rank, quanta of 8 stop at 40/24 (slowest 24 ms); quanta of 4 reach 44/20 (22 ms)
    assert best_split([0.5, 1.0], 64, 8) == ((40, 24), 24.0)
    assert best_split([0.5, 1.0], 64, 4) == ((44, 20), 22.0)
    assert PacingConfig().rebalance.quantum == "auto"
    for bad in (0, -8, "big", 2.5, True):
        with pytest.raises(PacingConfigError, match=r"rebalance\.quantum=.*an integer >= 1 or 'auto'"):
            RebalanceConfig(quantum=bad)


def test_a_split_that_would_not_fit_the_devices_memory_is_never_proposed():
    assert memory_caps((0.72, 0.0), (32, 32)) == (40, None)  # 0.9 x 32 / 0.72; CPU: no cap
    with pytest.raises(ValueError, match="do not hold"):
        best_split([1.0, 1.0], 64, 8, caps=(16, 16))
    policy = RebalancePolicy(
        dataclasses.replace(CFG, rebalance=dataclasses.replace(CFG.rebalance, max_share=4.0)), 64, 2
    )
    # rank 1 is 3x slower per sample: free, the split would go to 48/16; rank 0's device is at 72%
    windows = [window(i * K, (32, 32), (16.0, 48.0)) for i in range(3)]
    for g in windows:
        g[0, :, Field.MEM_PEAK] = 0.72
    decisions = feed(policy, windows)
    trial = decisions[-1]
    assert trial.state is RebalanceState.TRIAL and trial.shares == (40, 24), trial.reason
    assert "held by device memory: rank 0 at most 40 samples (peak 72% of its device at 32; 48 would" in (
        trial.reason
    )
    # both devices already past the limit: no split that moves samples fits, the split stays even
    full = RebalancePolicy(
        dataclasses.replace(CFG, rebalance=dataclasses.replace(CFG.rebalance, max_share=4.0)), 64, 2
    )
    windows = [window(i * K, (32, 32), (16.0, 48.0)) for i in range(3)]
    for g in windows:
        g[:, :, Field.MEM_PEAK] = 0.95
    decisions = feed(full, windows)
    assert all(d.state is RebalanceState.WATCH and d.shares == (32, 32) for d in decisions)
    assert "no split that moves samples fits the devices' memory" in decisions[-1].reason


def test_the_memory_peak_survives_a_state_round_trip():
    policy = RebalancePolicy(CFG, 64, 2)
    g = window(0, (32, 32), (16.0, 32.0))
    g[:, :, Field.MEM_PEAK] = 0.5
    feed(policy, [g])
    restored = RebalancePolicy(CFG, 64, 2)
    restored.load_state_dict(policy.state_dict())
    assert [w.mem_peak for w in restored._streak] == [(0.5, 0.5)]


def test_a_reason_names_every_rank_up_to_64_and_the_range_above():
    from pace_strategy.core.rebalance import _ms, _split

    assert _split([8, 9, 7]) == "[8, 9, 7]" and _ms([1.0, 2.5]) == "[1, 2.5]"
    shares = [32] * 99 + [20]
    assert _split(shares) == "[100 ranks: 20-32 samples, the fewest on rank 99]"
    per_sample = [1.0] * 8192
    per_sample[4096] = 1.75
    assert _ms(per_sample) == "[8,192 ranks: 1-1.75, the most on rank 4096]"
