"""Deterministic straggler injection for demos, tests and benchmarks (framework-agnostic, stdlib only).

A :class:`Straggler` says which rank is slowed, by how much and how often; the delay for a given
(rank, step) is a pure function of its fields and the seed, so every run replays the same schedule.
Where the time goes is the straggler's ``phase``: at the start of the step (``"step"``, before the
forward; isolates the mechanism), inside backward (``"backward"``: what a real model's slow rank does,
where most of its compute is), or split between forward and backward (``"forward_backward"``). The
backward phases are applied by :class:`~pace_strategy.testing.slow.InjectionPoint`, a parameter-free
module the model calls at some depth. The delay is a sleep (accelerator time, without stealing the
host's CPU from the other ranks) or, with ``spin``, real CPU work for that long.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pace_strategy.core.errors import PacingConfigError

__all__ = [
    "PHASES",
    "Straggler",
    "batch_samples",
    "injected_delay_ms",
    "parse_slow_devices",
    "parse_stragglers",
    "sleep_injected",
    "spend_ms",
]


#: where a straggler's time is spent in the step
PHASES = ("step", "backward", "forward_backward")


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """Slow one rank down.

    Args:
        rank: global rank to slow down.
        delay_ms: added compute time per affected step, milliseconds.
        per_sample_ms: added compute time per sample of the affected step's batch, milliseconds: a
            slow device, whose extra time scales with its share of the batch (what rebalancing can
            shorten; a fixed ``delay_ms`` it cannot).
        probability: chance that a given step is affected (1.0: every step, a persistent straggler).
        jitter_ms: uniform +/- spread added to ``delay_ms`` on affected steps.
        start_step: first step affected.
        stop_step: first step no longer affected (``None``: to the end): with ``start_step``, a
            straggler episode.
        seed: seed of the per-step draws.
        phase: where the time goes: ``"step"`` (before the forward), ``"backward"`` (inside
            backward, at the model's injection point), ``"forward_backward"`` (half in the forward
            and half in the backward at the injection point).
        spin: real CPU work instead of a sleep (a host that is slow itself; on a small machine it
            also takes CPU from the other ranks).
    """

    rank: int
    delay_ms: float
    per_sample_ms: float = 0.0
    probability: float = 1.0
    jitter_ms: float = 0.0
    start_step: int = 0
    stop_step: int | None = None
    seed: int = 0
    phase: str = "step"
    spin: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise PacingConfigError(
                f"Straggler.phase={self.phase!r} is invalid: expected one of {', '.join(PHASES)}."
            )
        if self.rank < 0:
            raise PacingConfigError(f"Straggler.rank={self.rank!r} is invalid: expected a rank >= 0.")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.per_sample_ms < 0:
            raise PacingConfigError(
                f"Straggler delay_ms={self.delay_ms!r}, jitter_ms={self.jitter_ms!r}, per_sample_ms="
                f"{self.per_sample_ms!r}: all must be >= 0."
            )
        if not 0.0 <= self.probability <= 1.0:
            raise PacingConfigError(f"Straggler.probability={self.probability!r}: expected 0 <= p <= 1.")

    def delay_at(self, rank: int, step: int, samples: int = 0) -> float:
        """Milliseconds this injection adds to ``rank`` at ``step`` whose batch has ``samples``
        samples (deterministic)."""
        if (
            rank != self.rank
            or step < self.start_step
            or (self.stop_step is not None and step >= self.stop_step)
        ):
            return 0.0
        base = self.delay_ms + self.per_sample_ms * samples
        if self.probability >= 1.0 and self.jitter_ms == 0.0:
            return base
        rng = random.Random(f"{self.seed}:{rank}:{step}")
        if rng.random() >= self.probability:
            return 0.0
        return max(0.0, base + rng.uniform(-self.jitter_ms, self.jitter_ms))


def injected_delay_ms(stragglers: Iterable[Straggler], rank: int, step: int, samples: int = 0) -> float:
    """Total injected delay for ``rank`` at ``step`` (a batch of ``samples`` samples)."""
    return sum(s.delay_at(rank, step, samples) for s in stragglers)


def sleep_injected(stragglers: Iterable[Straggler], rank: int, step: int, samples: int = 0) -> float:
    """Spend the injected delay of the ``"step"``-phase stragglers now (a sleep, or CPU work for
    ``spin`` ones); returns the milliseconds spent."""
    total = 0.0
    for s in stragglers:
        if s.phase == "step":
            ms = s.delay_at(rank, step, samples)
            spend_ms(ms, s.spin)
            total += ms
    return total


def spend_ms(ms: float, spin: bool = False) -> None:
    """Take ``ms`` milliseconds: a sleep, or with ``spin`` real CPU work (small matrix products,
    which release the GIL as real kernels do) until the time is up."""
    if ms <= 0:
        return
    if not spin:
        time.sleep(ms / 1e3)
        return
    import torch

    deadline = time.perf_counter() + ms / 1e3
    a = torch.ones(64, 64)
    while time.perf_counter() < deadline:
        a = torch.mm(a, a).clamp_(max=1.0)


def batch_samples(batch: object) -> int:
    """The samples of a batch: the length of its first tensor (a tensor, or a tuple, list or dict of
    them, as collated); 0 when it has none."""
    while isinstance(batch, (tuple, list, dict)) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else 0


def parse_slow_devices(spec: str, sample_ms: float) -> list[Straggler]:
    """Parse ``"RANK:FACTOR"`` items separated by commas (e.g. ``"1:2"``: rank 1 takes twice as long per
    sample) into per-sample stragglers on top of ``sample_ms`` per sample on every rank."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        rank_text, _, factor_text = item.partition(":")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise PacingConfigError(
                f"slow device spec {item!r} is invalid: expected RANK:FACTOR, e.g. '1:2' (rank 1 twice as "
                "slow per sample)."
            ) from None
        if factor < 1.0 or sample_ms <= 0:
            raise PacingConfigError(
                f"slow device spec {item!r}: FACTOR must be >= 1 and the per-sample time (--sample-ms) "
                f"> 0, got {factor!r} and {sample_ms!r}."
            )
        out.append(Straggler(rank=rank, delay_ms=0.0, per_sample_ms=sample_ms * (factor - 1.0)))
    return out


def parse_stragglers(spec: str) -> list[Straggler]:
    """Parse ``"RANK:MS[:PROB][@FIRST-LAST]"`` items separated by commas, e.g. ``"1:40"``,
    ``"2:30:0.2,3:10"`` or ``"1:30@100-180"`` (rank 1 30 ms slow in steps 100 to 180: an episode;
    ``@100-`` from step 100 to the end)."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        body, _, steps = item.partition("@")
        parts = body.split(":")
        if len(parts) not in (2, 3):
            raise PacingConfigError(
                f"straggler spec {item!r} is invalid: expected RANK:MS, RANK:MS:PROBABILITY or either with "
                "@FIRST-LAST steps, e.g. '1:40' or '1:40@100-180'."
            )
        try:
            rank, ms = int(parts[0]), float(parts[1])
            prob = float(parts[2]) if len(parts) == 3 else 1.0
            first_text, dash, last_text = steps.partition("-")
            if steps and not dash:
                raise ValueError(f"steps {steps!r}: expected FIRST-LAST or FIRST-")
            first = int(first_text) if steps else 0
            stop = int(last_text) + 1 if last_text else None
        except ValueError as error:
            raise PacingConfigError(f"straggler spec {item!r} is invalid: {error}") from error
        out.append(Straggler(rank=rank, delay_ms=ms, probability=prob, start_step=first, stop_step=stop))
    return out
