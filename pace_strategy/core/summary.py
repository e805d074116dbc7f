"""Per-step :class:`StepSummary` records from gathered windows: what telemetry writes, not what the
controller decides on (that is :func:`~pace_strategy.core.skew.window_stats`)."""

from __future__ import annotations

import math
from collections import deque

import torch

from pace_strategy.core import glossary
from pace_strategy.core.records import Field, StepSummary

__all__ = ["StepSummarizer"]


class StepSummarizer:
    """Turns gathered windows into per-step :class:`StepSummary` records, in order.

    Keeps the rolling step-time CV across windows, so one summarizer must see every window once, in
    order. Decisions do not depend on it: only whoever writes telemetry needs one (the session: rank 0,
    on its telemetry thread).
    """

    def __init__(self, cv_window_steps: int) -> None:
        self._cv = _RollingCV(cv_window_steps)

    def summarize(self, g: torch.Tensor) -> tuple[StepSummary, ...]:
        """Summaries of the steps of one gathered window ``[world_size, steps, NUM_FIELDS]``."""
        # Columns become Python lists once: per-element tensor indexing would cost ~100 us per step.
        wait = g[:, :, Field.WAIT_MS]
        per_rank = {f: g[:, :, f].T.tolist() for f in Field}
        leads = glossary.lead_ms(wait, rank_axis=0).T.tolist()
        skew = glossary.skew_ms(wait, rank_axis=0).tolist()
        transfer = glossary.transfer_ms(wait, rank_axis=0).tolist()
        wait_max = wait.amax(dim=0).tolist()
        valid = (g[:, :, Field.VALID] > 0).all(dim=0).tolist()
        warm = (g[:, :, Field.WARMUP] > 0).any(dim=0).tolist()
        straggler = glossary.straggler_rank(wait, rank_axis=0).tolist()
        compute_straggler = g[:, :, Field.COMPUTE_MS].argmax(dim=0).tolist()
        step_ms = g[:, :, Field.STEP_MS].amax(dim=0).tolist()
        delay_max = g[:, :, Field.DELAY_MS].amax(dim=0).tolist()
        buckets = g[:, :, Field.BUCKETS].amax(dim=0).tolist()
        out = []
        for i in range(g.shape[1]):
            if valid[i] and not warm[i]:
                self._cv.add(step_ms[i])
            out.append(
                StepSummary(
                    step=int(per_rank[Field.STEP][i][0]),
                    valid=bool(valid[i]),
                    warmup=bool(warm[i]),
                    skew_ms=skew[i],
                    straggler_rank=int(straggler[i]),
                    compute_straggler_rank=int(compute_straggler[i]),
                    step_ms=step_ms[i],
                    step_cv=self._cv.value(),
                    wait_ms_min=transfer[i],
                    wait_ms_max=wait_max[i],
                    delay_ms_max=delay_max[i],
                    pacing_active=delay_max[i] > 0.0,
                    lead_ms=tuple(leads[i]),
                    compute_ms=tuple(per_rank[Field.COMPUTE_MS][i]),
                    wait_ms=tuple(per_rank[Field.WAIT_MS][i]),
                    delay_ms=tuple(per_rank[Field.DELAY_MS][i]),
                    rank_step_ms=tuple(per_rank[Field.STEP_MS][i]),
                    data_ms=tuple(per_rank[Field.DATA_MS][i]),
                    gap_ms=tuple(per_rank[Field.GAP_MS][i]),
                    buckets=int(buckets[i]),
                    gc_ms=tuple(per_rank[Field.GC_MS][i]),
                    gc_collections=tuple(int(v) for v in per_rank[Field.GC_COLLECTIONS][i]),
                    samples=tuple(int(v) for v in per_rank[Field.SAMPLES][i]),
                    opt_ms=tuple(per_rank[Field.OPT_MS][i]),
                    host_bound=tuple(int(v) for v in per_rank[Field.HOST_BOUND][i]),
                )
            )
        return tuple(out)


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
