"""The controllers: what each gathered window decides, one component each, under one arbitration rule.

The :class:`~pace_strategy.core.pacer.Pacer` measures each step and exchanges a window; it hands the
gathered window to :class:`Controllers`, which asks each component for its decision and arbitrates:

- :class:`PacingControl` — per-rank delays (:class:`~pace_strategy.core.policy.PacingPolicy`) and the
  rate-limited persistent-straggler warning;
- :class:`RebalanceControl` — per-rank shares of the global batch
  (:class:`~pace_strategy.core.rebalance.RebalancePolicy`) written into the share schedule the data
  pipeline reads; only with ``rebalance.enabled`` and a schedule attached;
- :class:`~pace_strategy.core.gc_sync.GcSync` — a synchronized full collection at an agreed step;
  only with ``gc_sync.enabled``.

**Who wins when two want the same step** (:meth:`Controllers.decide`, the one place it is written):

1. Rebalancing before pacing. Both change the step time, so their A/B checks would credit each
   other's effect. While a rebalancing trial runs, or while a new split is decided but has not started
   yet, pacing is *held*: every delay is zero, its state is ``MONITOR``, and it starts over from a fresh
   policy once the split stands.
2. GC sync stands beside either: a collection at an agreed step moves no delay and no share, so its
   decision is attached to whichever pacing decision stands.

Every component decides from the same gathered window on every rank, so every rank reaches the same
decisions with no further communication. State: each component's ``state_dict`` is versioned plain
data; the share schedule's entries are owned (and checkpointed) by the data pipeline that reads them
(:class:`~pace_strategy.data.ShareBatchSampler`), not here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pace_strategy.core.balance_check import BalanceCheck, BalanceState, BalanceStep
from pace_strategy.core.clock import Clock
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.cost_fit import CostFit, fit_ranks, moved, window_rows
from pace_strategy.core.errors import PaceDistributedError, PacingConfigError
from pace_strategy.core.gc_sync import GcSync
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.rebalance import (
    RebalanceDecision,
    RebalancePolicy,
    RebalanceState,
    WindowMeasure,
    first_boundary,
    measure_window,
)
from pace_strategy.core.records import Decision, Field, PolicyState
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.skew import WindowStats, usable_steps
from pace_strategy.core.state import STATE_VERSION, PacingStateError, check_state

__all__ = ["Controllers", "PacingControl", "RebalanceControl", "WindowInput"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowInput:
    """One gathered window as every controller sees it (identical on every rank)."""

    gathered: torch.Tensor  #: ``[world_size, steps, NUM_FIELDS]`` float64
    stats: WindowStats  #: its statistics (:func:`~pace_strategy.core.skew.window_stats`)
    last_step: int  #: the label of the window's last step (or of the last step ended, when empty)
    after_step: int  #: the label of the last step this rank ended (``>= last_step``)
    #: rebalancing's :func:`~pace_strategy.core.rebalance.measure_window` of the window, when taken
    #: already (:meth:`RebalanceControl.prepare`); ``None``: rebalancing takes it
    measure: WindowMeasure | str | None = None


@dataclass(frozen=True)
class Verdict:
    """What the controllers decided from one window, arbitrated."""

    decision: Decision  #: pacing's decision (held or not), with GC sync's collection attached
    warnings: tuple[str, ...]  #: messages to log (rate-limited straggler warnings, rebalancing's end)
    rebalance: RebalanceDecision | None  #: ``None``: no rebalancing this run


class PacingControl:
    """Pacing as a component: per-rank delays from each window, and the persistent-straggler warning.

    Its state is the policy's (:meth:`PacingPolicy.state_dict`)."""

    def __init__(self, config: PacingConfig, world_size: int, clock: Clock) -> None:
        self.config = config
        self.world_size = world_size
        self.policy = PacingPolicy(config, world_size)
        self._watch = _StragglerWatch(config, clock)

    @property
    def decision(self) -> Decision:
        return self.policy.last_decision

    def decide(self, stats: WindowStats) -> tuple[Decision, tuple[str, ...]]:
        return self.policy.update(stats), self._watch.check(stats)

    def hold(self, decision: Decision, reason: str) -> Decision:
        """``decision`` with pacing held (no delay, ``MONITOR``); the policy starts over afresh."""
        self.policy = PacingPolicy(self.config, self.world_size)
        return dataclasses.replace(
            decision,
            state=PolicyState.MONITOR,
            delays_ms=(0.0,) * self.world_size,
            reason=f"pacing held: {reason}",
            baseline_step_ms=None,
            paced_step_ms=None,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state)


