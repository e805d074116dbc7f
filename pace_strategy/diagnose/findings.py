"""Name the failure mode a run record shows: which ranks and hosts, with the evidence in numbers."""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from pace_strategy.core.glossary import lead_ms, skew_ms, straggler_rank, transfer_ms
from pace_strategy.diagnose.arrays import RANK_AXIS, RunArrays
from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.hosts import HostLoad, host_loads
from pace_strategy.diagnose.noise import jitter_floor
from pace_strategy.diagnose.projection import DEFAULT_PROJECT_RANKS, project

__all__ = ["MODES", "Diagnosis", "Finding", "Mode", "diagnose"]


class Mode(str, enum.Enum):
    """The failure modes a diagnosis names; the values are the strings of ``--json`` and the docs."""

    PERSISTENT_STRAGGLER = "persistent_straggler"
    LOCALITY = "locality"
    SYNC_AMPLIFICATION = "sync_amplification"
    FABRIC_CONTENTION = "fabric_contention"
    DATA_STALL = "data_stall"
    HOST_OVERSUBSCRIPTION = "host_oversubscription"
    UNEXPLAINED_SKEW = "unexplained_skew"
    HEALTHY = "healthy"

    def __str__(self) -> str:
        # Python 3.11 formats str-mixin enums as "Mode.HEALTHY" in f-strings; reports print the value.
        return self.value


#: the mode strings, in declaration order
MODES: tuple[str, ...] = tuple(m.value for m in Mode)

# Structural minimums, not tunable: skew needs a second rank, and a slowness "follows a place" only if
# it shows on at least two places (one place is one rank or one host, reported as such).
_MIN_RANKS = 2
_MIN_PLACES = 2

# Fixed confidences (0..1). They rank findings for the reader and decide nothing, so they are not
# thresholds of DiagnosisConfig.
_UNEXPLAINED_CONFIDENCE = 0.3  #: lost time with no pattern: a pointer to the heat map, no more
_LATE_START_CONFIDENCE_FACTOR = 0.8  #: a slow path is inferred from start gaps, not measured on it
_FABRIC_BASE_CONFIDENCE = 0.6  #: plus _FABRIC_SIGNAL_CONFIDENCE for each of "inflated", "unstable"
_FABRIC_SIGNAL_CONFIDENCE = 0.2
_AMPLIFICATION_BASE_CONFIDENCE = 0.5  #: plus _AMPLIFICATION_SIGNAL_CONFIDENCE for each of heavy tail, growth
_AMPLIFICATION_SIGNAL_CONFIDENCE = 0.25
_OVERSUBSCRIPTION_BASE_CONFIDENCE = 0.6  #: busy threads > cores is read from the header, not inferred;
_OVERSUBSCRIPTION_SIGNAL_CONFIDENCE = 0.2  #: plus this for each of "waiting beyond the floor", "unsteady"

# Which statistics the evidence quotes (and the docs name): skew p99/p50, transfer p95/p50; the transfer
# time's floor (its best case, for what a steadier fabric would save) is its 5th percentile.
_SKEW_TAIL_PERCENTILE = 99
_TRANSFER_TAIL_PERCENTILE = 95
_TRANSFER_FLOOR_PERCENTILE = 5

# The amplification curve: slowest-of-k excess for k = 2, 4, ... up to W, on a fixed-seed sample of steps
# (a sample is plenty for a mean, and the seed keeps the report reproducible).
_GROWTH_RANK_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_GROWTH_SAMPLE_STEPS = 5000
_GROWTH_SEED = 0

_EPSILON = 1e-9  #: keeps ratios finite where a denominator (ms or share) is zero


@dataclass(frozen=True)
class Finding:
    """One diagnosed problem (or ``healthy``)."""

    mode: Mode
    ranks: list[int]
    hosts: list[str]
    confidence: float  #: 0..1
    lost_step_fraction: float  #: estimated share of step time lost to this problem
    evidence: str
    action: str
    details: dict[str, Any] = field(default_factory=dict)
    #: share of step time the run's own jitter explains over the steps this finding covers; a finding
    #: is worth acting on when ``lost_step_fraction - noise_floor_fraction >= healthy_lost_fraction``
    noise_floor_fraction: float = 0.0
    #: what the projection simulates: the job's whole ``waiting``, what the named ``ranks`` cost, or the
    #: collective's time (``transfer``, or its part above its best case, ``transfer_variable``)
    projection_basis: Literal["waiting", "ranks", "transfer", "transfer_variable"] = "waiting"
    #: ``[{"ranks": R, "lost_fraction": x}, ...]``: this problem's share of step time at R ranks
    projection: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain containers for JSON; ``mode`` as its string."""
        return {**asdict(self), "mode": self.mode.value}

    @property
    def excess_fraction(self) -> float:
        """Lost share beyond what the run's own jitter explains: what acting on it could save."""
        return self.lost_step_fraction - self.noise_floor_fraction


