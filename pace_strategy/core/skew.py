"""Skew math of the glossary, vectorized over one gathered window of per-rank step records.

The formulas themselves live in :mod:`pace_strategy.core.glossary`; here they are applied with ranks on
dim 0 of torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    "ranks_last",
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


def kth_smallest(rows: torch.Tensor | np.ndarray, k: int) -> torch.Tensor:
    """Each row's ``k``-th smallest value (from 0), NaN where the row has a NaN (as
    ``rows.median(dim=1)`` gives at ``k = (n - 1) // 2``; a row without NaN: ``rows.kthvalue(k + 1,
    dim=1)``), by numpy's partition, several times faster than torch's (an 8,192 x 32 window on one
    thread: 0.7 ms instead of 3.6)."""
    values = rows if isinstance(rows, np.ndarray) else rows.detach().cpu().numpy()
    kth = np.partition(values, k, axis=1)[:, k]
    return torch.from_numpy(np.where(np.isnan(values).any(axis=1), np.nan, kth))


#: numbers a block of :func:`ranks_last` copies at once: 256 KB of float64, which stays in a core's
#: cache while it is written
_TRANSPOSE_BLOCK = 32_768


def ranks_last(values: torch.Tensor) -> np.ndarray:
    """A ``[ranks, steps]`` field of a window as a contiguous ``[steps, ranks]`` numpy array: each
    step's ranks adjacent, so that reductions over the ranks run along rows.

    Reductions over the ranks of a ``[ranks, steps]`` view (a window's field) are fine for min and max
    (0.2 ms at 8,192 x 32 on one thread) but not for an arg-min, arg-max or partition, which walk
    each step's ranks 32 numbers apart: torch's ``argmin(dim=0)`` takes 1.7 ms there, and one
    transposed copy 2.2 ms (every number of a step on its own cache line). Copied here a block of
    ranks at a time (0.6 ms), after which numpy's ``argmin(axis=1)`` takes 0.04 ms and a median's
    partition 0.45 ms. Arg-min and arg-max give the same index as torch's over the ranks (the first
    on a tie, the first NaN where there is one)."""
    source = values.detach().cpu().numpy()
    ranks, steps = source.shape
    out = np.empty((steps, ranks), dtype=source.dtype)
    block = max(1, _TRANSPOSE_BLOCK // max(steps, 1))
    for first in range(0, ranks, block):
        out[:, first : first + block] = source[first : first + block].T
    return out


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
    return _pacable_lead(wait_ms + delay_ms, compute_ms)


def _pacable_lead(unpaced_wait_ms: torch.Tensor, compute_ms: torch.Tensor) -> torch.Tensor:
    """:func:`pacable_lead` from the unpaced waits (``wait + delay``), which the window statistics
    form once for the skew as well."""
    wait_lead = lead(unpaced_wait_ms)
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
    #: ``[window steps]`` bool, which of the window's steps are usable (:func:`usable_steps`), for
    #: whatever else reads the same window (rebalancing's measure); ``None``: not computed
    usable: torch.Tensor | None = None

    #: :attr:`lead_spread` once taken (set once, by whoever reads it first)
    _lead_spread: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def lead_spread(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per rank ``[world_size]``, ms: the median of its pacable lead over the usable steps (torch's
        ``median(dim=1)``: the lower middle value of an even count) and the lead's population
        standard deviation (its noise; zeros with fewer than two steps), what the pacing policy sizes
        delays from. Taken once, on first use: a Pacer takes it on its window side thread
        (:mod:`pace_strategy.core.pacer`), off the training thread (3.6 ms at 8,192 ranks). (Not a
        ``functools.cached_property``: before Python 3.12 that holds one lock for every instance.)"""
        if self._lead_spread is None:
            leads = self.pacable_lead_ms
            median = kth_smallest(leads, (leads.shape[1] - 1) // 2)
            noise = leads.std(dim=1, correction=0) if leads.shape[1] > 1 else torch.zeros_like(median)
            object.__setattr__(self, "_lead_spread", (median, noise))  # frozen: set once
        assert self._lead_spread is not None
        return self._lead_spread

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
            usable=usable,
        )
    wait = usable_field(gathered, usable, Field.WAIT_MS)
    delay = usable_field(gathered, usable, Field.DELAY_MS)
    compute = usable_field(gathered, usable, Field.COMPUTE_MS)
    step_ms = usable_field(gathered, usable, Field.STEP_MS).amax(dim=0)
    unpaced = wait + delay
    unpaced_skew = skew(unpaced)
    # each step's straggler over its ranks side by side (``ranks_last``: a third of the time)
    straggler = torch.from_numpy(glossary.straggler_rank(ranks_last(wait), rank_axis=1))
    stragglers = torch.bincount(straggler, minlength=world_size)
    return WindowStats(
        window=window,
        world_size=world_size,
        steps=steps,
        median_step_ms=float(step_ms.median()),
        median_unpaced_skew_ms=float(unpaced_skew.median()),
        pacable_lead_ms=_pacable_lead(unpaced, compute),
        straggler_counts=tuple(stragglers.tolist()),  # int64: Python ints already
        usable=usable,
    )
