"""The noise floor: how much waiting a run's own ordinary jitter explains at its number of ranks.

Every synchronous run waits a little: in each step the barrier waits for the slowest of W ranks, and
even identical ranks differ by their jitter. For W ranks whose arrivals scatter like a normal
distribution of standard deviation sigma, the mean lead over ranks is the expected maximum minus
the mean, ``sigma * e_W`` with ``e_W = E[max of W standard normals]`` (0.56 at 2 ranks, 1.03 at 4,
2.40 at 64). sigma is estimated robustly (the median absolute deviation of each rank's arrival
around its own typical lateness), so that the bulk of the jitter sets it and transient stragglers,
the tail, do not: waiting beyond the floor comes from something a user can act on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from pace_strategy.telemetry.arrays import RANK_AXIS

__all__ = ["JitterFloor", "expected_max_normal", "jitter_floor"]

#: MAD -> standard deviation of a normal distribution
_MAD_TO_SD = 1.4826
#: ranks whose median over the steps is taken at a time (a [steps, 128] copy: 20 MB at 20,000 steps)
_COLUMNS = 128
#: integration grid of the order statistic, in standard deviations
_GRID = np.linspace(-9.0, 9.0, 3601)


@functools.lru_cache(maxsize=64)
def expected_max_normal(ranks: int) -> float:
    """``E[max]`` of ``ranks`` independent standard normal draws (0 for one rank).

    Integrates ``x * W phi(x) Phi(x)^(W-1)``; exact to ~1e-6 for W up to millions.
    """
    if ranks <= 1:
        return 0.0
    x = _GRID
    cdf = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    density = ranks * pdf * np.power(cdf, ranks - 1)
    return float(np.trapezoid(x * density, x))


@dataclass(frozen=True)
class JitterFloor:
    """What the run's ordinary jitter costs at its size."""

    ranks: int
    sigma_ms: float  #: robust standard deviation of a rank's arrival, ms
    expected_lead_ms: float  #: sigma * e_W: mean lead over ranks that this jitter alone gives
    mean_step_ms: float

    @property
    def fraction(self) -> float:
        """Share of step time this jitter alone spends waiting (the noise floor, before any margin)."""
        return self.expected_lead_ms / self.mean_step_ms if self.mean_step_ms > 0 else 0.0


def jitter_floor(wait: np.ndarray, step_ms: np.ndarray, *, overwrite_input: bool = False) -> JitterFloor:
    """The noise floor of a run from its waits (``[steps, ranks]``: every step's, or a sample of
    steps, :func:`pace_strategy.diagnose.digest.floor_rows`) and step times (``[steps]``, every step).
    ``overwrite_input``: ``wait`` (C-contiguous) may be overwritten (no copy of it is made).

    A rank's arrival relative to the step's mean arrival is ``mean(wait) - wait_r``; its own median
    over steps (a persistent offset, which is a finding, not jitter) is removed; the MAD of the rest,
    scaled to a standard deviation and corrected for the per-step centring (``sqrt(W / (W - 1))``),
    is sigma.
    """
    steps, ranks = wait.shape
    if ranks < 2 or steps == 0:
        return JitterFloor(ranks, 0.0, 0.0, float(step_ms.mean()) if len(step_ms) else 0.0)
    # In place where the values allow: at 20,000 sampled steps x 8,192 ranks every [steps, ranks]
    # temporary is 1.3 GB (and, first touched, slow to page in); the numbers are the same.
    late = np.subtract(wait.mean(axis=RANK_AXIS, keepdims=True), wait, out=wait if overwrite_input else None)
    # each rank's median over the steps, a block of ranks at a time (the same values as over a
    # transposed copy of the whole: a median does not depend on the order it reads)
    late -= np.concatenate([np.median(late[:, i : i + _COLUMNS], axis=0) for i in range(0, ranks, _COLUMNS)])
    # the residuals about their own median, then their MAD: both medians partition ``late`` in
    # place (its order no longer matters: what follows is elementwise, then a median of all)
    late -= np.median(late, overwrite_input=True)
    mad = float(np.median(np.abs(late, out=late), overwrite_input=True))
    sigma = _MAD_TO_SD * mad * math.sqrt(ranks / (ranks - 1))
    return JitterFloor(ranks, sigma, sigma * expected_max_normal(ranks), float(step_ms.mean()))