@dataclass(frozen=True)
class Diagnosis:
    findings: list[Finding]
    summary: str
    stats: dict[str, Any]
    thresholds: dict[str, Any]
    notes: list[str]
    projection: dict[str, Any] = field(default_factory=dict)  #: how the projections were made

    def to_dict(self) -> dict[str, Any]:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.summary,
            "stats": self.stats,
            "thresholds": self.thresholds,
            "notes": self.notes,
            "projection": self.projection,
        }


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def projection_text(points: Sequence[dict[str, float]]) -> str:
    """``"4.1% at 8, 11% at 64, 16% at 512 ranks"``."""
    return ", ".join(f"{_pct(p['lost_fraction'])} at {int(p['ranks']):,}" for p in points) + " ranks"


class _Run:
    """Derived per-step quantities shared by the checks."""

    def __init__(self, a: RunArrays, cfg: DiagnosisConfig) -> None:
        self.a, self.cfg = a, cfg
        self.W = a.world_size
        self.S = a.steps
        w = a.wait
        self.transfer = transfer_ms(w, RANK_AXIS)
        self.lead = lead_ms(w, RANK_AXIS)
        self.straggler = straggler_rank(w, RANK_AXIS)
        self.counts = np.bincount(self.straggler, minlength=self.W)
        self.share = self.counts / max(self.S, 1)
        self.median_wait = np.median(w, axis=1)
        self.lost_per_step = self.lead.mean(axis=1)
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
        self.has_fabric = len(set(self.hosts)) >= _MIN_PLACES or any(not d.startswith("cpu") for d in devices)
        self.notes: list[str] = []  #: what the checks observed but do not report as findings

    def others_median(self, x: np.ndarray, ranks: list[int]) -> np.ndarray:
        """Per step, the median of ``x`` over the ranks not in ``ranks``."""
        keep = np.ones(self.W, dtype=bool)
        keep[ranks] = False
        return np.median(x[:, keep], axis=1)

    def late_ms(self, ranks: list[int], mask: np.ndarray) -> np.ndarray:
        """How much later than the other ranks' median the straggler arrived, on the masked steps."""
        return (self.others_median(self.a.wait, ranks) - self.transfer)[mask]

    def noise_ms(self) -> float:
        return max(self.cfg.slow_ms_floor, self.cfg.slow_step_fraction * self.median_step)

    def lost_when(self, mask: np.ndarray) -> float:
        return float(self.lost_per_step[mask].sum()) / self.total_step if self.total_step > 0 else 0.0

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


