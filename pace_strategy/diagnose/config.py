"""Thresholds of the diagnosis, in one typed config; the report states which were used."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from pace_strategy.core.config import check_known_keys, doc
from pace_strategy.core.errors import PacingConfigError

__all__ = ["DiagnosisConfig"]


@dataclass(frozen=True, kw_only=True)
class DiagnosisConfig:
    """Thresholds that decide which failure mode a run record shows. Our own design, like every
    constant of the project; override with ``pace diagnose --set FIELD=VALUE``."""

    persistent_share: float = field(
        default=0.5, metadata=doc("A rank last in at least this share of steps is a persistent straggler.")
    )
    locality_share: float = field(
        default=0.8,
        metadata=doc(
            """A place (one local rank index across nodes, or one host) holding the straggler in at least
            this share of steps is a locality problem."""
        ),
    )
    slow_ms_floor: float = field(
        default=2.0, metadata=doc("Lateness below this many milliseconds counts as noise.")
    )
    slow_step_fraction: float = field(
        default=0.05, metadata=doc("Lateness below this fraction of the median step counts as noise.")
    )
    healthy_lost_fraction: float = field(
        default=0.05,
        metadata=doc(
            """Below this share of step time lost to waiting (mean lead over ranks / step time), and with
            no other finding, the run is healthy."""
        ),
    )
    spread_entropy: float = field(
        default=0.6,
        metadata=doc(
            """Normalized entropy (0: always the same rank, 1: uniform over ranks) of the straggler
            identity above which the straggler "changes from step to step"."""
        ),
    )
    heavy_tail_ratio: float = field(
        default=2.0, metadata=doc("Skew p99 / p50 at or above which the skew is heavy-tailed.")
    )
    transfer_step_fraction: float = field(
        default=0.25,
        metadata=doc("Transfer time (minimum wait) above this fraction of the median step is inflated."),
    )
    transfer_cv: float = field(
        default=0.5, metadata=doc("Transfer time coefficient of variation above which it is unstable.")
    )
    compute_cv_steady: float = field(
        default=0.15,
        metadata=doc("Per-rank compute-time CV (median over ranks) below which compute is steady."),
    )
    data_share: float = field(
        default=0.5,
        metadata=doc(
            """A straggler whose input wait explains at least this share of its lateness (median over the
            steps it was last) has a data-loading stall."""
        ),
    )
    max_heatmap_rows: int = field(
        default=128, metadata=doc("Above this many ranks the lead heat map aggregates by node.")
    )
    max_heatmap_columns: int = field(
        default=1000, metadata=doc("Above this many steps the plots bin steps (mean per bin).")
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise PacingConfigError(
                    f"DiagnosisConfig.{f.name}={value!r} is invalid: expected a number >= 0. "
                    f"Fix: pass --set {f.name}=<number>."
                )
        for name in ("persistent_share", "locality_share", "spread_entropy", "data_share"):
            if not 0 < getattr(self, name) <= 1:
                raise PacingConfigError(
                    f"DiagnosisConfig.{name}={getattr(self, name)!r} is invalid: expected 0 < value <= 1."
                )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DiagnosisConfig:
        check_known_keys(values, [f.name for f in fields(cls)], "diagnosis threshold")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
