"""The results of a diagnosis: the failure modes, a finding with its evidence, the whole diagnosis."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["MODES", "Diagnosis", "Finding", "Mode", "pct", "projection_text"]


class Mode(str, enum.Enum):
    """The failure modes a diagnosis names; the values are the strings of ``--json`` and the docs."""

    PERSISTENT_STRAGGLER = "persistent_straggler"
    STRAGGLER_EPISODE = "straggler_episode"
    LOCALITY = "locality"
    STAGE_IMBALANCE = "stage_imbalance"
    INPUT_IMBALANCE = "input_imbalance"
    SYNC_AMPLIFICATION = "sync_amplification"
    FABRIC_CONTENTION = "fabric_contention"
    DATA_STALL = "data_stall"
    HOST_OVERSUBSCRIPTION = "host_oversubscription"
    GC_PAUSES = "gc_pauses"
    UNEXPLAINED_SKEW = "unexplained_skew"
    HEALTHY = "healthy"

    def __str__(self) -> str:
        # Python 3.11 formats str-mixin enums as "Mode.HEALTHY" in f-strings; reports print the value.
        return self.value


#: the mode strings, in declaration order
MODES: tuple[str, ...] = tuple(m.value for m in Mode)


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
    #: share of the run's step time the finding covers (a straggler episode: its stretches); it is worth
    #: acting on by its excess over that part of the run, not over the whole
    scope_fraction: float = 1.0
    #: what the projection simulates: the job's whole ``waiting``, the waiting the named ``ranks`` cost,
    #: the ``step`` time they add (a slow group, a stage), or the collective's time (``transfer``, or its
    #: part above its best case, ``transfer_variable``)
    projection_basis: Literal["waiting", "ranks", "step", "transfer", "transfer_variable"] = "waiting"
    #: ``[{"ranks": R, "lost_fraction": x}, ...]``: this problem's share of step time at R ranks
    projection: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain containers for JSON; ``mode`` as its string."""
        return {**asdict(self), "mode": self.mode.value}

    @property
    def excess_fraction(self) -> float:
        """Lost share beyond what the run's own jitter explains: what acting on it could save."""
        return self.lost_step_fraction - self.noise_floor_fraction

    @property
    def scope_excess_fraction(self) -> float:
        """:attr:`excess_fraction` over the part of the run the finding covers."""
        return self.excess_fraction / max(self.scope_fraction, 1e-9)


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


def pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def projection_text(points: Sequence[dict[str, float]]) -> str:
    """``"4.1% at 8, 11% at 64, 16% at 512 ranks"``."""
    return ", ".join(f"{pct(p['lost_fraction'])} at {int(p['ranks']):,}" for p in points) + " ranks"
