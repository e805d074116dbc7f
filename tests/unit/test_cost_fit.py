"""Balancing's online cost fit: the least squares itself, its rows from a gathered window, and the
whole loop on one process (a real sampler and balancer noting each step's work, the controller
fitting it from windows whose compute follows a known cost, the fitted cost splitting later steps)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.controllers import RebalanceControl, WindowInput
from pace_strategy.core.cost_fit import MIN_ROWS, CostFit, fit_ranks, moved, solve, window_rows
from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.skew import window_stats
from pace_strategy.data.balance import Balancer, SampleCost, assign
from pace_strategy.data.share_sampler import ShareBatchSampler


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.5, 0.8, n), 16, 512).astype(np.int64)


def padded_rows(lengths: np.ndarray, per_batch: int, seed: int = 0) -> list[tuple[float, float, float]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(200):
        n = int(rng.integers(1, per_batch + 1))
        longest = float(rng.choice(lengths, n).max())
        rows.append((float(n), n * longest, n * longest * longest))
    return rows


def test_solve_matches_numpy_and_refuses_a_singular_system():
    rng = np.random.default_rng(1)
    m = rng.normal(size=(3, 3)) + 3 * np.eye(3)
    rhs = rng.normal(size=3)
    assert np.allclose(solve(m.tolist(), rhs.tolist()), np.linalg.solve(m, rhs))
    assert solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None


def test_the_fit_recovers_per_sample_and_quadratic_tokens_from_noisy_steps():
    # t = 0.4 ms per sample + 1 us per token + L^2 / 300 us: per_sample 400, quadratic_tokens 300
    rows = padded_rows(lognormal_lengths(4096), per_batch=16)
    rand = random.Random(0)
    times = [(400 * n + t + q / 300) * 1e-3 * rand.uniform(0.95, 1.05) for n, t, q in rows]
    fit = CostFit()
    for start in range(0, 200, 20):  # ten windows
        fit.add(rows[start : start + 20], times[start : start + 20])
    cost = fit.cost()
    assert cost is not None
    quadratic_tokens, per_sample = cost
    assert 240 <= quadratic_tokens <= 380 and 320 <= per_sample <= 480, cost
    # two significant digits: what every host computes alike
    assert per_sample == float(f"{per_sample:.2g}") and quadratic_tokens == float(f"{quadratic_tokens:.2g}")


def test_no_fit_before_enough_rows_or_from_one_length_and_a_term_below_noise_is_left_out():
    fit = CostFit()
    fit.add([(4.0, 400.0, 40000.0)] * (MIN_ROWS + 10), [5.0] * (MIN_ROWS + 10))
    assert fit.cost() is None  # one length: nothing to tell the terms apart by
    few = CostFit()
    rows = padded_rows(lognormal_lengths(512), per_batch=8)[: MIN_ROWS - 1]
    few.add(rows, [1.0 + n for n, _, _ in rows])
    assert few.cost() is None
    # linear in tokens with no quadratic part: c comes out ~0 or negative and the fit is linear
    linear = CostFit()
    rows = padded_rows(lognormal_lengths(4096), per_batch=16)
    rand = random.Random(2)
    linear.add(rows, [(50 * n + t) * 1e-3 * rand.uniform(0.99, 1.01) for n, t, _ in rows])
    quadratic_tokens, per_sample = linear.cost()  # type: ignore[misc]
    assert quadratic_tokens >= 1e4 and 30 <= per_sample <= 70
    tokens_only = CostFit(quadratic=False)
    tokens_only.add(rows, [(50 * n + t) * 1e-3 for n, t, _ in rows])
    assert tokens_only.cost() == (1e9, 50.0)


def test_a_cost_moves_by_a_quarter_of_either_term():
    assert not moved((1000.0, 400.0), (1100.0, 450.0))
    assert moved((1000.0, 400.0), (1400.0, 400.0)) and moved((1000.0, 600.0), (1000.0, 400.0))
    assert moved((1024.0, 5.0), (1024.0, 0.0)) and not moved((1024.0, 0.5), (1024.0, 0.0))


def test_window_rows_pair_each_rank_s_noted_work_with_its_compute():
    g = torch.zeros(2, 3, NUM_FIELDS, dtype=torch.float64)
    g[:, :, Field.STEP] = torch.tensor([10.0, 11.0, 12.0])
    g[:, :, Field.SAMPLES] = torch.tensor([[4.0, 3.0, 4.0], [4.0, 5.0, 4.0]])
    g[:, :, Field.COMPUTE_MS] = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    usable = torch.tensor([True, True, False])
    work = {10: [(4.0, 40.0, 400.0), (4.0, 80.0, 1600.0)], 11: [(3.0, 3.0, 3.0), (6.0, 6.0, 6.0)]}
    rows, times = window_rows(g, usable, (0, 1), work)
    # step 11's rank 1 reported 5 samples where 6 were noted: left out; step 12 is not usable
    assert rows == [(4.0, 40.0, 400.0), (4.0, 80.0, 1600.0), (3.0, 3.0, 3.0)] and times == [1.0, 4.0, 2.0]
    assert fit_ranks(8) == tuple(range(8)) and len(fit_ranks(8192)) == 32 and fit_ranks(8192)[1] == 256


K, WORLD, BATCH = 8, 2, 32
#: what a step costs on the modelled device: 0.5 ms per sample + 1 us per token + L^2 / 200 us
TRUE = SampleCost("attention", 200.0, 500.0)


def closed_loop(balance: dict, windows: int, lookahead: int = 2):
    """Two ranks' samplers and controllers (in one process, each rank its own schedule), a balancer
    of padded batches at the product's default cost (per_sample 0, quadratic_tokens 1024), and
    windows whose compute follows :data:`TRUE`; a step ends 1 ms after its slowest rank. Each
    window's decision (asserted the same on both ranks), rank 0's schedule, its sampler, every
    step's batches, the lengths and rank 0's controller."""
    cfg = PacingConfig(
        mode="monitor",
        balance={"enabled": True, **balance},
        exchange_every_steps=K,
        warmup_steps=0,
        ab_windows=2,
    )
    lengths = lognormal_lengths(BATCH * 200)
    schedules = [ShareSchedule(BATCH, WORLD) for _ in range(WORLD)]
    controls = [RebalanceControl(cfg, r, WORLD) for r in range(WORLD)]
    for control, schedule in zip(controls, schedules, strict=True):
        control.attach(schedule, lookahead_steps=lookahead)
    balancer = Balancer(lengths, SampleCost("attention", 1024.0, 0.0), "padded")
    samplers = [
        ShareBatchSampler(range(len(lengths)), schedules[r], r, seed=3, balancer=balancer)
        for r in range(WORLD)
    ]
    iters = [iter(s) for s in samplers]
    rows = torch.zeros(WORLD, K, NUM_FIELDS, dtype=torch.float64)
    decisions, seen = [], {}
    for step in range(windows * K):
        while len(seen) < step + 1 + lookahead:
            seen[len(seen)] = [next(it) for it in iters]
        for r, part in enumerate(seen[step]):
            cell = rows[r, step % K]
            cell[Field.STEP], cell[Field.VALID], cell[Field.SAMPLES] = step, 1.0, len(part)
            cell[Field.COMPUTE_MS] = len(part) * float(TRUE(lengths[part].max())) * 1e-3
        rows[:, step % K, Field.STEP_MS] = rows[:, step % K, Field.COMPUTE_MS].max() + 1.0
        if step % K == K - 1:
            window = WindowInput(rows.clone(), window_stats(step // K, rows.clone()), step, step)
            decided = [c.decide(window, step // K) for c in controls]
            assert decided[0] == decided[1]  # the same decision from the same window, on every rank
            decisions.append(decided[0])
    return decisions, schedules[0], samplers[0], seen, lengths, controls[0]


@pytest.mark.timeout(60)
def test_the_loop_fits_the_cost_from_what_the_ranks_measured_and_splits_with_it():
    """The configured cost is wrong by far: the controller fits it, schedules it from an unbuilt step,
    and the samplers split the later steps with it."""
    decisions, schedule, sampler, seen, lengths, control = closed_loop({"verify": False}, windows=12)
    posted = [d for d in decisions if d is not None]
    assert posted and posted[0].balance == "fit" and posted[0].changed, decisions
    # a new cost model alone moves no share of the step: pacing is not held for it
    assert control.holds_pacing(posted[0], posted[0].window * K + K - 1) is None
    fitted = schedule.current.cost
    assert fitted is not None and 150 <= fitted[0] <= 270 and 380 <= fitted[1] <= 650, schedule.current
    # from its entry on, both samplers split each step with the fitted cost, not the configured one
    start = schedule.current.from_step
    assert start > posted[-1].window * K + K - 1 + 2  # after every step built when it was decided
    order = sampler.permutation(0).tolist()
    differs = 0
    for step in range(start, len(seen)):
        chunk = sampler._chunk(order, step)
        split = [
            [chunk[p] for p in ps]
            for ps in assign(lengths[chunk], WORLD, SampleCost("attention", *fitted), "padded")
        ]
        assert seen[step] == split
        configured = assign(lengths[chunk], WORLD, SampleCost("attention", 1024.0, 0.0), "padded")
        differs += [len(ps) for ps in configured] != [len(b) for b in split]
    assert differs > 0


@pytest.mark.timeout(60)
def test_during_the_a_b_check_the_fit_only_rides_on_its_switches_and_the_verdict_keeps_it():
    decisions, schedule, _, _, _, _ = closed_loop(
        {"verify": True, "check_rounds": 2, "recheck_windows": 0}, 16
    )
    trial = [d for d in decisions if d is not None and d.balance == "trial"]
    assert trial and not any(d.balance == "fit" for d in decisions[: len(trial)])
    # the arms' entries: balanced (configured cost), plain, balanced (fitted), plain, and the verdict
    entries = schedule.entries
    assert [e.balanced for e in entries[:4]] == [True, False, True, False]
    assert entries[0].cost is None and entries[2].cost is not None
    verdict = next(d for d in decisions if d is not None and d.balance in ("kept", "dropped"))
    assert verdict.balance == "kept" and verdict.trial_step_ms < verdict.baseline_step_ms
    assert schedule.current.balanced and schedule.current.cost is not None


def test_the_diagnosis_names_the_fitted_cost():
    from pace_strategy.diagnose.rebalance import BalanceOutcome

    said = BalanceOutcome(True, 30.0, 20.0, 1, 95, "A/B ...: kept", cost=[200.0, 510.0]).text()
    assert "cost model fitted online: per_sample 510, quadratic_tokens 200" in said
    from pace_strategy.diagnose.rebalance import fitted_cost

    lines = [{"cost": None}, {"cost": [300, 400]}, {"balance": "kept"}, {"cost": [200, 510]}, {}]
    assert fitted_cost(lines) == [200.0, 510.0] and fitted_cost(lines[:1]) is None


# ---------------------------------------------------------------------- a user's cost model
def bucketed(lengths: np.ndarray) -> np.ndarray:
    """A user's cost model: measured per length bucket (a step function of the length)."""
    return np.where(lengths <= 64, 1.0, np.where(lengths <= 256, 5.0, 30.0))


