"""Rebalancing: per-rank shares of a constant global batch from per-sample compute time, proven online.

Pacing cannot shorten a step whose length the last rank sets. When one rank is persistently slow *per
sample* (a throttled or older device, a busier host), giving it fewer samples of the same global batch
and the fast ranks more does. :class:`RebalancePolicy` decides the split; the Pacer writes it into the
:class:`~pace_strategy.core.shares.ShareSchedule` that the data pipeline reads.

Like the pacing controller it is a deterministic state machine fed one gathered window at a time, so
every rank takes the same decision from the same data without further communication:

- **Measure** each rank's per-sample compute time: ``COMPUTE_MS / SAMPLES``, the **mean** over the
  window's usable steps. The mean, not the median: throughput is set by the mean step, and a host slow
  in bursts (a CPU quota, a noisy neighbour) is normal at the median and loses its time in the tail.
  Compute time runs from batch ready to the end of the rank's local backward, so a rank that starts
  late behind a slow network path (``GAP_MS``, the wait pattern) or waits for its input
  (``DATA_MS``) is not slow here and is never rebalanced.
- **Propose** the split of the global batch, in whole quanta, that minimizes the slowest predicted
  compute (per-sample time x share): shares proportional to speed. Only when it is predicted to
  shorten the step by ``rebalance_min_imbalance`` of the step time, for
  ``rebalance_persist_windows`` windows in a row (hysteresis).
- **Prove** it: the split starts at a window boundary the data pipeline has not built yet; after
  ``ab_windows`` windows at it, it is kept only if (1) the compute of the ranks that lost samples
  fell by at least ``rebalance_min_scaling`` of what their per-sample time predicted (otherwise the
  slowness is a fixed per-step cost: a fixed sleep, a per-step stall) and (2) the median step time
  at the same global batch fell by more than pacing's A/B rule asks (``min_gain_fraction`` and
  ``ab_noise_factor`` times the run's own window-to-window noise). Otherwise the previous split
  comes back (the even one, the first time) and a cool-down follows, longer after each reverted
  trial in a row.

A kept split keeps being measured: if the speeds change (the slow rank recovers, another slows down),
the imbalance under the kept split triggers a new proposal and a new trial against it.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.policy import ab_gain_needed_ms, ab_noise_ms, next_cooldown_windows
from pace_strategy.core.records import Field
from pace_strategy.core.shares import best_split, even_shares
from pace_strategy.core.skew import usable_field, usable_steps
from pace_strategy.core.state import STATE_VERSION, PacingStateError, check_state

__all__ = [
    "MEMORY_LIMIT_FRACTION",
    "RebalanceDecision",
    "RebalancePolicy",
    "RebalanceState",
    "best_split",
    "first_boundary",
    "measure_window",
    "memory_caps",
    "per_share",
    "resolve_quantum",
]

#: a split may give a rank at most the share whose predicted peak memory (its peak so far, scaled by
#: the share) is this fraction of the device's: the rest is the caching allocator's fragmentation and
#: what the framework allocates outside the step
MEMORY_LIMIT_FRACTION = 0.9

#: ``rebalance.quantum="auto"``: the quantum is 8 where the even share is at least this many samples
_AUTO_QUANTUM_FULL_SHARE = 64
_AUTO_QUANTUM = 8


def resolve_quantum(setting: int | str, global_batch: int, world_size: int) -> int:
    """The quantum in samples: ``setting`` itself, or for ``"auto"`` 8 where the even share is at
    least 64 samples, else the largest power of two up to an eighth of it (at least 1)."""
    if setting != "auto":
        return int(setting)
    even = global_batch // max(world_size, 1)
    if even >= _AUTO_QUANTUM_FULL_SHARE:
        return _AUTO_QUANTUM
    return 1 << max(0, (max(even // 8, 1)).bit_length() - 1)


def memory_caps(mem_peak: Sequence[float], shares: Sequence[int]) -> tuple[int | None, ...]:
    """Per rank, the most samples its device is predicted to hold: its peak memory so far
    (``mem_peak[r]``, a fraction of the device) at its share ``shares[r]``, scaled linearly to
    :data:`MEMORY_LIMIT_FRACTION` (``None``: not measured, CPU)."""
    return tuple(
        int(MEMORY_LIMIT_FRACTION * s / m) if m > 0 and s > 0 else None
        for m, s in zip(mem_peak, shares, strict=True)
    )


class RebalanceState(str, enum.Enum):
    """States of the rebalancing controller."""

    WATCH = "watch"  #: the split in effect (even, or kept) is measured; waiting for a persistent imbalance
    TRIAL = "trial"  #: a new split is scheduled or running; its check is pending
    COOLDOWN = "cooldown"  #: a trial was reverted; no new split until the cool-down ends
    OFF = "off"  #: the data pipeline does not follow the schedule: rebalancing stopped for the run

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RebalanceDecision:
    """What the rebalancing controller decided after one window; identical on every rank.

    ``shares[r]`` is rank ``r``'s samples per step of the latest split (in effect, or scheduled from
    ``from_step``).
    """

    window: int
    state: RebalanceState
    shares: tuple[int, ...]
    reason: str
    #: this decision adds a split that starts at this global step (``None``: the split is unchanged)
    from_step: int | None = None
    #: the state or the split changed with this window (what the run record writes a line for)
    changed: bool = False
    baseline_step_ms: float | None = None  #: median step time at the split a trial replaced, ms
    trial_step_ms: float | None = None  #: median step time of the trial, ms (at its verdict)
    per_sample_ms: tuple[float, ...] = ()  #: latest per-rank median compute time per sample, ms
    #: where cost-balanced batches are on: whether the split's samples are balanced by cost (the
    #: latest arm of the schedule); ``None``: balancing off
    balanced: bool | None = None
    #: the cost model fitted online (``balance.fit``), ``(quadratic_tokens, per_sample)``, that
    #: splits the samples from ``from_step`` on; ``None``: unchanged
    cost: tuple[float, float] | None = None
    #: a decision of balancing's A/B check: its state
    #: (:class:`~pace_strategy.core.balance_check.BalanceState`: ``"trial"``, ``"kept"``,
    #: ``"dropped"``); at its verdict ``baseline_step_ms`` is the plain arm's median step and
    #: ``trial_step_ms`` the balanced arm's; ``"fit"``: a new fitted cost model only. ``None``: a
    #: decision of rebalancing
    balance: str | None = None


@dataclass(frozen=True)
class WindowMeasure:
    """One window's usable steps at one split (:func:`measure_window`)."""

    first_step: int  #: first usable step's label
    last_step: int
    shares: tuple[int, ...]  #: per-rank samples of the first usable step
    uniform: bool  #: every usable step ran at ``shares``, with the same number of micro-batches
    batches: int  #: micro-batches per step (gradient accumulation), each of one global batch
    compute_ms: tuple[float, ...]  #: per-rank mean compute time per step, ms
    #: per-rank mean unpaced wait at the sync point (wait + delay), ms: how early each rank arrived
    wait_ms: tuple[float, ...]
    per_sample_ms: tuple[float, ...]  #: per-rank mean of compute time / samples, ms
    step_ms: float  #: mean step time (slowest rank), ms: what sets the samples per second
    paced: bool  #: some usable step ran under a pacing delay
    #: per-rank peak device memory so far, a fraction of the device (``Field.MEM_PEAK``); ``()``
    #: where no rank measured any (CPU)
    mem_peak: tuple[float, ...] = ()


