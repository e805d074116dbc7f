"""share_phases: the runs of steps at one split, from run-record step lines."""

from __future__ import annotations

import pytest

from pace_strategy.data.phases import describe_phases, share_phases


def _step(step: int, samples: list[int], compute_ms: list[float], step_ms: float) -> dict:
    return {
        "step": step,
        "valid": True,
        "warmup": False,
        "step_ms": step_ms,
        "ranks": {"samples": samples, "compute_ms": compute_ms},
    }


def test_phases_split_at_each_share_change_and_measure_per_sample_compute() -> None:
    steps = [_step(i, [8, 8], [8.0, 16.0], 20.0) for i in range(4)]
    steps += [_step(i, [12, 4], [12.0, 8.0], 14.0) for i in range(4, 8)]
    first, second = share_phases(steps, skip=1)
    assert (first.shares, first.first_step, first.last_step, first.steps) == ((8, 8), 0, 3, 3)
    assert first.ms_per_sample == pytest.approx((1.0, 2.0))
    assert first.samples_per_s == pytest.approx(16 / 0.020)
    assert first.outside_ms == pytest.approx(4.0)  # 20 ms step minus the slowest rank's 16 ms
    assert first.capacity_per_s == pytest.approx(1000.0 + 500.0)
    assert second.shares == (12, 4) and second.samples_per_s == pytest.approx(16 / 0.014)
    assert "x1.43 of the first split" in describe_phases([first, second])[1]


def test_steps_where_a_rank_reported_no_samples_form_no_phase() -> None:
    # A run without rebalancing records 0 samples per rank: no phase (was a ZeroDivisionError).
    steps = [_step(i, [0, 0], [8.0, 8.0], 10.0) for i in range(4)]
    steps.append({**_step(4, [8, 8], [8.0, 8.0], 10.0), "valid": False})
    assert share_phases(steps) == []
    assert describe_phases([]) == ["  rebalancing       no per-rank samples in the record"]
