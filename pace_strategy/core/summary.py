"""Per-step :class:`StepSummary` records from gathered windows: what telemetry writes, not what the
controller decides on (that is :func:`~pace_strategy.core.skew.window_stats`)."""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pace_strategy.core import glossary
from pace_strategy.core.records import Field, StepSummary
from pace_strategy.core.skew import kth_smallest, ranks_last

__all__ = ["NodeStep", "StepSummarizer", "node_steps", "node_transfer"]


class NodeStep(enum.IntEnum):
    """Columns of a node's per-step reductions (:func:`node_steps`): what a step's summary takes over
    the ranks, reduced over one node's. Each node leader sends its node's beside the node's rows in
    the leaders' all-gather (``exchange_topology: node_leaders``), and rank 0 summarizes each step
    from the nodes' instead of every rank's (:meth:`StepSummarizer.summarize`). Ranks are global
    rank numbers (exact in float64)."""

    WAIT_MIN = 0
    WAIT_MAX = 1
    WAIT_MIN_RANK = 2  #: the node's first rank of the smallest wait (of the first NaN, if any)
    COMPUTE_MAX = 3
    COMPUTE_MAX_RANK = 4  #: the node's first rank of the largest compute (of the first NaN, if any)
    VALID_MIN = 5
    WARMUP_MAX = 6
    STEP_MS_MAX = 7
    DELAY_MS_MAX = 8
    BUCKETS_MAX = 9
    GC_MS_MAX = 10


def node_steps(
    block: torch.Tensor, ranks: Sequence[int], steps_wait: np.ndarray | None = None
) -> torch.Tensor:
    """One node's per-step reductions ``[steps, fields]`` (columns :class:`NodeStep`, the rest 0) of
    its rows ``block`` ``[node ranks, steps, fields]``, whose global ranks are ``ranks`` (ascending).
    Shaped as one rank's rows, so that it travels as one more row of the node's block. The whole
    window is one node of every rank to :meth:`StepSummarizer.summarize` (``steps_wait``: the
    block's wait as :func:`~pace_strategy.core.skew.ranks_last` gives it, when the caller has it).

    The reductions that pick a rank (arg-min, arg-max) run over each step's ranks side by side
    (``ranks_last``: at 8,192 ranks one blocked copy costs less than one of them over the window's
    view); the first rank on a tie, the first NaN where there is one, as torch's over the ranks."""
    out = torch.zeros(block.shape[1], block.shape[2], dtype=torch.float64)
    o = out.numpy()
    numbers = (  # a range of 8,192 ranks converted number by number costs 0.3 ms
        np.arange(ranks.start, ranks.stop, ranks.step, dtype=np.float64)
        if isinstance(ranks, range)
        else np.asarray(ranks, dtype=np.float64)
    )
    wait = ranks_last(block[:, :, Field.WAIT_MS]) if steps_wait is None else steps_wait  # [steps, ranks]
    compute = ranks_last(block[:, :, Field.COMPUTE_MS])
    o[:, NodeStep.WAIT_MIN] = glossary.transfer_ms(wait, rank_axis=1)
    o[:, NodeStep.WAIT_MAX] = wait.max(axis=1)
    o[:, NodeStep.WAIT_MIN_RANK] = numbers[glossary.straggler_rank(wait, rank_axis=1)]
    o[:, NodeStep.COMPUTE_MAX] = compute.max(axis=1)
    o[:, NodeStep.COMPUTE_MAX_RANK] = numbers[compute.argmax(axis=1)]
    o[:, NodeStep.VALID_MIN] = block[:, :, Field.VALID].amin(dim=0).numpy()
    for column, f in _NODE_MAXIMA.items():
        o[:, column] = block[:, :, f].amax(dim=0).numpy()
    return out


def node_transfer(nodes: torch.Tensor) -> np.ndarray:
    """Each step's smallest wait over every rank (``glossary.transfer_ms``, NaN where any rank's is
    NaN), from every node's :func:`node_steps` ``[nodes, steps, fields]``."""
    return nodes[:, :, NodeStep.WAIT_MIN].amin(dim=0).numpy()


#: the columns of :func:`node_steps` that are a field's largest value over the node's ranks
_NODE_MAXIMA = {
    NodeStep.WARMUP_MAX: Field.WARMUP,
    NodeStep.STEP_MS_MAX: Field.STEP_MS,
    NodeStep.DELAY_MS_MAX: Field.DELAY_MS,
    NodeStep.BUCKETS_MAX: Field.BUCKETS,
    NodeStep.GC_MS_MAX: Field.GC_MS,
}


def _first_rank(values: np.ndarray, ranks: np.ndarray, extreme: np.ndarray) -> np.ndarray:
    """Per step, the first (lowest) global rank whose value is the step's ``extreme`` over every rank
    (its smallest or largest, NaN where any is NaN), or of the first NaN where there is one, as
    torch's ``argmin`` / ``argmax`` over every rank gives it: from each node's extreme ``values``
    ``[nodes, steps]`` and the node's first rank of it ``ranks``."""
    nan = np.isnan(values)
    hit = np.where(np.isnan(extreme), nan, values == extreme)
    return np.where(hit, ranks, np.inf).min(axis=0).astype(np.int64)


