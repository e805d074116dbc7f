"""The controller's state machine, fed synthetic windows (no clock, no ranks)."""

import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.records import PolicyState
from pace_strategy.core.skew import WindowStats


def window(i, leads, step_ms=100.0, skew_ms=None, noise_ms=0.0, steps=16):
    """A window where rank r leads by ``leads[r]`` ms (+/- noise alternating), straggler last."""
    base = torch.tensor(leads, dtype=torch.float64).unsqueeze(1).repeat(1, steps)
    if noise_ms:
        signs = torch.tensor([1.0 if s % 2 else -1.0 for s in range(steps)], dtype=torch.float64)
        base = (base + noise_ms * signs * (base > 0)).clamp_min(0.0)
    return WindowStats(
        window=i,
        world_size=len(leads),
        steps=steps,
        median_step_ms=step_ms,
        median_unpaced_skew_ms=max(leads) if skew_ms is None else skew_ms,
        pacable_lead_ms=base,
        straggler_counts=tuple(steps if lead == 0 else 0 for lead in leads),
    )


def feed(policy, windows):
    return [policy.update(w) for w in windows]


def test_turns_on_only_after_several_severe_windows():
    cfg = PacingConfig(activate_windows=3)
    policy = PacingPolicy(cfg, 2)
    out = feed(policy, [window(i, [30.0, 0.0]) for i in range(3)])
    assert [d.state for d in out] == [PolicyState.MONITOR, PolicyState.MONITOR, PolicyState.PACING]
    assert not out[1].pacing_active and out[2].pacing_active
    assert out[2].delays_ms[1] == 0.0  # the straggler is never delayed


def test_mild_skew_never_activates():
    policy = PacingPolicy(PacingConfig(), 2)
    out = feed(policy, [window(i, [5.0, 0.0]) for i in range(10)])  # 5% of a 100 ms step < 10%
    assert all(d.state is PolicyState.MONITOR and not d.pacing_active for d in out)


def test_delay_is_a_bounded_fraction_of_the_lead():
    cfg = PacingConfig(gain=0.5, max_delay_ms=50.0, max_delay_step_fraction=0.5, activate_windows=1)
    d = PacingPolicy(cfg, 3).update(window(0, [20.0, 10.0, 0.0]))
    assert d.delays_ms == (10.0, 5.0, 0.0)


def test_delay_caps_max_delay_ms_and_step_fraction():
    cfg = PacingConfig(gain=1.0, max_delay_ms=8.0, max_delay_step_fraction=0.5, activate_windows=1)
    assert PacingPolicy(cfg, 2).update(window(0, [40.0, 0.0])).delays_ms[0] == 8.0
    cfg = PacingConfig(gain=1.0, max_delay_ms=100.0, max_delay_step_fraction=0.1, activate_windows=1)
    assert PacingPolicy(cfg, 2).update(window(0, [40.0, 0.0], step_ms=60.0)).delays_ms[0] == 6.0


def test_noise_margin_is_kept_unpaced():
    cfg = PacingConfig(
        gain=1.0,
        noise_margin_factor=2.0,
        max_delay_ms=100,
        max_delay_step_fraction=1.0,
        activate_windows=1,
        persist_fraction=0.5,
    )
    d = PacingPolicy(cfg, 2).update(window(0, [20.0, 0.0], noise_ms=3.0))
    # median lead 20 ms (lower median of 17/23 is 17), std 3 ms -> margin 6 ms
    assert abs(d.delays_ms[0] - (17.0 - 6.0)) < 1e-9


def test_transient_lead_is_not_paced():
    cfg = PacingConfig(activate_windows=1)
    leads = torch.zeros(2, 16, dtype=torch.float64)
    leads[0, :3] = 40.0  # rank 0 led in only 3 of 16 steps
    w = WindowStats(0, 2, 16, 100.0, 40.0, leads, (0, 16))
    assert not PacingPolicy(cfg, 2).update(w).pacing_active


