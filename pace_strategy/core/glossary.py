"""The glossary's arithmetic — transfer time, lead, skew, straggler — written once for torch and NumPy.

The Pacer (torch, ranks on dim 0), the controller's window statistics (torch) and the offline diagnosis
(NumPy, ranks on axis 1) all call these. Standard library only: the functions work through the array's
own reductions, so ``pace diagnose`` does not import torch to use them.

Every function takes per-rank waits at one sync point, in milliseconds, and ``rank_axis``, the axis that
indexes ranks. See ``DESIGN.md`` (glossary) for why the waits alone are a clock-free measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["coefficient_of_variation", "lead_ms", "skew_ms", "straggler_rank", "transfer_ms"]

#: a ``torch.Tensor`` or a ``numpy.ndarray`` (anything with either library's reductions)
Array = TypeVar("Array", bound=Any)


def _is_torch(x: Any) -> bool:
    # torch.Tensor has amax/amin methods; numpy.ndarray has only max/min (which in torch return pairs).
    return hasattr(x, "amax")


def _min(x: Array, axis: int, keep: bool) -> Array:
    return x.amin(dim=axis, keepdim=keep) if _is_torch(x) else x.min(axis=axis, keepdims=keep)


def _max(x: Array, axis: int, keep: bool) -> Array:
    return x.amax(dim=axis, keepdim=keep) if _is_torch(x) else x.max(axis=axis, keepdims=keep)


def transfer_ms(wait_ms: Array, rank_axis: int) -> Array:
    """What the collective costs once everyone is there: ``min(wait)`` over ranks."""
    return _min(wait_ms, rank_axis, keep=False)


def lead_ms(wait_ms: Array, rank_axis: int) -> Array:
    """How early each rank arrived: ``wait_r - min(wait)``, same shape as ``wait_ms``. The straggler has
    lead 0."""
    return wait_ms - _min(wait_ms, rank_axis, keep=True)


def skew_ms(wait_ms: Array, rank_axis: int) -> Array:
    """Latest minus earliest arrival: ``max(wait) - min(wait)`` over ranks (the latest rank waits least
    and collectives complete at nearly the same time on all ranks)."""
    return _max(wait_ms, rank_axis, keep=False) - _min(wait_ms, rank_axis, keep=False)


def straggler_rank(wait_ms: Array, rank_axis: int) -> Array:
    """The rank that arrived last (waited least); integer indices."""
    return wait_ms.argmin(rank_axis)


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over mean; 0.0 for fewer than two values or a zero mean."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    if mean <= 0.0:
        return 0.0
    var = sum((v - mean) * (v - mean) for v in values) / n  # x * x: inf where x ** 2 would raise
    return math.sqrt(var) / mean
