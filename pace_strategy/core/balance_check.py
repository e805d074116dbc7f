"""Balancing's A/B check: cost-balanced batches are kept only while they make the step shorter.

A cost model that does not fit the model (a per-sample overhead larger than the length's work, a
layout other than the one configured), lengths that do not vary, or a step that something else sets
(a slow device, the network) can make balanced batches no faster than slices, at the cost of a sort
per step and unequal batch shapes. So the run measures it, as pacing and rebalancing prove
themselves (docs/balancing.md, "The A/B check"):

- **Arms in turns.** From the first step the samples are balanced; after ``ab_windows`` measured
  windows the schedule switches to plain slices of the same global batches, then back, for
  ``balance.check_rounds`` rounds (balanced, plain, balanced, plain, ...). Each switch starts at a
  window boundary that no rank's data pipeline has built yet, so every rank switches at the same step
  (the share schedule's rule). A window counts for an arm only when all its steps ran at that arm,
  past warm-up and unpaced (pacing is held while the check runs).
- **Verdict.** The median over the balanced windows of each window's median step time (slowest
  rank) against the same of the plain windows, by pacing's A/B rule: kept only if it is shorter by
  ``min_gain_fraction`` of the plain step and by ``ab_noise_factor`` times the comparison's noise
  (the plain windows' own spread). Otherwise plain slices stay for the run, or until the next check.
- **Again later.** With ``balance.recheck_windows`` > 0 the check runs again that many windows
  after each verdict: the input mix, the model's speed or the cluster may have changed.

A pure state machine fed one window's :class:`~pace_strategy.core.rebalance.WindowMeasure` at a time,
the same on every rank, so every rank reaches the same verdict with no further communication.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.policy import ab_gain_needed_ms, ab_noise_ms
from pace_strategy.core.rebalance import WindowMeasure
from pace_strategy.core.state import STATE_VERSION, PacingStateError, check_state

__all__ = ["BalanceCheck", "BalanceState", "BalanceStep"]


class BalanceState(str, enum.Enum):
    """States of balancing's A/B check."""

    TRIAL = "trial"  #: the arms run in turns; pacing and rebalancing wait for the verdict
    KEPT = "kept"  #: balanced batches made the step shorter: they stay
    DROPPED = "dropped"  #: they did not: plain slices stay

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BalanceStep:
    """What the check decided after one window (identical on every rank)."""

    state: BalanceState
    balanced: bool  #: the arm in effect, or scheduled from ``from_step``
    reason: str
    from_step: int | None = None  #: the arm switches at this step (``None``: unchanged)
    changed: bool = False  #: the state or the arm changed with this window
    plain_step_ms: float | None = None  #: median step time of the plain windows, ms (at a verdict)
    balanced_step_ms: float | None = None  #: median step time of the balanced windows, ms (at a verdict)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class BalanceCheck:
    """The A/B check of cost-balanced batches (module doc).

    Args:
        config: the validated configuration (``balance.check_rounds``, ``balance.recheck_windows``,
            and pacing's A/B rule: ``ab_windows``, ``min_gain_fraction``, ``ab_noise_factor``).
        since_step: the step from which the balanced arm runs (the schedule's first entry).
    """

    def __init__(self, config: PacingConfig, since_step: int = 0) -> None:
        self.config = config
        self.state = BalanceState.TRIAL
        self.balanced = True  #: the arm of the steps from ``_since`` on
        self._since = since_step
        self._blocks = 0  #: arm blocks completed in this check
        self._counted = 0  #: windows counted in the current block
        self._ms: dict[bool, list[float]] = {True: [], False: []}  #: window step times by arm
        self._idle = 0  #: windows since the last verdict
        self._last = BalanceStep(self.state, True, "A/B check of cost-balanced batches: balanced arm first")

    @property
    def deciding(self) -> bool:
        """The check is running: pacing and rebalancing wait for its verdict."""
        return self.state is BalanceState.TRIAL

    def update(self, m: WindowMeasure | str, from_step: int, step_ms: float | None = None) -> BalanceStep:
        """Consume one window's measure; a switch of arm, if any, starts at ``from_step`` (a window
        boundary past every step a data pipeline may have built, the same on every rank).
        ``step_ms``: the window's median step time (slowest rank), what the arms are compared by, as
        pacing's A/B check compares window medians (a hiccup of one step does not move it);
        ``None``: the measure's mean step."""
        if self.state is not BalanceState.TRIAL:
            return self._after_verdict(from_step)
        if isinstance(m, str):
            return self._keep(f"{m}: not counted")
        if m.first_step < self._since:
            return self._keep(f"waiting for the {self._arm()} arm from step {self._since}")
        if m.paced:
            return self._keep("a paced window is not counted")
        self._ms[self.balanced].append(m.step_ms if step_ms is None else step_ms)
        self._counted += 1
        windows = self.config.ab_windows
        total = 2 * self.config.balance.check_rounds
        if self._counted < windows:
            return self._keep(f"A/B {self._arm()} arm, window {self._counted}/{windows}")
        self._blocks += 1
        self._counted = 0
        if self._blocks < total:
            return self._switch(
                not self.balanced, from_step, BalanceState.TRIAL, f"A/B arm {self._blocks + 1}/{total}"
            )
        return self._verdict(from_step)

    def _verdict(self, from_step: int) -> BalanceStep:
        cfg = self.config
        plain, balanced = _median(self._ms[False]), _median(self._ms[True])
        noise = ab_noise_ms(self._ms[False], len(self._ms[True]))
        needed = ab_gain_needed_ms(cfg, plain, noise)
        said = (
            f"A/B of cost-balanced batches: step {balanced:.2f} ms balanced vs {plain:.2f} ms plain "
            f"({balanced / plain - 1:+.2%}) over {len(self._ms[True])} and {len(self._ms[False])} windows"
        )
        self._ms = {True: [], False: []}
        self._blocks = self._idle = 0
        times = {"plain_step_ms": plain, "balanced_step_ms": balanced}
        if plain - balanced >= needed:
            return self._switch(True, from_step, BalanceState.KEPT, f"{said}: kept", **times)
        return self._switch(
            False,
            from_step,
            BalanceState.DROPPED,
            f"{said}: no gain of {needed:.2f} ms ({cfg.min_gain_fraction:.1%} of the step, or "
            f"{cfg.ab_noise_factor:g} x the comparison's noise {noise:.2f} ms): plain slices",
            **times,
        )

    def _after_verdict(self, from_step: int) -> BalanceStep:
        self._idle += 1
        recheck = self.config.balance.recheck_windows
        if recheck <= 0 or self._idle < recheck:
            return self._keep(self._last.reason)
        self._idle = 0
        return self._switch(
            True, from_step, BalanceState.TRIAL, f"{recheck} windows since the last verdict: A/B again"
        )

    def _arm(self) -> str:
        return "balanced" if self.balanced else "plain"

    def _switch(
        self,
        balanced: bool,
        from_step: int,
        state: BalanceState,
        reason: str,
        plain_step_ms: float | None = None,
        balanced_step_ms: float | None = None,
    ) -> BalanceStep:
        """Enter ``state`` with the arm ``balanced``; a change of arm starts at ``from_step``."""
        start = from_step if balanced != self.balanced else None
        if start is not None:
            self.balanced, self._since = balanced, start
            reason = f"{reason}; {self._arm()} from step {start}"
        changed = state is not self.state or start is not None
        self.state = state
        self._last = BalanceStep(
            state, self.balanced, reason, start, changed, plain_step_ms, balanced_step_ms
        )
        return self._last

    def _keep(self, reason: str) -> BalanceStep:
        last = self._last
        self._last = BalanceStep(
            self.state, self.balanced, reason, None, False, last.plain_step_ms, last.balanced_step_ms
        )
        return self._last

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The check's state as plain data (versioned)."""
        return {
            "version": STATE_VERSION,
            "state": self.state.value,
            "balanced": self.balanced,
            "since": self._since,
            "blocks": self._blocks,
            "counted": self._counted,
            "balanced_ms": list(self._ms[True]),
            "plain_ms": list(self._ms[False]),
            "idle": self._idle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises :class:`PacingStateError` (nothing changed) if it does
        not load."""
        fields = {"state": str, "balanced": bool, "since": int, "blocks": int, "counted": int}
        fields.update(balanced_ms=list, plain_ms=list)
        s = check_state(state, "the balancing check's state", fields)
        try:
            restored = BalanceState(s["state"])
            ms = {True: [float(v) for v in s["balanced_ms"]], False: [float(v) for v in s["plain_ms"]]}
            idle = int(s.get("idle", 0))
        except (TypeError, ValueError) as error:
            raise PacingStateError(f"the balancing check's state does not load: {error}") from error
        self.state, self.balanced, self._since = restored, bool(s["balanced"]), int(s["since"])
        self._blocks, self._counted, self._ms, self._idle = int(s["blocks"]), int(s["counted"]), ms, idle
        self._last = BalanceStep(self.state, self.balanced, "restored from a checkpoint")
