"""Skew math of the glossary, vectorized over one gathered window of per-rank step records.

The formulas themselves live in :mod:`pace_strategy.core.glossary`; here they are applied with ranks on
dim 0 of torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pace_strategy.core import glossary
from pace_strategy.core.glossary import coefficient_of_variation
from pace_strategy.core.records import Field

__all__ = [
    "WindowStats",
    "coefficient_of_variation",
    "kth_smallest",
    "lead",
    "pacable_lead",
    "skew",
    "usable_field",
    "usable_steps",
    "window_stats",
]


def usable_steps(gathered: torch.Tensor) -> torch.Tensor:
    """``[steps]`` bool: the steps of a gathered window that every rank saw valid and past warm-up.
    By each flag's extremes over the ranks: a comparison of every rank's flag, then ``all``, costs
    four times as much at 8,192 ranks; the flags are 0 or 1, and a NaN counts as not usable either way."""
    valid, warmup = gathered[:, :, Field.VALID], gathered[:, :, Field.WARMUP]
    return (valid.amin(dim=0) > 0) & (warmup.amax(dim=0) == 0) & (warmup.amin(dim=0) == 0)


def usable_field(gathered: torch.Tensor, usable: torch.Tensor, field: Field) -> torch.Tensor:
    """One field of a gathered window's ``usable`` steps (``[steps]`` bool), ``[world_size, usable
    steps]``: a view of the window when every step is usable (each rank's steps adjacent in the
    field-major window; a copy of 8,192 ranks' field cost 0.3 ms, ten per decision), else a copy of
    those steps. Copying every field of the usable steps to read a few of them moves all 17 (half a
    decision's time at 8,192 ranks); the values are the same either way."""
    values = gathered[:, :, field]
    return values if bool(usable.all()) else values[:, usable]


def kth_smallest(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k``-th smallest value (from 0), NaN where the row has a NaN (as
    ``rows.median(dim=1)`` gives at ``k = (n - 1) // 2``; a row without NaN: ``rows.kthvalue(k + 1,
    dim=1)``), by numpy's partition, several times faster than torch's (an 8,192 x 32 window on one
    thread: 0.7 ms instead of 3.6)."""
    values = rows.detach().cpu().numpy()
    kth = np.partition(values, k, axis=1)[:, k]
    return torch.from_numpy(np.where(np.isnan(values).any(axis=1), np.nan, kth))


def skew(wait_ms: torch.Tensor) -> torch.Tensor:
    """Latest minus earliest arrival per step: ``max(wait) - min(wait)`` over ranks (dim 0).

    Clock-free: the latest rank waits least and collectives complete at nearly the same time on all ranks.
    """
    return glossary.skew_ms(wait_ms, rank_axis=0)


def lead(wait_ms: torch.Tensor) -> torch.Tensor:
    """How early each rank arrived: ``wait_r - min(wait)`` (ranks on dim 0). The straggler has lead 0."""
    return glossary.lead_ms(wait_ms, rank_axis=0)


def pacable_lead(wait_ms: torch.Tensor, delay_ms: torch.Tensor, compute_ms: torch.Tensor) -> torch.Tensor:
    """The part of each rank's lead that pacing may remove, per rank and step (ranks on dim 0).

    Two clock-free signals must agree: the *unpaced* wait-based lead (the delay a rank was given is
    added back to its wait) and the compute-based lead (``max(compute) - compute_r``). On an asymmetric
    fabric a rank behind a slow path finishes the previous collective late, starts late and looks early
    or late by its waits although its compute is normal; taking the minimum of both never paces a rank
    for lateness that the network caused.
    """
    wait_lead = lead(wait_ms + delay_ms)
    compute_lead = compute_ms.amax(dim=0, keepdim=True) - compute_ms
    return torch.minimum(wait_lead, compute_lead).clamp_min(0.0)


@dataclass(frozen=True)
class WindowStats:
    """Statistics of one window's usable steps (valid and past warm-up), the controller's only input."""

    window: int
    world_size: int
    steps: int  #: usable steps in the window
    median_step_ms: float
    median_unpaced_skew_ms: float
    pacable_lead_ms: torch.Tensor  #: [world_size, steps] float64
    straggler_counts: tuple[int, ...]  #: how often each rank arrived last

    @property
    def skew_fraction(self) -> float:
        """Median unpaced skew relative to the median step time."""
        if self.median_step_ms <= 0.0:
            return 0.0
        return self.median_unpaced_skew_ms / self.median_step_ms


def window_stats(window: int, gathered: torch.Tensor) -> WindowStats:
    """Reduce a gathered window ``[world_size, steps, NUM_FIELDS]`` to the controller's statistics."""
    world_size = gathered.shape[0]
    usable = usable_steps(gathered)
    steps = int(usable.sum())
    if steps == 0:
        return WindowStats(
            window=window,
            world_size=world_size,
            steps=0,
            median_step_ms=0.0,
            median_unpaced_skew_ms=0.0,
            pacable_lead_ms=torch.zeros(world_size, 0, dtype=torch.float64),
            straggler_counts=(0,) * world_size,
        )
    wait = usable_field(gathered, usable, Field.WAIT_MS)
    delay = usable_field(gathered, usable, Field.DELAY_MS)
    compute = usable_field(gathered, usable, Field.COMPUTE_MS)
    step_ms = usable_field(gathered, usable, Field.STEP_MS).amax(dim=0)
    unpaced_skew = skew(wait + delay)
    stragglers = torch.bincount(glossary.straggler_rank(wait, rank_axis=0), minlength=world_size)
    return WindowStats(
        window=window,
        world_size=world_size,
        steps=steps,
        median_step_ms=float(step_ms.median()),
        median_unpaced_skew_ms=float(unpaced_skew.median()),
        pacable_lead_ms=pacable_lead(wait, delay, compute),
        straggler_counts=tuple(stragglers.tolist()),  # int64: Python ints already
    )
