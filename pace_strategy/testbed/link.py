"""The test bed's user-space delay element: one process that forwards Ethernet frames between two TAP
devices, holding each frame for a seeded delay (plus jitter) and dropping a seeded share of them.

This kernel has no ``netem`` qdisc, so delay, jitter and loss cannot be put on a link with ``tc``.
The element stands in for a cable: the test bed replaces a veth pair with two TAP devices, each on
its own bridge, and this process carries the frames between them. ``tbf`` on the TAP devices still
rate-limits the link; the kernel applies it before a frame reaches this process (serialization),
and the delay here comes after it (propagation), as on a real link.

The schedule is a pure function of the seed and the frame's position in its direction: frame *k*
of a direction is dropped with probability ``loss`` and otherwise held ``delay_ms`` plus a normal
draw of standard deviation ``jitter_ms`` (truncated at zero). Frames never overtake each other (a
link is FIFO; reordering would make TCP retransmit, which is not what jitter means here), so a frame
is released no earlier than the one before it.

    python -m pace_strategy.testbed_link TAP_A TAP_B --a-to-b 5:1:0.001 --b-to-a 0 --seed 7

runs in the namespace that holds both TAP devices, prints ``ready`` once both are open, and runs
until killed (``SIGTERM``).
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pace_strategy.testbed.errors import TestbedSpecError

__all__ = ["Impairment", "LinkSchedule", "forward", "open_tap"]

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_MAX_FRAME = 65536


@dataclass(frozen=True)
class Impairment:
    """What one direction of a link does to frames: ``delay_ms`` (ms, >= 0), ``jitter_ms`` (ms, the
    standard deviation of a normal draw added to the delay, >= 0) and ``loss`` (share of frames
    dropped, 0..0.5)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not 0.0 <= value <= 10_000.0:
                raise TestbedSpecError(f"link {name}={value!r} is invalid: expected 0..10000 ms.")
        if not 0.0 <= self.loss <= 0.5:
            raise TestbedSpecError(f"link loss={self.loss!r} is invalid: expected a share in 0..0.5.")

    @property
    def is_identity(self) -> bool:
        return self.delay_ms == 0.0 and self.jitter_ms == 0.0 and self.loss == 0.0

    @classmethod
    def parse(cls, text: str) -> Impairment:
        """``MS[:JITTER_MS[:LOSS]]``, e.g. ``5``, ``5:1`` or ``5:1:0.001``."""
        parts = text.split(":")
        try:
            if not 1 <= len(parts) <= 3:
                raise ValueError
            values = [float(p) for p in parts]
        except ValueError:
            raise TestbedSpecError(
                f"link impairment {text!r} is invalid: expected MS[:JITTER_MS[:LOSS]], e.g. 5:1:0.001."
            ) from None
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.delay_ms:g}:{self.jitter_ms:g}:{self.loss:g}"


class LinkSchedule:
    """The seeded schedule of one direction: for each frame in arrival order, when it leaves (or
    that it is dropped). Deterministic in ``(impairment, seed)`` and the arrival times."""

    def __init__(self, impairment: Impairment, seed: int) -> None:
        self.impairment = impairment
        self._rng = random.Random(seed)
        self._last_release_s = 0.0

    def release_at(self, arrival_s: float) -> float | None:
        """The time (same clock as ``arrival_s``, seconds) the frame that arrived at ``arrival_s``
        is released, or ``None`` if it is dropped. Two draws per frame, always, so frame *k*'s fate
        does not depend on what happened to the frames before it."""
        imp = self.impairment
        lost = self._rng.random() < imp.loss
        noise = self._rng.gauss(0.0, 1.0)
        if lost:
            return None
        hold_ms = max(0.0, imp.delay_ms + imp.jitter_ms * noise)
        release = max(arrival_s + hold_ms / 1e3, self._last_release_s)  # FIFO: never overtake
        self._last_release_s = release
        return release


def open_tap(name: str) -> int:
    """Attach to the existing TAP device ``name`` (in this process's network namespace); returns
    a non-blocking file descriptor that reads and writes whole Ethernet frames."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(
    fd_a: int, fd_b: int, a_to_b: LinkSchedule, b_to_a: LinkSchedule, *, stop: list[bool] | None = None
) -> dict[str, int]:
    """Carry frames both ways until ``stop[0]`` is set; returns frame counts (forwarded, dropped)."""
    stop = stop if stop is not None else [False]
    counts = {"a_to_b": 0, "b_to_a": 0, "dropped": 0}
    pending: list[tuple[float, int, int, bytes]] = []  # (release time, sequence, out fd, frame)
    route = {fd_a: (fd_b, a_to_b, "a_to_b"), fd_b: (fd_a, b_to_a, "b_to_a")}
    seq = 0
    while not stop[0]:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, out, frame = heapq.heappop(pending)
            try:
                os.write(out, frame)
            except OSError:  # the kernel's queue is full or the device went down: the frame is lost
                counts["dropped"] += 1
        timeout = max(0.0, pending[0][0] - now) if pending else 0.2
        try:
            ready, _, _ = select.select([fd_a, fd_b], [], [], timeout)
        except InterruptedError:
            continue
        for fd in ready:
            out, schedule, name = route[fd]
            for _ in range(64):  # drain a burst without going back to select for every frame
                try:
                    frame = os.read(fd, _MAX_FRAME)
                except BlockingIOError:
                    break
                release = schedule.release_at(time.monotonic())
                if release is None:
                    counts["dropped"] += 1
                    continue
                counts[name] += 1
                seq += 1
                heapq.heappush(pending, (release, seq, out, frame))
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pace_strategy.testbed.link", description=__doc__)
    p.add_argument("tap_a")
    p.add_argument("tap_b")
    p.add_argument("--a-to-b", type=Impairment.parse, default=Impairment(), metavar="MS[:JITTER[:LOSS]]")
    p.add_argument("--b-to-a", type=Impairment.parse, default=Impairment(), metavar="MS[:JITTER[:LOSS]]")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    stop = [False]

    def _stop(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    fd_a, fd_b = open_tap(args.tap_a), open_tap(args.tap_b)
    # Each direction its own stream of draws: one direction's traffic never shifts the other's schedule.
    schedules = LinkSchedule(args.a_to_b, args.seed * 2), LinkSchedule(args.b_to_a, args.seed * 2 + 1)
    print("ready", flush=True)
    counts = forward(fd_a, fd_b, *schedules, stop=stop)
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
