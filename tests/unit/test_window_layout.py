"""The exchange gathers windows field-major (``comm.field_major``): what reads a window must give the
same numbers on either layout, and the summaries must be the glossary's, step by step."""

from __future__ import annotations

import torch

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.comm import WindowExchange, field_major
from pace_strategy.core.config import PacingConfig, RebalanceConfig
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.skew import kth_smallest
from pace_strategy.core.summary import StepSummarizer, node_steps


def _window(world: int, steps: int, first: int, seed: int) -> torch.Tensor:
    """A step-major window with ties (waits on a coarse grid), an invalid and a warm-up step."""
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(world, steps, NUM_FIELDS, dtype=torch.float64)
    w[:, :, Field.STEP] = torch.arange(first, first + steps, dtype=torch.float64)
    w[:, :, Field.VALID] = 1.0
    w[world - 1, 1, Field.VALID] = 0.0
    w[0, 2, Field.WARMUP] = 1.0
    compute = 40.0 + torch.randint(0, 4, (world, steps), generator=g).double()
    compute[world // 3] *= 1.5  # a slow rank: rebalancing moves samples off it
    w[:, :, Field.COMPUTE_MS] = compute
    w[:, :, Field.WAIT_MS] = compute.amax(dim=0, keepdim=True) - compute + 0.5
    w[:, :, Field.DELAY_MS] = torch.randint(0, 2, (world, steps), generator=g).double()
    w[:, :, Field.STEP_MS] = compute.amax(dim=0, keepdim=True) + 6.0
    w[:, :, Field.GC_MS] = torch.rand(world, steps, generator=g, dtype=torch.float64)
    w[:, :, Field.BUCKETS] = torch.randint(1, 4, (world, steps), generator=g).double()
    w[:, :, Field.SAMPLES] = 8.0
    return w


def _field_major(step_major: torch.Tensor) -> torch.Tensor:
    out = field_major(*step_major.shape)
    out.copy_(step_major)
    return out


def test_the_exchange_hands_out_a_field_major_window_of_the_rows_it_was_given():
    rows = _window(1, 5, 0, seed=0)[0]
    exchange = WindowExchange(None, 0, 1, timeout_s=5.0)
    got = exchange.gather(rows, 0, 4)
    assert torch.equal(got[0], rows)
    assert got.stride() == field_major(1, 5, NUM_FIELDS).stride()
    assert got[:, :, Field.WAIT_MS].stride() == (NUM_FIELDS * 5, 1)  # a field's steps are adjacent


def test_summaries_are_the_glossarys_on_either_layout():
    world, steps = 7, 6
    step_major = _window(world, steps, 10, seed=1)
    for g in (step_major, _field_major(step_major)):
        for per_rank in (True, False):
            summaries = StepSummarizer(8).summarize(g, per_rank=per_rank)
            for i, s in enumerate(summaries):
                wait = step_major[:, i, Field.WAIT_MS].tolist()
                compute = step_major[:, i, Field.COMPUTE_MS].tolist()
                leads = sorted(x - min(wait) for x in wait)
                assert s.step == 10 + i
                assert s.skew_ms == max(wait) - min(wait)
                assert s.straggler_rank == wait.index(min(wait))  # the first on a tie
                assert s.compute_straggler_rank == compute.index(max(compute))
                assert s.lead_band == (leads[world // 2], leads[0], leads[-1])
                assert s.wait_ms_min == min(wait) and s.wait_ms_max == max(wait)
                assert s.valid == (i != 1) and s.warmup == (i == 2)
                assert s.step_ms == max(step_major[:, i, Field.STEP_MS].tolist())
                assert s.delay_ms_max == max(step_major[:, i, Field.DELAY_MS].tolist())
                assert s.gc_ms_max == max(step_major[:, i, Field.GC_MS].tolist())
                assert s.buckets == int(max(step_major[:, i, Field.BUCKETS].tolist()))
                assert s.wait_ms == (tuple(wait) if per_rank else ())
    assert StepSummarizer(8).summarize(step_major) == StepSummarizer(8).summarize(_field_major(step_major))


def test_decisions_are_the_same_on_either_layout():
    world, steps = 16, 8
    forced = PacingConfig(exchange_every_steps=steps, warmup_steps=0, mode="forced")
    rebalancing = PacingConfig(
        exchange_every_steps=steps, warmup_steps=0, rebalance=RebalanceConfig(enabled=True)
    )
    paced = splits = 0
    for config in (forced, rebalancing):
        pacers = [Pacer(config, None, 0, world, ManualClock()) for _ in range(2)]
        for pacer in pacers:
            pacer.attach_shares(ShareSchedule(8 * world, world), 2)
        for window in range(8):
            step_major = _window(world, steps, window * steps, seed=window)
            a, b = pacers[0]._decide(step_major), pacers[1]._decide(_field_major(step_major))
            assert a.decision == b.decision and _same_stats(a.stats, b.stats)
            assert a.rebalance == b.rebalance
            paced += a.decision.pacing_active
            splits += a.rebalance is not None and "best split" in a.rebalance.reason
    assert paced and splits  # the windows did decide delays and find a split: compared on something


def _same_stats(a, b) -> bool:
    return (
        a.window == b.window
        and a.steps == b.steps
        and a.median_step_ms == b.median_step_ms
        and a.median_unpaced_skew_ms == b.median_unpaced_skew_ms
        and torch.equal(a.pacable_lead_ms, b.pacable_lead_ms)
        and a.straggler_counts == b.straggler_counts
    )


def test_kth_smallest_is_torchs_median_and_kthvalue():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 8, 31, 32, 33):
        x = torch.randint(0, 5, (200, n), generator=g).double()  # ties
        x[3, 0] = float("nan")
        clean = ~x.isnan().any(dim=1)
        median, got = x.median(dim=1).values, kth_smallest(x, (n - 1) // 2)
        assert torch.equal(got.isnan(), median.isnan()) and torch.equal(got[clean], median[clean])
        upper, got = x.kthvalue(n // 2 + 1, dim=1).values, kth_smallest(x, n // 2)
        assert torch.equal(got[clean], upper[clean]) and bool(got[~clean].isnan().all())


def test_summaries_from_the_nodes_reductions_are_the_ones_from_every_rank():
    # node leaders send each node's per-step reductions (node_steps); rank 0 summarizes from them
    world, steps = 9, 6
    layouts = [
        ((0, 1, 2), (3, 4, 5), (6, 7, 8)),
        ((0, 2, 4, 6, 8), (1, 3), (5, 7)),  # interleaved, uneven
        ((0,), (1, 2, 3, 4, 5, 6, 7, 8)),
    ]
    compared = 0
    for seed in range(4):
        step_major = _window(world, steps, 0, seed=seed)
        if seed == 1:  # NaN: the first NaN rank is the straggler, as torch's argmin gives it
            step_major[[7, 2], 3, Field.WAIT_MS] = float("nan")
            step_major[5, 4, Field.COMPUTE_MS] = float("nan")
            step_major[8, 4, Field.GC_MS] = float("nan")
        if seed == 2:  # every rank tied
            step_major[:, 5, Field.WAIT_MS] = 1.0
            step_major[:, 5, Field.COMPUTE_MS] = 3.0
        g = _field_major(step_major)
        for nodes in layouts:
            reduced = torch.stack([node_steps(step_major[list(ranks)], ranks) for ranks in nodes])
            for per_rank in (True, False):
                every = StepSummarizer(8).summarize(g, per_rank=per_rank)
                by_node = StepSummarizer(8).summarize(g, per_rank=per_rank, nodes=reduced)
                assert repr(by_node) == repr(every)  # NaN included (NaN != NaN)
                compared += len(every)
                if seed == 1:
                    assert by_node[3].straggler_rank == 2 and by_node[4].compute_straggler_rank == 5
                    assert by_node[2].straggler_rank == 3  # the slow rank (the smallest wait)
    assert compared == 4 * 3 * 2 * steps
