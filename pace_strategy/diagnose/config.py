"""Thresholds of the diagnosis, in one typed config; the report states which were used."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from pace_strategy.core.config import check_known_keys, check_number, doc

__all__ = ["DiagnosisConfig"]

#: fields that are shares or fractions of something, so must lie in (0, 1]
_SHARES = (
    "persistent_share",
    "tail_loss_share",
    "compute_late_fraction",
    "locality_share",
    "locality_spread_fraction",
    "spread_entropy",
    "data_share",
    "data_straggler_share",
    "gc_explained_share",
    "input_explained_share",
)


#: counts of steps, at least 1
_STEPS = ("min_steps", "projection_steps", "projection_calibration_steps")


@dataclass(frozen=True, kw_only=True)
class DiagnosisConfig:
    """Thresholds that decide which failure mode a run record shows. Our own design, like every
    constant of the project; override with ``pace diagnose --set FIELD=VALUE``."""

    min_steps: int = field(
        default=10,
        metadata=doc("Fewer usable steps than this and the record is not diagnosed (too few to count)."),
    )
    persistent_share: float = field(
        default=0.5, metadata=doc("A rank last in at least this share of steps is a persistent straggler.")
    )
    tail_loss_share: float = field(
        default=0.7,
        metadata=doc(
            """A rank whose late steps hold at least this share of all the time the ranks lost waiting is
            a straggler even when it is late in only some steps (a host slow in bursts: a CPU quota, a
            noisy neighbour); its lateness is then the mean over those steps weighted by the wait each
            caused, not the median."""
        ),
    )
    compute_late_fraction: float = field(
        default=0.5,
        metadata=doc(
            """A straggler whose own compute exceeds the other ranks' median by at least this fraction of
            its lateness is slow itself (``persistent_straggler``); so is one whose compute plus its own
            work between steps (optimizer, input, framework: its previous collective's completion to its
            next step's start) does. Below it, its work was normal and it started late behind a slower
            network path (``fabric_contention``)."""
        ),
    )
    locality_share: float = field(
        default=0.8,
        metadata=doc(
            """A place (one local rank index across nodes, or one host) holding the straggler in at least
            this share of steps is a locality problem."""
        ),
    )
    locality_spread_fraction: float = field(
        default=0.5,
        metadata=doc(
            """A rank of that local index counts towards the spread over nodes when it was last in at least
            this fraction of an even split of the index's straggler share (0.5: half its fair part)."""
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
            """A finding is worth acting on when the share of step time it loses exceeds the noise floor
            (the waiting the run's own jitter explains over the same steps) by at least this much;
            smaller ones are notes, and a run with none is healthy."""
        ),
    )
    jitter_floor_factor: float = field(
        default=1.0,
        metadata=doc(
            """The noise floor is this multiple of the waiting that normal jitter of the measured size
            (robust sd of the ranks' arrivals) gives at the run's number of ranks (sd x E[max of W
            normals]); 0 compares with ``healthy_lost_fraction`` alone."""
        ),
    )
    busy_threads_per_core: float = field(
        default=1.0,
        metadata=doc(
            """A host whose ranks keep more busy threads (intra-op threads plus DataLoader workers) than
            this many per usable core is oversubscribed (``host_oversubscription``)."""
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
        default=2.0,
        metadata=doc(
            """Skew p99 / p50 at or above which the skew is heavy-tailed; transfer time p95 / p50 at or
            above which it is unstable."""
        ),
    )
    growth_ratio: float = field(
        default=1.2,
        metadata=doc(
            """Expected slowest-rank excess at all ranks over that at 2 ranks above which the amplification
            grows with the number of ranks (raises the ``sync_amplification`` confidence)."""
        ),
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
    data_straggler_share: float = field(
        default=0.1,
        metadata=doc("Only a rank last in at least this share of steps is checked for a data-loading stall."),
    )
    data_straggler_steps: int = field(
        default=5,
        metadata=doc("Only a rank last in at least this many steps is checked for a data-loading stall."),
    )
    gc_explained_share: float = field(
        default=0.5,
        metadata=doc(
            """In the costly steps (skew above the noise threshold), the late rank's own garbage-collector
            time beyond the other ranks' must explain at least this share of its summed lateness for
            ``gc_pauses`` (needs a record with ``gc_ms``)."""
        ),
    )
    gc_min_steps: int = field(
        default=3,
        metadata=doc(
            """``gc_pauses`` needs at least this many costly steps whose late rank's own collector
            explains at least half of its lateness (one collection is not a pattern)."""
        ),
    )
    input_explained_share: float = field(
        default=0.5,
        metadata=doc(
            """The ranks' recorded work sizes (tokens, else samples) must explain at least this share of
            the differences in their per-step compute (R^2 of a least-squares fit on the work size and
            its square) for ``input_imbalance``."""
        ),
    )
    max_heatmap_rows: int = field(
        default=128, metadata=doc("Above this many ranks the lead heat map aggregates by node.")
    )
    max_heatmap_columns: int = field(
        default=1000, metadata=doc("Above this many steps the plots bin steps (mean per bin).")
    )
    projection_steps: int = field(
        default=500,
        metadata=doc("Simulated steps per rank count when projecting the findings to scale."),
    )
    projection_calibration_steps: int = field(
        default=5000,
        metadata=doc(
            """Recorded steps (a seeded sample, all of them when fewer) the projection's simulator is
            calibrated on."""
        ),
    )

    def __post_init__(self) -> None:
        # the pacing config's number check: a share in (0, 1], a count of steps at least 1, busy
        # threads per core above 0, every other threshold a number >= 0
        for f in fields(self):
            low, high, low_open = 0.0, math.inf, False
            if f.name in _SHARES:
                high, low_open = 1.0, True
            elif f.name in _STEPS:
                low = 1.0
            elif f.name == "busy_threads_per_core":
                low_open = True
            fix = f"pass --set {f.name}=<{'steps' if f.name in _STEPS else 'number'}>"
            check_number(
                f"DiagnosisConfig.{f.name}", getattr(self, f.name), low, high, low_open=low_open, fix=fix
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DiagnosisConfig:
        check_known_keys(values, [f.name for f in fields(cls)], "diagnosis threshold")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
