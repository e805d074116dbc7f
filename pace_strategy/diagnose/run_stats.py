"""What every check reads: a run's derived per-step quantities, and the fixed constants the
checks share (structural minimums, confidences, quoted percentiles)."""

from __future__ import annotations

import numpy as np

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.digest import GROWTH_SAMPLE_STEPS, GROWTH_SEED, RunDigest, digest_run, noise_ms
from pace_strategy.diagnose.hosts import HostLoad, host_loads
from pace_strategy.diagnose.result import Finding, Mode
from pace_strategy.telemetry.arrays import RunLines

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

EPSILON = 1e-9  #: keeps ratios finite where a denominator (ms or share) is zero

#: a straggler whose median lateness is at least this fraction of its wait-weighted mean lateness is
#: late by a steady amount (quoted at the median); below it, it is late in bursts (quoted weighted)
STEADY_MEDIAN_FRACTION = 0.5


class RunStats:
    """Derived per-step quantities shared by the checks: the run's lines (``a``) and what its
    per-rank numbers reduce to (``digest``, :mod:`pace_strategy.diagnose.digest`; read here when
    not given)."""

    def __init__(self, a: RunLines, cfg: DiagnosisConfig, digest: RunDigest | None = None) -> None:
        digest = digest if digest is not None else digest_run(a, cfg)
        self.a, self.cfg, self.digest = a, cfg, digest
        self.W = a.world_size
        self.S = a.steps
        self.transfer = digest.transfer
        self.straggler = digest.straggler
        self.counts = np.bincount(self.straggler, minlength=self.W)
        self.share = self.counts / max(self.S, 1)
        self.median_wait = digest.median_wait
        #: [S] the ranks' mean lead: what the step lost waiting
        self.lost_per_step = digest.lost
        self.total_step = float(a.step_ms.sum())
        self.median_step = float(np.median(a.step_ms))
        self.skew = digest.skew
        self.hosts = [str(h) if h is not None else "?" for h in a.topology("host")]
        nodes = a.topology("node_rank")
        self.nodes = [n if n is not None and n >= 0 else self.hosts[r] for r, n in enumerate(nodes)]
        local = a.topology("local_rank")
        self.local = [x if x is not None and x >= 0 else -1 for x in local]
        self.floor = digest.floor
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

    def own(self, field: str, mask: np.ndarray) -> np.ndarray:
        """On the masked steps, the straggler's ``field``: ``compute``, ``data``, ``between`` (its own
        work between steps: the optimizer step of the step before, where recorded, and its input) or
        ``loop`` (the rest of the gap before the step: the framework's loop between steps, where a
        framework may run a collective of its own, e.g. Lightning's broadcast from rank 0, and the
        one part a slower network path can make late)."""
        return self.digest.own[field][mask]

    def others(self, field: str, mask: np.ndarray) -> np.ndarray:
        """On the masked steps, the median of ``field`` over the ranks but the straggler (a field of
        :meth:`own`, or ``wait``)."""
        return self.digest.others[field][mask]

    @property
    def compute_spread(self) -> tuple[np.ndarray, np.ndarray]:
        """Each rank's compute time over the run: its standard deviation and mean (``[W]`` each, ms)."""
        return self.digest.compute_std, self.digest.compute_mean

    def late_ms(self, mask: np.ndarray) -> np.ndarray:
        """How much later than the other ranks' median the straggler arrived, on the masked steps."""
        return self.others("wait", mask) - self.transfer[mask]

    def group_late_ms(self, mask: np.ndarray) -> np.ndarray:
        """How much later than the median of the ranks outside its local-index group the straggler
        arrived, on the masked steps (local indices recorded)."""
        assert self.digest.local_others_wait is not None
        return self.digest.local_others_wait[mask] - self.transfer[mask]

    def noise_ms(self) -> float:
        return noise_ms(self.cfg, self.median_step)

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
        crowded = f.mode is Mode.HOST_OVERSUBSCRIPTION
        return crowded or f.scope_excess_fraction >= self.cfg.healthy_lost_fraction

    def hosts_of(self, ranks: list[int]) -> list[str]:
        return sorted({self.hosts[r] for r in ranks})