def diagnose(
    a: RunArrays,
    cfg: DiagnosisConfig | None = None,
    *,
    project_ranks: Sequence[int] | None = DEFAULT_PROJECT_RANKS,
) -> Diagnosis:
    """All findings for a run, most costly first; ``healthy`` when there is nothing worth acting on.

    Each finding is projected to every rank count of ``project_ranks`` (``None`` or empty: none).
    """
    cfg = cfg or DiagnosisConfig()
    notes = []
    if a.truncated:
        notes.append(
            "the record's last line was cut off (the run crashed or is still running); it was skipped"
        )
    if a.end is None:
        notes.append("the record has no end line: the run did not finish cleanly")
    elif a.end.get("status") == "failed":
        notes.append(f"the run failed: {a.end.get('error')}")
    if a.steps < cfg.min_steps or a.world_size < _MIN_RANKS:
        return Diagnosis(
            findings=[],
            summary=f"not enough data to diagnose: {a.steps} usable steps, {a.world_size} ranks",
            stats={"steps": a.steps, "world_size": a.world_size},
            thresholds=cfg.to_dict(),
            notes=notes,
        )
    run = _Run(a, cfg)
    findings: list[Finding] = []
    explained: set[int] = set()
    checks = (
        _data_stall,
        _locality,
        _persistent_or_late_start,
        _host_oversubscription,
        _fabric,
        _sync_amplification,
    )
    for check in checks:
        findings.extend(check(run, explained))
    notes += run.notes
    minor = [f for f in findings if not run.worth_acting_on(f)]
    findings = [f for f in findings if run.worth_acting_on(f)]
    for f in minor:
        notes.append(
            f"below the worth-acting-on floor ({cfg.healthy_lost_fraction:.0%} of step time beyond what "
            f"the run's own jitter explains), not reported: {f.mode} ({f.lost_step_fraction:.1%} of step "
            f"time, of which jitter explains {f.noise_floor_fraction:.1%}): {f.evidence}"
        )
    total_lost = run.lost_when(run.all_steps)
    jitter = run.jitter_when(run.all_steps)
    if not findings:
        if total_lost - jitter < cfg.healthy_lost_fraction:
            findings.append(_healthy(run, total_lost, jitter))
        else:
            findings.append(
                Finding(
                    mode=Mode.UNEXPLAINED_SKEW,
                    ranks=[],
                    hosts=[],
                    confidence=_UNEXPLAINED_CONFIDENCE,
                    lost_step_fraction=total_lost,
                    noise_floor_fraction=jitter,
                    evidence=(
                        f"ranks lose {_pct(total_lost)} of step time waiting at the sync point, "
                        f"{_pct(total_lost - jitter)} more than the run's own jitter explains, but no "
                        "single rank, place, data wait or network pattern explains it"
                    ),
                    action="look at the per-rank lead heat map for a pattern the checks do not cover",
                )
            )
    findings.sort(key=lambda f: -f.lost_step_fraction)
    projection: dict[str, Any] = {}
    if project_ranks:
        findings, meta = project(
            a,
            findings,
            project_ranks,
            steps=cfg.projection_steps,
            calibration_steps=cfg.projection_calibration_steps,
            measured_lost_fraction=total_lost,
        )
        projection = meta.to_dict()
        notes.append(
            f"waiting costs {_pct(total_lost)} of step time at {run.W} ranks (the run's own jitter "
            f"explains {_pct(jitter)}); projected {projection_text(meta.waiting)} (simulated; the "
            "assumption is under projection)"
        )
    mean_step = float(a.step_ms.mean())
    stats = {
        "steps": run.S,
        "total_steps": a.total_steps,
        "world_size": run.W,
        "median_step_ms": run.median_step,
        "mean_step_ms": mean_step,
        "step_cv": float(a.step_ms.std() / mean_step) if mean_step > 0 else 0.0,
        "skew_ms_p50": float(np.percentile(run.skew, 50)),
        "skew_ms_p99": float(np.percentile(run.skew, _SKEW_TAIL_PERCENTILE)),
        "transfer_ms_p50": float(np.median(run.transfer)),
        "lost_step_fraction": total_lost,
        "jitter_sigma_ms": run.floor.sigma_ms,
        "noise_floor_fraction": jitter,
        "straggler_share": {int(r): float(s) for r, s in enumerate(run.share) if s > 0},
        "pacing_active_share": float(a.pacing_active.mean()),
        "oversubscribed_hosts": [h.host for h in run.crowded],
    }
    head = findings[0]
    summary = (
        f"{head.mode.value.replace('_', ' ')}: {head.evidence}"
        if head.mode is not Mode.HEALTHY
        else f"healthy: {head.evidence}"
    )
    return Diagnosis(
        findings=findings,
        summary=summary,
        stats=stats,
        thresholds=cfg.to_dict(),
        notes=notes,
        projection=projection,
    )


def _healthy(run: _Run, total_lost: float, jitter: float) -> Finding:
    top = int(run.share.argmax())
    excess = total_lost - jitter
    return Finding(
        mode=Mode.HEALTHY,
        ranks=[],
        hosts=[],
        confidence=float(np.clip(1.0 - excess / max(run.cfg.healthy_lost_fraction, _EPSILON), 0.0, 1.0)),
        lost_step_fraction=total_lost,
        noise_floor_fraction=jitter,
        evidence=(
            f"skew {np.median(run.skew):.1f} ms at the median ({_pct(np.median(run.skew) / run.median_step)} "
            f"of the {run.median_step:.1f} ms step), {_pct(total_lost)} of step time lost to waiting, of "
            f"which the run's own jitter (sd {run.floor.sigma_ms:.2f} ms per rank) explains "
            f"{_pct(jitter)} at {run.W} ranks; no rank last in more than {_pct(float(run.share[top]))} "
            f"of {run.S:,} steps"
        ),
        action=(
            "nothing to act on at this size; pacing would not help. The projection says what the same "
            "jitter costs at more ranks (the slowest of more ranks is later)"
        ),
    )


