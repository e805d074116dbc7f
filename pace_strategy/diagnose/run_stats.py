"""What every check reads: a run's derived per-step quantities, and the fixed constants the
checks share (structural minimums, confidences, quoted percentiles)."""

from __future__ import annotations

import functools

import numpy as np

from pace_strategy.core.glossary import lead_ms, skew_ms, straggler_rank, transfer_ms
from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.hosts import HostLoad, host_loads
from pace_strategy.diagnose.noise import jitter_floor
from pace_strategy.diagnose.result import Finding, Mode
from pace_strategy.telemetry.arrays import RANK_AXIS, RunArrays

__all__ = [
    "AMPLIFICATION_BASE_CONFIDENCE",
    "AMPLIFICATION_SIGNAL_CONFIDENCE",
    "EPSILON",
    "FABRIC_BASE_CONFIDENCE",
    "FABRIC_SIGNAL_CONFIDENCE",
    "GROWTH_RANK_COUNTS",
    "GROWTH_SAMPLE_STEPS",
    "GROWTH_SEED",
    "LATE_START_CONFIDENCE_FACTOR",
    "MIN_PLACES",
    "MIN_RANKS",
    "OVERSUBSCRIPTION_BASE_CONFIDENCE",
    "OVERSUBSCRIPTION_SIGNAL_CONFIDENCE",
    "SKEW_TAIL_PERCENTILE",
    "STEADY_MEDIAN_FRACTION",
    "TRANSFER_FLOOR_PERCENTILE",
    "TRANSFER_TAIL_PERCENTILE",
    "UNEXPLAINED_CONFIDENCE",
    "RunStats",
]


# Structural minimums, not tunable: skew needs a second rank, and a slowness "follows a place" only if
# it shows on at least two places (one place is one rank or one host, reported as such).
MIN_RANKS = 2

MIN_PLACES = 2

# Fixed confidences (0..1). They rank findings for the reader and decide nothing, so they are not
# thresholds of DiagnosisConfig.
UNEXPLAINED_CONFIDENCE = 0.3  #: lost time with no pattern: a pointer to the heat map, no more

LATE_START_CONFIDENCE_FACTOR = 0.8  #: a slow path is inferred from start gaps, not measured on it

FABRIC_BASE_CONFIDENCE = 0.6  #: plus FABRIC_SIGNAL_CONFIDENCE for each of "inflated", "unstable"

FABRIC_SIGNAL_CONFIDENCE = 0.2

AMPLIFICATION_BASE_CONFIDENCE = 0.5  #: plus AMPLIFICATION_SIGNAL_CONFIDENCE for each of heavy tail, growth

AMPLIFICATION_SIGNAL_CONFIDENCE = 0.25

OVERSUBSCRIPTION_BASE_CONFIDENCE = 0.6  #: busy threads > cores is read from the header, not inferred;

OVERSUBSCRIPTION_SIGNAL_CONFIDENCE = 0.2  #: plus this for each of "waiting beyond the floor", "unsteady"

# Which statistics the evidence quotes (and the docs name): skew p99/p50, transfer p95/p50; the transfer
# time's floor (its best case, for what a steadier fabric would save) is its 5th percentile.
SKEW_TAIL_PERCENTILE = 99

TRANSFER_TAIL_PERCENTILE = 95

TRANSFER_FLOOR_PERCENTILE = 5

# The amplification curve: slowest-of-k excess for k = 2, 4, ... up to W, on a fixed-seed sample of steps
# (a sample is plenty for a mean, and the seed keeps the report reproducible).
GROWTH_RANK_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

GROWTH_SAMPLE_STEPS = 5000

GROWTH_SEED = 0

#: steps a run-wide [steps, ranks] intermediate is computed over at a time (4,096 x 1,024 ranks: 32 MB)
_ROWS = 4096

#: ranks a per-rank statistic over the run is computed for at a time
_COLUMNS = 128

EPSILON = 1e-9  #: keeps ratios finite where a denominator (ms or share) is zero

#: a straggler whose median lateness is at least this fraction of its wait-weighted mean lateness is
#: late by a steady amount (quoted at the median); below it, it is late in bursts (quoted weighted)
STEADY_MEDIAN_FRACTION = 0.5


