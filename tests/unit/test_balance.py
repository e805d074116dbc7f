"""Cost-balanced batches (pace_strategy.data.balance): the assignment against brute force on small
batches, its guarantees (every sample once, every rank one at least, the same on every call, the
budget), and what it gains on a long-tailed length mix."""

import itertools

import numpy as np
import pytest
import torch

from pace_strategy.data.balance import SampleCost, assign, assign_packed, assign_padded, step_costs

ATTENTION = SampleCost("attention", quadratic_tokens=256.0)


def brute_force(lengths, world, cost, layout):
    """The smallest largest rank cost over every assignment with one sample per rank at least."""
    best = np.inf
    for owner in itertools.product(range(world), repeat=len(lengths)):
        if len(set(owner)) < world:
            continue
        parts = [[i for i, o in enumerate(owner) if o == r] for r in range(world)]
        best = min(best, step_costs(lengths, parts, cost, layout).max())
    return best


@pytest.mark.parametrize("seed", range(12))
def test_padded_is_optimal_and_packed_within_the_lpt_bound_on_small_batches(seed):
    rng = np.random.default_rng(seed)
    world = 2 + seed % 2
    lengths = rng.integers(8, 400, 8 - world + 1 + 2 * (seed % 2 == 0)).tolist()
    for layout, bound in (("padded", 1.0), ("packed", 4.0 / 3.0)):
        parts = assign(lengths, world, ATTENTION, layout)
        mine = step_costs(lengths, parts, ATTENTION, layout).max()
        assert mine <= bound * brute_force(lengths, world, ATTENTION, layout) * (1 + 1e-9), (layout, lengths)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_sample_once_every_rank_at_least_one_and_the_same_answer_every_time(layout):
    rng = np.random.default_rng(3)
    for world in (1, 2, 4, 8, 64):
        lengths = rng.integers(1, 2000, world * 3).tolist()
        parts = assign(lengths, world, ATTENTION, layout)
        assert sorted(p for ps in parts for p in ps) == list(range(len(lengths)))
        assert all(parts) and parts == assign(lengths, world, ATTENTION, layout)
        assert all(ps == sorted(ps) for ps in parts)
    ties = [100] * 8  # equal lengths: by position, equal counts
    assert assign(ties, 4, ATTENTION, layout) == [[0, 1], [2, 3], [4, 5], [6, 7]] or layout == "packed"
    assert [len(ps) for ps in assign(ties, 4, ATTENTION, layout)] == [2, 2, 2, 2]


def test_padded_gives_the_longest_samples_to_fewer_ranks_slots():
    lengths = [512, 40, 30, 35, 20, 25, 45, 50]  # one long sample, seven short
    parts = assign_padded(lengths, 2, SampleCost("tokens"))
    assert parts[0] == [0] and len(parts[1]) == 7  # 1 x 512 against 7 x 50
    assert step_costs(lengths, parts, SampleCost("tokens"), "padded").max() == 512


def test_the_token_budget_is_kept_or_refused_naming_it():
    lengths = [300, 200, 100, 100, 50, 50]
    arr = np.asarray(lengths)
    # padded: count x longest; the 300 can share with the 200 only (2 x 300), the rest 4 x 100
    for layout, fits, too_small in (("padded", 600, 500), ("packed", 450, 350)):
        parts = assign(lengths, 2, SampleCost("tokens"), layout, max_tokens=fits)
        used = [len(ps) * arr[ps].max() if layout == "padded" else arr[ps].sum() for ps in parts]
        assert max(used) <= fits, (layout, parts)
        with pytest.raises(ValueError, match=f"max_tokens={too_small}"):
            assign(lengths, 2, SampleCost("tokens"), layout, max_tokens=too_small)


