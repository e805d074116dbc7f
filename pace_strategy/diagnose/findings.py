"""Name the failure mode a run record shows: which ranks and hosts, with the evidence in numbers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.digest import RunDigest, digest_run
from pace_strategy.diagnose.gc_checks import gc_pauses
from pace_strategy.diagnose.group_checks import fabric_contention, sync_amplification
from pace_strategy.diagnose.hang import hang_evidence_notes
from pace_strategy.diagnose.input_checks import input_imbalance
from pace_strategy.diagnose.projection import DEFAULT_PROJECT_RANKS, project
from pace_strategy.diagnose.rank_checks import (
    data_stall,
    host_oversubscription,
    locality,
    persistent_or_late_start,
)
from pace_strategy.diagnose.rebalance import RebalanceOutcome, balance_outcome, rebalance_outcome
from pace_strategy.diagnose.result import MODES, Diagnosis, Finding, Mode, pct, projection_text
from pace_strategy.diagnose.run_stats import (
    EPSILON,
    MIN_RANKS,
    SKEW_TAIL_PERCENTILE,
    UNEXPLAINED_CONFIDENCE,
    RunStats,
)
from pace_strategy.diagnose.slow_groups import slow_group, straggler_episode
from pace_strategy.telemetry.arrays import RunLines, timeline_notes
from pace_strategy.telemetry.run_record import arrival_of, hang_text
from pace_strategy.telemetry.topology import group_numbers, mesh_caveats, tensor_parallel_groups

__all__ = ["MODES", "Diagnosis", "Finding", "Mode", "diagnose", "diagnose_run", "projection_text"]


def _restart_notes(a: RunLines) -> list[str]:
    """An elastically restarted job: which attempt this record is, and how every attempt ended."""
    restarts = int(a.header.get("restart_count", 0))
    notes = []
    if restarts:
        notes.append(
            f"elastic restart: this record is attempt {restarts + 1} of the job (torchrun restarted its "
            f"workers {restarts} time{'s' if restarts > 1 else ''}; TORCHELASTIC_RESTART_COUNT={restarts})"
        )
    for attempt in a.attempts:
        error = f": {attempt['error']}" if attempt.get("error") else ""
        hangs = "".join(f"; hang: {hang_text(h)}" for h in attempt.get("hangs", []))
        which = " (this record)" if attempt.get("this") else ""
        number = int(attempt["restart_count"] or 0) + 1
        notes.append(
            f"attempt {number} of the job{which}, {Path(attempt['path']).name}: {attempt['status']} "
            f"after {attempt.get('steps', 0)} recorded steps{error}{hangs}"
        )
    return notes


def _at_the_kept_split(
    a: RunLines, rebalanced: RebalanceOutcome, cfg: DiagnosisConfig, notes: list[str]
) -> RunLines:
    """A rebalanced run is diagnosed at the split it kept: the steps before it hold the imbalance the
    split removed (the rebalanced note says what it cost and what was recovered), and read together
    with the rest they mix two different runs (a slow rank before, the remainder of whole quanta
    after), which no single finding explains. Whole records stay whole when too few steps follow."""
    start = rebalanced.from_step
    if rebalanced.samples is None or start is None:
        return a
    keep = a.step >= start
    kept = int(keep.sum())
    if kept == a.steps or kept < cfg.min_steps:
        return a
    notes.append(
        f"diagnosed at the kept split: the {kept:,} usable steps from step {start} on; the "
        f"{a.steps - kept:,} before it are the imbalance the split removed (the rebalanced note)"
    )
    return a.select(keep)


def diagnose(
    a: RunLines,
    cfg: DiagnosisConfig | None = None,
    *,
    project_ranks: Sequence[int] | None = DEFAULT_PROJECT_RANKS,
) -> Diagnosis:
    """All findings for a run, most costly first; ``healthy`` when there is nothing worth acting on.

    ``a``: the run in memory (:class:`RunArrays`), or its lines (:class:`RunLines`, from
    :func:`load_lines`), whose per-rank numbers are then read a block of steps at a time. Each
    finding is projected to every rank count of ``project_ranks`` (``None`` or empty: none).
    """
    return diagnose_run(a, cfg, project_ranks=project_ranks)[0]


#: the checks in the order they claim ranks (:func:`_run_checks`)
CHECKS = (
    data_stall,
    # Before the rank checks: with two ranks one of them is last in half the steps whatever the
    # cause, and a rank whose lateness its own collector explains is not slow itself. A persistent
    # straggler's lateness is not GC time, so it stays theirs.
    gc_pauses,
    # uneven inputs claim the waiting the ranks' work sizes explain (no ranks of their own: the
    # late rank changes with the batch), before the checks that blame ranks and places
    input_imbalance,
    locality,
    # several slow ranks taking turns being last, then a rank or ranks slow for a stretch, before
    # the one-rank check: neither is last in most steps, and whole-run shares drown a stretch
    slow_group,
    straggler_episode,
    persistent_or_late_start,
    host_oversubscription,
    fabric_contention,
    sync_amplification,
)


def diagnose_run(
    a: RunLines,
    cfg: DiagnosisConfig | None = None,
    *,
    project_ranks: Sequence[int] | None = DEFAULT_PROJECT_RANKS,
) -> tuple[Diagnosis, RunDigest | None]:
    """:func:`diagnose`, and the digest of the run's per-rank numbers it read (None: too few steps
    or ranks to read them), of every step of ``a`` unless the diagnosis kept fewer (a rebalanced
    run's kept split: then its ``steps`` is fewer than ``a``'s)."""
    cfg = cfg or DiagnosisConfig()
    notes = _record_notes(a)
    rebalanced = rebalance_outcome(a)
    if rebalanced is not None:
        notes.append(rebalanced.text())
        a = _at_the_kept_split(a, rebalanced, cfg, notes)
    if a.steps < cfg.min_steps or a.world_size < MIN_RANKS:
        return Diagnosis(
            findings=[],
            summary=f"not enough data to diagnose: {a.steps} usable steps, {a.world_size} ranks",
            stats={"steps": a.steps, "world_size": a.world_size},
            thresholds=cfg.to_dict(),
            notes=notes,
        ), None
    digest = digest_run(a, cfg)
    run = RunStats(a, cfg, digest)
    findings = _run_checks(run)
    notes += run.notes + _tensor_parallel_group_notes(a, digest)
    if rebalanced is not None:
        for f in findings:
            if f.mode is Mode.PERSISTENT_STRAGGLER:
                f.details["rebalanced"] = rebalanced.to_dict()
    for f in findings:
        if not run.worth_acting_on(f):
            notes.append(
                f"below the worth-acting-on floor ({cfg.healthy_lost_fraction:.0%} of step time beyond "
                f"what the run's own jitter explains), not reported: {f.mode} ({f.lost_step_fraction:.1%} "
                f"of step time, of which jitter explains {f.noise_floor_fraction:.1%}): {f.evidence}"
            )
    findings = [f for f in findings if run.worth_acting_on(f)]
    total_lost = run.lost_when(run.all_steps)
    jitter = run.jitter_when(run.all_steps)
    if not findings:
        findings.append(_no_finding(run, total_lost, jitter))
    findings.sort(key=lambda f: -f.lost_step_fraction)
    projection: dict[str, Any] = {}
    if project_ranks:
        findings, meta = project(
            digest.sample,
            findings,
            project_ranks,
            steps=cfg.projection_steps,
            measured_lost_fraction=total_lost,
        )
        projection = meta.to_dict()
        notes.append(
            f"waiting costs {pct(total_lost)} of step time at {run.W} ranks (the run's own jitter "
            f"explains {pct(jitter)}); projected {projection_text(meta.waiting)} (simulated; the "
            "assumption is under projection)"
        )
    stats = _run_stats(a, run, total_lost, jitter)
    if rebalanced is not None:
        stats["rebalance"] = rebalanced.to_dict()
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
    ), digest


def _tensor_parallel_group_notes(a: RunLines, digest: RunDigest) -> list[str]:
    """On a tensor-parallel mesh: the tensor-parallel group that arrived last most often (a group
    arrives with its last member, so this holds whichever member's wait the per-rank numbers show)."""
    groups = tensor_parallel_groups(a.header.get("topology") or [])
    if groups is None or len(groups) != a.world_size or not len(digest.straggler):
        return []
    keys = [tuple(sorted(g.items())) for g in groups]
    of_rank = np.array(group_numbers(keys))
    counts = np.bincount(of_rank[digest.straggler], minlength=int(of_rank.max()) + 1)
    top = int(counts.argmax())
    members = [int(r) for r in np.flatnonzero(of_rank == top)]
    where = ", ".join(f"{k} {v}" for k, v in keys[members[0]])
    return [
        f"the tensor-parallel group of {where} (ranks {', '.join(map(str, members))}) arrived last in "
        f"{counts[top] / counts.sum():.0%} of {int(counts.sum())} steps (a group arrives with its last "
        "member): its slow member, if one is slow, is one of these ranks; which one is not timed"
    ]


def _record_notes(a: RunLines) -> list[str]:
    """What the record itself says before any number is read: how the run ended, its schema, where
    it came from, its hangs and restarts, the verdict of balancing's A/B check."""
    notes = []
    if a.truncated:
        notes.append(
            "the record's last line was cut off (the run crashed or is still running); it was skipped"
        )
    if a.end is None:
        notes.append("the record has no end line: the run did not finish cleanly")
    elif a.end.get("status") == "failed":
        notes.append(f"the run failed: {a.end.get('error')}")
    elif a.end.get("status") == "hung":
        notes.append(f"the run was aborted on a hang: {a.end.get('error')}")
    elif a.end.get("status") == "terminated":
        notes.append(
            f"the run was stopped by a signal ({a.end.get('error')}): its steps up to then are kept; "
            f"{a.end.get('local_steps', 0)} more were measured on rank 0 only (local_step lines, not "
            "diagnosed)"
        )
    if arrival_of(a.header) == "first_gradient":
        notes.append(
            "this record is of schema version 1: a DDP rank's arrival was its first gradient, so the rest "
            "of its backward counts as waiting here; a rank slow in backward looks on time in it"
        )
    notes += mesh_caveats(a.header.get("topology") or [])
    notes += timeline_notes(a)
    imported = a.header.get("imported")
    if imported:
        how = (
            "the waits follow from the synchronous model (each rank waits for the slowest rank's compute, "
            "plus the collective's time where the table gives it)"
            if imported.get("waits") == "synchronous_model"
            else "the waits are as recorded there"
        )
        notes.append(f"imported from {imported.get('source')} ({imported.get('format')}): {how}")
    notes += [f"hang: {hang_text(h)}" for h in a.hangs]
    balanced = balance_outcome(a)
    if balanced is not None:
        notes.append(balanced.text())
    if a.hangs:
        notes += hang_evidence_notes(a.path)
    return notes + _restart_notes(a)


def _run_checks(run: RunStats) -> list[Finding]:
    """Every check of :data:`CHECKS` in order, each told the ranks the earlier ones explained."""
    findings: list[Finding] = []
    explained: set[int] = set()
    for check in CHECKS:
        # A finding below the worth-acting-on floor explains nothing: its ranks stay open to the later
        # checks (with two ranks, one is last in about half the steps whatever the cause, and a minor
        # persistent-straggler reading must not hide synchronization amplification).
        newly = set(explained)
        found = check(run, newly)
        findings.extend(found)
        newly -= explained
        if found:
            newly &= {r for f in found if run.worth_acting_on(f) for r in f.ranks}
        explained |= newly
    return findings


def _no_finding(run: RunStats, total_lost: float, jitter: float) -> Finding:
    """No check found anything worth acting on: healthy, or waiting that nothing explains."""
    if total_lost - jitter < run.cfg.healthy_lost_fraction:
        return _healthy(run, total_lost, jitter)
    return Finding(
        mode=Mode.UNEXPLAINED_SKEW,
        ranks=[],
        hosts=[],
        confidence=UNEXPLAINED_CONFIDENCE,
        lost_step_fraction=total_lost,
        noise_floor_fraction=jitter,
        evidence=(
            f"ranks lose {pct(total_lost)} of step time waiting at the sync point, "
            f"{pct(total_lost - jitter)} more than the run's own jitter explains, but no "
            "single rank, place, data wait or network pattern explains it"
        ),
        action="look at the per-rank lead heat map for a pattern the checks do not cover",
    )


def _run_stats(a: RunLines, run: RunStats, total_lost: float, jitter: float) -> dict[str, Any]:
    """The diagnosis's ``stats``: the run's numbers a reader compares runs by."""
    mean_step = float(a.step_ms.mean())
    balanced = balance_outcome(a)
    return {
        **({"balance": balanced.to_dict()} if balanced is not None else {}),
        "steps": run.S,
        "total_steps": a.total_steps,
        "world_size": run.W,
        "median_step_ms": run.median_step,
        "mean_step_ms": mean_step,
        "step_cv": float(a.step_ms.std() / mean_step) if mean_step > 0 else 0.0,
        "skew_ms_p50": float(np.percentile(run.skew, 50)),
        "skew_ms_p99": float(np.percentile(run.skew, SKEW_TAIL_PERCENTILE)),
        "transfer_ms_p50": float(np.median(run.transfer)),
        "lost_step_fraction": total_lost,
        "jitter_sigma_ms": run.floor.sigma_ms,
        "noise_floor_fraction": jitter,
        "straggler_share": {int(r): float(s) for r, s in enumerate(run.share) if s > 0},
        "pacing_active_share": float(a.pacing_active.mean()),
        "oversubscribed_hosts": [h.host for h in run.crowded],
    }


def _healthy(run: RunStats, total_lost: float, jitter: float) -> Finding:
    top = int(run.share.argmax())
    excess = total_lost - jitter
    return Finding(
        mode=Mode.HEALTHY,
        ranks=[],
        hosts=[],
        confidence=float(np.clip(1.0 - excess / max(run.cfg.healthy_lost_fraction, EPSILON), 0.0, 1.0)),
        lost_step_fraction=total_lost,
        noise_floor_fraction=jitter,
        evidence=(
            f"skew {np.median(run.skew):.1f} ms at the median ({pct(np.median(run.skew) / run.median_step)} "
            f"of the {run.median_step:.1f} ms step), {pct(total_lost)} of step time lost to waiting, of "
            f"which the run's own jitter (sd {run.floor.sigma_ms:.2f} ms per rank) explains "
            f"{pct(jitter)} at {run.W} ranks; no rank last in more than {pct(float(run.share[top]))} "
            f"of {run.S:,} steps"
        ),
        action=(
            "nothing to act on at this size; pacing would not help. The projection says what the same "
            "jitter costs at more ranks (the slowest of more ranks is later)"
        ),
    )