def test_a_user_cost_function_splits_the_samples_and_no_fit_replaces_it():
    from torch.utils.data import DataLoader

    from pace_strategy.core.config import BalanceConfig
    from pace_strategy.integrations.rebalance import DataRebalance

    lengths = lognormal_lengths(BATCH * 20)
    path = DataRebalance(None, 0, WORLD, lambda: 0, 0, balance=BalanceConfig(enabled=True), cost=bucketed)
    path.lengths = lengths.tolist()
    loader = path.replace(DataLoader(range(len(lengths)), batch_size=BATCH // WORLD, collate_fn=list))
    assert path.schedule is not None and path.schedule.fixed_cost  # the controller fits nothing
    assert path.sampler is not None and path.sampler.balancer is not None
    balancer = path.sampler.balancer
    assert balancer.fixed and balancer.cost_of((200.0, 500.0)) is bucketed
    first = next(iter(loader))
    chunk = path.sampler._chunk(path.sampler.permutation(0).tolist(), 0)
    expected = assign(lengths[chunk], WORLD, bucketed, "padded")
    assert sorted(first) == sorted(chunk[p] for p in expected[0])
    control = RebalanceControl(PacingConfig(balance={"enabled": True}), 0, WORLD)
    control.attach(path.schedule, lookahead_steps=1)
    assert control.fit is None and path.schedule.work_ranks is None


@pytest.mark.parametrize(
    ("cost", "said"),
    [
        (lambda lengths: -np.ones(len(lengths)), "finite, positive"),
        (lambda lengths: np.ones(3), "returned shape"),
        (lambda lengths: 1000.0 / lengths, "must not fall as the length grows"),
        (lambda lengths: 1 / 0, "failed on an array of lengths"),
    ],
)
def test_a_user_cost_function_that_cannot_split_is_refused_naming_the_argument(cost, said):
    from pace_strategy.core.errors import PacingConfigError

    with pytest.raises(PacingConfigError, match=rf"pace\.dataloader\(cost=\.\.\.\).*{said}"):
        Balancer(lognormal_lengths(64), cost, "padded")
