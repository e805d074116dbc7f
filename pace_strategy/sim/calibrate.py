"""Fit the simulator to a recorded run and predict that job at other scales.

The fit is empirical (a bootstrap), not a parametric guess: per step, a rank's time from its previous
collective's completion to its arrival at the sync point (start gap, input wait included, plus
compute) is split into its own persistent offset, a component shared by all ranks in that step, and
an idiosyncratic residual; transfer time and the rest of the step are kept as measured. A prediction
redraws those pieces for any number of ranks, and scales the transfer time with the ring
all-reduce's ``2 (n-1)/n`` factor (bandwidth term) from the recorded rank count. ``pace diagnose``
projects its findings to scale with the same fit and prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pace_strategy.core import glossary
from pace_strategy.core.config import PacingConfig
from pace_strategy.sim.engine import RunResult, WindowDraws, run_steps
from pace_strategy.sim.model import NetworkModel
from pace_strategy.sim.network import inter_node_bandwidth_gbps
from pace_strategy.telemetry.arrays import RANK_AXIS, RunArrays

__all__ = ["Calibration", "fit", "oversubscription_factor", "predict", "ring_factor"]


@dataclass(frozen=True)
class Calibration:
    ranks: int
    steps: int
    base_ms: float  #: median compute of the median rank
    offsets_ms: np.ndarray  #: [ranks] each rank's persistent offset from base
    common_ms: np.ndarray  #: [steps] per-step component shared by all ranks
    #: [steps, ranks] idiosyncratic residuals, each rank's own: a rank slow in bursts keeps its tail
    residual_ms: np.ndarray
    transfer_ms: np.ndarray  #: [steps] measured transfer time (minimum wait)
    other_ms: np.ndarray  #: [steps] step time not explained by compute and transfer
    slow_threshold_ms: float  #: offsets above this count as persistent stragglers
    measured_mean_step_ms: float
    measured_cv: float

    @property
    def slow_ranks(self) -> list[int]:
        return [int(r) for r in np.nonzero(self.offsets_ms > self.slow_threshold_ms)[0]]

    def report(self) -> str:
        res = self.residual_ms
        tail = float(np.mean(res > 3 * max(float(np.std(res)), 1e-9)))
        return "\n".join(
            [
                f"fitted from {self.steps} steps x {self.ranks} ranks:",
                f"  compute base {self.base_ms:.2f} ms; per-rank offsets "
                + ", ".join(f"r{r} {o:+.2f}" for r, o in enumerate(self.offsets_ms[:16]))
                + (" ..." if self.ranks > 16 else ""),
                f"  persistent stragglers (offset > {self.slow_threshold_ms:.2f} ms): "
                f"{self.slow_ranks or 'none'}",
                f"  shared per-step jitter sd {np.std(self.common_ms):.2f} ms; per-rank residual sd "
                f"{np.std(res):.2f} ms, {tail:.1%} of residuals beyond 3 sd (transient stragglers)",
                f"  transfer {np.median(self.transfer_ms):.2f} ms median "
                f"(p95 {np.percentile(self.transfer_ms, 95):.2f}); "
                f"other {np.median(self.other_ms):.2f} ms",
                f"  measured: mean step {self.measured_mean_step_ms:.2f} ms, CV {self.measured_cv:.3f}",
            ]
        )


def fit(a: RunArrays) -> Calibration:
    """Calibrate from a run record's usable steps.

    A rank arrives at the sync point its start gap (previous collective's completion to batch ready,
    the input wait included) plus its compute after the previous collective completed: the
    lateness the barrier turns into waiting. Records without start gaps fall back to the input wait.
    """
    c = a.compute + np.maximum(a.gap, a.data)
    per_rank = np.median(c, axis=0)
    base = float(np.median(per_rank))
    offsets = per_rank - base
    e = c - per_rank[None, :]
    common = np.median(e, axis=1)
    residual = e - common[:, None]
    transfer = glossary.transfer_ms(a.wait, RANK_AXIS)
    other = np.clip(a.step_ms - c.max(axis=1) - transfer, 0.0, None)
    mad = float(np.median(np.abs(offsets - np.median(offsets)))) * 1.4826
    threshold = max(3 * mad, 0.05 * float(np.median(a.step_ms)), 1.0)
    mean = float(a.step_ms.mean())
    return Calibration(
        ranks=a.world_size,
        steps=a.steps,
        base_ms=base,
        offsets_ms=offsets,
        common_ms=common,
        residual_ms=residual,
        transfer_ms=transfer,
        other_ms=other,
        slow_threshold_ms=threshold,
        measured_mean_step_ms=mean,
        measured_cv=float(a.step_ms.std() / mean),
    )


def ring_factor(recorded_ranks: int, ranks: int) -> float:
    """How the ring all-reduce's bandwidth term ``2 (n-1)/n`` changes from the recorded rank count."""
    if recorded_ranks <= 1 or ranks <= 1:
        return 1.0
    return (2 * (ranks - 1) / ranks) / (2 * (recorded_ranks - 1) / recorded_ranks)


