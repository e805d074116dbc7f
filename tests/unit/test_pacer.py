"""The Pacer on one process with a manual clock: what it measures and when it applies delays."""

import torch

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.summary import StepSummarizer


def summaries(*results):
    """The per-step records of consecutive windows, as the session's telemetry thread builds them."""
    summarizer = StepSummarizer(PacingConfig().cv_window_steps)
    return [s for r in results for s in summarizer.summarize(r.gathered)]


def run_step(pacer, clock, step, data_ms=2.0, compute_ms=30.0, wait_ms=5.0, opt_ms=1.0):
    """One step as the comm hook sees it: the first bucket 10 ms into the step, the last one (the
    arrival) at the end of ``compute_ms``."""
    clock.advance(data_ms)
    pacer.add_data_wait(data_ms)  # as the timed DataLoader iterator reports it
    pacer.begin_step(step)
    clock.advance(10.0)
    pacer.enter_sync()
    clock.advance(compute_ms - 10.0)  # the rest of backward
    pacer.note_bucket()
    pacer.arrive()  # the last bucket's hand-off
    clock.advance(wait_ms)
    done = pacer.sync_done_callback()
    fut = torch.futures.Future()
    fut.set_result(torch.zeros(1))
    done(fut)
    clock.advance(opt_ms)
    return pacer.end_step()


def test_measures_each_duration_of_the_step():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=4, warmup_steps=1), None, 0, 1, clock)
    # The window's exchange is launched at the end of step 3 and collected at the end of step 4.
    assert [run_step(pacer, clock, s) for s in range(4)] == [None] * 4
    window = run_step(pacer, clock, 4)
    assert window.window == 0 and [x.step for x in summaries(window)] == [0, 1, 2, 3]
    s = summaries(window)[2]
    assert s.step == 2 and s.valid and not s.warmup
    assert s.compute_ms == (30.0,)  # batch ready -> last bucket: the end of local backward
    assert s.data_ms == (2.0,)
    assert s.wait_ms == (5.0,)
    assert s.rank_step_ms == (38.0,)  # previous step's end -> this step's end
    assert s.gap_ms == (3.0,)  # previous collective completion -> batch ready (optimizer + input)
    assert s.buckets == 2
    assert summaries(window)[0].warmup and not summaries(window)[1].warmup


def test_grad_ready_path_measures_the_same_durations_without_buckets():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=2, warmup_steps=0), None, 0, 1, clock)
    for step in range(3):
        pacer.begin_step(step)
        clock.advance(10.0)  # forward and the first layers of backward
        pacer.enter_sync(bucketed=False)  # the step's first gradient
        clock.advance(20.0)  # the rest of backward: compute, not waiting
        pacer.arrive()  # the engine callback at the end of local backward
        clock.advance(5.0)
        pacer.sync_done()  # after DDP waited for every bucket
        clock.advance(1.0)
        window = pacer.end_step()
    assert window is not None
    s = summaries(window)[0]
    assert s.valid and s.compute_ms == (30.0,) and s.wait_ms == (5.0,) and s.buckets == 0


def test_the_delay_at_the_first_gradient_is_neither_compute_nor_wait():
    clock = ManualClock()
    cfg = PacingConfig(mode="forced", exchange_every_steps=2, warmup_steps=0)
    pacer = Pacer(cfg, None, 0, 1, clock)
    pacer._delay_ms = 4.0  # one rank has no lead: give it a delay directly
    for step in range(3):
        pacer.begin_step(step)
        clock.advance(10.0)
        pacer.enter_sync(bucketed=False)  # held 4 ms here, before any bucket can launch
        clock.advance(20.0)
        pacer.arrive()
        clock.advance(5.0)
        pacer.sync_done()
        window = pacer.end_step()
    assert clock.delays_ms == [4.0, 4.0, 4.0]
    s = summaries(window)[0]
    assert s.compute_ms == (30.0,) and s.wait_ms == (5.0,) and s.delay_ms == (4.0,)


