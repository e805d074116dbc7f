"""The checks that blame ranks, places and hosts: data stall, locality, persistent straggler or
late start, host oversubscription."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

__all__ = ["data_stall", "host_oversubscription", "locality", "persistent_or_late_start"]

from pace_strategy.diagnose.rebalance import per_sample_text, rebalance_outcome
from pace_strategy.diagnose.result import Finding, Mode, pct
from pace_strategy.diagnose.run_stats import (
    EPSILON,
    LATE_START_CONFIDENCE_FACTOR,
    MIN_PLACES,
    OVERSUBSCRIPTION_BASE_CONFIDENCE,
    OVERSUBSCRIPTION_SIGNAL_CONFIDENCE,
    STEADY_MEDIAN_FRACTION,
    RunStats,
)


def _rank_finding(
    run: RunStats,
    mode: Mode,
    r: int,
    mask: np.ndarray,
    confidence: float,
    evidence: str,
    action: str,
    details: dict[str, Any] | None = None,
) -> Finding:
    """A finding about rank ``r`` that costs the waiting of the ``mask`` steps (the ones it set)."""
    return Finding(
        mode=mode,
        ranks=[r],
        hosts=run.hosts_of([r]),
        confidence=confidence,
        lost_step_fraction=run.lost_when(mask),
        noise_floor_fraction=run.jitter_when(mask),
        projection_basis="ranks",
        evidence=evidence,
        action=action,
        details=details or {},
    )


def data_stall(run: RunStats, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    noise = run.noise_ms()
    for r in range(run.W):
        mask = run.straggler == r
        if run.share[r] < cfg.data_straggler_share or mask.sum() < cfg.data_straggler_steps:
            continue
        late = run.late_ms(mask)
        own, others = run.own("data", mask), run.others("data", mask)
        excess = own - others
        explained_share = float(np.median(np.clip(excess, 0, None) / np.maximum(late, EPSILON)))
        if np.median(excess) >= noise and explained_share >= cfg.data_share:
            explained.add(r)
            out.append(
                _rank_finding(
                    run,
                    Mode.DATA_STALL,
                    r,
                    mask,
                    confidence=min(1.0, explained_share) * float(run.share[r]) ** 0.5,
                    evidence=(
                        f"{run.a.describe_rank(r)} arrived last in {pct(float(run.share[r]))} of "
                        f"{run.S:,} steps, {np.median(late):.1f} ms late at the median; in those steps it "
                        f"waited {np.median(own):.1f} ms for its input against "
                        f"{np.median(others):.1f} ms for the other ranks"
                    ),
                    action=(
                        "the input pipeline of this rank is the bottleneck: more DataLoader workers, "
                        "pin_memory/prefetch, faster or local storage; pacing cannot help"
                    ),
                )
            )
    return out


def locality(run: RunStats, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    node_ids = sorted(set(map(str, run.nodes)))
    # the same local rank index slow on every node; with one rank per node every rank has the same
    # index, which then says nothing about place (a moving straggler is not locality)
    if len(node_ids) >= MIN_PLACES and min(run.local) >= 0 and len(set(run.local)) >= MIN_PLACES:
        local_of = np.asarray(run.local)[run.straggler]
        counts = Counter(local_of.tolist())
        index, hits = counts.most_common(1)[0]
        share = hits / run.S
        members = [r for r in range(run.W) if run.local[r] == index]
        member_shares = [float(run.share[r]) for r in members]
        spread = sum(s >= cfg.locality_spread_fraction * share / len(members) for s in member_shares)
        if share >= cfg.locality_share and len(members) >= MIN_PLACES and spread >= MIN_PLACES:
            mask = np.isin(run.straggler, members)
            explained.update(members)
            excess = float(np.median(run.group_late_ms(mask)))
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
                        f"local rank {index} was the straggler in {pct(share)} of {run.S:,} steps, on "
                        f"{spread} of {len(node_ids)} nodes (ranks {', '.join(map(str, members))}: last in "
                        f"{', '.join(pct(s) for s in member_shares)} of steps), {excess:.1f} ms late at the "
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
        len(set(run.hosts)) >= MIN_PLACES
        and len(members) >= MIN_PLACES
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
                        f"a rank of host {host} was the straggler in {pct(share)} of {run.S:,} steps "
                        f"(ranks {', '.join(map(str, members))}; none alone above "
                        f"{pct(max(member_shares))}): the host is slow, not one rank"
                    ),
                    action=(
                        "check that host: CPU frequency/thermal throttling, other jobs, its NIC and switch "
                        "port"
                    ),
                )
            )
    return out


def _weighted(x: np.ndarray, weights: np.ndarray) -> float:
    """Mean of ``x`` weighted by ``weights`` (the wait each step caused); the plain mean without any."""
    total = float(weights.sum())
    return float((x * weights).sum() / total) if total > 0 else float(x.mean())


def persistent_or_late_start(run: RunStats, explained: set[int]) -> list[Finding]:
    """A rank late in most steps (persistent), or late in the steps that cost most of the waiting (a
    bursty host), told apart by what made it late: its own work (compute, or its time between steps)
    or a start delayed by its previous collective completing late on it (the network)."""
    out = []
    for r in range(run.W):
        mask = run.straggler == r
        if r in explained or not mask.any():
            continue
        finding = _late_rank(run, r, mask)
        if finding is not None:
            explained.add(r)
            out.append(finding)
    return out


def _late_rank(run: RunStats, r: int, mask: np.ndarray) -> Finding | None:
    """Rank ``r``'s finding, when it is late steadily or in the costly steps (``mask``: the steps it
    was last in), else ``None``."""
    cfg = run.cfg
    noise = run.noise_ms()
    total_lost = float(run.lost_per_step.sum())
    late_steps = run.late_ms(mask)
    weights = np.clip(late_steps, 0.0, None)
    compute_excess = run.own("compute", mask) - run.others("compute", mask)
    own_excess = run.own("between", mask) - run.others("between", mask)
    loop_excess = run.own("loop", mask) - run.others("loop", mask)
    loss_share = float(run.lost_per_step[mask].sum()) / total_lost if total_lost > 0 else 0.0
    median_late, weighted_late = float(np.median(late_steps)), _weighted(late_steps, weights)
    steady = (
        run.share[r] >= cfg.persistent_share
        and median_late >= noise
        and median_late >= STEADY_MEDIAN_FRACTION * weighted_late
    )
    tail = not steady and loss_share >= cfg.tail_loss_share and weighted_late >= noise
    if not (steady or tail):
        return None
    # Late by a steady amount: quoted at the median. Late in bursts: the wait-weighted mean over
    # its late steps, where the time is lost (the median of such a rank is near zero).
    late = median_late if steady else weighted_late
    # What made it late, in the same weighting: per step the lateness is the sum of the excess
    # compute, the excess own work and loop between steps, and the previous collective completing
    # later on this rank, so the weighted means add up and say which part costs the time.
    compute_late, own_late = _weighted(compute_excess, weights), _weighted(own_excess, weights)
    loop_late = _weighted(loop_excess, weights)
    how_late = (
        f"{late:.1f} ms late on average over those steps, weighted by the wait each caused (median "
        f"{median_late:.1f} ms, p90 {float(np.percentile(late_steps, 90)):.1f} ms); "
        f"those steps hold {pct(loss_share)} of all the time the ranks lost waiting"
        if tail
        else f"{late:.1f} ms late at the median"
    )
    last_in = f"arrived last in {pct(float(run.share[r]))} of {run.S:,} steps"
    head = f"{run.a.describe_rank(r)} {last_in}, {how_late}"
    details = {
        "late_ms": late,
        "compute_late_ms": compute_late,
        "own_between_steps_late_ms": own_late,
        "loop_late_ms": loop_late,
        "lost_share": loss_share,
        "measure": "weighted_mean" if tail else "median",
    }
    cause = _own_work_cause(cfg.compute_late_fraction * late, compute_late, own_late)
    if cause:
        per_sample = per_sample_text(run.digest.sample, r, mask[run.digest.sample_rows])
        return _rank_finding(
            run,
            Mode.PERSISTENT_STRAGGLER,
            r,
            mask,
            confidence=max(float(run.share[r]), loss_share) if tail else float(run.share[r]),
            evidence=f"{head}; {cause}{per_sample}",
            action=_straggler_action(run, tail),
            details=details,
        )
    return _rank_finding(
        run,
        Mode.FABRIC_CONTENTION,
        r,
        mask,
        confidence=float(run.share[r]) * LATE_START_CONFIDENCE_FACTOR,
        evidence=(
            f"{head}, but its own work was normal (compute {compute_late:+.1f} ms, optimizer step "
            f"and input {own_late:+.1f} ms against the other ranks' median): it started each step "
            f"late, {loop_late:+.1f} ms in the framework's loop between steps, where the "
            "framework's own collectives run (Lightning broadcasts from rank 0 every step) and "
            "complete late on a rank behind a slower path; its lateness comes from the network, "
            "not from the rank"
        ),
        action=(
            "look at this rank's network path (link rate, switch port, oversubscribed uplink); "
            "the rank itself is healthy and must not be paced or replaced"
        ),
        details=details,
    )


def _own_work_cause(enough_ms: float, compute_late: float, own_late: float) -> str:
    """Why a rank was late when its own work explains at least ``enough_ms`` of it, else ``""``."""
    if compute_late >= enough_ms:
        return f"its own compute took {compute_late:.1f} ms longer than the other ranks' median"
    if compute_late + own_late >= enough_ms:
        return (
            f"its own work took longer: compute {compute_late:+.1f} ms and its own work between "
            f"steps (its optimizer step and its input) {own_late:+.1f} ms against the other ranks' "
            "median"
        )
    return ""


def _straggler_action(run: RunStats, bursty: bool = False) -> str:
    """What to do about a persistent compute straggler, given what rebalancing did in the run."""
    local = (
        "this rank's local work is slow: check its device (clocks, throttling, ECC), other processes "
        "on its host, its input; pacing the others cannot shorten its steps"
    )
    if bursty:
        local = (
            "this rank's host is slow in bursts: check for a CPU quota or throttling (cgroup cpu.max, "
            "thermal or power capping), a noisy neighbour, periodic work on that host; pacing the others "
            "cannot shorten its steps"
        )
    outcome = rebalance_outcome(run.a)
    if outcome is None:
        return (
            f"{local}. If its work scales with samples, rebalancing can: PacingConfig(rebalance=True) "
            "gives it a smaller share of the same global batch, kept only while the step is shorter "
            "(docs/rebalancing.md)"
        )
    if outcome.samples is not None:
        return f"{local}; rebalancing already gives it a smaller share (see the rebalanced note)"
    if outcome.fixed_cost:
        return (
            f"{local}; rebalancing tried a smaller share and reverted it: its compute did not fall with "
            "its samples, so the slowness is a fixed per-step cost (a sleep, a sync, a per-step transfer)"
        )
    return f"{local}; rebalancing was on and did not move samples ({outcome.text()})"


def host_oversubscription(run: RunStats, explained: set[int]) -> list[Finding]:
    out = []
    cfg = run.cfg
    for h in run.crowded:
        # the steps whose straggler is on this host and not already explained (a slow rank, its input)
        mask = np.isin(run.straggler, [r for r in h.ranks if r not in explained])
        waiting, jitter = run.lost_when(mask), run.jitter_when(mask)
        # Time-slicing makes every arrival scatter: what the host accounts for is the waiting that the
        # bulk of that scatter gives (the robust jitter floor over its steps). Waiting beyond it is a
        # few ranks late by far more than the bulk, in some steps: transient slowness, left to the
        # later checks (sync_amplification when the straggler moves), so that a cause hidden behind
        # the crowded host is still named with its own share. The host's ranks are not "explained":
        # the share is what is claimed, not the ranks.
        lost = min(waiting, jitter)
        run.account(lost, jitter)
        std, mean = run.compute_spread
        compute_cv = float(np.median(std[h.ranks] / np.maximum(mean[h.ranks], EPSILON)))
        step_cv = float(run.a.step_ms.std() / max(float(run.a.step_ms.mean()), EPSILON))
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
                confidence=OVERSUBSCRIPTION_BASE_CONFIDENCE
                + OVERSUBSCRIPTION_SIGNAL_CONFIDENCE * beyond
                + OVERSUBSCRIPTION_SIGNAL_CONFIDENCE * unsteady,
                lost_step_fraction=lost,
                noise_floor_fraction=jitter,
                evidence=(
                    f"host {h.host}: {h.load_text()} = {h.busy_threads} busy threads on {h.cores_text()}, "
                    f"{h.ratio:.1f} per core; steps {run.median_step:.1f} ms at the median (CV "
                    f"{step_cv:.2f}, per-rank compute CV {compute_cv:.2f}); the ranks' arrivals scatter by "
                    f"{run.floor.sigma_ms:.1f} ms (robust sd), which costs {pct(lost)} of step time in "
                    f"waiting{_beyond_text(waiting - lost)} — a lower bound of the cost, since "
                    f"time-slicing slows every rank's own compute too{collective}"
                ),
                action=h.fix_text(),
                details={
                    "waiting_fraction": waiting,
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


def _beyond_text(rest: float) -> str:
    """The waiting on a crowded host's steps beyond what its ranks' bulk scatter gives."""
    if rest <= 0:
        return ""
    return (
        f"; {pct(rest)} more is waiting for ranks late by far more than that scatter, in some steps "
        "(transient slowness, not counted here)"
    )
