"""FSDP2 on a device clock: the step's waits are the compute stream's, not the side streams' collective
calls (issue 30, item 2). The arithmetic with synthetic stream marks; the wiring on a real one-rank
FSDP2 model on CPU, with a clock double that says its marks are device marks."""

import pytest
import torch
import torch.distributed as dist

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.summary import StepSummarizer


def test_the_device_model_times_what_the_compute_stream_waited_for_and_keeps_the_delay_out():
    clock = ManualClock(host_time=False)  # one timeline for every stream: each mark set explicitly
    pacer = Pacer(PacingConfig(exchange_every_steps=1, warmup_steps=0), None, 0, 1, clock)
    pacer._delay_ms = 4.0

    def at(ms):
        clock.now_ms = ms

    at(0.0)
    pacer.begin_step(0)
    # root pre-forward: the first all-gather is issued on the all-gather stream at 1 ms, behind the
    # 4 ms spin (ready 1, released 5); it completes at 9 (a peer arrived late). The call's own marks
    # are side-stream marks: counted, not timed.
    at(1.0)
    first = pacer.enter_collective()
    assert clock.delays_ms == [4.0]
    pacer.exit_collective(first)
    # the compute stream reached FSDP's wait for it at 1 ms and resumed at 9: the delay is inside
    at(1.0)
    wait = pacer.enter_wait()
    at(9.0)
    pacer.exit_wait(wait)
    # forward 9 -> 19 with a prefetched all-gather issued at 12 on the side stream, done at 13, before
    # the compute stream waits for it at 14: no wait at all
    at(12.0)
    pacer.exit_collective(pacer.enter_collective())
    at(14.0)
    pacer.exit_wait(pacer.enter_wait())
    # backward 19 -> 39: a reduce-scatter issued at 30 on its own stream, whose post_backward held
    # the compute stream 0.5 ms for an older one (FSDP bounds the reduce-scatters in flight)
    at(30.0)
    pacer.exit_collective(pacer.enter_collective())
    wait = pacer.enter_wait()
    at(30.5)
    pacer.exit_wait(wait)
    # finalize_backward: the compute stream waits from 39 until the last reduce-scatter is done at 42
    at(39.0)
    wait = pacer.enter_wait()
    at(42.0)
    pacer.exit_wait(wait)
    at(43.0)  # optimizer step
    pacer.end_step()
    (window,) = pacer.flush()
    (s,) = StepSummarizer(PacingConfig().cv_window_steps).summarize(window.gathered)
    # waited: 8 (4 of it the delay) + 0 + 0.5 + 3 = 11.5; the delay is its own field, not waiting
    assert s.wait_ms == (pytest.approx(7.5),)
    # compute: begin -> completion (42) less every wait of the compute stream, the delay included
    assert s.compute_ms == (pytest.approx(30.5),)
    assert s.delay_ms == (pytest.approx(4.0),) and s.buckets == 3  # 3 collectives issued
    # the side-stream calls would have read 11 ms of "waiting" overlapping compute; none is counted
    assert pacer.clock_is_host_time is False


def test_a_host_clock_times_the_calls_and_ignores_the_wait_points():
    clock = ManualClock()
    pacer = Pacer(PacingConfig(exchange_every_steps=1, warmup_steps=0), None, 0, 1, clock)
    pacer.begin_step(0)
    assert pacer.enter_wait() is None  # the call itself was the wait on a host clock
    first = pacer.enter_collective()
    clock.advance(3.0)
    pacer.exit_collective(first)
    clock.advance(10.0)
    pacer.end_step()
    (window,) = pacer.flush()
    (s,) = StepSummarizer(PacingConfig().cv_window_steps).summarize(window.gathered)
    assert s.wait_ms == (3.0,) and s.compute_ms == (0.0,)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_fsdp2_wait_points_are_bracketed_on_a_device_clock_and_unbracketed_again():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pace_strategy.hooks.fsdp import (
        WAIT_METHODS,
        _param_group,
        _WaitBracket,
        register_paced_collectives,
        unregister_paced_collectives,
    )

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = [_param_group(m) for m in (model[0], model)]
    clock = ManualClock(host_time=False)
    pacer = Pacer(PacingConfig(warmup_steps=0), None, 0, 1, clock)
    assert register_paced_collectives(model, pacer) == 2
    assert register_paced_collectives(model, pacer) == 2  # idempotent: one bracket, not two
    for g in groups:
        brackets = [g.__dict__[name] for name in WAIT_METHODS]
        assert all(isinstance(b, _WaitBracket) and not isinstance(b.method, _WaitBracket) for b in brackets)
    pacer.begin_step(0)
    model(torch.ones(3, 4)).sum().backward()
    waits = len(pacer._open.collectives)
    # each group waits before its forward and in its post-backward; the root finalizes every group
    assert waits >= 2 * len(groups) + len(groups), waits
    pacer.end_step()
    assert unregister_paced_collectives(model) == 2
    assert all(name not in g.__dict__ for g in groups for name in WAIT_METHODS)
    # host clocks leave FSDP's methods alone, and take back the brackets of an earlier device pacer
    host = Pacer(PacingConfig(warmup_steps=0), None, 0, 1, ManualClock())
    register_paced_collectives(model, pacer)
    register_paced_collectives(model, host)
    assert all(name not in g.__dict__ for g in groups for name in WAIT_METHODS)
    unregister_paced_collectives(model)