def test_hysteresis_turns_off_only_after_calm_windows():
    cfg = PacingConfig(activate_windows=1, deactivate_windows=2, ab_windows=100)
    policy = PacingPolicy(cfg, 2)
    feed(policy, [window(0, [30.0, 0.0])])
    assert policy.state is PolicyState.PACING
    d = policy.update(window(1, [7.0, 0.0]))  # 7%: below on (10%) but above off (5%): stays on
    assert d.state is PolicyState.PACING
    assert policy.update(window(2, [3.0, 0.0])).state is PolicyState.PACING  # first calm window
    assert policy.update(window(3, [3.0, 0.0])).state is PolicyState.MONITOR  # second: off


def test_backs_off_for_a_cooldown_when_pacing_does_not_help():
    cfg = PacingConfig(activate_windows=2, ab_windows=2, cooldown_windows=3)
    policy = PacingPolicy(cfg, 2)
    feed(policy, [window(0, [30.0, 0.0], step_ms=100.0), window(1, [30.0, 0.0], step_ms=100.0)])
    assert policy.state is PolicyState.PACING
    out = feed(policy, [window(2, [30.0, 0.0], step_ms=101.0), window(3, [30.0, 0.0], step_ms=101.0)])
    assert out[-1].state is PolicyState.COOLDOWN and not out[-1].pacing_active
    assert "backing off" in out[-1].reason
    out = feed(policy, [window(4 + i, [30.0, 0.0]) for i in range(3)])
    assert [d.state for d in out] == [PolicyState.COOLDOWN, PolicyState.COOLDOWN, PolicyState.MONITOR]
    assert not any(d.pacing_active for d in out)


def test_keeps_pacing_that_helps_and_reprobes_it():
    cfg = PacingConfig(activate_windows=1, ab_windows=2, probe_every_windows=2, min_gain_fraction=0.005)
    policy = PacingPolicy(cfg, 2)
    policy.update(window(0, [30.0, 0.0], step_ms=100.0))
    out = feed(policy, [window(1, [30.0, 0.0], step_ms=95.0), window(2, [30.0, 0.0], step_ms=95.0)])
    assert out[-1].state is PolicyState.PROBE and not out[-1].pacing_active  # kept, then re-probe
    assert out[-1].paced_step_ms == 95.0
    out = feed(policy, [window(3, [30.0, 0.0], step_ms=100.0), window(4, [30.0, 0.0], step_ms=100.0)])
    assert out[-1].state is PolicyState.PACING and out[-1].pacing_active
    assert out[-1].baseline_step_ms == 100.0


def test_kept_pacing_keeps_its_delays_between_probes():
    cfg = PacingConfig(activate_windows=1, ab_windows=1, probe_every_windows=5)
    policy = PacingPolicy(cfg, 2)
    policy.update(window(0, [30.0, 0.0], step_ms=100.0))
    d = policy.update(window(1, [30.0, 0.0], step_ms=90.0))
    assert d.state is PolicyState.PACING and d.pacing_active and "kept" in d.reason


def test_monitor_mode_never_delays_and_forced_mode_always_does():
    monitor = PacingPolicy(PacingConfig(mode="monitor"), 2)
    assert not any(d.pacing_active for d in feed(monitor, [window(i, [40.0, 0.0]) for i in range(6)]))
    forced = PacingPolicy(PacingConfig(mode="forced"), 2)
    first = forced.update(window(0, [40.0, 0.0], step_ms=101.0))
    assert first.state is PolicyState.PACING and first.pacing_active


def test_identical_inputs_give_identical_decisions():
    a, b = PacingPolicy(PacingConfig(), 4), PacingPolicy(PacingConfig(), 4)
    ws = [window(i, [12.0, 30.0, 0.0, 7.0], noise_ms=2.0) for i in range(8)]
    assert feed(a, ws) == feed(b, ws)


def test_empty_window_keeps_the_previous_decision():
    policy = PacingPolicy(PacingConfig(mode="forced"), 2)
    d = policy.update(window(0, [30.0, 0.0]))
    empty = WindowStats(1, 2, 0, 0.0, 0.0, torch.zeros(2, 0, dtype=torch.float64), (0, 0))
    assert policy.update(empty).delays_ms == d.delays_ms


def _fail_one_check(policy, start, cfg):
    """Drive ``policy`` from MONITOR through one failed A/B trial; returns the next window index."""
    i = start
    while policy.state is not PolicyState.PACING:
        policy.update(window(i, [30.0, 0.0], step_ms=100.0))
        i += 1
    while policy.state is PolicyState.PACING:
        d = policy.update(window(i, [30.0, 0.0], step_ms=101.0))  # paced is slower: check fails
        i += 1
    assert d.state is PolicyState.COOLDOWN and "backing off" in d.reason
    return i