def test_without_an_arrival_mark_the_first_gradient_stands_in():
    # A caller that never reports the end of backward (FSDP's collectives, an older adapter): the
    # arrival is the first gradient, after the delay, as in run-record schema version 1.
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=2, warmup_steps=0), None, 0, 1, clock)
    for step in range(3):
        pacer.begin_step(step)
        clock.advance(10.0)
        pacer.enter_sync(bucketed=False)
        assert pacer.progress % 3 == 1  # not arrived yet: the watchdog sees a rank in its step
        clock.advance(20.0)
        pacer.sync_done()
        window = pacer.end_step()
    s = summaries(window)[0]
    assert s.compute_ms == (10.0,) and s.wait_ms == (20.0,)


def test_forced_mode_applies_the_delay_before_the_first_bucket_only():
    clock = ManualClock()
    cfg = PacingConfig(mode="forced", exchange_every_steps=2, warmup_steps=0)
    pacer = Pacer(cfg, None, 0, 1, clock)
    # A single rank has no lead, so give the policy a delay directly: no delay is ever computed.
    for s in range(4):
        run_step(pacer, clock, s)
    assert clock.delays_ms == []  # one rank: nothing to pace
    pacer._delay_ms = 3.0
    run_step(pacer, clock, 4)
    assert clock.delays_ms == [3.0]


def test_flush_exchanges_a_partial_window():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=10, warmup_steps=0), None, 0, 1, clock)
    for s in range(3):
        assert run_step(pacer, clock, s) is None
    results = pacer.flush()
    assert [len(summaries(r)) for r in results] == [3]
    assert [s.step for s in summaries(results[0])] == [0, 1, 2]
    assert pacer.flush() == []


def test_a_step_without_the_sync_point_is_marked_invalid():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=1, warmup_steps=0), None, 0, 1, clock)
    pacer.begin_step(0)
    clock.advance(5.0)
    pacer.end_step()
    (result,) = pacer.flush()
    assert not summaries(result)[0].valid
    assert result.stats.steps == 0


def test_fsdp_collectives_sum_their_blocked_time_and_the_first_one_is_paced():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=1, warmup_steps=0), None, 0, 1, clock)
    assert pacer.enter_collective() is None  # outside a step (validation): not timed, not delayed
    pacer._delay_ms = 4.0
    pacer.begin_step(0)
    # forward all-gather (blocked 3 ms), 10 ms of compute, reduce-scatter (blocked 2 ms)
    clock.advance(1.0)
    first = pacer.enter_collective()
    assert clock.delays_ms == [4.0]  # the delay goes before the step's first collective only
    clock.advance(3.0)
    pacer.exit_collective(first)
    clock.advance(10.0)
    second = pacer.enter_collective()
    clock.advance(2.0)
    pacer.exit_collective(second)
    assert clock.delays_ms == [4.0]
    clock.advance(1.0)
    pacer.end_step()
    (window,) = pacer.flush()
    s = summaries(window)[0]
    assert s.wait_ms == (5.0,)  # 3 + 2: time blocked in collectives, not the span between them
    assert s.compute_ms == (11.0,)  # 1 + 10: batch ready -> last collective done, less waits and delay
    assert s.delay_ms == (4.0,) and s.buckets == 2


