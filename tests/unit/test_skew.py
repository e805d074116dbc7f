import torch

from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.skew import coefficient_of_variation, lead, pacable_lead, skew, window_stats


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_skew_and_lead_follow_the_glossary():
    # 3 ranks x 2 steps; rank 2 waits least (arrives last)
    wait = t([[30.0, 12.0], [25.0, 2.0], [1.0, 10.0]])
    assert skew(wait).tolist() == [29.0, 10.0]
    assert lead(wait).tolist() == [[29.0, 10.0], [24.0, 0.0], [0.0, 8.0]]
    assert wait.argmin(dim=0).tolist() == [2, 1]


def test_pacable_lead_adds_back_the_delay_it_was_given():
    # rank 0 was delayed 10 ms, so its wait shrank from 30 to 20: its unpaced lead is still 29
    wait, delay, compute = t([[20.0], [1.0]]), t([[10.0], [0.0]]), t([[10.0], [39.0]])
    assert pacable_lead(wait, delay, compute).tolist() == [[29.0], [0.0]]


def test_pacable_lead_ignores_lateness_the_network_caused():
    # Rank 1 finished the previous collective late (slow path) and so waited little, but its compute
    # equals rank 0's: by waits it looks like a straggler and rank 0 looks early; by compute nobody is.
    wait = t([[9.0], [1.0]])
    compute = t([[40.0], [40.0]])
    assert pacable_lead(wait, torch.zeros_like(wait), compute).tolist() == [[0.0], [0.0]]


def test_window_stats_skip_warmup_and_steps_without_a_sync_point():
    g = torch.zeros(2, 4, NUM_FIELDS, dtype=torch.float64)
    g[:, :, Field.VALID] = 1.0
    g[:, 0, Field.WARMUP] = 1.0  # step 0 warm-up
    g[1, 3, Field.VALID] = 0.0  # step 3: rank 1 never saw the sync point
    g[:, :, Field.STEP_MS] = 100.0
    g[0, :, Field.WAIT_MS] = 40.0
    g[1, :, Field.WAIT_MS] = 1.0
    g[0, :, Field.COMPUTE_MS] = 50.0
    g[1, :, Field.COMPUTE_MS] = 90.0
    stats = window_stats(7, g)
    assert stats.window == 7 and stats.steps == 2
    assert stats.median_unpaced_skew_ms == 39.0
    assert abs(stats.skew_fraction - 0.39) < 1e-12
    assert stats.straggler_counts == (0, 2)
    assert stats.pacable_lead_ms.tolist() == [[39.0, 39.0], [0.0, 0.0]]


def test_coefficient_of_variation():
    assert coefficient_of_variation([]) == 0.0
    assert coefficient_of_variation([5.0]) == 0.0
    assert coefficient_of_variation([10.0, 10.0]) == 0.0
    assert abs(coefficient_of_variation([8.0, 12.0]) - 0.2) < 1e-12