def measure_window(
    gathered: torch.Tensor, global_batch: int, usable_steps_: torch.Tensor | None = None
) -> WindowMeasure | str:
    """Per-rank compute per sample over the usable steps of a gathered window ``[W, steps, fields]``.

    Usable: valid, past warm-up, every rank reported its samples and they add up to a whole number
    of global batches (one per micro-batch with gradient accumulation; an epoch's short last batch is
    left out). Returns the reason in words when no step is usable. ``usable_steps_``: the window's
    :func:`~pace_strategy.core.skew.usable_steps` when the caller has them already (the window
    statistics'), else computed here.
    """
    valid = usable_steps(gathered) if usable_steps_ is None else usable_steps_
    if not bool(valid.any()):
        return "no usable steps in the window (warm-up or sync point not seen)"
    samples = gathered[:, :, Field.SAMPLES]
    reported = valid & (samples.amin(dim=0) > 0)  # every rank's; NaN is not > 0 either way (4x faster)
    if not bool(reported.any()):
        return "no step reported its samples (the integration calls Pacer.set_samples)"
    total = samples.sum(dim=0)
    usable = reported & (total % global_batch == 0)
    if not bool(usable.any()):
        totals = sorted({int(v) for v in total[reported].tolist()})
        return f"no step trained on the global batch of {global_batch} samples (the ranks' totals: {totals})"

    def column(f: Field) -> torch.Tensor:
        return usable_field(gathered, usable, f)

    batches = total[usable] / global_batch  # micro-batches per step (gradient accumulation)
    trained = column(Field.SAMPLES)
    n = trained / batches  # per micro-batch: the split itself
    compute = column(Field.COMPUTE_MS)
    labels = gathered[0, usable, Field.STEP]
    # Means over the window: the time a burst costs counts (a median would not see it).
    per_sample = (compute / trained).mean(dim=1)
    if not bool((per_sample > 0).all()):
        return "a rank's compute time was not measured (0 ms per sample)"
    delay = column(Field.DELAY_MS)
    peak = column(Field.MEM_PEAK).amax(dim=1)
    return WindowMeasure(
        first_step=int(labels[0]),
        last_step=int(labels[-1]),
        shares=tuple(n[:, 0].long().tolist()),  # truncated as int() would: whole samples
        uniform=bool((n == n[:, :1]).all()) and bool((batches == batches[0]).all()),
        batches=int(batches[0]),
        compute_ms=tuple(compute.mean(dim=1).tolist()),
        wait_ms=tuple((column(Field.WAIT_MS) + delay).mean(dim=1).tolist()),
        per_sample_ms=tuple(per_sample.tolist()),
        step_ms=float(column(Field.STEP_MS).amax(dim=0).mean()),
        paced=bool((delay > 0).any()),
        # none on CPU: () (8,192 zeros, tested for a positive one in every proposal, cost 0.5 ms)
        mem_peak=tuple(peak.tolist()) if bool((peak > 0).any()) else (),
    )


