"""Share phases of a run record (stdlib only): the runs of consecutive steps trained at one split,
with their throughput and each rank's per-sample compute; what the demo and the rebalancing
benchmark report."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SharePhase", "describe_phases", "share_phases"]


@dataclass(frozen=True)
class SharePhase:
    """Consecutive valid, post-warm-up steps at the same per-rank sample counts."""

    shares: tuple[int, ...]  #: samples per rank per step
    first_step: int
    last_step: int
    steps: int  #: steps counted (a phase's first ``skip`` steps are not)
    samples_per_s: float  #: global samples over the summed step wall time
    ms_per_sample: tuple[float, ...]  #: each rank's mean compute time per sample, milliseconds
    #: mean step time outside the slowest rank's compute (all-reduce, optimizer, data, loop), ms:
    #: the per-step cost no split of the samples shortens
    outside_ms: float = 0.0

    @property
    def capacity_per_s(self) -> float:
        """The capacity bound: the sum of the ranks' speeds (samples/s if nobody ever waited)."""
        return sum(1e3 / ms for ms in self.ms_per_sample if ms > 0)


def share_phases(steps: Iterable[Mapping[str, Any]], skip: int = 2) -> list[SharePhase]:
    """The share phases of a run record's ``step`` lines (``RunRecord.steps``); steps without
    per-rank ``samples``, or where a rank reported none (``0``: a run without rebalancing does not
    count them), form no phase. ``skip``: steps left out at the start of each phase (its first
    steps pay for the new batch shapes)."""
    runs: list[tuple[tuple[int, ...], list[Mapping[str, Any]]]] = []
    for step in steps:
        samples = step.get("ranks", {}).get("samples")
        if not samples or not step.get("valid") or step.get("warmup"):
            continue
        shares = tuple(int(s) for s in samples)
        if min(shares) <= 0:
            continue
        if runs and runs[-1][0] == shares:
            runs[-1][1].append(step)
        else:
            runs.append((shares, [step]))
    phases = []
    for shares, members in runs:
        counted = members[skip:] if len(members) > skip else members
        total_ms = sum(float(s["step_ms"]) for s in counted)
        # Means, as the rebalancer measures: a rank slow in bursts costs its tail, not its median.
        per_rank = [
            statistics.fmean(float(s["ranks"]["compute_ms"][r]) / n for s in counted)
            for r, n in enumerate(shares)
        ]
        outside = statistics.fmean(
            float(s["step_ms"]) - max(float(c) for c in s["ranks"]["compute_ms"]) for s in counted
        )
        phases.append(
            SharePhase(
                shares=shares,
                first_step=int(members[0]["step"]),
                last_step=int(members[-1]["step"]),
                steps=len(counted),
                samples_per_s=sum(shares) * len(counted) / (total_ms / 1e3) if total_ms > 0 else 0.0,
                ms_per_sample=tuple(per_rank),
                outside_ms=max(0.0, outside),
            )
        )
    return phases


def describe_phases(phases: Sequence[SharePhase]) -> list[str]:
    """Lines for a report: each phase's split, steps and samples/s, against the first phase and
    against the capacity bound measured in that first phase."""
    if not phases:
        return ["  rebalancing       no per-rank samples in the record"]
    base = phases[0]
    lines = []
    for p in phases:
        gain = p.samples_per_s / base.samples_per_s if base.samples_per_s else float("nan")
        lines.append(
            f"  shares {list(p.shares)!s:<16} steps {p.first_step:>4}-{p.last_step:<4} "
            f"{p.samples_per_s:8.0f} samples/s  x{gain:.2f} of the first split, "
            f"{p.samples_per_s / base.capacity_per_s:.0%} of the capacity bound"
        )
    speeds = ", ".join(f"rank {r} {ms:.2f}" for r, ms in enumerate(base.ms_per_sample))
    lines.append(
        f"  per-sample compute (ms, first split): {speeds}; capacity {base.capacity_per_s:.0f} samples/s"
    )
    return lines
