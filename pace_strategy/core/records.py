"""Frozen result records: one step seen by all ranks, one window's statistics, one pacing decision."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["NUM_FIELDS", "Decision", "Field", "GcCollect", "PolicyState", "StepSummary"]


class Field(enum.IntEnum):
    """Column layout of the per-rank step record exchanged between ranks (float64, one row per step).

    All durations are milliseconds measured on the rank itself; no clock is compared across ranks.
    """

    STEP = 0  #: global step label (checked for agreement across ranks)
    VALID = 1  #: 1.0 when the gradient sync point was seen this step (the comm hook fired), else 0.0
    WARMUP = 2  #: 1.0 for warm-up steps (excluded from statistics and pacing)
    #: DDP: batch ready -> arrival, the end of the rank's local backward (forward and the whole
    #: backward; the grad-ready monitor's engine callback, or the comm hook's last-bucket hand-off),
    #: without the delay. Run-record schema version 1 ended it at the first gradient instead.
    #: FSDP: batch ready -> last collective done, less the time blocked in collectives and the delay.
    COMPUTE_MS = 3
    #: DDP: arrival (end of local backward) -> completion of the step's last gradient collective; the
    #: smallest over the ranks is the transfer time, what is exposed once the last rank finished.
    #: FSDP: the sum over the step's all-gathers and reduce-scatters of hand-off -> completion.
    #: Both: plus the time blocked in the framework's own collectives outside the gradient sync
    #: (``Pacer.enter_framework_sync``: the HF Trainer's pre-step gather), taken out of the field the
    #: time was spent in (``GAP_MS``, ``COMPUTE_MS`` or ``OPT_MS``): a step's wait is the sum of its
    #: waits at every sync point.
    WAIT_MS = 4
    DELAY_MS = 5  #: pacing delay applied at the first gradient, before the first gradient collective
    STEP_MS = 6  #: wall time of the step on this rank (start -> after the optimizer step)
    DATA_MS = 7  #: time the training loop was blocked fetching this step's input (``add_data_wait``)
    GAP_MS = 8  #: previous step's collective completion -> this batch ready (optimizer, loop, input, ...)
    BUCKETS = 9  #: buckets (DDP comm-hook monitor; 0: not timed) or collectives (FSDP) handed off
    GC_MS = 10  #: time this rank's garbage collector ran during the step (0 when not measured)
    GC_COLLECTIONS = 11  #: garbage collections (any generation) that ran during the step
    SAMPLES = 12  #: samples this rank trained on in the step (0: not known to pace_strategy)
    #: ``gc_sync``: how close this rank's collector is to the full collection it would have run by
    #: itself, at the step's end (>= 1: it would have collected; 0 while gc_sync is off)
    GC_DUE = 13
    #: completion of the step's gradient collective -> the step's end (optimizer step, gradient
    #: clipping, the framework's hooks): the rank's own work after its sync. The rest of the next
    #: step's ``GAP_MS`` (``GAP_MS`` of step k+1 minus ``OPT_MS`` of step k) is the framework's loop
    #: between steps, its input and any collective it runs there (Lightning broadcasts from rank 0
    #: every step), which completes late on a rank behind a slower network path.
    OPT_MS = 14
    #: 1.0 when the host was the bottleneck of the step: the device had already reached the rank's
    #: arrival (the end of its local backward) when the host ended the step, so it was waiting for
    #: the host and a host-side pause (a collection, input) lengthened the step. 0.0: the device was
    #: still behind, and a host pause up to that lag was hidden by the run-ahead. Always 1.0 on a
    #: host clock (CPU: the host is the device). Read without waiting (``Clock.ready``).
    HOST_BOUND = 15
    #: the device's peak allocated memory so far (``torch.cuda.max_memory_allocated``) as a fraction
    #: of its total, read when the step is resolved; 0.0 on CPU. Exchanged for rebalancing's memory
    #: check (a split that would not fit is never taken), not written to the run record.
    MEM_PEAK = 16
    #: tokens this rank trained on in the step (0: not known): its work size where inputs differ in
    #: length (the padded ``input_ids`` of its forwards, or what the loop reports)
    TOKENS = 17


NUM_FIELDS = len(Field)


class PolicyState(str, enum.Enum):
    """States of the adaptive pacing controller."""

    MONITOR = "monitor"  #: measuring only, waiting for sustained severe imbalance
    PACING = "pacing"  #: delays applied (the paced arm of the A/B check)
    PROBE = "probe"  #: delays withheld to re-measure the unpaced arm
    COOLDOWN = "cooldown"  #: backed off after pacing failed to help; no pacing until it ends


@dataclass(frozen=True)
class GcCollect:
    """A synchronized full garbage collection (``gc_sync``), decided identically on every rank.

    Every rank runs it at the start of the step after ``after_step``, so the pauses overlap."""

    after_step: int  #: label of the step in whose ``end_step`` the window's decision was made
    #: each rank's due fraction at the window's last step (>= ``gc_sync_due_fraction``: it was due)
    due: tuple[float, ...]


@dataclass(frozen=True)
class Decision:
    """What the controller decided after one window; identical on every rank.

    ``delays_ms[r]`` is the delay rank ``r`` applies before its first gradient collective in each step
    until the next decision.
    """

    window: int
    state: PolicyState
    delays_ms: tuple[float, ...]
    reason: str
    baseline_step_ms: float | None = None
    paced_step_ms: float | None = None
    #: ``gc_sync``: a synchronized full collection decided from this window (``None``: none)
    gc_collect: GcCollect | None = None

    @property
    def pacing_active(self) -> bool:
        return any(map((0.0).__lt__, self.delays_ms))  # d > 0 (NaN: no), in C: 8,192 delays in 0.1 ms


@dataclass(frozen=True)
class StepSummary:
    """One step as seen by all ranks after the exchange (the row behind every ``pace/`` tag).

    Durations in milliseconds. Per-rank tuples are indexed by global rank.
    """

    step: int
    valid: bool
    warmup: bool
    skew_ms: float  #: latest minus earliest arrival, clock-free: max(wait) - min(wait)
    straggler_rank: int  #: the rank that arrived last (least wait)
    compute_straggler_rank: int  #: the rank with the longest compute time
    step_ms: float  #: wall time of the step (slowest rank)
    step_cv: float  #: coefficient of variation of step_ms over the rolling window
    wait_ms_min: float  #: transfer time estimate
    wait_ms_max: float
    delay_ms_max: float
    pacing_active: bool
    lead_ms: tuple[float, ...]  #: wait_r - min(wait)
    compute_ms: tuple[float, ...]
    wait_ms: tuple[float, ...]
    delay_ms: tuple[float, ...]
    rank_step_ms: tuple[float, ...]
    data_ms: tuple[float, ...]
    gap_ms: tuple[float, ...]
    buckets: int
    gc_ms: tuple[float, ...] = ()  #: per rank: time in the garbage collector during the step
    gc_collections: tuple[int, ...] = ()  #: per rank: collections during the step
    samples: tuple[int, ...] = ()  #: per rank: samples trained on (0: not known)
    #: per rank: completion of the collective -> step end (optimizer step, the framework's hooks)
    opt_ms: tuple[float, ...] = ()
    #: per rank: 1 when the host was the bottleneck of the step (``Field.HOST_BOUND``)
    host_bound: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()  #: per rank: tokens trained on (0: not known)
    #: (median, min, max) of ``lead_ms`` over the ranks (the median: the upper one of an even count);
    #: ``None``: take them from ``lead_ms``. Set by the summarizer, also where the per-rank tuples are
    #: left empty (a wide world whose per-rank columns go to the columnar record)
    lead_band: tuple[float, float, float] | None = None
    #: the largest ``gc_ms`` over the ranks (``None``: take it from ``gc_ms``)
    gc_ms_max: float | None = None
    #: per group of ranks, where the summarizer was given groups (``tag_groups``): the group's lead,
    #: the smallest of its ranks' ``lead_ms`` (0 for the group that holds the straggler)
    group_lead_ms: tuple[float, ...] = ()

    def lead_ms_band(self) -> tuple[float, float, float]:
        """(median, min, max) of the ranks' leads."""
        if self.lead_band is not None:
            return self.lead_band
        leads = sorted(self.lead_ms)
        return (leads[len(leads) // 2], leads[0], leads[-1]) if leads else (0.0, 0.0, 0.0)

    def largest_gc_ms(self) -> float:
        """The longest time a rank spent in its garbage collector in this step, ms."""
        return self.gc_ms_max if self.gc_ms_max is not None else max(self.gc_ms, default=0.0)