class RebalanceControl:
    """The share schedule's controller: from each window, the split of the global batch over the
    ranks (rebalancing) and whether its samples are split by cost (balancing's A/B check,
    :class:`~pace_strategy.core.balance_check.BalanceCheck`). While the check runs it alone decides:
    rebalancing waits for its verdict, as pacing does.

    Inactive until the data pipeline attaches its share schedule (:meth:`attach`). A state restored
    before then is kept (checked) and applied at :meth:`attach`: the one buffer of restored state in
    the core.
    """

    def __init__(self, config: PacingConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.policy: RebalancePolicy | None = None  #: ``None``: no schedule attached, or disabled
        #: balancing's A/B check (``None``: no schedule attached, balancing off, or unchecked)
        self.check: BalanceCheck | None = None
        #: balancing's online cost fit (``balance.fit``; ``None``: off, or no schedule attached)
        self.fit: CostFit | None = None
        self.schedule: ShareSchedule | None = None
        self.lookahead_steps = 0
        self._restored: Mapping[str, Any] | None = None  # a state loaded before attach
        self._warned_unattached = False

    def attach(self, schedule: ShareSchedule, lookahead_steps: int) -> None:
        """See :meth:`pace_strategy.core.pacer.Pacer.attach_shares`."""
        if schedule.world_size != self.world_size:
            raise PacingConfigError(
                f"the share schedule splits the batch over {schedule.world_size} ranks but this job has "
                f"{self.world_size}: build ShareSchedule(global_batch, world_size={self.world_size})."
            )
        if isinstance(lookahead_steps, bool) or not isinstance(lookahead_steps, int) or lookahead_steps < 0:
            raise ValueError(f"lookahead_steps must be an integer >= 0, got {lookahead_steps!r}")
        self.schedule = schedule
        self.lookahead_steps = lookahead_steps
        if not self._active():
            return
        current = schedule.current
        if self.config.rebalance.enabled:
            self.policy = RebalancePolicy(
                self.config, schedule.global_batch, self.world_size, current.samples, current.from_step
            )
        if self._checks_balance():
            self.check = BalanceCheck(self.config, current.from_step)
        if self._fits_cost() and not schedule.fixed_cost:
            self.fit = CostFit(quadratic=self.config.balance.cost == "attention")
            schedule.work_ranks = fit_ranks(self.world_size)
        restored, self._restored = self._restored, None
        if restored is not None:
            try:
                self._restorer(restored)()
            except PacingStateError as error:
                log.warning("pace_strategy: rebalancing starts fresh from the even split: %s", error)

    def _active(self) -> bool:
        return bool(self.config.rebalance.enabled or self._checks_balance() or self._fits_cost())

    def _checks_balance(self) -> bool:
        return bool(self.config.balance.enabled and self.config.balance.verify)

    def _fits_cost(self) -> bool:
        return bool(self.config.balance.enabled and self.config.balance.fit)

    def decide(self, window: WindowInput, index: int) -> RebalanceDecision | None:
        """Window ``index``'s decision; a new split or arm goes into the schedule. ``None``: neither
        rebalancing nor balancing's check runs."""
        if self.schedule is None or not (self.policy or self.check or self.fit):
            if self.config.rebalance.enabled and not self._warned_unattached:
                self._warned_unattached = True
                log.warning(
                    "pace_strategy: rebalance=True but no share schedule is attached (the integration "
                    "calls Pacer.attach_shares): this run is not rebalanced"
                )
            return None
        # Every rank has built at most lookahead_steps batches beyond the step after this one: a split
        # from the first window boundary past that is one no rank has built yet, the same everywhere.
        start = first_boundary(
            window.last_step, self.config.exchange_every_steps, window.after_step + self.lookahead_steps + 2
        )
        if self.fit is not None:
            work = self.schedule.take_work(
                window.gathered[0, :, Field.STEP].long().tolist(), window.last_step
            )
            ranks = self.schedule.work_ranks or ()
            usable = window.stats.usable
            usable = usable_steps(window.gathered) if usable is None else usable
            self.fit.add(*window_rows(window.gathered, usable, ranks, work))
        decision = self._decide(window, index, start) if self.policy or self.check else None
        decision = self._with_cost(decision, index, start)
        if decision is not None:
            self._schedule(decision)
        return decision

    def _decide(self, window: WindowInput, index: int, start: int) -> RebalanceDecision:
        """The check's decision while it runs or switches, else rebalancing's."""
        assert self.schedule is not None
        if self.check is not None:
            measure = window.measure
            if measure is None:
                measure = measure_window(window.gathered, self.schedule.global_batch, window.stats.usable)
            step = self.check.update(measure, start, window.stats.median_step_ms)
            if self.check.deciding or step.from_step is not None or self.policy is None:
                return self._balance_decision(index, step)
        assert self.policy is not None
        current = self.schedule.current
        self.policy.follow(current.from_step, current.samples)  # a split added by someone else
        balanced = self.config.balance.enabled and self.schedule.entry_for_step(window.last_step).balanced
        decision = self.policy.update(window.gathered, index, start, window.measure, balanced)
        if self.config.balance.enabled:
            decision = dataclasses.replace(decision, balanced=current.balanced)
        return decision

    def _with_cost(
        self, decision: RebalanceDecision | None, index: int, start: int
    ) -> RebalanceDecision | None:
        """``decision`` with the fitted cost model where it changes it: it rides on any entry the
        decision adds, and outside a trial (of the check or of rebalancing: its arms are compared at
        one cost) a fit that moved by ``CHANGE`` adds its own entry (``balance="fit"``; with neither
        rebalancing nor the check, the only decisions there are)."""
        assert self.schedule is not None
        fitted = self.fit.cost() if self.fit is not None else None
        b = self.config.balance
        if fitted is not None and b.cost == "tokens":  # (quadratic_tokens means nothing to it)
            fitted = (b.quadratic_tokens, fitted[1])
        current = self.schedule.current
        in_force = current.cost or (b.quadratic_tokens, b.per_sample)
        if fitted is None or fitted == in_force:
            return decision
        said = f"cost model fitted online: per_sample {fitted[1]:g}, quadratic_tokens {fitted[0]:g}"
        if decision is not None and decision.from_step is not None:
            return dataclasses.replace(decision, cost=fitted, reason=f"{decision.reason}; {said}")
        trial = decision is not None and (
            decision.state is RebalanceState.TRIAL or decision.balance == BalanceState.TRIAL.value
        )
        if trial or not moved(fitted, in_force):
            return decision
        if decision is None:
            decision = RebalanceDecision(
                index, RebalanceState.WATCH, current.samples, "", balanced=current.balanced
            )
        return dataclasses.replace(
            decision,
            from_step=start,
            changed=True,
            cost=fitted,
            balance="fit",
            reason=f"{said} from step {start}",
        )

    def _balance_decision(self, index: int, step: BalanceStep) -> RebalanceDecision:
        """The check's step as the schedule's decision: the split in effect, the arm it decided."""
        assert self.schedule is not None
        if step.state is BalanceState.TRIAL:
            state = RebalanceState.TRIAL  # (pacing is held by it)
        else:
            state = RebalanceState.WATCH if self.policy is None else self.policy.state
        return RebalanceDecision(
            window=index,
            state=state,
            shares=self.schedule.current.samples,
            reason=step.reason,
            from_step=step.from_step,
            changed=step.changed,
            baseline_step_ms=step.plain_step_ms,
            trial_step_ms=step.balanced_step_ms,
            balanced=step.balanced,
            balance=step.state.value,
        )

    def prepare(self, gathered: torch.Tensor, stats: WindowStats) -> WindowMeasure | str | None:
        """What :meth:`decide` measures of a window, from the window alone (no state: any thread may
        take it); ``None`` when nothing measures it."""
        if self.schedule is None:
            return None
        rebalancing = self.policy is not None and self.policy.state is not RebalanceState.OFF
        if not rebalancing and self.check is None:
            return None  # (OFF: the policy measures nothing any more)
        return measure_window(gathered, self.schedule.global_batch, stats.usable)

    def follow(self, decision: RebalanceDecision) -> None:
        """A decision taken by the node leader: its new split into this rank's schedule."""
        if self.schedule is not None:
            self._schedule(decision)

    def _schedule(self, decision: RebalanceDecision) -> None:
        assert self.schedule is not None
        if decision.from_step is not None:
            current = self.schedule.current
            balanced = current.balanced if decision.balanced is None else decision.balanced
            # (a list after the node leader's JSON message)
            cost = (
                current.cost if decision.cost is None else (float(decision.cost[0]), float(decision.cost[1]))
            )
            try:
                self.schedule.add(
                    decision.from_step, decision.shares, decision.reason, balanced=balanced, cost=cost
                )
            except ValueError as error:
                raise PaceDistributedError(
                    self.rank,
                    self.world_size,
                    f"rebalancing decided the split {list(decision.shares)} from step {decision.from_step}, "
                    f"but this rank's data pipeline has already built step {self.schedule.last_built}: it "
                    f"builds further ahead than the {self.lookahead_steps} steps its integration declared "
                    "(attach_shares lookahead_steps), so the ranks could split that step differently. "
                    "Declare the DataLoader's real prefetch (num_workers x prefetch_factor, plus the "
                    f"framework's own). ({error})",
                ) from error

    def holds_pacing(self, decision: RebalanceDecision | None, last_step: int) -> str | None:
        """Why pacing is held after this window (a rebalancing trial, or a split that the window's
        steps did not run at yet), or ``None``."""
        if decision is None or self.schedule is None:
            return None
        if decision.balance == BalanceState.TRIAL.value:
            return "balancing's A/B check is running"
        if decision.state is RebalanceState.TRIAL:
            return f"a rebalancing trial of the split {list(decision.shares)} is running"
        current = self.schedule.current
        running = self.schedule.entry_for_step(last_step)
        # (a new cost model alone moves no rank's share of the step: pacing goes on)
        same_split = (current.samples, current.balanced) == (running.samples, running.balanced)
        if current.from_step > last_step and not (same_split and current.cost != running.cost):
            return f"the split {list(current.samples)} starts at step {current.from_step}"
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """The controller's state (``None``: neither rebalancing nor balancing's check runs). The
        schedule's entries are the data pipeline's to save (the sampler's state), not repeated here."""
        if self.policy is None and self.check is None:
            return None
        state: dict[str, Any] = {"version": STATE_VERSION}
        if self.policy is not None:
            state["policy"] = self.policy.state_dict()
        if self.check is not None:
            state["balance"] = self.check.state_dict()
        return state

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`PacingStateError` if ``state`` would not restore (nothing changes)."""
        if self.schedule is not None and self._active():
            self._restorer(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore now if a schedule is attached, else keep the state for :meth:`attach`."""
        if self.schedule is not None and self._active():
            self._restorer(state)()
        else:
            self._restored = state

    def _restorer(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check ``state``; the returned call restores the controller (and the schedule's later splits
        of a state written before the sampler owned them). Raises :class:`PacingStateError`."""
        schedule = self.schedule
        assert schedule is not None
        s = check_state(state, "the rebalancing state", {})
        if self.policy is None and self.config.rebalance.enabled and not isinstance(s.get("policy"), dict):
            raise PacingStateError("the rebalancing state has no 'policy' field: not a rebalancing state")
        try:
            # written by pace_strategy before the schedule had one owner; the sampler's state holds them now
            entries: list[dict[str, Any]] = [
                {
                    "from_step": int(e["from_step"]),
                    "samples": [int(n) for n in e["samples"]],
                    "reason": str(e["reason"]),
                }
                for e in s.get("entries", [])
            ]
        except (TypeError, ValueError, KeyError) as error:
            raise PacingStateError(f"the rebalancing state's entries do not load: {error}") from error
        policy = None
        if self.config.rebalance.enabled and "policy" in s:
            policy = RebalancePolicy(self.config, schedule.global_batch, self.world_size)
            policy.load_state_dict(s["policy"])
        check = None
        if self._checks_balance() and "balance" in s:
            check = BalanceCheck(self.config)
            check.load_state_dict(s["balance"])

        def restore() -> None:
            self.policy = policy if policy is not None else self.policy
            self.check = check if check is not None else self.check
            # the start entry is held already
            schedule.restore([e for e in entries if e["from_step"] > schedule.current.from_step])

        return restore


class Controllers:
    """The components one Pacer drives, and the rule between them (module doc).

    Args:
        config: the validated configuration.
        rank, world_size: this rank in the exchange's group.
        clock: the Pacer's clock (the straggler warning's rate limit).
    """

    def __init__(self, config: PacingConfig, rank: int, world_size: int, clock: Clock) -> None:
        self.pacing = PacingControl(config, world_size, clock)
        self.rebalance = RebalanceControl(config, rank, world_size)
        #: ``gc_sync.enabled``: collects at agreed steps (``None``: the collector is left alone)
        self.gc_sync: GcSync | None = GcSync(config) if config.gc_sync.enabled else None

    def follow(self, decision: Decision, rebalance: RebalanceDecision | None) -> None:
        """A window's arbitrated decisions taken elsewhere (by this rank's node leader): a collection
        at the next step, a new split into the schedule. The controllers' own state stays where the
        decisions were taken."""
        if decision.gc_collect is not None and self.gc_sync is not None:
            self.gc_sync.follow()
        if rebalance is not None:
            self.rebalance.follow(rebalance)

    def decide(self, window: WindowInput, index: int) -> Verdict:
        """Every component's decision from window ``index``, arbitrated (identical on every rank)."""
        decision, warnings = self.pacing.decide(window.stats)
        if self.gc_sync is not None:
            collect = self.gc_sync.decide(window.gathered, window.after_step)
            if collect is not None:
                decision = dataclasses.replace(decision, gc_collect=collect)
        rebalance = self.rebalance.decide(window, index)
        if rebalance is not None and rebalance.changed and rebalance.state is RebalanceState.OFF:
            warnings += (f"pace_strategy: {rebalance.reason}",)
        held = self.rebalance.holds_pacing(rebalance, window.last_step)
        if held is not None:
            decision = self.pacing.hold(decision, held)
        return Verdict(decision, warnings, rebalance)


class _StragglerWatch:
    """Warns (rate-limited) when the same rank arrives last in most steps for several windows."""

    def __init__(self, config: PacingConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._rank: int | None = None
        self._streak = 0
        self._last_warned_s: float | None = None

    def check(self, stats: WindowStats) -> tuple[str, ...]:
        if stats.steps == 0 or stats.world_size < 2:
            return ()
        counts = stats.straggler_counts
        rank = max(range(len(counts)), key=counts.__getitem__)
        share = counts[rank] / stats.steps
        if share < self.config.straggler_warn_fraction:
            self._rank, self._streak = None, 0
            return ()
        self._streak = self._streak + 1 if rank == self._rank else 1
        self._rank = rank
        now = self.clock.now_s()
        due = (
            self._last_warned_s is None or now - self._last_warned_s >= self.config.straggler_warn_interval_s
        )
        if self._streak >= self.config.activate_windows and due:
            self._last_warned_s = now
            return (
                f"pace_strategy: rank {rank} is a persistent straggler: it arrived last at the gradient sync "
                f"in {share:.0%} of window {stats.window}'s {stats.steps} steps ({self._streak} windows in a "
                "row); its per-rank lead is in the pace/lead_ms tags.",
            )
        return ()
