import pytest

from pace_strategy import PacingConfigError
from pace_strategy.testing import Straggler, injected_delay_ms, parse_stragglers


def test_persistent_straggler_hits_every_step_of_its_rank_only():
    s = Straggler(rank=1, delay_ms=40.0, start_step=2)
    assert [s.delay_at(1, step) for step in range(4)] == [0.0, 0.0, 40.0, 40.0]
    assert s.delay_at(0, 3) == 0.0


def test_seeded_transient_schedule_replays_and_depends_on_the_seed():
    a = Straggler(rank=0, delay_ms=30.0, probability=0.3, jitter_ms=5.0, seed=7)
    first = [a.delay_at(0, step) for step in range(200)]
    assert first == [a.delay_at(0, step) for step in range(200)]
    hits = [d for d in first if d > 0]
    assert 30 <= len(hits) <= 90 and all(25.0 <= d <= 35.0 for d in hits)
    other = Straggler(rank=0, delay_ms=30.0, probability=0.3, jitter_ms=5.0, seed=8)
    assert first != [other.delay_at(0, step) for step in range(200)]


def test_parse_and_sum():
    ss = parse_stragglers("1:40, 2:10:0.5")
    assert ss[0] == Straggler(rank=1, delay_ms=40.0)
    assert ss[1].probability == 0.5
    assert injected_delay_ms(ss, 1, 0) == 40.0
    assert parse_stragglers("") == []
    with pytest.raises(PacingConfigError, match="RANK:MS"):
        parse_stragglers("1")
    with pytest.raises(PacingConfigError):
        Straggler(rank=0, delay_ms=-1.0)
