"""What a run record says about rebalancing and cost-balanced batches: the splits tried, kept and
reverted, and the step time the kept split recovered, measured on the record's own steps at the same
global batch; the verdicts of balancing's A/B check and the step time balanced batches recovered."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pace_strategy.core.config import recorded_switch
from pace_strategy.diagnose.result import pct
from pace_strategy.telemetry.arrays import RunArrays, RunLines

__all__ = [
    "BalanceOutcome",
    "RebalanceOutcome",
    "balance_outcome",
    "fitted_cost",
    "per_sample_text",
    "rebalance_outcome",
]


@dataclass(frozen=True)
class RebalanceOutcome:
    """The rebalancing of one run, from its ``shares`` lines and its steps."""

    enabled: bool  #: the run's config had ``rebalance`` on
    samples: list[int] | None  #: the split kept at the end (per-rank samples per step); None: even
    replaced: list[int] | None  #: the split it replaced
    from_step: int | None  #: the step the kept split started at
    before_ms: float | None  #: median step time at the replaced split (the record's steps), ms
    after_ms: float | None  #: median step time at the kept split, ms
    before_steps: int = 0
    after_steps: int = 0
    verdict: str = ""  #: the A/B check that kept the split, in words
    reverted: tuple[str, ...] = ()  #: why each reverted trial was reverted
    off: str | None = None  #: why rebalancing stopped, if it did
    last_reason: str = ""  #: the controller's last recorded reason

    @property
    def recovered_fraction(self) -> float | None:
        """Step time saved by the kept split, as a fraction of the step before it."""
        if self.before_ms is None or self.after_ms is None or self.before_ms <= 0:
            return None
        return 1.0 - self.after_ms / self.before_ms

    @property
    def fixed_cost(self) -> bool:
        """Some trial was reverted because the slow rank's compute did not scale with its samples."""
        return any("fixed per-step cost" in r for r in self.reverted)

    def text(self) -> str:
        """The outcome in one paragraph, with numbers."""
        parts = []
        recovered = self.recovered_fraction
        if self.samples is not None and recovered is not None:
            assert self.before_ms is not None and self.after_ms is not None
            parts.append(
                f"rebalanced: {self.samples} samples per rank per step from step {self.from_step} "
                f"(was {self.replaced}); the step took {self.after_ms:.1f} ms against "
                f"{self.before_ms:.1f} ms at the median ({self.after_steps} against "
                f"{self.before_steps} steps of the record): "
                f"{pct(recovered)} of the step recovered at the same global batch, "
                f"{self.before_ms / self.after_ms - 1:+.1%} samples/s ({self.verdict})"
            )
        elif self.samples is not None:
            parts.append(f"rebalanced: {self.samples} samples per rank per step from step {self.from_step}")
        if self.reverted:
            parts.append(
                f"{len(self.reverted)} trial split(s) reverted, the last because {self.reverted[-1]}"
            )
        if self.off:
            parts.append(f"rebalancing stopped: {self.off}")
        if not parts:
            parts.append(f"rebalancing was on and kept the even split ({self.last_reason})")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recovered_fraction": self.recovered_fraction}


def rebalance_outcome(a: RunLines) -> RebalanceOutcome | None:
    """The run's rebalancing, or ``None`` when it was off and left no ``shares`` line."""
    enabled = recorded_switch(a.header.get("config"), "rebalance")
    lines = [line for line in a.shares if line.get("balance") is None]  # (not balancing's check)
    if not enabled and not lines:
        return None
    starts = [line for line in lines if line["from_step"] is not None]  # every split scheduled
    kept = [line for line in lines if line["state"] == "watch" and line["trial_step_ms"] is not None]
    reverted = tuple(
        _why(line["reason"]) for line in lines if line["state"] == "cooldown" and line["from_step"]
    )
    off = next((line["reason"] for line in lines if line["state"] == "off"), None)
    last_reason = str(lines[-1]["reason"]) if lines else "no decision recorded"
    outcome = RebalanceOutcome(
        enabled=enabled,
        samples=None,
        replaced=None,
        from_step=None,
        before_ms=None,
        after_ms=None,
        reverted=reverted,
        off=off,
        last_reason=last_reason,
    )
    if not kept:
        return outcome
    verdict = kept[-1]
    trial = [line for line in starts if line["window"] < verdict["window"]][-1]
    start = int(trial["from_step"])
    earlier = [int(line["from_step"]) for line in starts if int(line["from_step"]) < start]
    later = [int(line["from_step"]) for line in starts if int(line["from_step"]) > start]
    before = (a.step >= (earlier[-1] if earlier else -1)) & (a.step < start)
    after = (a.step >= start) & (a.step < (later[0] if later else np.iinfo(np.int64).max))
    return RebalanceOutcome(
        enabled=enabled,
        samples=list(trial["samples"]),
        replaced=_split_before(lines, trial),
        from_step=start,
        before_ms=float(np.median(a.step_ms[before])) if before.any() else None,
        after_ms=float(np.median(a.step_ms[after])) if after.any() else None,
        before_steps=int(before.sum()),
        after_steps=int(after.sum()),
        verdict=f"the A/B check kept it at {verdict['trial_step_ms']:.2f} ms against "
        f"{verdict['baseline_step_ms']:.2f} ms",
        reverted=reverted,
        off=off,
        last_reason=last_reason,
    )


