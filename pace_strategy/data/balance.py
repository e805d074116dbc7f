"""Cost-balanced batches: which samples of a global batch each rank trains, so that the ranks' predicted
compute is equal instead of each rank taking the next slice (docs/balancing.md).

With uneven inputs (sequence lengths) every step waits for the rank that drew the most work. Every
rank computes the same assignment from the same sample lengths, with no collective: the functions
here are pure (numpy only, deterministic, ties broken by position), so the ranks agree by
construction.

Two batch layouts, two cost models of a rank's step:

- **padded**: a rank's batch is padded to its longest sample, so its cost is its count times the
  cost of that longest sample. At equal counts the rank holding the longest sample sets the step
  whatever the assignment; only unequal counts shorten it: few long samples on one rank, many short
  ones on another. :func:`assign_padded` cuts the samples, sorted by length, into one contiguous run
  per rank, the longest run to the rank of the largest weight, minimising the largest cost over
  weight (bisection on that bound; each rank's run is as long as the bound allows).
- **packed**: a rank's samples are concatenated (or its attention is block-diagonal), so its cost is
  the sum of its samples' costs. :func:`assign_packed` places the samples, longest first, each on the
  rank whose cost over weight grows least (LPT), at any counts.

The cost of one sample of ``L`` tokens (:class:`SampleCost`): ``tokens`` is ``L``; ``attention`` is
``L + L**2 / quadratic_tokens`` (the linear layers' work grows with ``L``, attention's with ``L**2``;
``quadratic_tokens`` is the length at which both are equal, about the model width times a small
factor for a transformer block). A per-rank token budget (``max_tokens``) bounds what a rank may
take: ``count x longest`` for padded batches, the sum of lengths for packed ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from pace_strategy.core.config import BalanceCost, BalanceLayout
from pace_strategy.core.errors import PacingConfigError

__all__ = [
    "COSTS",
    "LAYOUTS",
    "Balancer",
    "CostModel",
    "SampleCost",
    "assign",
    "assign_packed",
    "assign_padded",
    "check_cost_model",
    "fit_cost",
    "sample_lengths",
    "step_costs",
]

#: a cost model: each sample's predicted cost from its length (an array of lengths in, an array of
#: positive costs out, non-decreasing in the length): a :class:`SampleCost` or a user's function
CostModel = Callable[[np.ndarray], np.ndarray]

#: the cost models of one sample (:class:`SampleCost`): ``BalanceConfig.cost``'s values
COSTS: tuple[str, ...] = get_args(BalanceCost)
#: how a rank's samples make its batch, padded to its longest or packed: ``BalanceConfig.layout``'s
LAYOUTS: tuple[str, ...] = get_args(BalanceLayout)


@dataclass(frozen=True)
class SampleCost:
    """The predicted cost of a sample of ``L`` tokens, in token-equivalents (the cost of one token of
    the linear layers): ``per_sample + L`` (``tokens``) or ``per_sample + L + L**2 /
    quadratic_tokens`` (``attention``). ``per_sample`` is what a sample costs whatever its length
    (per-sample work of the loop, the loss, a kernel launch); :func:`fit_cost` measures both."""

    model: str = "attention"
    quadratic_tokens: float = 1024.0
    per_sample: float = 0.0

    def __post_init__(self) -> None:
        if self.model not in COSTS:
            raise ValueError(f"cost model must be one of {COSTS}, got {self.model!r}")
        if not self.quadratic_tokens > 0:
            raise ValueError(f"quadratic_tokens must be > 0, got {self.quadratic_tokens!r}")
        if not self.per_sample >= 0:
            raise ValueError(f"per_sample must be >= 0, got {self.per_sample!r}")

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        if self.model == "tokens":
            return self.per_sample + lengths
        return self.per_sample + lengths + lengths * lengths / self.quadratic_tokens


def fit_cost(lengths: Sequence[int], milliseconds: Sequence[float]) -> SampleCost:
    """The ``attention`` cost of one sample fitted to measured times: ``t = a + b L + c L**2`` by least
    squares (coefficients kept >= 0; ``b`` at least a thousandth of the mean time per token, so that
    the unit exists), returned in units of ``b``: ``per_sample = a / b``, ``quadratic_tokens = b / c``.
    ``lengths`` and ``milliseconds``: single samples timed (forward and backward) at several lengths."""
    L = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(milliseconds, dtype=np.float64)
    if L.shape != t.shape or len(np.unique(L)) < 3:
        raise ValueError("fit_cost needs times of single samples at three lengths at least")
    design = np.stack([np.ones_like(L), L, L * L], axis=1)
    a, b, c = np.clip(np.linalg.lstsq(design, t, rcond=None)[0], 0.0, None)
    b = max(b, 1e-3 * float(np.mean(t / L)))
    return SampleCost("attention", quadratic_tokens=float(b / c) if c > 0 else 1e12, per_sample=float(a / b))


def _weights(world: int, weights: Sequence[float] | None) -> np.ndarray:
    w = np.full(world, 1.0 / world) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (world,) or not np.all(w > 0):
        raise ValueError(f"weights must be {world} positive numbers, got {weights!r}")
    return w / w.sum()


def _order_by_length(lengths: np.ndarray) -> np.ndarray:
    """Positions by length, longest first; equal lengths by position (the same on every rank)."""
    return np.lexsort((np.arange(len(lengths)), -lengths))


def _by_length(
    lengths: Sequence[int], world: int, cost: CostModel, weights: Sequence[float] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What both assignments start from, checked: the lengths, the ranks' normalized weights, the
    positions longest first and each one's cost in that order."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 1 or len(arr) < world:
        raise ValueError(f"need at least one sample per rank: {len(arr)} samples for {world} ranks")
    if np.any(arr < 1):
        raise ValueError("every sample needs a length of at least one token")
    order = _order_by_length(arr)
    return arr, _weights(world, weights), order, cost(arr[order])


def assign_padded(
    lengths: Sequence[int],
    world: int,
    cost: CostModel,
    weights: Sequence[float] | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Each rank's positions in ``lengths`` (ascending) for padded batches: a rank's cost is its count
    times the cost of its longest sample; the largest cost over weight is minimised over contiguous
    runs of the samples sorted by length, every rank at least one sample, ``count x longest`` at most
    ``max_tokens``. ``weights``: each rank's share of the work (its speed; even when ``None``)."""
    arr, w, order, per_sample = _by_length(lengths, world, cost, weights)  # costs non-increasing
    ranks = np.lexsort((np.arange(world), -w))  # the heaviest rank takes the longest run

    def runs(bound: float) -> list[int] | None:
        """Each rank's run length in ``ranks`` order within ``bound``, or None where it cannot be."""
        at, counts = 0, []
        for j, r in enumerate(ranks):
            left = world - j - 1  # ranks after this one, one sample each at least
            if at >= len(arr) - left:
                return None
            take = int(bound * w[r] / per_sample[at] * (1 + 1e-12))
            if max_tokens is not None:
                take = min(take, max_tokens // int(arr[order[at]]))
            take = min(take, len(arr) - left - at)
            if take < 1:
                return None
            counts.append(take)
            at += take
        return counts if at == len(arr) else None

    low = 0.0
    high = float(per_sample[0] * len(arr) / w.min())
    if runs(high) is None:
        raise ValueError(
            f"no split of {len(arr)} samples over {world} ranks keeps count x longest within max_tokens="
            f"{max_tokens}: raise the budget or lower the batch size"
        )
    for _ in range(64):
        mid = 0.5 * (low + high)
        if runs(mid) is None:
            low = mid
        else:
            high = mid
        if high - low <= 1e-9 * high:
            break
    counts = runs(high)
    assert counts is not None
    out: list[list[int]] = [[] for _ in range(world)]
    at = 0
    for r, take in zip(ranks, counts, strict=True):
        out[int(r)] = sorted(int(p) for p in order[at : at + take])
        at += take
    return out


def assign_packed(
    lengths: Sequence[int],
    world: int,
    cost: CostModel,
    weights: Sequence[float] | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Each rank's positions in ``lengths`` (ascending) for packed batches: a rank's cost is the sum of
    its samples' costs; longest first, each sample to the rank whose cost over weight grows least
    (ties to the lowest rank) among those with room for it under ``max_tokens``; every rank at least
    one sample."""
    arr, w, order, per_sample = _by_length(lengths, world, cost, weights)
    load = np.zeros(world)
    tokens = np.zeros(world, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(world)]
    for p, c in zip(order, per_sample, strict=True):
        after = (load + c) / w
        if max_tokens is not None:
            after[tokens + arr[p] > max_tokens] = np.inf
        r = int(np.argmin(after))
        if not np.isfinite(after[r]):
            raise ValueError(
                f"no rank has room for a sample of {int(arr[p])} tokens within max_tokens={max_tokens}: "
                "raise the budget or lower the batch size"
            )
        out[r].append(int(p))
        load[r] += c
        tokens[r] += arr[p]
    for r in range(world):  # a rank left empty takes the shortest sample of the rank with the most
        if not out[r]:
            donor = max(range(world), key=lambda k: (len(out[k]), -k))
            out[r].append(out[donor].pop())  # appended longest first: the last is the shortest
    return [sorted(ps) for ps in out]


def assign(
    lengths: Sequence[int],
    world: int,
    cost: CostModel,
    layout: str,
    weights: Sequence[float] | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """:func:`assign_padded` or :func:`assign_packed`, by ``layout`` (:data:`LAYOUTS`)."""
    if layout == "padded":
        return assign_padded(lengths, world, cost, weights, max_tokens)
    if layout == "packed":
        return assign_packed(lengths, world, cost, weights, max_tokens)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def step_costs(
    lengths: Sequence[int], parts: Sequence[Sequence[int]], cost: CostModel, layout: str
) -> np.ndarray:
    """Each rank's predicted cost of the step (token-equivalents) under an assignment ``parts``."""
    arr = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(len(parts))
    for r, ps in enumerate(parts):
        if len(ps):
            mine = arr[np.asarray(ps, dtype=np.int64)]
            longest = mine.max(keepdims=True)
            out[r] = len(ps) * float(cost(longest)[0]) if layout == "padded" else float(cost(mine).sum())
    return out


def sample_lengths(dataset: Any, lengths: Sequence[int] | None = None) -> np.ndarray:
    """Every sample's length in tokens, from (in order): ``lengths`` (the adapter's argument), the
    dataset's ``lengths`` attribute, a ``length`` column of a Hugging Face dataset (what the Trainer's
    ``length_column_name`` names by default), else the length of each sample's ``input_ids``, read
    once here. Fails naming these ways when none applies or a length is not a positive integer."""
    size = len(dataset)
    source = "lengths="
    if lengths is None and getattr(dataset, "lengths", None) is not None:
        lengths, source = dataset.lengths, "the dataset's lengths attribute"
    if lengths is None and "length" in (getattr(dataset, "column_names", None) or ()):
        lengths, source = dataset["length"], "the dataset's length column"
    if lengths is None:
        lengths, source = [_input_ids_length(dataset, i) for i in range(size)], "each sample's input_ids"
    arr = np.asarray(lengths)
    if arr.shape != (size,) or arr.dtype.kind not in "iu" or (size and arr.min() < 1):
        raise ValueError(
            f"balance needs one positive integer length per sample: {source} gave "
            f"{arr.dtype} of shape {arr.shape} for {size} samples"
        )
    return arr.astype(np.int64)


def _input_ids_length(dataset: Any, index: int) -> int:
    sample = dataset[index]
    ids = sample.get("input_ids") if isinstance(sample, dict) else None
    if ids is None:
        raise ValueError(
            f"balance needs each sample's length: sample {index} of {type(dataset).__name__} has no "
            "input_ids; give the lengths (the adapter's lengths= argument, or a lengths attribute or "
            "length column of the dataset)"
        )
    return int(ids.shape[-1]) if hasattr(ids, "shape") else len(ids)


def check_cost_model(cost: CostModel, lengths: np.ndarray) -> None:
    """Refuse a user's cost function that does not map every length of the dataset to one finite,
    positive cost, non-decreasing in the length (the padded split sorts by length and reads the
    longest sample's cost as the batch's), naming what it returned."""
    where = "pace.dataloader(cost=...)"
    unique = np.unique(np.asarray(lengths, dtype=np.int64))
    try:
        costs = np.asarray(cost(unique), dtype=np.float64)
    except Exception as error:  # the user's function: any failure is a configuration error
        raise PacingConfigError(
            f"{where}: the cost function failed on an array of lengths: {error!r}"
        ) from error
    if costs.shape != unique.shape or not np.all(np.isfinite(costs)) or not np.all(costs > 0):
        raise PacingConfigError(
            f"{where}: the cost function must map an array of {len(unique)} lengths to as many finite, "
            f"positive costs; it returned shape {costs.shape}, e.g. {costs.ravel()[:3].tolist()}"
        )
    if np.any(np.diff(costs) < 0):
        at = int(np.flatnonzero(np.diff(costs) < 0)[0])
        raise PacingConfigError(
            f"{where}: the cost must not fall as the length grows: {costs[at]:g} at {unique[at]} tokens, "
            f"{costs[at + 1]:g} at {unique[at + 1]}"
        )


class Balancer:
    """The cost-balanced split of each step's samples (dataset indices), the same on every rank: the
    samples' lengths, the cost model, the layout and the token budget. Called with the step's
    indices and the ranks' shares (their weights: rebalancing's split by device speed, or even);
    returns each rank's indices."""

    def __init__(
        self, lengths: np.ndarray, cost: CostModel, layout: str, max_tokens: int | None = None
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(cost, SampleCost):
            check_cost_model(cost, lengths)
        self.lengths = lengths
        self.cost = cost
        self.layout = layout
        self.max_tokens = max_tokens

    def __call__(
        self, indices: Sequence[int], shares: Sequence[int], cost: CostModel | None = None
    ) -> list[list[int]]:
        """Each rank's indices of the step's ``indices``; ``cost``: the cost model in force (the fitted
        one of the step's schedule entry), else the configured one."""
        lengths = self.lengths[np.asarray(indices)]
        try:
            parts = assign(lengths, len(shares), cost or self.cost, self.layout, shares, self.max_tokens)
        except ValueError as error:  # the budget: a configuration error, named as the field
            raise PacingConfigError(f"balance.max_tokens: {error}") from error
        return [[int(indices[p]) for p in ps] for ps in parts]

    @property
    def fixed(self) -> bool:
        """The cost is a user's function: nothing to fit (:meth:`cost_of` keeps it)."""
        return not isinstance(self.cost, SampleCost)

    def cost_of(self, fitted: tuple[float, float]) -> CostModel:
        """The configured cost model with a fitted ``(quadratic_tokens, per_sample)`` (a user's
        function stays as it is)."""
        if not isinstance(self.cost, SampleCost):
            return self.cost
        return SampleCost(self.cost.model, fitted[0], fitted[1])

    def work(self, parts: Sequence[Sequence[int]]) -> list[tuple[float, float, float]]:
        """Each part's work as the online cost fit reads it (:class:`~pace_strategy.core.cost_fit.
        CostFit`): ``(n, T, Q)``, its samples, tokens and squared tokens as this layout computes them
        (padded: ``n * longest`` and ``n * longest**2``; packed: the sums of ``L`` and ``L**2``)."""
        out = []
        for part in parts:
            mine = self.lengths[np.asarray(part, dtype=np.int64)].astype(np.float64)
            n = float(len(mine))
            if not n:
                out.append((0.0, 0.0, 0.0))
            elif self.layout == "padded":
                longest = float(mine.max())
                out.append((n, n * longest, n * longest * longest))
            else:
                out.append((n, float(mine.sum()), float((mine * mine).sum())))
        return out
