"""The check that blames the garbage collector: the late rank's excess in the costly steps is its own
GC time (``gc_pauses``). Needs a record with per-rank ``gc_ms``.

``gc_ms`` is host time; the lateness is device time on CUDA. A collection lengthens the step only
when the host, not the device, was the bottleneck of that step (``host_bound``: the device had
caught up with the host); with the host running ahead, the pause is hidden and a rank late in that
step is late for another reason. So only host-bound steps of the late rank count as GC steps (every
step of a CPU run is).
"""

from __future__ import annotations

import numpy as np

from pace_strategy.core.config import recorded_switch
from pace_strategy.diagnose.result import Finding, Mode, pct
from pace_strategy.diagnose.run_stats import EPSILON, MIN_RANKS, RunStats

__all__ = ["GC_PAUSE_PERCENTILE", "gc_pauses"]

#: the pause length the evidence quotes: the 99th percentile of the pauses (steps x ranks above the
#: noise threshold), not of every step (most steps have none)
GC_PAUSE_PERCENTILE = 99

#: a costly step counts as a GC step when the late rank's own GC excess is at least this share of its
#: lateness (the majority of it); ``gc_explained_share`` then judges the sum over those steps
_STEP_MAJORITY = 0.5


def gc_pauses(run: RunStats, explained: set[int]) -> list[Finding]:
    a, cfg, gc = run.a, run.cfg, run.digest.gc
    if gc is None or run.W < MIN_RANKS:
        return []
    noise = run.noise_ms()
    costly = run.skew >= noise
    if not costly.any():
        return []
    rows = np.nonzero(costly)[0]
    late_rank = run.straggler[rows]
    # how much later than the other ranks' median the late rank arrived, and how much more of its
    # step it spent in the collector than the others did (their median: a pause every rank took at
    # the same step is not the late rank's own)
    late = np.clip((run.median_wait - run.transfer)[rows], 0.0, None)
    excess = np.clip(gc.own[rows] - gc.others[rows], 0.0, None)
    hidden = 0
    if run.digest.host_bound is not None:
        bound = run.digest.host_bound[rows]
        hidden = int(((excess > 0) & ~bound).sum())
        excess = np.where(bound, excess, 0.0)  # a pause the device's lag hid explains nothing
    covered = np.minimum(excess, late)
    share = float(covered.sum() / max(float(late.sum()), EPSILON))
    by_gc = covered >= _STEP_MAJORITY * np.maximum(late, EPSILON)
    if share < cfg.gc_explained_share or int(by_gc.sum()) < cfg.gc_min_steps:
        return []
    mask = np.zeros(run.S, dtype=bool)
    mask[rows[by_gc]] = True
    ranks = sorted({int(r) for r in late_rank[by_gc]})
    # the pauses longer than noise, of every rank in every step; the longest pause
    paused, longest = gc.pauses, gc.longest
    per_1000 = 1000.0 * len(paused) / (run.S * run.W)
    p99 = float(np.percentile(paused, GC_PAUSE_PERCENTILE)) if len(paused) else 0.0
    lost = run.lost_when(mask)
    explained.update(ranks)
    collections = (
        f"; {gc.collections / (run.S * run.W):.1f} collections (any generation) per step per rank"
        if gc.collections is not None
        else ""
    )
    return [
        Finding(
            mode=Mode.GC_PAUSES,
            ranks=ranks,
            hosts=run.hosts_of(ranks),
            confidence=min(1.0, share),
            lost_step_fraction=lost,
            noise_floor_fraction=run.jitter_when(mask),
            evidence=(
                f"in {int(costly.sum()):,} of {run.S:,} steps the skew was above {noise:.1f} ms; the late "
                f"rank's own garbage-collector time beyond the other ranks' explains {pct(share)} of its "
                f"lateness there, the majority of it in {int(by_gc.sum()):,} steps (late ranks "
                f"{', '.join(map(str, ranks))}), which cost {pct(lost)} of step time; collector pauses "
                f"above {noise:.1f} ms: {per_1000:.1f} per 1,000 steps per rank, p{GC_PAUSE_PERCENTILE} "
                f"{p99:.0f} ms, longest {longest:.0f} ms{collections}: each rank pauses at "
                f"its own steps and every other rank waits"
                + (
                    f"; in {hidden:,} more costly steps the late rank's pause fell while its device was "
                    "still behind its host (hidden by the run-ahead), so they are not counted"
                    if hidden
                    else ""
                )
            ),
            action=_action(run, synced=recorded_switch(a.header.get("config"), "gc_sync")),
            details={
                "explained_share": share,
                "gc_steps": int(by_gc.sum()),
                "costly_steps": int(costly.sum()),
                "pauses_per_1000_steps_per_rank": per_1000,
                "pause_ms_p99": p99,
                "pause_ms_max": longest,
                "hidden_steps": hidden,
            },
        )
    ]


def _action(run: RunStats, synced: bool) -> str:
    freeze = (
        "gc_sync.freeze=True (or gc.freeze() after start-up) so that full collections skip the "
        "long-lived heap built at start-up (frozen objects are never collected)"
    )
    if synced:
        return (
            "gc_sync is on: the ranks already collect at the same steps, and what is left is the "
            "difference between their pause lengths (a rank with a larger heap, or a slower core, "
            f"pauses longer); make every full collection short: {freeze}, or keep fewer objects alive"
        )
    return (
        "synchronize the collections: PacingConfig(gc_sync=True) makes every rank run its full "
        f"collections at the same agreed step, so {run.W} ranks' pauses cost about one (saves about "
        f"{(run.W - 1) / run.W:.0%} of this stall); with a large long-lived heap also {freeze}"
    )