class _OversleepingClock(ManualClock):
    """A clock whose delay runs 50% long (a host sleep that oversleeps, a device spin whose SM clock
    dropped) and that can be corrected, like the CUDA spin, from what the Pacer measures."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[tuple[float, float]] = []

    def delay(self, ms: float) -> None:
        super().delay(1.5 * ms)

    def observe_delay(self, requested_ms: float, measured_ms: float) -> None:
        self.observed.append((requested_ms, measured_ms))


def test_the_record_holds_the_delay_as_measured_not_as_requested():
    clock = _OversleepingClock()
    pacer = Pacer(PacingConfig(mode="forced", exchange_every_steps=2, warmup_steps=0), None, 0, 1, clock)
    pacer._delay_ms = 4.0
    for step in range(3):
        pacer.begin_step(step)
        clock.advance(10.0)
        pacer.enter_sync(bucketed=False)
        clock.advance(20.0)
        pacer.arrive()
        clock.advance(5.0)
        pacer.sync_done()
        window = pacer.end_step()
    s = summaries(window)[0]
    assert s.delay_ms == (6.0,) and s.compute_ms == (30.0,)  # the 6 ms it took, not the 4 asked
    assert clock.observed[:2] == [(4.0, 6.0), (4.0, 6.0)]  # the clock can correct its spin


def test_a_clock_that_resolves_two_steps_behind_still_exchanges_whole_windows():
    class LaggingClock(ManualClock):
        resolve_lag_steps = 2  # as CudaEventClock: the newest two steps stay unresolved

    clock = LaggingClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=4, warmup_steps=0), None, 0, 1, clock)
    windows = [w for w in (run_step(pacer, clock, s) for s in range(12)) if w is not None]
    assert [w.gathered.shape[1] for w in windows] == [4, 4]  # same shape on every rank, every window
    assert [int(w.gathered[0, 0, 0]) for w in windows] == [0, 4]


def test_the_cuda_spin_rescales_from_measured_delays_without_a_host_sync():
    import threading

    from pace_strategy.core.clock import CudaEventClock

    clock = CudaEventClock.__new__(CudaEventClock)  # the arithmetic only: no device here
    clock._lock, clock._cycles_per_ms = threading.Lock(), 1000.0
    clock.observe_delay(4.0, 4.2)  # 5% off: within the drift allowed, left alone
    assert clock._cycles_per_ms == 1000.0
    clock.observe_delay(4.0, 5.0)  # the spin ran 25% long (SM clocks dropped): fewer cycles per ms
    assert clock._cycles_per_ms == 800.0


def _framework_sync_rank(before_gather_ms, gather_ms, steps=3):
    """One rank's window: ``before_gather_ms`` of its own work after each step, then a framework
    collective outside the gradient sync (the HF Trainer's pre-step gather) that it is blocked in for
    ``gather_ms``, then the step: 30 ms to the end of backward, 1 ms gradient wait, 2 ms optimizer."""
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=steps, warmup_steps=0), None, 0, 1, clock)
    window = None
    for step in range(steps + 1):
        clock.advance(before_gather_ms)
        start = pacer.enter_framework_sync()
        clock.advance(gather_ms)
        pacer.exit_framework_sync(start)  # before begin_step: the next step's, taken from its gap
        pacer.begin_step(step)
        clock.advance(10.0)
        pacer.enter_sync(bucketed=False)
        clock.advance(20.0)
        pacer.arrive()
        clock.advance(1.0)
        pacer.sync_done()
        clock.advance(2.0)
        window = pacer.end_step() or window
    assert window is not None
    return window


def test_a_framework_collective_outside_the_gradient_sync_counts_as_wait():
    from pace_strategy.core.skew import window_stats

    early = _framework_sync_rank(before_gather_ms=3.0, gather_ms=25.0)  # waits for the late rank
    late = _framework_sync_rank(before_gather_ms=28.0, gather_ms=0.0)  # arrives last: no wait
    s = summaries(early)[1]
    assert s.wait_ms == (26.0,) and s.compute_ms == (30.0,)  # 25 at the gather + 1 at the gradients
    assert s.gap_ms == (5.0,) and s.opt_ms == (2.0,)  # the gather's 25 ms left the gap: own work
    assert s.rank_step_ms == (61.0,)
    assert summaries(late)[1].wait_ms == (1.0,) and summaries(late)[1].gap_ms == (30.0,)
    both = torch.cat([early.gathered, late.gathered])  # as the all-gather stacks the ranks
    stats = window_stats(0, both)
    assert stats.straggler_counts == (0, stats.steps)  # the late rank, wherever the barrier was
    assert stats.median_unpaced_skew_ms == 25.0
    assert float(stats.pacable_lead_ms.max()) == 0.0  # equal compute: nothing for pacing to take


def test_framework_collectives_inside_the_step_leave_compute_and_the_optimizer_time():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=1, warmup_steps=0), None, 0, 1, clock)
    windows = []
    for step in range(2):
        pacer.begin_step(step)
        clock.advance(5.0)
        start = pacer.enter_framework_sync()  # in the step, before the first gradient
        clock.advance(7.0)
        pacer.exit_framework_sync(start)
        clock.advance(5.0)
        pacer.enter_sync(bucketed=False)
        clock.advance(20.0)
        pacer.arrive()
        clock.advance(1.0)
        pacer.sync_done()
        start = pacer.enter_framework_sync()  # after the gradient sync (a stop-flag broadcast)
        clock.advance(4.0)
        pacer.exit_framework_sync(start)
        clock.advance(2.0)
        windows.append(pacer.end_step())
    s = summaries(windows[-1])[0]
    assert s.compute_ms == (30.0,) and s.wait_ms == (12.0,) and s.opt_ms == (2.0,)