class StepSummarizer:
    """Turns gathered windows into per-step :class:`StepSummary` records, in order.

    Keeps the rolling step-time CV across windows, so one summarizer must see every window once, in
    order. Decisions do not depend on it: only whoever writes telemetry needs one (the session: rank 0,
    on its telemetry thread).
    """

    def __init__(self, cv_window_steps: int) -> None:
        self._cv = _RollingCV(cv_window_steps)

    def summarize(
        self,
        g: torch.Tensor,
        per_rank: bool = True,
        nodes: torch.Tensor | None = None,
        groups: Sequence[int] | None = None,
    ) -> tuple[StepSummary, ...]:
        """Summaries of the steps of one gathered window ``[world_size, steps, NUM_FIELDS]``.

        ``per_rank=False``: the per-rank tuples are left empty (each would be W Python numbers per
        field per step: 2.9 million objects per window at 8,192 ranks); the step's own numbers and
        the leads' band are kept. For a writer whose per-rank columns come from ``g`` itself (the
        columnar record) and tags that are not per rank (above ``per_rank_tag_limit``).

        ``nodes``: every node's :func:`node_steps` ``[nodes, steps, fields]`` (a node leader's
        ``WindowResult.node_steps``): the step's extremes, flags and the ranks that reached them are
        then reduced over the nodes' (exactly the same values), and only the leads' median reads
        every rank's wait (it is no node's). ``groups``: each rank's group (dense from 0): each
        summary then carries each group's lead (:attr:`StepSummary.group_lead_ms`)."""

        # Reductions over the ranks (dim 0) of each field's view: with the exchange's field-major
        # window (:func:`~pace_strategy.core.comm.field_major`) no field is copied to reduce it.
        def field(f: Field) -> torch.Tensor:
            return g[:, :, f]  # [ranks, steps]

        wait = field(Field.WAIT_MS)
        # Each step's ranks side by side (``ranks_last``) for the median, and for the extremes when
        # there are no nodes' reductions: every rank is then one node's.
        steps_wait = ranks_last(wait)  # [steps, ranks]
        if nodes is None:
            nodes = node_steps(g, range(g.shape[0]), steps_wait).unsqueeze(0)
        of = _StepColumns.of_nodes(nodes)
        transfer, wait_max = of.transfer, of.wait_max
        # The leads' band without the [ranks, steps] leads: a lead is wait - min(wait), monotone in
        # the wait, so the lead of the median (smallest, largest) wait is the median (smallest,
        # largest) lead. The median as ``sorted(leads)[W // 2]`` (the upper one of an even count).
        median = kth_smallest(steps_wait, g.shape[0] // 2)
        band = torch.stack((median - transfer, transfer - transfer, wait_max - transfer), dim=1).tolist()
        gc_max = of.gc_max.tolist()
        # Columns become Python lists once: per-element tensor indexing would cost ~100 us per step.
        columns = {f: field(f).T.tolist() for f in Field} if per_rank else {}
        leads = glossary.lead_ms(wait, rank_axis=0).T.tolist() if per_rank else []
        group_leads = _group_leads(wait, transfer, groups) if groups else None
        steps = g[0, :, Field.STEP].tolist()
        skew = (wait_max - transfer).tolist()  # glossary.skew_ms: max(wait) - min(wait)
        valid = (of.valid_min > 0).tolist()
        warm = (of.warmup_max > 0).tolist()
        straggler = of.straggler.tolist()
        compute_straggler = of.compute_straggler.tolist()
        step_ms = of.step_ms.tolist()
        delay_max = of.delay_max.tolist()
        buckets = of.buckets.tolist()
        wait_min, wait_top = transfer.tolist(), wait_max.tolist()
        out = []
        for i in range(g.shape[1]):
            if valid[i] and not warm[i]:
                self._cv.add(step_ms[i])
            ranks = _per_rank(columns, leads, i) if per_rank else _NO_RANKS
            out.append(
                StepSummary(
                    step=int(steps[i]),
                    valid=bool(valid[i]),
                    warmup=bool(warm[i]),
                    skew_ms=skew[i],
                    straggler_rank=int(straggler[i]),
                    compute_straggler_rank=int(compute_straggler[i]),
                    step_ms=step_ms[i],
                    step_cv=self._cv.value(),
                    wait_ms_min=wait_min[i],
                    wait_ms_max=wait_top[i],
                    delay_ms_max=delay_max[i],
                    pacing_active=delay_max[i] > 0.0,
                    buckets=int(buckets[i]),
                    lead_band=(band[i][0], band[i][1], band[i][2]),
                    gc_ms_max=gc_max[i],
                    group_lead_ms=() if group_leads is None else tuple(group_leads[i]),
                    **ranks,
                )
            )
        return tuple(out)


def _group_leads(wait: torch.Tensor, transfer: torch.Tensor, groups: Sequence[int]) -> list[list[float]]:
    """Each step's group leads ``[steps][groups]`` (ms): a group's smallest wait less the step's
    smallest (``transfer``), from ``wait`` ``[ranks, steps]`` and each rank's group."""
    index = torch.tensor(list(groups), dtype=torch.long).unsqueeze(1).expand(wait.shape)
    smallest = torch.full((max(groups) + 1, wait.shape[1]), float("inf"), dtype=wait.dtype)
    smallest.scatter_reduce_(0, index, wait, reduce="amin", include_self=True)
    leads: list[list[float]] = (smallest - transfer.unsqueeze(0)).T.tolist()
    return leads


class _StepColumns:
    """A window's per-step reductions over its ranks that a summary reads (``[steps]`` each), from
    the nodes' :func:`node_steps`."""

    transfer: torch.Tensor  #: min(wait)
    wait_max: torch.Tensor
    straggler: np.ndarray  #: the first rank of min(wait): ``glossary.straggler_rank``
    compute_straggler: np.ndarray  #: the first rank of max(compute)
    valid_min: torch.Tensor
    warmup_max: torch.Tensor
    step_ms: torch.Tensor
    delay_max: torch.Tensor
    buckets: torch.Tensor
    gc_max: torch.Tensor

    @classmethod
    def of_nodes(cls, nodes: torch.Tensor) -> _StepColumns:
        """From every node's :func:`node_steps` ``[nodes, steps, fields]``: every column's smallest
        and largest over the nodes in one pass each (the nodes' rows are step-major)."""
        c = cls()
        each = nodes.detach().cpu().numpy()  # [nodes, steps, fields]
        low, high = each.min(axis=0), each.max(axis=0)  # [steps, fields], NaN where a node has one

        def lowest(n: NodeStep) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(low[:, n]))

        def highest(n: NodeStep) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(high[:, n]))

        c.transfer, c.wait_max = lowest(NodeStep.WAIT_MIN), highest(NodeStep.WAIT_MAX)
        c.straggler = _first_rank(
            each[:, :, NodeStep.WAIT_MIN], each[:, :, NodeStep.WAIT_MIN_RANK], low[:, NodeStep.WAIT_MIN]
        )
        c.compute_straggler = _first_rank(
            each[:, :, NodeStep.COMPUTE_MAX],
            each[:, :, NodeStep.COMPUTE_MAX_RANK],
            high[:, NodeStep.COMPUTE_MAX],
        )
        c.valid_min = lowest(NodeStep.VALID_MIN)
        c.warmup_max, c.step_ms = highest(NodeStep.WARMUP_MAX), highest(NodeStep.STEP_MS_MAX)
        c.delay_max, c.buckets = highest(NodeStep.DELAY_MS_MAX), highest(NodeStep.BUCKETS_MAX)
        c.gc_max = highest(NodeStep.GC_MS_MAX)
        return c