def test_weights_give_a_faster_rank_more_of_the_work():
    rng = np.random.default_rng(4)
    lengths = rng.integers(16, 512, 64).tolist()
    for layout in ("padded", "packed"):
        parts = assign(lengths, 2, ATTENTION, layout, weights=[2.0, 1.0])
        cost = step_costs(lengths, parts, ATTENTION, layout)
        assert 1.5 < cost[0] / cost[1] < 2.7, (layout, cost)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one sample per rank"):
        assign_padded([10, 20], 3, ATTENTION)
    with pytest.raises(ValueError, match="at least one token"):
        assign_packed([10, 0, 5], 2, ATTENTION)
    with pytest.raises(ValueError, match="layout"):
        assign([10, 20], 2, ATTENTION, "sorted")
    with pytest.raises(ValueError, match="cost model"):
        SampleCost("flops")


def test_on_a_long_tailed_mix_the_slowest_rank_does_far_less_than_at_even_slices():
    """Log-normal lengths, 16-512 tokens, 64 samples a step over 4 ranks, attention cost: the slowest
    rank's predicted compute against the even contiguous split the plain sampler makes."""
    rng = np.random.default_rng(5)
    world, batch = 4, 64
    gains = {"padded": [], "packed": []}
    for _ in range(200):
        lengths = np.clip(rng.lognormal(4.5, 0.8, batch), 16, 512).astype(int).tolist()
        even = [list(range(r * batch // world, (r + 1) * batch // world)) for r in range(world)]
        for layout in gains:
            plain = step_costs(lengths, even, ATTENTION, layout).max()
            balanced = step_costs(lengths, assign(lengths, world, ATTENTION, layout), ATTENTION, layout)
            gains[layout].append(plain / balanced.max())
            # the attainable bound: the total over the ranks, evenly (packed), never beaten
            if layout == "packed":
                assert balanced.max() >= balanced.sum() / world - 1e-6
    assert np.median(gains["padded"]) > 1.3, np.median(gains["padded"])
    assert np.median(gains["packed"]) > 1.3, np.median(gains["packed"])


class Texts:
    """A map-style dataset of variable-length samples with its lengths, as a tokenized corpus is."""

    def __init__(self, lengths):
        self.lengths = list(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.ones(self.lengths[i], dtype=torch.long)}


def _samplers(dataset, world, batch, layout):
    from pace_strategy.core.shares import ShareSchedule
    from pace_strategy.data.balance import Balancer, sample_lengths
    from pace_strategy.data.share_sampler import ShareBatchSampler

    schedule = ShareSchedule(batch * world, world)
    balancer = Balancer(sample_lengths(dataset), ATTENTION, layout)
    return [ShareBatchSampler(dataset, schedule, r, seed=7, balancer=balancer) for r in range(world)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_sampler_splits_every_step_by_cost_and_the_loss_scales_make_the_global_mean(layout):
    rng = np.random.default_rng(8)
    world, batch = 4, 8
    dataset = Texts(np.clip(rng.lognormal(4.5, 0.8, 100), 16, 512).astype(int))
    samplers = _samplers(dataset, world, batch, layout)
    steps = [list(s) for s in samplers]  # each rank iterates its own: no collective
    built = [[s.pop_built() for _ in range(len(s))] for s in samplers]
    weight = torch.randn(3)
    for i in range(len(steps[0])):
        batches = [steps[r][i] for r in range(world)]
        shares = built[0][i].shares
        assert all(built[r][i].shares == shares for r in range(world))  # every rank agrees
        assert tuple(len(b) for b in batches) == shares and all(shares)
        union = sorted(x for b in batches for x in b)
        assert len(union) == len(set(union))
        # DDP averages over ranks the gradients of each rank's scaled mean loss: the global mean
        x = {j: torch.randn(3, generator=torch.Generator().manual_seed(j)) for j in union}
        per_rank = [
            built[r][i].loss_scale * torch.stack([x[j] * weight for j in batches[r]]).mean(0)
            for r in range(world)
        ]
        ddp = torch.stack(per_rank).mean(0)
        assert torch.allclose(ddp, torch.stack([x[j] * weight for j in union]).mean(0), atol=1e-6)
    seen = sorted(x for per_step in zip(*steps, strict=True) for b in per_step for x in b)
    assert seen[: len(dataset)] == list(range(len(dataset)))  # every sample of the epoch once
    # and the split is by cost: the slowest rank's predicted work against the even slices
    lengths = np.asarray(dataset.lengths)
    first = [steps[r][0] for r in range(world)]
    even = sorted(x for b in first for x in b)
    even = [even[r * batch : (r + 1) * batch] for r in range(world)]
    assert (
        step_costs(lengths, first, ATTENTION, layout).max()
        <= step_costs(lengths, even, ATTENTION, layout).max()
    )


def test_lengths_come_from_the_argument_the_attribute_the_column_or_input_ids():
    from pace_strategy.data.balance import sample_lengths

    texts = Texts([3, 5, 2])
    assert sample_lengths(texts).tolist() == [3, 5, 2]
    assert sample_lengths(texts, [1, 1, 1]).tolist() == [1, 1, 1]

    class Ids(list):  # no lengths: each sample's input_ids, read once
        def __getitem__(self, i):
            return {"input_ids": [0] * super().__getitem__(i)}

    bare = Ids([4, 6])
    assert sample_lengths(bare).tolist() == [4, 6]

    class Columns(list):
        column_names = ("length", "text")

        def __getitem__(self, key):
            return [7, 9] if key == "length" else super().__getitem__(key)

    assert sample_lengths(Columns([0, 0])).tolist() == [7, 9]
    with pytest.raises(ValueError, match="no input_ids"):
        sample_lengths([(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="one positive integer length per sample"):
        sample_lengths(texts, [1, 0, 2])


def test_fit_cost_recovers_the_coefficients_of_measured_times():
    from pace_strategy.data.balance import fit_cost

    lengths = [16, 32, 64, 128, 256, 512]
    times = [3.0 + 0.002 * n + 6e-5 * n * n for n in lengths]  # ms: a, b, c
    cost = fit_cost(lengths, times)
    assert cost.model == "attention"
    assert abs(cost.per_sample - 1500.0) < 1.0 and abs(cost.quadratic_tokens - 0.002 / 6e-5) < 0.1
    # its predictions are the times in units of b
    assert np.allclose(cost(np.asarray(lengths)) * 0.002, times)
    with pytest.raises(ValueError, match="three lengths"):
        fit_cost([16, 16, 32], [1.0, 1.0, 2.0])


def test_the_balance_group_is_configured_and_checked_by_name():
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.core.errors import PacingConfigError

    config = PacingConfig.from_dict({"balance": {"enabled": True, "layout": "packed", "per_sample": 50.0}})
    assert config.balance.enabled and config.splits_batches and config.balance.per_sample == 50.0
    assert PacingConfig.from_dict({"balance": True}).balance.layout == "padded"
    assert not PacingConfig().splits_batches
    for bad, field in (({"cost": "flops"}, "balance.cost"), ({"max_tokens": 0}, "balance.max_tokens")):
        with pytest.raises(PacingConfigError, match=field.replace(".", r"\.")):
            PacingConfig.from_dict({"balance": bad})


def test_a_loop_that_never_says_its_batch_is_in_hand_is_stopped_before_a_wrong_update():
    from torch.utils.data import DataLoader

    from pace_strategy.core.config import BalanceConfig
    from pace_strategy.core.errors import PacingConfigError
    from pace_strategy.integrations.rebalance import DataRebalance

    def data_path():
        path = DataRebalance(None, 0, 2, lambda: 0, 0, balance=BalanceConfig(enabled=True))
        loader = path.replace(DataLoader(Texts([16, 32, 64, 128] * 8), batch_size=2, collate_fn=list))
        return path, iter(loader)

    path, batches = data_path()
    for _ in range(3):  # begin_batch (pace.begin_step) as each batch is taken: fine
        next(batches)
        path.begin_batch()
        path.check_taken()
        path.end_step()
    path, batches = data_path()
    next(batches)
    path.check_taken()  # the batch in hand, taken at begin_step, may be the one built ahead
    for _ in range(3):
        next(batches)
    with pytest.raises(PacingConfigError, match=r"call pace.begin_step\(\)"):
        path.check_taken()  # what the comm hook calls in every backward
