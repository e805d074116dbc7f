"""The cost model of cost-balanced batches, fitted online from what the ranks measured.

A rank's compute time in a step (batch ready -> the end of its local backward, ``Field.COMPUTE_MS``)
is modelled as ``a * n + b * T + c * Q`` over the samples it trained: ``n`` samples, ``T`` tokens and
``Q`` squared tokens (padded batches: ``T = n * longest``, ``Q = n * longest**2``; packed: the sums of
``L`` and ``L**2``), what :class:`~pace_strategy.data.balance.SampleCost` predicts with ``per_sample =
a / b`` and ``quadratic_tokens = b / c``. Every rank knows every rank's samples of every step (the
split is computed the same everywhere) and every rank sees the same gathered window, so every rank
fits the same coefficients with no further communication, provided the arithmetic is the same
everywhere: the sums here are exactly rounded (``math.fsum``) and the 3 x 3 system is solved in Python
floats, so the result does not depend on a BLAS or on the CPU it runs on; it is then rounded to two
significant digits, which the split is insensitive to and which keeps it from moving every window.

The normal equations decay by ``DECAY`` per window, so the fit follows a model whose speed changes
(a new phase of training, other input), and a rank's speed (a slower device) is pooled with the
others': it moves the fit as noise, not as bias, where the ranks' lengths are drawn alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from pace_strategy.core.records import Field

__all__ = ["CHANGE", "DECAY", "CostFit", "fit_ranks", "moved", "solve", "window_rows"]

#: the weight of a window's rows in the next window's fit
DECAY = 0.8
#: rows a fit needs before it is used (of at least three distinct feature rows)
MIN_ROWS = 24
#: a fitted cost replaces the one in force only when ``per_sample`` or ``quadratic_tokens`` moves by
#: this fraction of it: the split barely changes for less, and every change is a schedule entry
CHANGE = 0.25
#: the largest ``quadratic_tokens`` a fit reports: attention's share too small to measure
LINEAR = 1e9


#: ranks whose rows the fit reads, at most (every rank's split is known everywhere: a strided subset
#: of ranks is as good a sample of the lengths as all of them, and keeps the work per window bounded)
FIT_RANKS = 32


def fit_ranks(world_size: int) -> tuple[int, ...]:
    """The ranks the fit reads (:data:`FIT_RANKS` of them at most, evenly strided)."""
    return tuple(range(0, world_size, -(-world_size // FIT_RANKS)))


def _round2(x: float) -> float:
    """``x`` to two significant digits (as ``format(x, '.2g')`` writes it: the same on every host)."""
    return float(f"{x:.2g}")


def solve(matrix: Sequence[Sequence[float]], rhs: Sequence[float]) -> list[float] | None:
    """``matrix @ x = rhs`` by Gaussian elimination with partial pivoting, in Python floats (the same
    result on every host). ``None`` when the matrix is singular to working precision."""
    n = len(rhs)
    a = [[float(v) for v in row] + [float(rhs[i])] for i, row in enumerate(matrix)]
    scale = max((abs(v) for row in a for v in row[:n]), default=0.0)
    if scale == 0.0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class CostFit:
    """Least squares of ``compute_ms ~ a n + b T + c Q`` over decaying windows (module doc).

    Args:
        quadratic: fit ``c`` (the ``attention`` cost model); ``False``: ``a n + b T`` (``tokens``).
    """

    def __init__(self, quadratic: bool = True) -> None:
        self.quadratic = quadratic
        self._k = 3 if quadratic else 2
        self._xtx = [[0.0] * self._k for _ in range(self._k)]
        self._xty = [0.0] * self._k
        self._rows = 0.0  #: decayed row count
        #: distinct work sizes seen, up to three (lengths that do not vary fit nothing)
        self._seen: set[float] = set()

    def add(self, rows: Sequence[Sequence[float]], compute_ms: Sequence[float]) -> None:
        """One window's rows: each ``(n, T, Q)`` of a rank's step and its compute time in ms; rows of
        no samples or no time are left out. Earlier windows' weight decays by :data:`DECAY`."""
        kept = [(r[: self._k], t) for r, t in zip(rows, compute_ms, strict=True) if r[0] > 0 and t > 0]
        for i in range(self._k):
            self._xty[i] = DECAY * self._xty[i] + math.fsum(r[i] * t for r, t in kept)
            for j in range(self._k):
                self._xtx[i][j] = DECAY * self._xtx[i][j] + math.fsum(r[i] * r[j] for r, _ in kept)
        self._rows = DECAY * self._rows + len(kept)
        if len(self._seen) < 3:
            self._seen.update(r[1] / r[0] for r, _ in kept)  # tokens per sample

    def cost(self) -> tuple[float, float] | None:
        """``(quadratic_tokens, per_sample)`` of the fit, each to two significant digits, or ``None``
        before :data:`MIN_ROWS` rows of three distinct work sizes or when no positive fit exists.
        Coefficients that come out negative (noise where a term is too small to measure) are left
        out of the fit in turn: first ``c``, then ``a``."""
        if self._rows < MIN_ROWS or len(self._seen) < 3:
            return None
        # the columns kept, in the order tried: all, without c (linear), without a, b alone
        tries = [(0, 1, 2), (0, 1), (1, 2), (1,)] if self.quadratic else [(0, 1), (1,)]
        for cols in tries:
            x = solve([[self._xtx[i][j] for j in cols] for i in cols], [self._xty[i] for i in cols])
            if x is None or any(v < 0 for v in x) or x[cols.index(1)] <= 0:
                continue
            coef = dict(zip(cols, x, strict=True))
            b = coef[1]
            c = coef.get(2, 0.0)
            quadratic_tokens = min(LINEAR, b / c) if c > 0 else LINEAR
            return _round2(quadratic_tokens), _round2(coef.get(0, 0.0) / b)
        return None


def moved(new: tuple[float, float], old: tuple[float, float]) -> bool:
    """Whether a fitted ``(quadratic_tokens, per_sample)`` differs from ``old`` by :data:`CHANGE` of
    it in either term (a ``per_sample`` of 0 moves with any positive one of 1 token or more)."""
    (q1, p1), (q0, p0) = new, old
    if abs(q1 - q0) > CHANGE * q0:
        return True
    return abs(p1 - p0) > max(CHANGE * p0, 1.0)


def window_rows(
    gathered: torch.Tensor,
    usable: torch.Tensor,
    ranks: Sequence[int],
    work: Mapping[int, Sequence[tuple[float, float, float]]],
) -> tuple[list[tuple[float, float, float]], list[float]]:
    """The fit's rows of one gathered window ``[W, steps, fields]``: for each usable step whose work
    the data pipeline noted and each of ``ranks``, the rank's ``(n, T, Q)`` and its compute time (ms).
    A row whose noted samples differ from what the rank reported (a batch from outside the balanced
    loader, an epoch's short last step counted elsewhere) is left out."""
    rows: list[tuple[float, float, float]] = []
    times: list[float] = []
    labels = gathered[0, :, Field.STEP].tolist()
    samples = gathered[:, :, Field.SAMPLES]
    compute = gathered[:, :, Field.COMPUTE_MS]
    for j, ok in enumerate(usable.tolist()):
        noted = work.get(int(labels[j])) if ok else None
        if noted is None:
            continue
        for w, r in zip(noted, ranks, strict=True):
            if r < gathered.shape[0] and float(samples[r, j]) == w[0]:
                rows.append(w)
                times.append(float(compute[r, j]))
    return rows, times
