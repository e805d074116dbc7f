"""Clocks that mark moments on one rank and measure durations between them (host time or CUDA events)."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["DELAY_DRIFT_FRACTION", "Clock", "CudaEventClock", "HostClock", "ManualClock", "clock_for_device"]

#: a measured pacing delay this far (as a fraction) from the requested one recalibrates the device spin
DELAY_DRIFT_FRACTION = 0.1


@runtime_checkable
class Clock(Protocol):
    """Marks moments and measures durations on one rank; no value is ever compared across ranks.

    ``mark()`` must be cheap (it runs in the DDP comm hook). ``elapsed_ms(a, b)`` may block until both
    marks have happened (CUDA) and is only called when a window of steps is resolved. ``ready(m)``
    never blocks: whether mark ``m`` has happened. A shutdown path (SIGTERM, a hang) resolves only
    steps whose marks are all ready: a peer may die inside a collective, and a mark queued behind it
    would then never complete.
    """

    #: How many of the most recent steps must stay unresolved at a window boundary. CUDA marks are
    #: recorded asynchronously; resolving the newest step would stall the host on the device.
    resolve_lag_steps: int

    #: Whether marks are host times, so that marks around a blocking call bracket the time the rank
    #: was blocked in it (``True``). ``False``: marks are taken on the device's current stream, and a
    #: collective issued on a side stream (FSDP2) is timed where the compute stream waits for it.
    host_time: bool

    def mark(self) -> Any: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def delay(self, ms: float) -> None: ...

    def now_s(self) -> float: ...

    def ready(self, mark: Any) -> bool: ...


class HostClock:
    """Monotonic host time (``time.perf_counter_ns``); the right clock for CPU / gloo training."""

    resolve_lag_steps = 0
    host_time = True

    def mark(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def delay(self, ms: float) -> None:
        if ms > 0:
            # time.sleep releases the GIL: gloo and other ranks' threads keep running meanwhile.
            time.sleep(ms / 1e3)

    def now_s(self) -> float:
        return time.monotonic()

    def ready(self, mark: int) -> bool:
        return True  # a host time is taken when it happens


class CudaEventClock:
    """CUDA events on the current stream: NCCL returns before the transfer happens, so host timestamps
    are meaningless on GPU; events measure when the stream actually reached each point.

    ``delay`` enqueues a device-side spin (``torch.cuda._sleep``) so that the *stream* enters the
    collective later; a host sleep would only delay the enqueue, which usually runs ahead of the device.
    The spin's cycles per millisecond are measured by :meth:`calibrate` (the session calls it at start,
    on the session's device, not inside a measured step) and corrected without a host sync from every
    delay the Pacer measures afterwards (:meth:`observe_delay`): SM clocks move with boost and power caps.

    ``resolve_lag_steps`` is 2: a window is resolved two steps behind the newest, so reading its events
    does not wait for the step just enqueued; the host keeps its run-ahead of the device.
    """

    resolve_lag_steps = 2
    host_time = False

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaEventClock needs a CUDA device, got {device!s}")
        self.device = device
        self._cycles_per_ms: float | None = None
        self._lock = threading.Lock()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))

    def ready(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())  # never waits: the stream may be stuck behind a dead peer's collective

    def delay(self, ms: float) -> None:
        if ms <= 0:
            return
        cycles = int(ms * self._calibrate())
        with torch.cuda.device(self.device):
            torch.cuda._sleep(cycles)

    def now_s(self) -> float:
        return time.monotonic()

    def calibrate(self) -> float:
        """Measure the spin kernel's cycles per millisecond on this clock's device (a host sync: call it
        at start, not in a step). Returns them."""
        with self._lock, torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            probe_cycles = 1_000_000
            torch.cuda._sleep(probe_cycles)  # warm the kernel up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            torch.cuda._sleep(probe_cycles)
            end.record(stream)
            end.synchronize()
            elapsed = max(float(start.elapsed_time(end)), 1e-3)
            self._cycles_per_ms = probe_cycles / elapsed
            return self._cycles_per_ms

    def observe_delay(self, requested_ms: float, measured_ms: float) -> None:
        """A delay of ``requested_ms`` measured ``measured_ms`` (events around the spin): rescale the
        cycles per millisecond when they drift by more than 10%, with no host sync."""
        with self._lock:
            if self._cycles_per_ms is None or requested_ms <= 0 or measured_ms <= 0:
                return
            ratio = requested_ms / measured_ms
            if abs(ratio - 1.0) > DELAY_DRIFT_FRACTION:
                self._cycles_per_ms *= ratio

    def _calibrate(self) -> float:
        """The cycles per millisecond, measured now if the session did not (a clock used alone)."""
        return self._cycles_per_ms if self._cycles_per_ms is not None else self.calibrate()


class ManualClock:
    """A clock that only moves when told to: deterministic time for unit tests of the Pacer.

    ``delay`` advances the clock, as if the rank slept. ``host_time=False`` stands for a device clock
    (synthetic stream marks, to test the arithmetic of the device model without a device).
    """

    resolve_lag_steps = 0

    def __init__(self, start_ms: float = 0.0, *, host_time: bool = True) -> None:
        self.host_time = host_time
        self.now_ms = start_ms
        self.delays_ms: list[float] = []

    def advance(self, ms: float) -> None:
        self.now_ms += ms

    def mark(self) -> float:
        return self.now_ms

    def elapsed_ms(self, start: float, end: float) -> float:
        return end - start

    def delay(self, ms: float) -> None:
        self.delays_ms.append(ms)
        self.now_ms += max(ms, 0.0)

    def now_s(self) -> float:
        return self.now_ms / 1e3

    def ready(self, mark: float) -> bool:
        return True


def clock_for_device(device: torch.device) -> Clock:
    """The clock that measures correctly on ``device``: CUDA events on GPU, host time otherwise."""
    if device.type == "cuda":
        return CudaEventClock(device)
    return HostClock()
