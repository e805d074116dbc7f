"""What each finding would cost at larger scale: the simulator calibrated on the same run.

The calibration and the prediction are ``pace simulate --from-run``'s own (:mod:`pace_strategy.sim.
calibrate`), unpaced, on a seeded subsample of the record's steps. Per finding, by its
``projection_basis``:

- ``waiting``: the share of step time ranks spend waiting at the sync point at R ranks (jitter,
  transient stragglers, a crowded host: everything that makes the slowest of R ranks late), with the
  ranks other findings name behaving like the others (what they cost is theirs); where several
  findings share the waiting (a crowded host's bulk scatter and transient stragglers beside it), each
  is projected its measured share of it;
- ``ranks``: what the named ranks cost: the waiting (ms per step) minus the waiting of the same job
  with those ranks behaving like the others (the same random draws, so the difference is the
  ranks'), over the step with them;
- ``step``: the step time the named ranks add (a slow group, a pipeline stage): the mean step minus
  the mean step of the same job with those ranks behaving like the others, over the step with them;
- ``transfer`` / ``transfer_variable``: the collective's time (or its part above its 5th
  percentile) at R ranks, scaled like the ring all-reduce, as a share of the simulated step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pace_strategy.telemetry.arrays import RunArrays

__all__ = ["ASSUMPTION", "DEFAULT_PROJECT_RANKS", "Projection", "project"]

#: rank counts a finding is projected to unless the user asks for others (``--project-ranks``)
DEFAULT_PROJECT_RANKS = (8, 64, 512, 1024)

ASSUMPTION = (
    "same per-rank behaviour (each simulated rank behaves like a recorded rank drawn at random: its "
    "persistent offset, the per-step jitter shared by all ranks, the per-rank jitter), the same step "
    "(compute and the time outside compute and the collective as recorded), the fabric as recorded "
    "(transfer time scaled by the ring all-reduce's 2(n-1)/n); no pacing"
)

_SEED = 0
_WINDOW_STEPS = 32  #: draws are made per window of steps, as in ``pace simulate --from-run``
_TRANSFER_FLOOR_PERCENTILE = 5  #: the transfer time's best case, as in the fabric check


@dataclass(frozen=True)
class Projection:
    """How the projections were made, and how well the simulator reproduces the run at its size."""

    ranks: list[int]
    assumption: str
    calibration_steps: int  #: recorded steps the simulator was calibrated on
    simulated_steps: int  #: simulated steps per rank count
    measured_lost_fraction: float  #: waiting share of the run as recorded
    simulated_lost_fraction: float  #: the same, simulated at the recorded rank count
    waiting: list[dict[str, float]]  #: the job's waiting share per projected rank count
    seconds: float  #: time the projection took

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def project(
    sample: RunArrays,
    findings: Sequence[Any],
    ranks: Sequence[int],
    *,
    steps: int,
    measured_lost_fraction: float,
) -> tuple[list[Any], Projection]:
    """``findings`` with their ``projection`` filled in for every rank count of ``ranks``, the
    simulator calibrated on ``sample``: the run's steps, or a seeded sample of them
    (``projection_calibration_steps``, :func:`pace_strategy.telemetry.arrays.sample_steps`)."""
    from pace_strategy.sim.calibrate import fit, predict, ring_factor

    started = time.monotonic()
    cal = fit(sample)
    sizes = sorted({int(r) for r in ranks if int(r) >= 1})

    def run(n: int, fixed: Sequence[int] = ()) -> Any:
        return predict(cal, n, steps=steps, seed=_SEED, window_steps=_WINDOW_STEPS, fixed_ranks=fixed)

    base = {n: run(n) for n in sizes}
    now = run(cal.ranks)
    named = sorted({r for f in findings if f.projection_basis in ("ranks", "step") for r in f.ranks})
    rest = {n: run(n, named) for n in sizes} if named else base
    transfer_mean = float(cal.transfer_ms.mean())
    transfer_variable = float(
        (cal.transfer_ms - np.percentile(cal.transfer_ms, _TRANSFER_FLOOR_PERCENTILE)).mean()
    )
    waiting = [f.lost_step_fraction for f in findings if f.projection_basis == "waiting"]
    out = []
    for f in findings:
        points = []
        for n in sizes:
            plain = base[n]
            if f.projection_basis == "step" and f.ranks:
                fixed = run(n, f.ranks)
                cost = (plain.mean_step_ms - fixed.mean_step_ms) / plain.mean_step_ms
            elif f.projection_basis == "ranks" and f.ranks:
                # waiting in ms per step with and without them, over today's step: the shares do not
                # subtract, since fixing the ranks also shortens the step
                fixed = run(n, f.ranks)
                lead_ms = plain.lost_fraction * plain.mean_step_ms - fixed.lost_fraction * fixed.mean_step_ms
                cost = lead_ms / plain.mean_step_ms
            elif f.projection_basis in ("transfer", "transfer_variable"):
                per_step = transfer_mean if f.projection_basis == "transfer" else transfer_variable
                cost = per_step * ring_factor(cal.ranks, n) / plain.mean_step_ms
            else:
                split = f.lost_step_fraction / sum(waiting) if len(waiting) > 1 and sum(waiting) > 0 else 1.0
                cost = rest[n].lost_fraction * split
            points.append({"ranks": n, "lost_fraction": max(0.0, float(cost))})
        out.append(dataclasses.replace(f, projection=points))
    meta = Projection(
        ranks=sizes,
        assumption=ASSUMPTION,
        calibration_steps=cal.steps,
        simulated_steps=steps,
        measured_lost_fraction=measured_lost_fraction,
        simulated_lost_fraction=now.lost_fraction,
        waiting=[{"ranks": n, "lost_fraction": base[n].lost_fraction} for n in sizes],
        seconds=time.monotonic() - started,
    )
    return out, meta
