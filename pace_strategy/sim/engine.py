"""Bulk-synchronous steps, vectorized over ranks and a window of steps, paced by the real controller.

Per step: each rank computes (``compute_ms``), the first gradient bucket is ready after the
non-overlapped part, the rank sleeps its pacing delay, then hands its first bucket to the
collective. The collective starts when the last rank's first bucket is there and takes
``collective_ms``; the overlapped part of backward runs after the hand-off. What a rank records is
what the real monitors record: its arrival is the end of its local backward (the overlapped part
included), its wait runs from there to the completion of the step's collectives (the collective's
end, or the last rank's end of backward if that is later). Waits, compute times and delays go
through the same ``window_stats`` -> ``PacingPolicy`` pipeline as a real run, once per window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.core.skew import WindowStats

__all__ = ["RunResult", "WindowDraws", "run_steps"]


@dataclass(frozen=True)
class WindowDraws:
    """Random inputs of ``k`` consecutive steps (identical for the paced and the unpaced run)."""

    compute_ms: np.ndarray  #: [k, ranks] compute time including input wait
    collective_ms: np.ndarray  #: [k] all-reduce time once every rank has arrived
    other_ms: np.ndarray  #: [k] per-step time outside compute and the collective


@dataclass(frozen=True)
class RunResult:
    """Post-warm-up statistics of one simulated run."""

    ranks: int
    step_ms: np.ndarray  #: [steps] every step's time (warm-up excluded)
    mean_step_ms: float
    cv: float
    p99_ms: float
    pacing_active_share: float
    mean_delay_ms: float  #: mean over paced steps of the largest delay
    last_reason: str
    #: share of step time ranks spent waiting at the sync point (mean lead over ranks, summed over
    #: steps, over the summed step time): the diagnosis's lost step fraction
    lost_fraction: float = 0.0

    @property
    def throughput(self) -> float:
        """Rank-steps per second (samples per second for a per-rank batch of one)."""
        return self.ranks * 1e3 / self.mean_step_ms


def _spin_extra(ready: np.ndarray, arrival: np.ndarray, gpus_per_node: int, contention: float) -> np.ndarray:
    """Extra compute of each rank from node-mates busy-polling while it still computes.

    A node-mate that arrived at ``a_m`` busy-polls until the collective starts; while rank ``r`` is
    still computing (until ``ready_r``) each such mate slows it by ``contention`` per ms of overlap.
    """
    k, w = ready.shape
    if contention <= 0.0 or gpus_per_node < 2:
        return np.zeros_like(ready)
    nodes = w // gpus_per_node
    r = ready[:, : nodes * gpus_per_node].reshape(k, nodes, gpus_per_node, 1)
    a = arrival[:, : nodes * gpus_per_node].reshape(k, nodes, 1, gpus_per_node)
    overlap = np.clip(r - a, 0.0, None).sum(axis=3)  # self term is 0: own arrival >= own ready
    out = np.zeros_like(ready)
    out[:, : nodes * gpus_per_node] = contention * overlap.reshape(k, nodes * gpus_per_node)
    return out


def _window_stats(
    window: int,
    index: np.ndarray,
    keep: np.ndarray,
    compute: np.ndarray,
    wait: np.ndarray,
    delays: np.ndarray,
    step: np.ndarray,
) -> WindowStats:
    """The controller's view of one simulated window: the gathered ``[ranks, steps, NUM_FIELDS]``
    rows a real exchange would give (``compute``, ``wait``: ``[steps, ranks]`` ms), as statistics."""
    import torch

    from pace_strategy.core.records import NUM_FIELDS, Field
    from pace_strategy.core.skew import window_stats

    k, ranks = compute.shape
    g = torch.zeros(ranks, k, NUM_FIELDS, dtype=torch.float64)
    g[:, :, Field.STEP] = torch.from_numpy(index.astype(np.float64))
    g[:, :, Field.VALID] = 1.0
    g[:, :, Field.WARMUP] = torch.from_numpy((~keep).astype(np.float64))
    g[:, :, Field.COMPUTE_MS] = torch.from_numpy(compute.T.copy())
    g[:, :, Field.WAIT_MS] = torch.from_numpy(wait.T.copy())
    g[:, :, Field.DELAY_MS] = torch.from_numpy(np.repeat(delays[:, None], k, axis=1))
    g[:, :, Field.STEP_MS] = torch.from_numpy(np.repeat(step[None, :], ranks, axis=0))
    return window_stats(window, g)


def run_steps(
    draw: Callable[[int, int], WindowDraws],
    *,
    ranks: int,
    steps: int,
    warmup_steps: int,
    gpus_per_node: int,
    backward_overlap: float,
    spin_contention: float,
    pacing: PacingConfig | None,
    window_steps: int,
) -> RunResult:
    """Simulate ``steps`` steps; ``draw(window, k)`` gives each window's random inputs.

    With ``pacing=None`` no rank is ever delayed; otherwise the real ``PacingPolicy`` decides the
    delays from each window's measurements and they apply from the next window on. Paced and unpaced
    runs must use the same ``window_steps`` so that they see the same draws.
    """
    k_window = window_steps
    policy = None
    if pacing is not None:  # torch only for the controller: an unpaced run is NumPy alone
        from pace_strategy.core.policy import PacingPolicy

        policy = PacingPolicy(pacing, ranks)
    delays = np.zeros(ranks)
    step_times: list[np.ndarray] = []
    active: list[np.ndarray] = []
    delay_max: list[np.ndarray] = []
    lead_sum = 0.0  # summed over kept steps of the mean lead over ranks
    reason = "no pacing"
    done = 0
    window = 0
    while done < steps:
        k = min(k_window, steps - done)
        d = draw(window, k)
        c = d.compute_ms
        tail = c * backward_overlap
        ready = c - tail
        arrival = ready + delays
        extra = _spin_extra(ready, arrival, gpus_per_node, spin_contention)
        ready = ready + extra
        arrival = arrival + extra
        collective_done = arrival.max(axis=1) + d.collective_ms  # starts at the last first bucket
        local_end = arrival + tail  # each rank's end of local backward: its arrival as recorded
        completion = np.maximum(collective_done, local_end.max(axis=1))
        step = completion + d.other_ms
        wait = completion[:, None] - local_end
        index = np.arange(done, done + k)
        keep = index >= warmup_steps
        step_times.append(step[keep])
        lead_sum += float((local_end.max(axis=1, keepdims=True) - local_end).mean(axis=1)[keep].sum())
        active.append(np.full(int(keep.sum()), bool((delays > 0).any())))
        delay_max.append(np.full(int(keep.sum()), float(delays.max())))
        if policy is not None:
            decision = policy.update(_window_stats(window, index, keep, ready + tail, wait, delays, step))
            delays = np.asarray(decision.delays_ms, dtype=np.float64)
            reason = f"{decision.state.value}: {decision.reason}"
        done += k
        window += 1
    times = np.concatenate(step_times)
    act = np.concatenate(active)
    dmax = np.concatenate(delay_max)
    mean = float(times.mean())
    return RunResult(
        ranks=ranks,
        step_ms=times,
        mean_step_ms=mean,
        cv=float(times.std() / mean) if mean > 0 else 0.0,
        p99_ms=float(np.percentile(times, 99)),
        pacing_active_share=float(act.mean()),
        mean_delay_ms=float(dmax[act].mean()) if act.any() else 0.0,
        last_reason=reason,
        lost_fraction=lead_sum / float(times.sum()) if times.sum() > 0 else 0.0,
    )