def _draws(
    cal: Calibration,
    ranks: int,
    seed: int,
    remove_stragglers: bool,
    transfer_factor: float,
    fixed_ranks: Sequence[int] = (),
) -> Callable[[int, int], WindowDraws]:
    rng0 = np.random.default_rng([seed, ranks, 7])
    source = cal.offsets_ms.copy()
    # whose residuals each recorded rank's stand-in draws: its own, so a rank slow in bursts stays so
    behaves_like = np.arange(cal.ranks)
    fixed = sorted({int(r) for r in fixed_ranks})
    if fixed and len(fixed) < cal.ranks:  # what-if: these recorded ranks behave like the others
        others = np.delete(np.arange(cal.ranks), fixed)
        source[fixed] = float(np.median(source[others]))
        behaves_like[fixed] = rng0.choice(others, size=len(fixed), replace=True)
    # at another size, ranks are drawn from the recorded ones: a slow rank stays as common as it was
    drawn = np.arange(cal.ranks) if ranks == cal.ranks else rng0.choice(cal.ranks, size=ranks, replace=True)
    offsets = source[drawn]
    residual_of = behaves_like[drawn]
    if remove_stragglers:
        offsets = np.minimum(offsets, cal.slow_threshold_ms)
        offsets[offsets >= cal.slow_threshold_ms] = 0.0
    ring = ring_factor(cal.ranks, ranks)

    def draw(window: int, k: int) -> WindowDraws:
        rng = np.random.default_rng([seed, ranks, window])
        s = rng.integers(0, cal.steps, k)
        compute = cal.base_ms + offsets[None, :] + cal.common_ms[s][:, None]
        rows = rng.integers(0, cal.residual_ms.shape[0], size=(k, ranks))
        compute = compute + cal.residual_ms[rows, residual_of[None, :]]
        return WindowDraws(
            compute_ms=np.clip(compute, 0.0, None),
            collective_ms=cal.transfer_ms[s] * ring * transfer_factor,
            other_ms=cal.other_ms[s],
        )

    return draw


def predict(
    cal: Calibration,
    ranks: int,
    *,
    steps: int,
    seed: int = 0,
    pacing: PacingConfig | None = None,
    remove_stragglers: bool = False,
    gpus_per_node: int = 1,
    window_steps: int = 32,
    transfer_factor: float = 1.0,
    fixed_ranks: Sequence[int] = (),
) -> RunResult:
    """The calibrated job at ``ranks`` ranks (with ``pacing`` or without).

    What-ifs: ``remove_stragglers`` sets the persistent offsets to 0; ``fixed_ranks`` gives those
    recorded ranks the median offset of the others (wherever they are drawn); ``transfer_factor``
    multiplies the transfer time (see :func:`oversubscription_factor`). The same ``seed`` gives the
    same draws with and without a what-if.
    """
    return run_steps(
        _draws(cal, ranks, seed, remove_stragglers, transfer_factor, fixed_ranks),
        ranks=ranks,
        steps=steps,
        warmup_steps=0,
        gpus_per_node=gpus_per_node,
        backward_overlap=0.0,
        spin_contention=0.0,
        pacing=pacing,
        window_steps=pacing.exchange_every_steps if pacing is not None else window_steps,
    )


def oversubscription_factor(net: NetworkModel, nodes: int) -> float:
    """How much longer the inter-node transfer gets on ``net`` than on the same fabric at full
    bisection (oversubscription 1): the ratio of the per-node ring bandwidths."""
    full = float(inter_node_bandwidth_gbps(dataclasses.replace(net, oversubscription=1.0), nodes))
    return full / float(inter_node_bandwidth_gbps(net, nodes))