def per_share(m: WindowMeasure, shares: Sequence[int]) -> WindowMeasure:
    """``m`` read per share instead of per sample: with cost-balanced batches the balancer gives each
    rank a predicted cost in proportion to its share (its weight), whatever the counts, so a rank's
    compute over its share is its time per unit of work, as compute over samples is for equal-cost
    samples. The window is taken to run at ``shares`` (the counts say nothing about it)."""
    shares = tuple(shares)
    return dataclasses.replace(
        m,
        shares=shares,
        uniform=True,
        per_sample_ms=tuple(c / (s * m.batches) for c, s in zip(m.compute_ms, shares, strict=True)),
    )


def first_boundary(window_last_step: int, every_steps: int, not_before: int) -> int:
    """The first window boundary (a window's first step: ``window_last_step + 1 + m * every_steps``)
    at or after step ``not_before``."""
    start = window_last_step + 1
    if not_before <= start:
        return start
    return start + -(-(not_before - start) // every_steps) * every_steps


def _median_each(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per-rank median over several windows' per-rank values (``statistics.median`` of each rank's:
    the middle value, or the mean of the two middle ones)."""
    return tuple(np.median(np.asarray(rows, dtype=np.float64), axis=0).tolist())


#: above this many ranks a reason names the per-rank values' range, not every value (at 8,192 ranks
#: the lists made each reason 114 KB, about 3 ms to format per window, and every node's verdict
#: carried it; the splits themselves are in the record's ``shares`` lines)
_LISTED_RANKS = 64


def _ms(values: Sequence[float]) -> str:
    if len(values) > _LISTED_RANKS:
        v = np.asarray(values)  # argmax: the first of the largest, as max() over the ranks gives it
        slowest = int(v.argmax())
        return f"[{len(values):,} ranks: {v.min():.3g}-{values[slowest]:.3g}, the most on rank {slowest}]"
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _split(shares: Sequence[int]) -> str:
    """A split in a reason: every rank's samples, or their range above :data:`_LISTED_RANKS`."""
    if len(shares) > _LISTED_RANKS:
        v = np.asarray(shares)
        fewest = int(v.argmin())
        return (
            f"[{len(shares):,} ranks: {shares[fewest]}-{int(v.max())} samples, the fewest on rank {fewest}]"
        )
    return str(list(shares))


class RebalancePolicy:
    """Turns gathered windows into per-rank shares of a constant global batch (see the module doc).

    Args:
        config: the validated configuration (``rebalance_*`` fields, and pacing's A/B rule).
        global_batch: N, samples per step summed over ranks.
        world_size: W.
        shares: the split in effect at the start (default: the even split), from ``since_step``.
    """

    def __init__(
        self,
        config: PacingConfig,
        global_batch: int,
        world_size: int,
        shares: Sequence[int] | None = None,
        since_step: int = 0,
    ) -> None:
        self.config = config
        self.global_batch = global_batch
        self.world_size = world_size
        #: samples per quantum (``rebalance.quantum``, or what ``"auto"`` gives for this batch)
        self.quantum = resolve_quantum(config.rebalance.quantum, global_batch, world_size)
        best_split([1.0] * world_size, global_batch, self.quantum)  # N >= W quanta, or fail now
        self.even = even_shares(global_batch, world_size)
        self.state = RebalanceState.WATCH
        self._shares = tuple(shares) if shares is not None else self.even  #: the latest split
        self._since = since_step  #: the step from which ``_shares`` run
        self._previous = self._shares  #: the split a trial replaced (what a revert restores)
        self._streak: list[WindowMeasure] = []  #: consecutive imbalanced windows at the split in effect
        self._baseline: list[float] = []  #: median step times of unpaced windows at the split in effect
        self._trial: list[WindowMeasure] = []  #: unpaced windows at the trial split
        self._paced_in_trial = 0  #: paced windows at the trial split (not counted)
        self._before_compute: tuple[float, ...] = ()  #: per-rank compute per step before the trial
        self._before_per_sample: tuple[float, ...] = ()
        self._batches = 1  #: micro-batches per step before the trial
        self._baseline_ms: float | None = None
        self._noise_ms = 0.0
        self._state_windows = 0  #: windows spent in the current COOLDOWN
        self._failed = 0  #: reverted trials in a row
        self._cooldown_len = config.rebalance.cooldown_windows
        self._last = RebalanceDecision(-1, self.state, self._shares, "start: even split")

    @property
    def last_decision(self) -> RebalanceDecision:
        return self._last

    @property
    def shares(self) -> tuple[int, ...]:
        """The latest split (in effect, or scheduled from :attr:`since_step`)."""
        return self._shares

    @property
    def since_step(self) -> int:
        return self._since

    def follow(self, from_step: int, shares: Sequence[int]) -> bool:
        """Adopt a split that someone else scheduled (the schedule's latest entry, when it is not this
        controller's): its windows are measured from then on, any trial is dropped. Returns whether
        it was new."""
        shares = tuple(map(int, shares))
        if (from_step, shares) == (self._since, self._shares):
            return False
        self._shares, self._previous, self._since = shares, shares, from_step
        self._streak, self._trial, self._baseline = [], [], []
        self.state = RebalanceState.WATCH
        return True

    def update(
        self,
        gathered: torch.Tensor,
        window: int,
        from_step: int,
        measured: WindowMeasure | str | None = None,
        balanced: bool = False,
    ) -> RebalanceDecision:
        """Consume one gathered window; a new split, if any, starts at ``from_step`` (a window boundary
        after every step the data pipeline may have built, the same on every rank). ``measured``: the
        window's :func:`measure_window` at this policy's global batch, when the caller took it already
        (a Pacer does, on its window side thread). ``balanced``: the window's samples were split by
        their cost with the shares as the ranks' weights (cost-balanced batches), so a rank's count
        varies from step to step while its predicted cost follows its share: its compute is read per
        share (:func:`per_share`), not per sample."""
        if self.state is RebalanceState.OFF:
            return self._keep(window, self._last.reason)
        m = measure_window(gathered, self.global_batch) if measured is None else measured
        if isinstance(m, str):
            return self._keep(window, f"{m}: split unchanged")
        if balanced:
            m = per_share(m, self._shares)
        if m.first_step < self._since:  # the window ran (at least partly) before the split took over
            return self._keep(window, f"waiting for the split {_split(self._shares)} from step {self._since}")
        if not m.uniform or m.shares != self._shares:
            self._streak, self._trial = [], []
            return self._set(
                window,
                RebalanceState.OFF,
                f"steps {m.first_step}..{m.last_step} trained on {_split(m.shares)} samples per rank"
                f"{'' if m.uniform else ' and other splits'} where the schedule says {_split(self._shares)}: "
                "the data pipeline does not follow the share schedule; rebalancing is off for this run",
                m,
            )
        if self.state is RebalanceState.TRIAL:
            return self._update_trial(window, m, from_step)
        if not m.paced:
            self._baseline.append(m.step_ms)
            del self._baseline[: -max(self.config.ab_windows, self.config.rebalance.persist_windows)]
        if self.state is RebalanceState.COOLDOWN:
            return self._update_cooldown(window, m)
        return self._update_watch(window, m, from_step)

    # ------------------------------------------------------------------ one method per state
    def _update_watch(self, window: int, m: WindowMeasure, from_step: int) -> RebalanceDecision:
        cfg = self.config
        shares, saving, memory = self._proposal(
            m.per_sample_ms, m.compute_ms, m.wait_ms, m.batches, m.mem_peak
        )
        note = (
            f"mean per-sample compute {_ms(m.per_sample_ms)} ms at {_split(self._shares)}; best split "
            f"{_split(shares)} saves {saving:.2f} of {m.step_ms:.2f} ms{memory}"
        )
        if shares == self._shares or saving < cfg.rebalance.min_imbalance * m.step_ms:
            self._streak = []
            return self._set(window, RebalanceState.WATCH, f"balanced: {note}", m)
        self._streak.append(m)
        if len(self._streak) < cfg.rebalance.persist_windows or not self._baseline:
            return self._set(
                window,
                RebalanceState.WATCH,
                f"imbalanced {len(self._streak)}/{cfg.rebalance.persist_windows} windows: {note}",
                m,
            )
        # The split comes from the streak's median per-sample times: one odd window cannot set it.
        per_sample = _median_each([w.per_sample_ms for w in self._streak])
        compute = _median_each([w.compute_ms for w in self._streak])
        wait = _median_each([w.wait_ms for w in self._streak])
        step_ms = statistics.median(w.step_ms for w in self._streak)
        shares, saving, memory = self._proposal(per_sample, compute, wait, m.batches, m.mem_peak)
        self._streak = []
        if shares == self._shares or saving < cfg.rebalance.min_imbalance * step_ms:
            return self._set(window, RebalanceState.WATCH, f"balanced over the streak: {note}", m)
        self._baseline_ms = statistics.median(self._baseline[-cfg.ab_windows :])
        self._noise_ms = ab_noise_ms(self._baseline, cfg.ab_windows)
        self._before_compute, self._before_per_sample, self._batches = compute, per_sample, m.batches
        self._previous, self._shares, self._since = self._shares, shares, from_step
        self._trial, self._paced_in_trial = [], 0
        return self._set(
            window,
            RebalanceState.TRIAL,
            f"imbalanced for {cfg.rebalance.persist_windows} windows (mean per-sample compute "
            f"{_ms(per_sample)} ms): split {_split(self._previous)} -> {_split(shares)} from step "
            f"{from_step}, "
            f"predicted to save {saving:.2f} ms of {step_ms:.2f}{memory}; A/B trial against "
            f"{self._baseline_ms:.2f} ms",
            m,
            from_step=from_step,
        )

    def _proposal(
        self,
        per_sample_ms: Sequence[float],
        compute_ms: Sequence[float],
        wait_ms: Sequence[float],
        batches: int,
        mem_peak: Sequence[float] = (),
    ) -> tuple[tuple[int, ...], float, str]:
        """The best split by per-sample compute, the step time it is predicted to save (ms), and
        what the devices' memory changed about it (``""``: nothing).

        Two clock-free predictions must agree, and the smaller counts: by compute (the slowest
        compute now against the slowest per-sample time x new share) and by arrival (each rank's
        arrival moves by its change of compute; arrivals are read from the waits, the latest rank
        waiting least). A rank that arrives last for another reason (a late start behind a slow
        path, a data stall) keeps the step long whatever the split: the arrival prediction says so,
        and the split, which only per-sample compute sets, never moves work because of it.
        """
        n, q, most = self.global_batch, self.quantum, self.config.rebalance.max_share
        free, slowest_ms = best_split(per_sample_ms, n, q, most)
        caps = memory_caps(mem_peak, self._shares) if any(v > 0 for v in mem_peak) else None
        memory = ""
        shares = free
        if caps is not None:
            held = [r for r, c in enumerate(caps) if c is not None and free[r] > c]
            if held:
                try:
                    shares, slowest_ms = best_split(per_sample_ms, n, q, most, caps)
                except ValueError:
                    return self._shares, 0.0, "; no split that moves samples fits the devices' memory"
                memory = "; held by device memory: " + ", ".join(
                    f"rank {r} at most {caps[r]} samples (peak {mem_peak[r]:.0%} of its device at "
                    f"{self._shares[r]}; {free[r]} would reach {mem_peak[r] * free[r] / self._shares[r]:.0%})"
                    for r in held
                )
        compute, wait = np.asarray(compute_ms, dtype=np.float64), np.asarray(wait_ms, dtype=np.float64)
        by_compute = float(compute.max()) - slowest_ms * batches  # a step trains ``batches`` such splits
        change = np.asarray(per_sample_ms, dtype=np.float64) * np.asarray(shares) * batches - compute
        by_arrival = -float(wait.min()) - float((change - wait).max())
        return shares, min(by_compute, by_arrival), memory

    def _update_trial(self, window: int, m: WindowMeasure, from_step: int) -> RebalanceDecision:
        cfg = self.config
        if m.paced:  # pacing delays in the window: its step time says nothing about the split
            self._paced_in_trial += 1
            if self._paced_in_trial < cfg.rebalance.persist_windows + cfg.ab_windows:
                return self._keep(window, "trial: a paced window is not counted")
            return self._revert(
                window,
                m,
                from_step,
                m.step_ms,
                f"pacing stayed on for {self._paced_in_trial} windows of the trial: no unpaced window to "
                "judge the split by",
            )
        self._trial.append(m)
        if len(self._trial) < cfg.ab_windows:
            return self._set(window, RebalanceState.TRIAL, f"trial {len(self._trial)}/{cfg.ab_windows}", m)
        after = _median_each([w.compute_ms for w in self._trial])
        trial_ms = statistics.median(w.step_ms for w in self._trial)
        base = self._baseline_ms if self._baseline_ms is not None else trial_ms
        fell = [r for r in range(self.world_size) if self._shares[r] < self._previous[r]]
        predicted = sum(
            self._before_compute[r] - self._before_per_sample[r] * self._shares[r] * self._batches
            for r in fell
        )
        realized = sum(self._before_compute[r] - after[r] for r in fell)
        scaling = realized / predicted if predicted > 0 else 1.0
        if scaling < cfg.rebalance.min_scaling:
            ranks = ", ".join(map(str, fell))
            return self._revert(
                window,
                m,
                from_step,
                trial_ms,
                f"the compute of rank(s) {ranks}, whose share fell, dropped {realized:.2f} ms where "
                f"{predicted:.2f} ms was predicted from the per-sample time ({scaling:.0%}, needs "
                f"{cfg.rebalance.min_scaling:.0%}): a fixed per-step cost, which fewer samples "
                "cannot shorten",
            )
        needed = ab_gain_needed_ms(cfg, base, self._noise_ms)
        if base - trial_ms < needed:
            return self._revert(
                window,
                m,
                from_step,
                trial_ms,
                f"A/B: step {trial_ms:.2f} ms vs {base:.2f} ms ({trial_ms / base - 1:+.2%}); no gain of "
                f"{needed:.2f} ms ({cfg.min_gain_fraction:.1%} of the step, or {cfg.ab_noise_factor:g} x "
                f"the comparison's noise {self._noise_ms:.2f} ms)",
            )
        self._failed = 0
        self._cooldown_len = cfg.rebalance.cooldown_windows
        self._baseline = [w.step_ms for w in self._trial]  # the kept split's windows are its baseline
        self._trial = []
        return self._set(
            window,
            RebalanceState.WATCH,
            f"A/B: step {trial_ms:.2f} ms at {_split(self._shares)} vs {base:.2f} ms at "
            f"{_split(self._previous)} ({trial_ms / base - 1:+.2%}) at the same global batch of "
            f"{self.global_batch}: kept",
            m,
            trial_ms=trial_ms,
        )

    def _update_cooldown(self, window: int, m: WindowMeasure) -> RebalanceDecision:
        self._state_windows += 1
        if self._state_windows < self._cooldown_len:
            return self._set(
                window, RebalanceState.COOLDOWN, f"cool-down {self._state_windows}/{self._cooldown_len}", m
            )
        self._streak = []
        return self._set(window, RebalanceState.WATCH, "cool-down over: watching", m)

    def _revert(
        self, window: int, m: WindowMeasure, from_step: int, trial_ms: float, why: str
    ) -> RebalanceDecision:
        """The trial failed: the split it replaced comes back from ``from_step``; cool down, for longer
        after each reverted trial in a row."""
        cfg = self.config
        self._cooldown_len = next_cooldown_windows(
            self._cooldown_len,
            self._failed,
            cfg.rebalance.cooldown_windows,
            cfg.cooldown_growth,
            max(cfg.max_cooldown_windows, cfg.rebalance.cooldown_windows),
        )
        self._failed += 1
        self._state_windows = 0
        tried, self._shares, self._since = self._shares, self._previous, from_step
        self._baseline, self._trial = [], []
        return self._set(
            window,
            RebalanceState.COOLDOWN,
            f"{why}: split {_split(tried)} reverted to {_split(self._shares)} from step {from_step}; "
            f"cool-down of {self._cooldown_len} windows (reverted trial {self._failed} in a row)",
            m,
            from_step=from_step,
            trial_ms=trial_ms,
        )

    # ------------------------------------------------------------------ decisions
    def _set(
        self,
        window: int,
        state: RebalanceState,
        reason: str,
        m: WindowMeasure,
        from_step: int | None = None,
        trial_ms: float | None = None,
    ) -> RebalanceDecision:
        changed = state is not self.state or from_step is not None or self._last.window < 0
        self.state = state
        self._last = RebalanceDecision(
            window=window,
            state=state,
            shares=self._shares,
            reason=reason,
            from_step=from_step,
            changed=changed,
            baseline_step_ms=self._baseline_ms
            if state is RebalanceState.TRIAL or trial_ms is not None
            else None,
            trial_step_ms=trial_ms,
            per_sample_ms=m.per_sample_ms,
        )
        return self._last

    def _keep(self, window: int, reason: str) -> RebalanceDecision:
        """A window that says nothing about the split in effect: same state and split, no streak moves."""
        last = self._last
        self._last = RebalanceDecision(
            window=window,
            state=self.state,
            shares=self._shares,
            reason=reason,
            changed=last.window < 0,
            baseline_step_ms=self._baseline_ms if self.state is RebalanceState.TRIAL else None,
            per_sample_ms=last.per_sample_ms,
        )
        return self._last

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything the next decision depends on, as plain JSON-able data (versioned)."""

        def measures(ms: Sequence[WindowMeasure]) -> list[dict[str, Any]]:
            return [
                {
                    "first_step": w.first_step,
                    "last_step": w.last_step,
                    "shares": list(w.shares),
                    "uniform": w.uniform,
                    "batches": w.batches,
                    "compute_ms": list(w.compute_ms),
                    "wait_ms": list(w.wait_ms),
                    "per_sample_ms": list(w.per_sample_ms),
                    "step_ms": w.step_ms,
                    "paced": w.paced,
                    "mem_peak": list(w.mem_peak),
                }
                for w in ms
            ]

        last = self._last
        return {
            "version": STATE_VERSION,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "state": self.state.value,
            "shares": list(self._shares),
            "since": self._since,
            "previous": list(self._previous),
            "streak": measures(self._streak),
            "baseline": list(self._baseline),
            "trial": measures(self._trial),
            "paced_in_trial": self._paced_in_trial,
            "before_compute": list(self._before_compute),
            "before_per_sample": list(self._before_per_sample),
            "batches": self._batches,
            "baseline_ms": self._baseline_ms,
            "noise_ms": self._noise_ms,
            "state_windows": self._state_windows,
            "failed": self._failed,
            "cooldown_len": self._cooldown_len,
            "last_window": last.window,
            "last_reason": last.reason,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Raises :class:`PacingStateError` (and changes
        nothing) for a newer version, a missing or mistyped field, or another world size or batch."""
        s = check_state(state, "the rebalancing controller's state", _STATE_FIELDS)
        for key, here in (("world_size", self.world_size), ("global_batch", self.global_batch)):
            if s[key] != here:
                raise PacingStateError(
                    f"the rebalancing controller's state was saved with {key} {s[key]}, this run has {here}: "
                    "per-rank shares do not carry over; rebalancing starts fresh from the even split."
                )
        try:
            state_now = RebalanceState(s["state"])
            shares, previous = _ints(s["shares"], self.world_size), _ints(s["previous"], self.world_size)
            streak, trial = [_measure(w) for w in s["streak"]], [_measure(w) for w in s["trial"]]
            baseline = [float(v) for v in s["baseline"]]
            before_compute = tuple(float(v) for v in s["before_compute"])
            before_per_sample = tuple(float(v) for v in s["before_per_sample"])
        except (TypeError, ValueError, KeyError) as error:
            raise PacingStateError(f"the rebalancing controller's state does not load: {error}") from error
        self.state = state_now
        self._shares, self._previous = shares, previous
        self._since = s["since"]
        self._streak, self._trial, self._baseline = streak, trial, baseline
        self._paced_in_trial = s["paced_in_trial"]
        self._before_compute, self._before_per_sample = before_compute, before_per_sample
        self._batches = s["batches"]
        self._baseline_ms = None if s["baseline_ms"] is None else float(s["baseline_ms"])
        self._noise_ms = float(s["noise_ms"])
        self._state_windows, self._failed, self._cooldown_len = (
            s["state_windows"],
            s["failed"],
            s["cooldown_len"],
        )
        self._last = RebalanceDecision(s["last_window"], self.state, self._shares, s["last_reason"])


_OPTIONAL_NUMBER = (int, float, type(None))
#: the fields of RebalancePolicy.state_dict() and their types
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "world_size": int,
    "global_batch": int,
    "state": str,
    "shares": list,
    "since": int,
    "previous": list,
    "streak": list,
    "baseline": list,
    "trial": list,
    "paced_in_trial": int,
    "before_compute": list,
    "before_per_sample": list,
    "batches": int,
    "baseline_ms": _OPTIONAL_NUMBER,
    "noise_ms": (int, float),
    "state_windows": int,
    "failed": int,
    "cooldown_len": int,
    "last_window": int,
    "last_reason": str,
}


def _ints(values: Sequence[Any], world_size: int) -> tuple[int, ...]:
    if len(values) != world_size or any(type(v) is not int for v in values):
        raise ValueError(f"{values!r} is not one integer per rank of {world_size}")
    return tuple(values)


def _measure(w: Mapping[str, Any]) -> WindowMeasure:
    return WindowMeasure(
        first_step=int(w["first_step"]),
        last_step=int(w["last_step"]),
        shares=tuple(int(v) for v in w["shares"]),
        uniform=bool(w["uniform"]),
        batches=int(w["batches"]),
        compute_ms=tuple(float(v) for v in w["compute_ms"]),
        wait_ms=tuple(float(v) for v in w["wait_ms"]),
        per_sample_ms=tuple(float(v) for v in w["per_sample_ms"]),
        step_ms=float(w["step_ms"]),
        paced=bool(w["paced"]),
        mem_peak=tuple(float(v) for v in w.get("mem_peak", ())),  # absent in states saved before it
    )
