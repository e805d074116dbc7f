"""Deterministic straggler injection for demos, tests and benchmarks (framework-agnostic, stdlib only).

A :class:`Straggler` says which rank is slowed, by how much and how often; the delay for a given
(rank, step) is a pure function of its fields and the seed, so every run replays the same schedule.
The delay is a sleep: it models accelerator or input time without stealing the host's CPU from the
other ranks (a busy-spin straggler on a small machine slows everyone).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pace_strategy.core.errors import PacingConfigError

__all__ = ["Straggler", "injected_delay_ms", "parse_stragglers", "sleep_injected"]


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """Slow one rank down.

    Args:
        rank: global rank to slow down.
        delay_ms: added compute time per affected step, milliseconds.
        probability: chance that a given step is affected (1.0: every step, a persistent straggler).
        jitter_ms: uniform +/- spread added to ``delay_ms`` on affected steps.
        start_step: first step affected.
        seed: seed of the per-step draws.
    """

    rank: int
    delay_ms: float
    probability: float = 1.0
    jitter_ms: float = 0.0
    start_step: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PacingConfigError(f"Straggler.rank={self.rank!r} is invalid: expected a rank >= 0.")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise PacingConfigError(
                f"Straggler delay_ms={self.delay_ms!r}, jitter_ms={self.jitter_ms!r}: both must be >= 0."
            )
        if not 0.0 <= self.probability <= 1.0:
            raise PacingConfigError(f"Straggler.probability={self.probability!r}: expected 0 <= p <= 1.")

    def delay_at(self, rank: int, step: int) -> float:
        """Milliseconds this injection adds to ``rank`` at ``step`` (deterministic)."""
        if rank != self.rank or step < self.start_step:
            return 0.0
        if self.probability >= 1.0 and self.jitter_ms == 0.0:
            return self.delay_ms
        rng = random.Random(f"{self.seed}:{rank}:{step}")
        if rng.random() >= self.probability:
            return 0.0
        return max(0.0, self.delay_ms + rng.uniform(-self.jitter_ms, self.jitter_ms))


def injected_delay_ms(stragglers: Iterable[Straggler], rank: int, step: int) -> float:
    """Total injected delay for ``rank`` at ``step``."""
    return sum(s.delay_at(rank, step) for s in stragglers)


def sleep_injected(stragglers: Iterable[Straggler], rank: int, step: int) -> float:
    """Sleep for the injected delay; returns the milliseconds slept."""
    ms = injected_delay_ms(stragglers, rank, step)
    if ms > 0:
        time.sleep(ms / 1e3)
    return ms


def parse_stragglers(spec: str) -> list[Straggler]:
    """Parse ``"RANK:MS[:PROB]"`` items separated by commas, e.g. ``"1:40"`` or ``"2:30:0.2,3:10"``."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise PacingConfigError(
                f"straggler spec {item!r} is invalid: expected RANK:MS or RANK:MS:PROBABILITY, e.g. '1:40'."
            )
        try:
            rank, ms = int(parts[0]), float(parts[1])
            prob = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError as error:
            raise PacingConfigError(f"straggler spec {item!r} is invalid: {error}") from error
        out.append(Straggler(rank=rank, delay_ms=ms, probability=prob))
    return out
