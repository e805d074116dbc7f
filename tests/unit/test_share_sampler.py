"""ShareBatchSampler: every sample of an epoch exactly once across ranks, whatever the shares and their
changes; seeded order, set_epoch, drop_last, accumulation, resume; the loss scale that keeps the update
the global-batch mean."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.data import ShareBatchSampler, scaled_shares, share_loss_scale

pytestmark = pytest.mark.timeout(60)


def _samplers(length: int, schedule: ShareSchedule, **kwargs) -> list[ShareBatchSampler]:
    return [ShareBatchSampler(range(length), schedule, r, **kwargs) for r in range(schedule.world_size)]


def _epoch(samplers: list[ShareBatchSampler], add: dict[int, tuple[int, ...]] | None = None) -> list[list]:
    """Every rank's batches of one epoch, built in lockstep (as ranks do, one step apart at most);
    ``add``: after building step s, add entry ``add[s]`` from step s + 1."""
    iters = [iter(s) for s in samplers]
    steps = []
    for _ in range(len(samplers[0])):
        steps.append([next(it) for it in iters])
        built = samplers[0].schedule.last_built
        if add and built in add:
            samplers[0].schedule.add(built + 1, add[built], "test")
    for it in iters:
        assert next(it, None) is None
    return steps


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 4),
    per_rank=st.integers(1, 6),
    extra=st.integers(0, 40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    cut=st.integers(1, 5),
    change_at=st.integers(0, 6),
)
def test_every_sample_once_per_epoch_across_ranks_through_share_changes(
    world, per_rank, extra, shuffle, drop_last, cut, change_at
):
    n = world * per_rank * 2
    length = n + extra
    schedule = ShareSchedule(n, world)
    moved = min(cut, 2 * per_rank - 1)  # from the last rank to rank 0, each keeping >= 1
    uneven = (2 * per_rank + moved, *[2 * per_rank] * (world - 2), 2 * per_rank - moved)
    samplers = _samplers(length, schedule, shuffle=shuffle, drop_last=drop_last, seed=7)
    steps = _epoch(samplers, {change_at: uneven})
    seen = [i for step in steps for batch in step for i in batch]
    full, rest = divmod(length, n)
    if drop_last or rest == 0:
        assert len(seen) == full * n and len(set(seen)) == len(seen)
    elif rest >= world:
        assert sorted(seen) == list(range(length))
    else:  # fewer leftover samples than ranks: padded from the epoch's start, each rank still gets one
        assert set(seen) == set(range(length)) and len(seen) == full * n + world
    order = samplers[0].permutation(0).tolist()
    for t, step in enumerate(steps[:full]):
        # the union of a step's batches is its contiguous slice of the global order, split by shares
        assert [i for batch in step for i in batch] == order[t * n : (t + 1) * n]
        assert tuple(len(b) for b in step) == schedule.shares_for_step(t)
        assert all(len(b) >= 1 for b in step)


def test_a_share_change_cannot_land_on_a_built_step_and_applies_from_its_step():
    schedule = ShareSchedule(16, 2)
    sampler = ShareBatchSampler(range(64), schedule, 1, shuffle=False)
    it = iter(sampler)
    assert next(it) == list(range(8, 16))  # step 0, even: rank 1 gets the second half
    assert schedule.last_built == 0
    with pytest.raises(ValueError, match="too late"):
        schedule.add(0, (12, 4))
    schedule.add(1, (12, 4), "rank 1 is slow")
    assert next(it) == list(range(28, 32))
    built = sampler.pop_built()
    assert built is not None and (built.step, built.shares, built.samples) == (0, (8, 8), 8)
    built = sampler.pop_built()
    assert built is not None and (built.step, built.shares, built.samples) == (1, (12, 4), 4)
    assert built.loss_scale == pytest.approx(4 * 2 / 16)
    assert sampler.pop_built() is None


def test_seeded_order_matches_distributed_sampler_and_set_epoch_reshuffles():
    data = range(40)
    schedule = ShareSchedule(8, 2)
    a, b = ShareBatchSampler(data, schedule, 0, seed=3), ShareBatchSampler(data, schedule, 1, seed=3)
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    for epoch in (0, 1):
        a.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert a.permutation(epoch).tolist() == list(reference)
        assert b.permutation(epoch).tolist() == a.permutation(epoch).tolist()
    assert a.permutation(0).tolist() != a.permutation(1).tolist()
    a.set_epoch(1)
    assert next(iter(a)) == a.permutation(1).tolist()[:4]
    assert ShareBatchSampler(data, schedule, 0, shuffle=False).permutation(5).tolist() == list(data)


def test_micro_batches_of_a_step_share_its_shares_and_steps_continue_across_epochs():
    schedule = ShareSchedule(8, 2)
    sampler = ShareBatchSampler(range(48), schedule, 0, shuffle=False, micro_batches=2)
    assert len(sampler) == 6
    it = iter(sampler)
    next(it)
    next(it)
    schedule.add(1, (6, 2))
    rest = list(it)
    assert [len(b) for b in rest] == [6, 6, 6, 6]
    assert [b.step for b in iter(sampler.pop_built, None)] == [0, 0, 1, 1, 2, 2]
    sampler.set_epoch(1)
    list(sampler)
    assert [b.step for b in iter(sampler.pop_built, None)] == [3, 3, 4, 4, 5, 5]


def test_step_source_maps_an_epoch_that_was_cut_short():
    trained = [0]
    schedule = ShareSchedule(8, 2)
    sampler = ShareBatchSampler(range(80), schedule, 0, shuffle=False, step_source=lambda: trained[0])
    it = iter(sampler)
    for _ in range(3):  # a loop that stops after 2 trained steps, one batch prefetched
        next(it)
    trained[0] = 2
    sampler.set_epoch(1)
    list(sampler)
    assert [b.step for b in iter(sampler.pop_built, None)] == list(range(2, 12))


def test_resume_mid_epoch_continues_with_the_same_batches_and_shares():
    def run(stop: int | None) -> tuple[list[list[int]], dict | None]:
        schedule = ShareSchedule(12, 3)
        sampler = ShareBatchSampler(range(100), schedule, 2, seed=5)
        sampler.set_epoch(1)
        out, state = [], None
        for i, batch in enumerate(sampler):
            out.append(batch)
            sampler.pop_built()
            if i == 1:
                schedule.add(3, (6, 4, 2), "slow rank 2")
            if stop is not None and i == stop:
                state = sampler.state_dict()
                break
        return out, state

    whole, _ = run(None)
    head, state = run(4)
    assert state is not None and state["position"] == 5 and state["epoch"] == 1
    schedule = ShareSchedule(12, 3)
    resumed = ShareBatchSampler(range(100), schedule, 2, seed=5)
    resumed.load_state_dict(state)
    resumed.load_state_dict(state)  # restoring the entries twice is harmless
    assert resumed.state_dict() == state  # a checkpoint before the resumed epoch starts: the same
    assert [e.samples for e in schedule.entries] == [(4, 4, 4), (6, 4, 2)]
    resumed.set_epoch(1)
    tail = list(resumed)
    assert head + tail == whole
    assert [b.step for b in iter(resumed.pop_built, None)] == list(range(5, len(whole)))
    with pytest.raises(PacingConfigError, match="seed"):
        ShareBatchSampler(range(100), ShareSchedule(12, 3), 2, seed=6).load_state_dict(state)


def test_iterable_dataset_is_refused_at_start():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(10)

    with pytest.raises(PacingConfigError, match="indexable data"):
        ShareBatchSampler(Stream(), ShareSchedule(4, 2), 0)


def test_scaled_shares_of_a_partial_step():
    assert scaled_shares((12, 4), 8) == (6, 2)
    assert scaled_shares((12, 4), 2) == (1, 1)
    assert sum(scaled_shares((5, 2, 1), 7)) == 7
    with pytest.raises(ValueError):
        scaled_shares((4, 4), 1)


def test_loss_scale_turns_the_mean_over_ranks_into_the_mean_over_samples():
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    shares = (11, 5)

    def grad_of(loss):
        net.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in net.parameters()]

    full = grad_of(torch.nn.functional.cross_entropy(net(x), y))
    per_rank, at = [], 0
    for r, n in enumerate(shares):
        loss = torch.nn.functional.cross_entropy(net(x[at : at + n]), y[at : at + n])
        per_rank.append(grad_of(loss * share_loss_scale(shares, r)))
        at += n
    ddp_mean = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    for got, want in zip(ddp_mean, full, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert share_loss_scale((8, 8), 0) == 1.0 and share_loss_scale((3, 3, 3), 2) == 1.0


def test_dataloader_workers_build_at_most_their_prefetch_ahead():
    schedule = ShareSchedule(8, 2)
    data = TensorDataset(torch.arange(64))
    sampler = ShareBatchSampler(data, schedule, 0, shuffle=False)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=1, prefetch_factor=2)
    it = iter(loader)
    first = next(it)
    assert first[0].tolist() == [0, 1, 2, 3]
    # one worker x prefetch 2 index lists in flight, plus the one just returned
    assert schedule.last_built <= 2
    built = schedule.last_built
    schedule.add(built + 1, (6, 2))
    rest = [b[0].tolist() for b in it]
    assert [len(b) for b in rest] == [4] * built + [6] * (7 - built)


def _rebalance(**kwargs):
    from pace_strategy.integrations.rebalance import DataRebalance

    return DataRebalance(None, 1, 2, step_source=lambda: 0, framework_prefetch=1, **kwargs)


def test_a_lightning_style_loader_is_rebuilt_with_its_order_and_workers_and_its_lookahead():
    data = TensorDataset(torch.arange(40))
    injected = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=9)
    loader = DataLoader(
        data, batch_size=4, sampler=injected, num_workers=2, prefetch_factor=3, drop_last=True
    )
    rebalance = _rebalance()
    rebuilt = rebalance.replace(loader)
    assert isinstance(rebuilt, DataLoader) and isinstance(rebuilt.batch_sampler, ShareBatchSampler)
    sampler = rebuilt.batch_sampler
    assert (sampler.shuffle, sampler.seed, sampler.drop_last, sampler.rank) == (True, 9, True, 1)
    assert (rebuilt.num_workers, rebuilt.prefetch_factor) == (2, 3)
    assert rebalance.schedule is not None and rebalance.schedule.global_batch == 8
    assert rebalance._lookahead == 2 * 3 + 1
    assert rebalance.replace(rebuilt) is rebuilt  # a reload of the same loader keeps it


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


class _Subclass(DataLoader):
    pass


@pytest.mark.parametrize(
    ("loader", "says"),
    [
        (lambda d: DataLoader(_Stream(), batch_size=2), "indexable data"),
        (
            lambda d: DataLoader(
                d, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 8, 8)
            ),
            "custom sampler",
        ),
        (lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]), "custom batch_sampler"),
        (lambda d: _Subclass(d, batch_size=2), "DataLoader subclass"),
        (lambda d: DataLoader(d, batch_size=2, num_workers=1, in_order=False), "in_order"),
        (lambda d: [[0, 1]], "torch DataLoader"),
    ],
)
def test_what_cannot_be_rebalanced_fails_at_start_naming_the_fix(loader, says):
    with pytest.raises(PacingConfigError, match=says):
        _rebalance().replace(loader(TensorDataset(torch.arange(8))))


def test_batches_per_step_beyond_the_accumulation_are_refused():
    rebalance = _rebalance()
    loader = rebalance.replace(DataLoader(TensorDataset(torch.arange(32)), batch_size=4))
    it = iter(loader)
    next(it)
    rebalance.begin_batch()
    assert rebalance.loss_scale == 1.0
    next(it)
    with pytest.raises(PacingConfigError, match="one batch per optimizer step"):
        rebalance.begin_batch()


def test_steps_of_the_plain_arm_are_cut_in_slices_and_the_arm_survives_a_resume():
    # balancing's A/B check switches the schedule between balanced and plain slices of the same
    # global batches: the sampler follows each step's entry, and its state carries the arms
    lengths = [(37 * i) % 101 + 1 for i in range(40)]

    def by_length(indices, shares, cost=None):  # a stand-in balancer: the longest samples to rank 0
        order = sorted(indices, key=lambda i: -lengths[i])
        return [order[: shares[0] // 2], order[shares[0] // 2 :]]

    schedule = ShareSchedule(8, 2)
    schedule.add(2, (4, 4), "A/B plain arm", balanced=False)
    schedule.add(4, (4, 4), "A/B balanced arm", balanced=True)
    samplers = [ShareBatchSampler(range(40), schedule, r, seed=3, balancer=by_length) for r in (0, 1)]
    steps = _epoch(samplers)
    order = samplers[0].permutation(0).tolist()
    for t, (a, b) in enumerate(steps):
        chunk = order[t * 8 : (t + 1) * 8]
        if t in (2, 3):
            assert (a, b) == (chunk[:4], chunk[4:]), t  # plain: rank r takes slice r
        else:
            assert (len(a), len(b)) == (2, 6) and sorted(a + b) == sorted(chunk), t
    state = samplers[0].state_dict()
    assert [e["balanced"] for e in state["entries"]] == [True, False, True]
    fresh = ShareSchedule(8, 2)
    ShareBatchSampler(range(40), fresh, 0, seed=3).load_state_dict(state)
    assert [(e.from_step, e.balanced) for e in fresh.entries] == [(0, True), (2, False), (4, True)]