#: a summary without per-rank tuples (the later ones default to empty)
_NO_RANKS: dict[str, Any] = dict.fromkeys(
    ("lead_ms", "compute_ms", "wait_ms", "delay_ms", "rank_step_ms", "data_ms", "gap_ms"), ()
)


def _per_rank(columns: dict[Field, list[list[float]]], leads: list[list[float]], i: int) -> dict[str, Any]:
    """Step ``i``'s per-rank tuples of a :class:`StepSummary`."""
    return {
        "lead_ms": tuple(leads[i]),
        "compute_ms": tuple(columns[Field.COMPUTE_MS][i]),
        "wait_ms": tuple(columns[Field.WAIT_MS][i]),
        "delay_ms": tuple(columns[Field.DELAY_MS][i]),
        "rank_step_ms": tuple(columns[Field.STEP_MS][i]),
        "data_ms": tuple(columns[Field.DATA_MS][i]),
        "gap_ms": tuple(columns[Field.GAP_MS][i]),
        "gc_ms": tuple(columns[Field.GC_MS][i]),
        "gc_collections": tuple(int(v) for v in columns[Field.GC_COLLECTIONS][i]),
        "samples": tuple(int(v) for v in columns[Field.SAMPLES][i]),
        "opt_ms": tuple(columns[Field.OPT_MS][i]),
        "host_bound": tuple(int(v) for v in columns[Field.HOST_BOUND][i]),
        "tokens": tuple(int(v) for v in columns[Field.TOKENS][i]),
    }


class _RollingCV:
    """Coefficient of variation over the last ``size`` values, O(1) per value."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sumsq = 0.0

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            old = self._values[0]
            self._sum -= old
            self._sumsq -= old * old
        self._values.append(value)
        self._sum += value
        self._sumsq += value * value

    def value(self) -> float:
        n = len(self._values)
        if n < 2 or self._sum <= 0.0:
            return 0.0
        mean = self._sum / n
        var = max(self._sumsq / n - mean * mean, 0.0)
        return math.sqrt(var) / mean
