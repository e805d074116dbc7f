"""The checks that blame no single rank: fabric contention and synchronization amplification."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["fabric_contention", "max_growth", "sync_amplification"]

from pace_strategy.diagnose.digest import growth_rows
from pace_strategy.diagnose.input_checks import work_sizes
from pace_strategy.diagnose.result import Finding, Mode, pct
from pace_strategy.diagnose.run_stats import (
    AMPLIFICATION_BASE_CONFIDENCE,
    AMPLIFICATION_SIGNAL_CONFIDENCE,
    EPSILON,
    FABRIC_BASE_CONFIDENCE,
    FABRIC_SIGNAL_CONFIDENCE,
    GROWTH_RANK_COUNTS,
    GROWTH_SEED,
    SKEW_TAIL_PERCENTILE,
    TRANSFER_FLOOR_PERCENTILE,
    TRANSFER_TAIL_PERCENTILE,
    RunStats,
)


def fabric_contention(run: RunStats, explained: set[int]) -> list[Finding]:
    cfg = run.cfg
    if run.crowded_ranks >= set(range(run.W)):
        # Every host is oversubscribed: a collective needs CPU to make progress, so its time is not
        # the fabric's (the host_oversubscription finding quotes it).
        return []
    t = run.transfer
    med = float(np.median(t))
    cv = float(t.std() / t.mean()) if t.mean() > 0 else 0.0
    p95 = float(np.percentile(t, TRANSFER_TAIL_PERCENTILE))
    std, mean = run.compute_spread
    compute_cv = float(np.median(std / np.maximum(mean, EPSILON)))
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
    floor = float(np.percentile(t, TRANSFER_FLOOR_PERCENTILE))
    variable = float((t - floor).sum()) / run.total_step
    # Inflated: without a baseline of this fabric at its best, the whole transfer is the upper bound.
    lost = max(variable, med / run.median_step) if inflated else variable
    what = []
    if inflated:
        what.append(
            f"transfer time {med:.1f} ms at the median, {pct(med / run.median_step)} of the step "
            "(the upper bound of what a faster fabric could save)"
        )
    if unstable:
        what.append(f"unstable (CV {cv:.2f}, p95 {p95:.1f} ms)")
    return [
        Finding(
            mode=Mode.FABRIC_CONTENTION,
            ranks=list(range(run.W)),
            hosts=sorted(set(run.hosts)),
            confidence=FABRIC_BASE_CONFIDENCE
            + FABRIC_SIGNAL_CONFIDENCE * inflated
            + FABRIC_SIGNAL_CONFIDENCE * unstable,
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


def sync_amplification(run: RunStats, explained: set[int]) -> list[Finding]:
    cfg = run.cfg
    if explained:
        return []
    p = run.share[run.share > 0]
    entropy = float(-(p * np.log(p)).sum() / math.log(run.W)) if run.W > 1 else 0.0
    # what a crowded host's time-slicing accounts for is its own; amplification is the rest
    lost = run.lost_when(run.all_steps) - run.accounted_lost
    jitter = max(0.0, run.jitter_when(run.all_steps) - run.accounted_floor)
    p50 = float(np.percentile(run.skew, 50))
    p99 = float(np.percentile(run.skew, SKEW_TAIL_PERCENTILE))
    heavy = p50 <= 0 or p99 / max(p50, EPSILON) >= cfg.heavy_tail_ratio
    # No rank was found persistent (``explained`` is empty): with two ranks one of them is last in at least
    # half the steps however the straggler moves, so a share alone cannot say "persistent".
    if entropy < cfg.spread_entropy or lost - jitter < cfg.healthy_lost_fraction:
        return []
    growth = max_growth(run)
    grows = len(growth) > 1 and growth[-1][1] > cfg.growth_ratio * growth[0][1]
    curve = ", ".join(f"{k} ranks {v:.1f} ms" for k, v in growth)
    crowded = (
        f"; the crowded host's share, {pct(run.accounted_lost)}, is not counted here"
        if run.accounted_lost > 0
        else ""
    )
    return [
        Finding(
            mode=Mode.SYNC_AMPLIFICATION,
            ranks=sorted(int(r) for r in np.nonzero(run.share > 0)[0]),
            hosts=sorted(set(run.hosts)),
            confidence=min(
                1.0,
                AMPLIFICATION_BASE_CONFIDENCE
                + AMPLIFICATION_SIGNAL_CONFIDENCE * heavy
                + AMPLIFICATION_SIGNAL_CONFIDENCE * grows,
            ),
            lost_step_fraction=lost,
            noise_floor_fraction=jitter,
            evidence=(
                f"the straggler changes from step to step ({int((run.share > 0).sum())} of {run.W} ranks "
                "took "
                f"turns, entropy {entropy:.2f}, none above {pct(float(run.share.max()))}); skew p50 "
                f"{p50:.1f} ms, p99 {p99:.1f} ms{' (heavy-tailed)' if heavy else ''}; "
                f"{pct(lost)} of step time lost to waiting ({pct(lost - jitter)} beyond what the bulk "
                f"of the jitter, sd {run.floor.sigma_ms:.2f} ms per rank, explains{crowded}); expected "
                "slowest-rank excess grows with "
                f"ranks: {curve}"
            ),
            action=_amplification_action(run),
            details={"entropy": entropy, "growth_ms": growth},
        )
    ]


def _amplification_action(run: RunStats) -> str:
    """Where to look for the transient slowness: uneven inputs first when the late rank's own compute
    was longer, no work size was recorded, and neither its input nor its collector explains it."""
    generic = (
        "transient slowness somewhere in many ranks, amplified by the barrier: find the sources "
        "(GC pauses, checkpoint I/O, noisy neighbours, power capping); it gets worse with more ranks"
    )
    mask = run.all_steps
    late = np.maximum(run.late_ms(mask), EPSILON)
    compute = np.median((run.own("compute", mask) - run.others("compute", mask)) / late)
    data = np.median((run.own("data", mask) - run.others("data", mask)) / late)
    gc = run.digest.gc
    collector = gc is not None and bool(np.median(np.nan_to_num(gc.own) / late) >= run.cfg.gc_explained_share)
    recorded = work_sizes(run) is not None
    if recorded or compute < run.cfg.compute_late_fraction or data >= run.cfg.data_share or collector:
        return generic
    return (
        "uneven inputs are the first suspect: in the steps it was late, the late rank's own compute "
        f"explains {pct(float(min(compute, 1.0)))} of its lateness at the median, a different rank each "
        "step, with no input wait or collector pause behind it, as when ranks draw sequences of different "
        "lengths. Record each rank's tokens to confirm (an adapter that sees input_ids counts them; "
        "pace.end_step(tokens=...) in a plain loop; a tokens column in pace import): then "
        "input_imbalance says how much they explain, and the fix is length-balanced batches. Otherwise: "
        "checkpoint I/O, noisy neighbours, power capping; it gets worse with more ranks"
    )


def max_growth(run: RunStats) -> list[tuple[int, float]]:
    """Mean over steps of (slowest of k random ranks - median rank) of arrival lateness, k = 2, 4, ...W,
    on a seeded sample of steps (:func:`pace_strategy.diagnose.digest.growth_rows`)."""
    rng = np.random.default_rng(GROWTH_SEED)
    rows = growth_rows(rng, run.S)  # the steps the digest kept the waits of, in the same order
    late = run.median_wait[rows][:, None] - run.digest.growth_wait  # how much later than the median rank
    sizes = [k for k in GROWTH_RANK_COUNTS if k < run.W] + [run.W]
    out = []
    for k in sizes:
        # the k ranks with the smallest random keys: the first k of a random order of the ranks
        # (argpartition picks the same k as a full argsort, in O(W) a row instead of O(W log W))
        keys = rng.random(late.shape)
        picks = np.argpartition(keys, k - 1, axis=1)[:, :k] if k < run.W else np.arange(run.W)[None, :]
        out.append((k, float(np.take_along_axis(late, picks, axis=1).max(axis=1).mean())))
    return out