def _cooldown_length(policy, start):
    i, n = start, 0
    while policy.state is PolicyState.COOLDOWN:
        assert not policy.update(window(i, [30.0, 0.0], step_ms=100.0)).pacing_active
        i, n = i + 1, n + 1
    return i, n


def test_cooldown_grows_after_each_failed_check_in_a_row_and_is_bounded():
    cfg = PacingConfig(activate_windows=1, ab_windows=1, cooldown_windows=2, cooldown_growth=2.0)
    cfg = cfg.replace(max_cooldown_windows=5)
    policy = PacingPolicy(cfg, 2)
    lengths, i = [], 0
    for _ in range(4):
        i, n = _cooldown_length(policy, _fail_one_check(policy, i, cfg))
        lengths.append(n)
    assert lengths == [2, 4, 5, 5]


def test_a_kept_check_resets_the_cooldown_to_its_start():
    cfg = PacingConfig(activate_windows=1, ab_windows=1, cooldown_windows=2, probe_every_windows=1)
    policy = PacingPolicy(cfg, 2)
    i, _ = _cooldown_length(policy, _fail_one_check(policy, 0, cfg))  # 2 windows
    i, _ = _cooldown_length(policy, _fail_one_check(policy, i, cfg))  # 4 windows
    policy.update(window(i, [30.0, 0.0], step_ms=100.0))  # severe again: pacing on
    d = policy.update(window(i + 1, [30.0, 0.0], step_ms=90.0))  # 10% faster: kept
    assert d.state is PolicyState.PROBE and "kept" in d.reason
    feed(policy, [window(i + 2, [30.0, 0.0], step_ms=100.0)])  # probe done: pacing again
    assert policy.state is PolicyState.PACING
    _, n = _cooldown_length(policy, _fail_one_check(policy, i + 3, cfg))
    assert n == 2


def test_fixed_cooldown_with_growth_one():
    cfg = PacingConfig(activate_windows=1, ab_windows=1, cooldown_windows=3, cooldown_growth=1.0)
    policy = PacingPolicy(cfg, 2)
    i, lengths = 0, []
    for _ in range(3):
        i, n = _cooldown_length(policy, _fail_one_check(policy, i, cfg))
        lengths.append(n)
    assert lengths == [3, 3, 3]


def test_a_gain_within_the_runs_own_noise_is_a_failed_check():
    # Unpaced windows of 98, 102, 100 ms (standard deviation 2 ms; baseline: the last two, 101 ms).
    # Two paced windows of 99.5 ms gain 1.5%: more than min_gain_fraction (0.5%) but within the
    # comparison's noise (1 x 2 ms), so the check fails; with the noise rule off it is kept.
    for factor, kept in ((1.0, False), (0.0, True)):
        cfg = PacingConfig(activate_windows=3, ab_windows=2, ab_noise_factor=factor)
        policy = PacingPolicy(cfg, 2)
        feed(policy, [window(i, [30.0, 0.0], step_ms=m) for i, m in enumerate([98.0, 102.0, 100.0])])
        assert policy.state is PolicyState.PACING
        d = feed(policy, [window(3 + i, [30.0, 0.0], step_ms=99.5) for i in range(2)])[-1]
        assert d.baseline_step_ms == 101.0 and d.paced_step_ms == 99.5
        if kept:
            assert d.state is not PolicyState.COOLDOWN and "kept" in d.reason, d.reason
        else:
            assert d.state is PolicyState.COOLDOWN and "noise 2.00 ms" in d.reason, d.reason


def test_a_gain_beyond_the_noise_is_kept():
    cfg = PacingConfig(activate_windows=3, ab_windows=2, ab_noise_factor=1.0)
    policy = PacingPolicy(cfg, 2)
    feed(policy, [window(i, [30.0, 0.0], step_ms=m) for i, m in enumerate([98.0, 102.0, 100.0])])
    d = feed(policy, [window(3 + i, [30.0, 0.0], step_ms=97.0) for i in range(2)])[-1]
    assert d.state is PolicyState.PACING and "kept" in d.reason, d.reason  # 4 ms > 2 ms of noise
