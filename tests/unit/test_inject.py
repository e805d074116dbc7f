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


def test_a_straggler_phase_must_be_known():
    with pytest.raises(PacingConfigError, match="phase='middle'"):
        Straggler(rank=0, delay_ms=1.0, phase="middle")


def test_the_injection_point_spends_its_backward_time_between_the_layers_gradients():
    import time

    import torch

    from pace_strategy.testing import InjectionPoint, arm_injection_points

    point = InjectionPoint()
    first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(first, point, torch.nn.ReLU(), last)
    ready: dict[str, float] = {}

    def noting(name: str):
        def hook(param: torch.Tensor) -> None:
            ready.setdefault(name, time.perf_counter())

        return hook

    last.weight.register_post_accumulate_grad_hook(noting("last"))
    first.weight.register_post_accumulate_grad_hook(noting("first"))
    slow = (Straggler(rank=1, delay_ms=30.0, phase="backward"),)
    assert arm_injection_points(model, slow, rank=0, step=0) == 0.0  # another rank: not armed
    assert arm_injection_points(model, slow, rank=1, step=0) == 30.0
    started = time.perf_counter()
    loss = model(torch.ones(2, 4)).sum()
    forward_s = time.perf_counter() - started
    loss.backward()
    assert forward_s < 0.02  # a backward straggler spends nothing in the forward
    # the layers above the point have their gradients before the delay, the first layer after it
    assert ready["first"] - ready["last"] >= 0.029
    assert point.spent_ms == 30.0
    ready.clear()
    model(torch.ones(2, 4)).sum().backward()  # armed once: the next step runs at full speed
    assert ready["first"] - ready["last"] < 0.02
    with pytest.raises(ValueError, match="needs an InjectionPoint"):
        arm_injection_points(torch.nn.Linear(2, 2), slow, rank=1, step=0)


def test_an_episode_spec_slows_its_steps_only():
    (s,) = parse_stragglers("1:30@5-7")
    assert (s.start_step, s.stop_step) == (5, 8)
    assert [injected_delay_ms([s], 1, step) for step in range(4, 10)] == [0, 30, 30, 30, 0, 0]
    (to_end,) = parse_stragglers("2:10@3-")
    assert to_end.stop_step is None and injected_delay_ms([to_end], 2, 10**6) == 10
    with pytest.raises(PacingConfigError, match="expected FIRST-LAST"):
        parse_stragglers("1:30@5")