def _rows_median(x: np.ndarray, rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> np.ndarray:
    """``np.median(x[rows][:, cols], axis=1)`` (``None``: every row, every column), a block of rows
    at a time: each block is copied once and partitioned in place, so the whole selection is never
    held (a row's median is the same whichever rows it is computed with)."""
    rows = np.arange(len(x)) if rows is None else rows
    out = np.empty(len(rows))
    for i in range(0, len(rows), _ROWS):
        block = x[rows[i : i + _ROWS]] if cols is None else x[np.ix_(rows[i : i + _ROWS], cols)]
        out[i : i + _ROWS] = np.median(block, axis=1, overwrite_input=True)
    return out


class RunStats:
    """Derived per-step quantities shared by the checks."""

    def __init__(self, a: RunArrays, cfg: DiagnosisConfig) -> None:
        self.a, self.cfg = a, cfg
        self.W = a.world_size
        self.S = a.steps
        w = a.wait
        self.transfer = transfer_ms(w, RANK_AXIS)
        self.straggler = straggler_rank(w, RANK_AXIS)
        self.counts = np.bincount(self.straggler, minlength=self.W)
        self.share = self.counts / max(self.S, 1)
        self.median_wait = _rows_median(w)
        #: [S] the ranks' mean lead: what the step lost waiting. Rows at a time: the [S, W] leads are
        #: never held whole (a row's mean is the same whichever rows it is computed with)
        self.lost_per_step = (
            np.concatenate(
                [lead_ms(w[i : i + _ROWS], RANK_AXIS).mean(axis=1) for i in range(0, self.S, _ROWS)]
            )
            if self.S
            else np.zeros(0)
        )
        self.total_step = float(a.step_ms.sum())
        self.median_step = float(np.median(a.step_ms))
        self.skew = skew_ms(w, RANK_AXIS)
        self.hosts = [str(h) if h is not None else "?" for h in a.topology("host")]
        nodes = a.topology("node_rank")
        self.nodes = [n if n is not None and n >= 0 else self.hosts[r] for r, n in enumerate(nodes)]
        local = a.topology("local_rank")
        self.local = [x if x is not None and x >= 0 else -1 for x in local]
        self.floor = jitter_floor(w, a.step_ms)
        self.crowded: list[HostLoad] = [
            h for h in host_loads(list(a.header.get("topology", []))) if h.ratio > cfg.busy_threads_per_core
        ]
        self.crowded_ranks = {r for h in self.crowded for r in h.ranks}
        self.all_steps = np.ones(self.S, dtype=bool)
        devices = [str(d) for d in a.topology("device") if d is not None]
        #: a network or device links between the ranks (several hosts, or accelerators)
        self.has_fabric = len(set(self.hosts)) >= MIN_PLACES or any(not d.startswith("cpu") for d in devices)
        self.notes: list[str] = []  #: what the checks observed but do not report as findings
        #: shares of step time (lost, and its noise floor) that a cause without ranks of its own (a
        #: crowded host's time-slicing) has claimed of the whole run's waiting: the checks that read
        #: the whole run's waiting count only the rest
        self.accounted_lost = 0.0
        self.accounted_floor = 0.0
        # The gap before step k (its previous collective's completion to its start) holds the rank's
        # optimizer step of step k-1 (``opt``, where recorded) and its input (``data``), its own work,
        # and the framework's loop between steps, where a framework may run a collective of its own
        # (Lightning broadcasts from rank 0 every step): the one part a slower network path can make
        # late. Records without ``opt_ms`` count the whole gap beyond the input as that loop.
        # (:meth:`between_steps`: for the steps a check reads, not [S, W] arrays of the whole run.)

    def between_steps(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """On the masked steps (``[S]`` bool), ``[steps, ranks]``: each rank's own work between steps
        (its previous optimizer step and its input), and the rest of the gap (the framework's loop
        between steps and its collectives)."""
        rows = np.nonzero(mask)[0]
        a = self.a
        # the optimizer step of the step before (the first step's own for step 0: none came before)
        opt_prev = a.opt[np.maximum(rows - 1, 0)] if a.opt is not None else np.zeros((len(rows), self.W))
        own = opt_prev + a.data[rows]
        return own, np.clip(a.gap[rows] - own, 0.0, None)

    @functools.cached_property
    def compute_spread(self) -> tuple[np.ndarray, np.ndarray]:
        """Each rank's compute time over the run: its standard deviation and mean (``[W]`` each, ms),
        a block of ranks at a time (``compute.std(axis=0)`` holds a [steps, ranks] temporary: 819 MB
        at 100k steps x 1,024 ranks; a column's numbers are the same either way)."""
        c = self.a.compute
        blocks = range(0, self.W, _COLUMNS)
        std = np.concatenate([c[:, i : i + _COLUMNS].std(axis=0) for i in blocks]) if self.W else np.zeros(0)
        mean = (
            np.concatenate([c[:, i : i + _COLUMNS].mean(axis=0) for i in blocks]) if self.W else np.zeros(0)
        )
        return std, mean

    def others_median(self, x: np.ndarray, ranks: list[int], mask: np.ndarray | None = None) -> np.ndarray:
        """Per step (per masked step, with ``mask``), the median of ``x`` over the ranks not in
        ``ranks``. The mask goes first: a check that asks this of every rank for the steps it was
        last in then does W medians of its own steps, not W medians of the whole run."""
        keep = np.ones(self.W, dtype=bool)
        keep[ranks] = False
        return _rows_median(x, None if mask is None else np.nonzero(mask)[0], np.nonzero(keep)[0])

    def late_ms(self, ranks: list[int], mask: np.ndarray) -> np.ndarray:
        """How much later than the other ranks' median the straggler arrived, on the masked steps."""
        return self.others_median(self.a.wait, ranks, mask) - self.transfer[mask]

    def noise_ms(self) -> float:
        return max(self.cfg.slow_ms_floor, self.cfg.slow_step_fraction * self.median_step)

    def lost_when(self, mask: np.ndarray) -> float:
        return float(self.lost_per_step[mask].sum()) / self.total_step if self.total_step > 0 else 0.0

    def account(self, lost: float, floor: float) -> None:
        """Claim ``lost`` of the run's waiting (share of step time) and ``floor`` of its noise floor."""
        self.accounted_lost += lost
        self.accounted_floor += floor

    def jitter_when(self, mask: np.ndarray) -> float:
        """The noise floor over the masked steps: the waiting the run's own jitter explains there."""
        if self.total_step <= 0:
            return 0.0
        lead = self.cfg.jitter_floor_factor * self.floor.expected_lead_ms
        return lead * float(mask.sum()) / self.total_step

    def worth_acting_on(self, f: Finding) -> bool:
        # A crowded host is read from the header, not inferred from the timings: it is reported whatever
        # the waiting costs, since the time-slicing slows every rank's compute too.
        return f.mode is Mode.HOST_OVERSUBSCRIPTION or f.excess_fraction >= self.cfg.healthy_lost_fraction

    def hosts_of(self, ranks: list[int]) -> list[str]:
        return sorted({self.hosts[r] for r in ranks})
