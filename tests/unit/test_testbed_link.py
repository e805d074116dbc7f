"""The delay element's seeded schedule: reproducible, FIFO, and the delay, jitter and loss it says."""

from __future__ import annotations

import statistics

import pytest

from pace_strategy.testbed import Impairment, LinkSchedule, TestbedSpecError

pytestmark = pytest.mark.timeout(60)


def _schedule(
    impairment: Impairment, seed: int, frames: int = 20_000, gap_s: float = 0.001
) -> list[float | None]:
    schedule = LinkSchedule(impairment, seed)
    return [schedule.release_at(k * gap_s) for k in range(frames)]


def test_a_seed_gives_the_same_schedule_and_another_seed_another():
    imp = Impairment(delay_ms=5.0, jitter_ms=1.0, loss=0.01)
    assert _schedule(imp, 3) == _schedule(imp, 3)
    assert _schedule(imp, 3) != _schedule(imp, 4)


def test_delay_jitter_and_loss_are_what_was_asked():
    imp = Impairment(delay_ms=5.0, jitter_ms=1.0, loss=0.02)
    gap_s = 0.02  # frames far apart next to the jitter: FIFO order never holds one back
    released = _schedule(imp, 11, gap_s=gap_s)
    kept = [(k, r) for k, r in enumerate(released) if r is not None]
    assert 0.015 < 1 - len(kept) / len(released) < 0.025  # 2% lost (binomial sd ~0.1%)
    holds_ms = [(r - k * gap_s) * 1e3 for k, r in kept]
    assert abs(statistics.fmean(holds_ms) - 5.0) < 0.05  # standard error ~0.007 ms
    assert 0.95 < statistics.pstdev(holds_ms) < 1.05


def test_frames_close_together_never_overtake_and_are_never_early():
    gap_s = 0.0005  # half the jitter: without FIFO, many frames would overtake
    released = _schedule(Impairment(delay_ms=5.0, jitter_ms=1.0), 12, gap_s=gap_s)
    times = [r for r in released if r is not None]
    assert times == sorted(times)
    holds_ms = [(r - k * gap_s) * 1e3 for k, r in enumerate(times)]
    assert min(holds_ms) >= 0.0
    # FIFO can only hold a frame longer than its own draw: the mean rises above the delay asked.
    assert statistics.fmean(holds_ms) > 5.0


def test_a_lost_frame_does_not_shift_the_fate_of_the_next():
    """Frame k's draws are the same whatever the loss share: changing loss only drops frames."""
    lossless = _schedule(Impairment(delay_ms=2.0, jitter_ms=0.5), 5, frames=2_000, gap_s=0.01)
    lossy = _schedule(Impairment(delay_ms=2.0, jitter_ms=0.5, loss=0.1), 5, frames=2_000, gap_s=0.01)
    assert all(b is None or a == b for a, b in zip(lossless, lossy, strict=True))
    assert sum(b is None for b in lossy) > 100


def test_impairment_text_and_validation():
    assert Impairment.parse("5") == Impairment(5.0)
    assert Impairment.parse("5:1:0.001") == Impairment(5.0, 1.0, 0.001)
    assert str(Impairment(5.0, 1.0)) == "5:1:0"
    assert Impairment().is_identity and not Impairment(loss=0.1).is_identity
    with pytest.raises(TestbedSpecError, match="MS\\[:JITTER_MS\\[:LOSS\\]\\]"):
        Impairment.parse("5:1:0:3")
    with pytest.raises(TestbedSpecError, match="delay_ms=-1"):
        Impairment(delay_ms=-1.0)