def _data_stall(run: _Run, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    noise = run.noise_ms()
    for r in range(run.W):
        mask = run.straggler == r
        if run.share[r] < cfg.data_straggler_share or mask.sum() < cfg.data_straggler_steps:
            continue
        late = run.late_ms([r], mask)
        excess = (run.a.data[:, r] - run.others_median(run.a.data, [r]))[mask]
        explained_share = float(np.median(np.clip(excess, 0, None) / np.maximum(late, _EPSILON)))
        if np.median(excess) >= noise and explained_share >= cfg.data_share:
            explained.add(r)
            out.append(
                Finding(
                    mode=Mode.DATA_STALL,
                    ranks=[r],
                    hosts=run.hosts_of([r]),
                    confidence=min(1.0, explained_share) * float(run.share[r]) ** 0.5,
                    lost_step_fraction=run.lost_when(mask),
                    noise_floor_fraction=run.jitter_when(mask),
                    projection_basis="ranks",
                    evidence=(
                        f"{run.a.describe_rank(r)} arrived last in {_pct(float(run.share[r]))} of "
                        f"{run.S:,} steps, {np.median(late):.1f} ms late at the median; in those steps it "
                        f"waited {np.median(run.a.data[mask, r]):.1f} ms for its input against "
                        f"{np.median(run.others_median(run.a.data, [r])[mask]):.1f} ms for the other ranks"
                    ),
                    action=(
                        "the input pipeline of this rank is the bottleneck: more DataLoader workers, "
                        "pin_memory/prefetch, faster or local storage; pacing cannot help"
                    ),
                )
            )
    return out


def _locality(run: _Run, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    node_ids = sorted(set(map(str, run.nodes)))
    # the same local rank index slow on every node; with one rank per node every rank has the same
    # index, which then says nothing about place (a moving straggler is not locality)
    if len(node_ids) >= _MIN_PLACES and min(run.local) >= 0 and len(set(run.local)) >= _MIN_PLACES:
        local_of = np.asarray(run.local)[run.straggler]
        counts = Counter(local_of.tolist())
        index, hits = counts.most_common(1)[0]
        share = hits / run.S
        members = [r for r in range(run.W) if run.local[r] == index]
        member_shares = [float(run.share[r]) for r in members]
        spread = sum(s >= cfg.locality_spread_fraction * share / len(members) for s in member_shares)
        if share >= cfg.locality_share and len(members) >= _MIN_PLACES and spread >= _MIN_PLACES:
            mask = np.isin(run.straggler, members)
            explained.update(members)
            excess = float(np.median(run.late_ms(members, mask)))
            out.append(
                Finding(
                    mode=Mode.LOCALITY,
                    ranks=members,
                    hosts=run.hosts_of(members),
                    confidence=share,
                    lost_step_fraction=run.lost_when(mask),
                    noise_floor_fraction=run.jitter_when(mask),
                    projection_basis="ranks",
                    evidence=(
                        f"local rank {index} was the straggler in {_pct(share)} of {run.S:,} steps, on "
                        f"{spread} of {len(node_ids)} nodes (ranks {', '.join(map(str, members))}: last in "
                        f"{', '.join(_pct(s) for s in member_shares)} of steps), {excess:.1f} ms late at the "
                        "median: slowness follows the local index, not one rank"
                    ),
                    action=(
                        f"compare what local rank {index} shares on every node: its GPU's PCIe/NUMA path, "
                        "NIC "
                        "affinity, CPU binding (check the topology in the run record); fix the placement"
                    ),
                )
            )
            return out
    # every rank of one host
    host_of = np.asarray(run.hosts)[run.straggler]
    counts = Counter(host_of.tolist())
    host, hits = counts.most_common(1)[0]
    share = hits / run.S
    members = [r for r in range(run.W) if run.hosts[r] == host]
    crowded = host in {h.host for h in run.crowded}  # then host_oversubscription names it, with the cause
    if (
        len(set(run.hosts)) >= _MIN_PLACES
        and len(members) >= _MIN_PLACES
        and share >= cfg.locality_share
        and not crowded
    ):
        member_shares = [float(run.share[r]) for r in members]
        if max(member_shares) < cfg.persistent_share:  # the straggler moves between the host's ranks
            mask = np.isin(run.straggler, members)
            explained.update(members)
            out.append(
                Finding(
                    mode=Mode.LOCALITY,
                    ranks=members,
                    hosts=[host],
                    confidence=share,
                    lost_step_fraction=run.lost_when(mask),
                    noise_floor_fraction=run.jitter_when(mask),
                    projection_basis="ranks",
                    evidence=(
                        f"a rank of host {host} was the straggler in {_pct(share)} of {run.S:,} steps "
                        f"(ranks {', '.join(map(str, members))}; none alone above "
                        f"{_pct(max(member_shares))}): the host is slow, not one rank"
                    ),
                    action=(
                        "check that host: CPU frequency/thermal throttling, other jobs, its NIC and switch "
                        "port"
                    ),
                )
            )
    return out


def _persistent_or_late_start(run: _Run, explained: set[int]) -> list[Finding]:
    out = []
    noise = run.noise_ms()
    for r in range(run.W):
        if r in explained or run.share[r] < run.cfg.persistent_share:
            continue
        mask = run.straggler == r
        late = float(np.median(run.late_ms([r], mask)))
        if late < noise:
            continue
        compute_late = float(np.median((run.a.compute[:, r] - run.others_median(run.a.compute, [r]))[mask]))
        explained.add(r)
        if compute_late >= run.cfg.compute_late_fraction * late:
            out.append(
                Finding(
                    mode=Mode.PERSISTENT_STRAGGLER,
                    ranks=[r],
                    hosts=run.hosts_of([r]),
                    confidence=float(run.share[r]),
                    lost_step_fraction=run.lost_when(mask),
                    noise_floor_fraction=run.jitter_when(mask),
                    projection_basis="ranks",
                    evidence=(
                        f"{run.a.describe_rank(r)} arrived last in {_pct(float(run.share[r]))} of "
                        f"{run.S:,} steps, {late:.1f} ms late at the median; its own compute took "
                        f"{compute_late:.1f} ms longer than the other ranks' median"
                    ),
                    action=(
                        "this rank's local work is slow: check its device (clocks, throttling, ECC), other "
                        "processes on its host, its input; pacing the others cannot shorten its steps"
                    ),
                )
            )
        else:
            gap_r = float(np.median(run.a.gap[mask, r]))
            gap_others = float(np.median(run.others_median(run.a.gap, [r])[mask]))
            out.append(
                Finding(
                    mode=Mode.FABRIC_CONTENTION,
                    ranks=[r],
                    hosts=run.hosts_of([r]),
                    confidence=float(run.share[r]) * _LATE_START_CONFIDENCE_FACTOR,
                    lost_step_fraction=run.lost_when(mask),
                    noise_floor_fraction=run.jitter_when(mask),
                    projection_basis="ranks",
                    evidence=(
                        f"{run.a.describe_rank(r)} arrived last in {_pct(float(run.share[r]))} of "
                        f"{run.S:,} steps, {late:.1f} ms late at the median, but its compute was normal "
                        f"({compute_late:+.1f} ms against the other ranks' median): it started each step "
                        f"{gap_r:.1f} ms after its previous collective completed, against "
                        f"{gap_others:.1f} ms "
                        "on the other ranks, so its lateness comes from a slower network path, not from "
                        "the rank"
                    ),
                    action=(
                        "look at this rank's network path (link rate, switch port, oversubscribed uplink); "
                        "the rank itself is healthy and must not be paced or replaced"
                    ),
                    details={
                        "late_ms": late,
                        "compute_late_ms": compute_late,
                        "start_gap_ms": gap_r,
                        "others_start_gap_ms": gap_others,
                    },
                )
            )
    return out


def _host_oversubscription(run: _Run, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    for h in run.crowded:
        # the steps whose straggler is on this host and not already explained (a slow rank, its input)
        mask = np.isin(run.straggler, [r for r in h.ranks if r not in explained])
        lost, jitter = run.lost_when(mask), run.jitter_when(mask)
        explained.update(h.ranks)  # a moving straggler on a crowded host: the host, not amplification
        cols = run.a.compute[:, h.ranks]
        compute_cv = float(np.median(cols.std(axis=0) / np.maximum(cols.mean(axis=0), _EPSILON)))
        step_cv = float(run.a.step_ms.std() / max(float(run.a.step_ms.mean()), _EPSILON))
        beyond = lost - jitter >= cfg.healthy_lost_fraction
        unsteady = max(compute_cv, step_cv) >= cfg.compute_cv_steady
        t = run.transfer
        transfer_cv = float(t.std() / t.mean()) if t.mean() > 0 else 0.0
        collective = (
            f"; the collective's time is unstable too (CV {transfer_cv:.2f}): on a crowded host it waits "
            "for CPU, so it is not reported as fabric contention"
            if run.crowded_ranks >= set(range(run.W)) and transfer_cv >= cfg.transfer_cv
            else ""
        )
        out.append(
            Finding(
                mode=Mode.HOST_OVERSUBSCRIPTION,
                ranks=list(h.ranks),
                hosts=[h.host],
                confidence=_OVERSUBSCRIPTION_BASE_CONFIDENCE
                + _OVERSUBSCRIPTION_SIGNAL_CONFIDENCE * beyond
                + _OVERSUBSCRIPTION_SIGNAL_CONFIDENCE * unsteady,
                lost_step_fraction=lost,
                noise_floor_fraction=jitter,
                evidence=(
                    f"host {h.host}: {h.load_text()} = {h.busy_threads} busy threads on {h.cores_text()}, "
                    f"{h.ratio:.1f} per core; steps {run.median_step:.1f} ms at the median (CV "
                    f"{step_cv:.2f}, per-rank compute CV {compute_cv:.2f}), {_pct(lost)} of step time lost "
                    "to waiting — a lower bound of the cost, since time-slicing slows every rank's own "
                    f"compute too{collective}"
                ),
                action=h.fix_text(),
                details={
                    "host": h.host,
                    "busy_threads": h.busy_threads,
                    "cores": h.cores,
                    "cores_from": h.cores_from,
                    "cpu_affinity": h.affinity,
                    "host_cores": h.host_cores,
                    "intra_op_threads": h.threads,
                    "intra_op_threads_recorded": h.threads_known,
                    "omp_num_threads": h.omp_num_threads,
                    "dataloader_workers": h.workers,
                    "dataloader_workers_recorded": h.workers_known,
                    "suggested_threads_per_rank": h.threads_per_rank_fix(),
                },
            )
        )
    return out


def _fabric(run: _Run, explained: set[int]) -> list[Finding]:
    cfg = run.cfg
    if run.crowded_ranks >= set(range(run.W)):
        # Every host is oversubscribed: a collective needs CPU to make progress, so its time is not
        # the fabric's (the host_oversubscription finding quotes it).
        return []
    t = run.transfer
    med = float(np.median(t))
    cv = float(t.std() / t.mean()) if t.mean() > 0 else 0.0
    p95 = float(np.percentile(t, _TRANSFER_TAIL_PERCENTILE))
    compute_cv = float(
        np.median(run.a.compute.std(axis=0) / np.maximum(run.a.compute.mean(axis=0), _EPSILON))
    )
    inflated = med >= cfg.transfer_step_fraction * run.median_step
    unstable = cv >= cfg.transfer_cv or (med > 0 and p95 / med >= cfg.heavy_tail_ratio)
    if unstable and not run.has_fabric:
        # One CPU host: the collective runs over loopback on the ranks' own cores, so its time varies
        # with CPU scheduling (every clean run here shows CV 0.6-0.9), not with a network.
        if med >= run.noise_ms():
            run.notes.append(
                f"the collective's time varies (CV {cv:.2f}, p95 {p95:.1f} ms, median {med:.1f} ms), but "
                "all ranks share one CPU host: over loopback it competes for the ranks' cores, so it is "
                "not reported as fabric contention"
            )
        unstable = False
    if not (inflated and compute_cv <= cfg.compute_cv_steady) and not (
        unstable and med >= run.noise_ms() and compute_cv <= cfg.compute_cv_steady
    ):
        return []
    floor = float(np.percentile(t, _TRANSFER_FLOOR_PERCENTILE))
    variable = float((t - floor).sum()) / run.total_step
    # Inflated: without a baseline of this fabric at its best, the whole transfer is the upper bound.
    lost = max(variable, med / run.median_step) if inflated else variable
    what = []
    if inflated:
        what.append(
            f"transfer time {med:.1f} ms at the median, {_pct(med / run.median_step)} of the step "
            "(the upper bound of what a faster fabric could save)"
        )
    if unstable:
        what.append(f"unstable (CV {cv:.2f}, p95 {p95:.1f} ms)")
    return [
        Finding(
            mode=Mode.FABRIC_CONTENTION,
            ranks=list(range(run.W)),
            hosts=sorted(set(run.hosts)),
            confidence=_FABRIC_BASE_CONFIDENCE
            + _FABRIC_SIGNAL_CONFIDENCE * inflated
            + _FABRIC_SIGNAL_CONFIDENCE * unstable,
            lost_step_fraction=lost,
            projection_basis="transfer" if inflated else "transfer_variable",
            evidence=" and ".join(what) + f", while compute is steady (per-rank CV {compute_cv:.2f})",
            action=(
                "the collective itself is slow once everyone has arrived: check link rates and "
                "oversubscription of shared uplinks, concurrent jobs on the fabric, NCCL/gloo transport "
                "settings; larger buckets overlap more of it with backward"
            ),
            details={"transfer_ms_p50": med, "transfer_cv": cv, "compute_cv": compute_cv},
        )
    ]


def _sync_amplification(run: _Run, explained: set[int]) -> list[Finding]:
    cfg = run.cfg
    if explained:
        return []
    p = run.share[run.share > 0]
    entropy = float(-(p * np.log(p)).sum() / math.log(run.W)) if run.W > 1 else 0.0
    lost = run.lost_when(run.all_steps)
    jitter = run.jitter_when(run.all_steps)
    p50 = float(np.percentile(run.skew, 50))
    p99 = float(np.percentile(run.skew, _SKEW_TAIL_PERCENTILE))
    heavy = p50 <= 0 or p99 / max(p50, _EPSILON) >= cfg.heavy_tail_ratio
    # No rank was found persistent (``explained`` is empty): with two ranks one of them is last in at least
    # half the steps however the straggler moves, so a share alone cannot say "persistent".
    if entropy < cfg.spread_entropy or lost - jitter < cfg.healthy_lost_fraction:
        return []
    growth = _max_growth(run)
    grows = len(growth) > 1 and growth[-1][1] > cfg.growth_ratio * growth[0][1]
    curve = ", ".join(f"{k} ranks {v:.1f} ms" for k, v in growth)
    return [
        Finding(
            mode=Mode.SYNC_AMPLIFICATION,
            ranks=sorted(int(r) for r in np.nonzero(run.share > 0)[0]),
            hosts=sorted(set(run.hosts)),
            confidence=min(
                1.0,
                _AMPLIFICATION_BASE_CONFIDENCE
                + _AMPLIFICATION_SIGNAL_CONFIDENCE * heavy
                + _AMPLIFICATION_SIGNAL_CONFIDENCE * grows,
            ),
            lost_step_fraction=lost,
            noise_floor_fraction=jitter,
            evidence=(
                f"the straggler changes from step to step ({int((run.share > 0).sum())} of {run.W} ranks "
                "took "
                f"turns, entropy {entropy:.2f}, none above {_pct(float(run.share.max()))}); skew p50 "
                f"{p50:.1f} ms, p99 {p99:.1f} ms{' (heavy-tailed)' if heavy else ''}; "
                f"{_pct(lost)} of step time lost to waiting ({_pct(lost - jitter)} beyond what the bulk "
                f"of the jitter, sd {run.floor.sigma_ms:.2f} ms per rank, explains); expected "
                "slowest-rank excess grows with "
                f"ranks: {curve}"
            ),
            action=(
                "transient slowness somewhere in many ranks, amplified by the barrier: find the sources "
                "(GC pauses, checkpoint I/O, noisy neighbours, power capping); it gets worse with more ranks"
            ),
            details={"entropy": entropy, "growth_ms": growth},
        )
    ]


def _max_growth(run: _Run) -> list[tuple[int, float]]:
    """Mean over steps of (slowest of k random ranks - median rank) of arrival lateness, k = 2, 4, ...W."""
    rng = np.random.default_rng(_GROWTH_SEED)
    rows = rng.choice(run.S, size=min(run.S, _GROWTH_SAMPLE_STEPS), replace=False)
    late = (run.median_wait[:, None] - run.a.wait)[rows]  # how much later than the median rank each arrived
    sizes = [k for k in _GROWTH_RANK_COUNTS if k < run.W] + [run.W]
    out = []
    for k in sizes:
        picks = np.argsort(rng.random(late.shape), axis=1)[:, :k]
        out.append((k, float(np.take_along_axis(late, picks, axis=1).max(axis=1).mean())))
    return out
