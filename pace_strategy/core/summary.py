"""Per-step :class:`StepSummary` records from gathered windows: what telemetry writes, not what the
controller decides on (that is :func:`~pace_strategy.core.skew.window_stats`)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from pace_strategy.core import glossary
from pace_strategy.core.records import Field, StepSummary
from pace_strategy.core.skew import kth_smallest, ranks_last

__all__ = ["StepSummarizer"]


class StepSummarizer:
    """Turns gathered windows into per-step :class:`StepSummary` records, in order.

    Keeps the rolling step-time CV across windows, so one summarizer must see every window once, in
    order. Decisions do not depend on it: only whoever writes telemetry needs one (the session: rank 0,
    on its telemetry thread).
    """

    def __init__(self, cv_window_steps: int) -> None:
        self._cv = _RollingCV(cv_window_steps)

    def summarize(self, g: torch.Tensor, per_rank: bool = True) -> tuple[StepSummary, ...]:
        """Summaries of the steps of one gathered window ``[world_size, steps, NUM_FIELDS]``.

        ``per_rank=False``: the per-rank tuples are left empty (each would be W Python numbers per
        field per step: 2.9 million objects per window at 8,192 ranks); the step's own numbers and
        the leads' band are kept. For a writer whose per-rank columns come from ``g`` itself (the
        columnar record) and tags that are not per rank (above ``per_rank_tag_limit``)."""

        # Reductions over the ranks (dim 0) of each field's view: with the exchange's field-major
        # window (:func:`~pace_strategy.core.comm.field_major`) no field is copied to reduce it.
        def field(f: Field) -> torch.Tensor:
            return g[:, :, f]  # [ranks, steps]

        def high(f: Field) -> torch.Tensor:
            return field(f).amax(dim=0)  # [steps]

        wait = field(Field.WAIT_MS)
        # The reductions that pick a rank (arg-min, arg-max, the median) run over each step's ranks
        # side by side: one blocked copy of each field they read (``ranks_last``), which costs less
        # than one of them over the window's view at 8,192 ranks.
        steps_wait = ranks_last(wait)  # [steps, ranks]
        transfer = torch.from_numpy(glossary.transfer_ms(steps_wait, rank_axis=1))
        wait_max = torch.from_numpy(steps_wait.max(axis=1))
        # The leads' band without the [ranks, steps] leads: a lead is wait - min(wait), monotone in
        # the wait, so the lead of the median (smallest, largest) wait is the median (smallest,
        # largest) lead. The median as ``sorted(leads)[W // 2]`` (the upper one of an even count).
        median = kth_smallest(steps_wait, g.shape[0] // 2)
        band = torch.stack((median - transfer, transfer - transfer, wait_max - transfer), dim=1).tolist()
        gc_max = high(Field.GC_MS).tolist()
        # Columns become Python lists once: per-element tensor indexing would cost ~100 us per step.
        columns = {f: field(f).T.tolist() for f in Field} if per_rank else {}
        leads = glossary.lead_ms(wait, rank_axis=0).T.tolist() if per_rank else []
        steps = g[0, :, Field.STEP].tolist()
        skew = (wait_max - transfer).tolist()  # glossary.skew_ms: max(wait) - min(wait)
        valid = (field(Field.VALID).amin(dim=0) > 0).tolist()
        warm = (high(Field.WARMUP) > 0).tolist()
        straggler = glossary.straggler_rank(steps_wait, rank_axis=1).tolist()
        compute_straggler = ranks_last(field(Field.COMPUTE_MS)).argmax(axis=1).tolist()
        step_ms = high(Field.STEP_MS).tolist()
        delay_max = high(Field.DELAY_MS).tolist()
        buckets = high(Field.BUCKETS).tolist()
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
                    **ranks,
                )
            )
        return tuple(out)


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
