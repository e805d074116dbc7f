"""``HOST_BOUND``: whether the host was the bottleneck of a step (the device had reached the rank's
arrival when the host ended the step), read without waiting; recorded sparsely; read back by the
diagnosis. A clock double whose marks complete only when told stands for the device."""

from __future__ import annotations

import torch

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import Field
from pace_strategy.core.summary import StepSummarizer
from pace_strategy.telemetry.arrays import load_arrays
from pace_strategy.telemetry.run_record import RunRecordWriter, read_run_record


class _LaggingDevice(ManualClock):
    """Device marks: a mark has happened only once the test says the device got there."""

    def __init__(self) -> None:
        super().__init__(host_time=False)
        self.reached = -1.0  # every mark at or before this time has happened

    def ready(self, mark: float) -> bool:
        return mark <= self.reached


def _step(pacer: Pacer, clock: _LaggingDevice, step: int, device_caught_up: bool) -> None:
    pacer.begin_step(step)
    clock.advance(5.0)
    pacer.enter_sync(bucketed=False)
    clock.advance(5.0)
    pacer.arrive()
    clock.advance(2.0)
    pacer.sync_done()
    if device_caught_up:
        clock.reached = clock.now_ms  # the device idles, waiting for the host
    clock.advance(1.0)
    pacer.end_step()


def test_a_step_is_host_bound_only_when_the_device_had_reached_the_arrival():
    clock = _LaggingDevice()
    pacer = Pacer(PacingConfig(exchange_every_steps=4, warmup_steps=0), None, 0, 1, clock)
    for step, caught_up in enumerate((True, False, True, False)):
        _step(pacer, clock, step, caught_up)
    clock.reached = float("inf")  # the device finishes: the window resolves
    (window,) = pacer.flush()
    assert window.gathered[0, :, Field.HOST_BOUND].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert window.gathered[0, :, Field.MEM_PEAK].tolist() == [0.0] * 4  # no memory probe: CPU
    summaries = StepSummarizer(8).summarize(window.gathered)
    assert [s.host_bound for s in summaries] == [(1,), (0,), (1,), (0,)]


def test_a_host_clock_is_always_host_bound_and_the_memory_probe_is_read():
    clock = ManualClock()
    pacer = Pacer(
        PacingConfig(exchange_every_steps=2, warmup_steps=0), None, 0, 1, clock, memory_probe=lambda: 0.25
    )
    for step in range(2):
        pacer.begin_step(step)
        pacer.enter_sync(bucketed=False)
        clock.advance(3.0)
        pacer.sync_done()
        pacer.end_step()
    (window,) = pacer.flush()
    assert window.gathered[0, :, Field.HOST_BOUND].tolist() == [1.0, 1.0]
    assert window.gathered[0, :, Field.MEM_PEAK].tolist() == [0.25, 0.25]


def test_the_record_writes_host_bound_only_where_a_device_lagged_and_reads_it_back(tmp_path):
    g = torch.zeros(2, 3, len(Field), dtype=torch.float64)
    g[:, :, Field.STEP] = torch.arange(3, dtype=torch.float64)
    g[:, :, Field.VALID] = 1.0
    g[:, :, Field.COMPUTE_MS] = 10.0
    g[:, :, Field.STEP_MS] = 12.0
    g[:, :, Field.WAIT_MS] = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    g[:, :, Field.HOST_BOUND] = 1.0
    g[1, 1, Field.HOST_BOUND] = 0.0  # step 1: rank 1's device was still behind its host
    path = tmp_path / "pace_run.jsonl"
    topology = [{"rank": r} for r in range(2)]
    writer = RunRecordWriter(path, world_size=2, config={}, topology=topology, framework="test")
    writer.write_window(StepSummarizer(8).summarize(g), None)
    writer.close("completed")
    record = read_run_record(tmp_path)
    assert ["host_bound" in s["ranks"] for s in record.steps] == [False, True, False]
    assert record.steps[1]["ranks"]["host_bound"] == [1, 0]
    a = load_arrays(tmp_path)
    assert a.host_bound is not None and a.host_bound.tolist() == [[True, True], [True, False], [True, True]]