@dataclass(frozen=True)
class BalanceOutcome:
    """The last verdict of balancing's A/B check in a run (its ``shares`` lines with ``balance``)."""

    kept: bool  #: balanced batches stayed
    plain_ms: float  #: median step time of the plain arm's windows, ms
    balanced_ms: float  #: median step time of the balanced arm's windows, ms
    verdicts: int  #: verdicts in the record (one per check)
    after_step: int  #: the verdict was taken after this step
    reason: str  #: the verdict in words
    #: the cost model fitted online in force at the end of the run, ``[quadratic_tokens, per_sample]``
    #: (``None``: the configured one throughout)
    cost: list[float] | None = None

    @property
    def recovered_fraction(self) -> float:
        """Step time balanced batches saved, a fraction of the plain step (negative: they cost)."""
        return 1.0 - self.balanced_ms / self.plain_ms if self.plain_ms > 0 else 0.0

    def text(self) -> str:
        said = (
            f"the step took {self.balanced_ms:.1f} ms balanced against {self.plain_ms:.1f} ms in plain "
            f"slices of the same global batches (medians of the check's windows, verdict after step "
            f"{self.after_step}, {self.verdicts} verdict(s) in the run)"
        )
        if self.cost is not None:
            said += (
                f"; cost model fitted online: per_sample {self.cost[1]:g}, quadratic_tokens {self.cost[0]:g}"
            )
        if self.kept:
            return (
                f"cost-balanced batches kept by their A/B check: {said}: {pct(self.recovered_fraction)} of "
                f"the step recovered, {self.plain_ms / self.balanced_ms - 1:+.1%} samples/s"
            )
        why = self.reason.split("; cost model")[0].rsplit(": ", 2)[-2]
        return f"cost-balanced batches dropped by their A/B check: {said}; {why}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recovered_fraction": self.recovered_fraction}


def balance_outcome(a: RunLines) -> BalanceOutcome | None:
    """The last verdict of balancing's A/B check, or ``None`` when the record has none."""
    verdicts = [
        line
        for line in a.shares
        if line.get("balance") in ("kept", "dropped") and line["trial_step_ms"] is not None
    ]
    if not verdicts:
        return None
    last = verdicts[-1]
    return BalanceOutcome(
        kept=last["balance"] == "kept",
        plain_ms=float(last["baseline_step_ms"]),
        balanced_ms=float(last["trial_step_ms"]),
        verdicts=len(verdicts),
        after_step=int(last["after_step"]),
        reason=str(last["reason"]),
        cost=fitted_cost(a.shares),
    )


def fitted_cost(shares: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """The last cost model fitted online that the record's ``shares`` lines scheduled,
    ``[quadratic_tokens, per_sample]`` (``None``: the configured one throughout)."""
    costs = [line["cost"] for line in shares if line.get("cost") is not None]
    return [float(v) for v in costs[-1]] if costs else None


def _split_before(lines: list[dict[str, Any]], trial: dict[str, Any]) -> list[int] | None:
    """The split in effect before ``trial``: the latest earlier line's (the first line's is the start)."""
    earlier = [line for line in lines if line is not trial and line["window"] <= trial["window"]]
    return list(earlier[-1]["samples"]) if earlier else None


def _why(reason: str) -> str:
    """A revert line's reason without the "reverted to ... cool-down" tail."""
    return reason.split(": split ", 1)[0]


def per_sample_text(a: RunArrays, rank: int, mask: np.ndarray) -> str:
    """``"; per sample 1.02 ms against 0.53 ms on the other ranks (1.9x)"`` over the masked steps, or
    ``""`` when the record has no samples for them."""
    if a.samples is None or not mask.any():
        return ""
    n = a.samples[mask]
    if (n <= 0).any():
        return ""
    per_sample = np.median(a.compute[mask] / n, axis=0)
    others = float(np.median(np.delete(per_sample, rank)))
    ratio = f" ({per_sample[rank] / others:.1f}x)" if others > 0 else ""
    return f"; per sample {per_sample[rank]:.3g} ms against {others:.3g} ms on the other ranks{ratio}"
