"""The adaptive pacing controller: a deterministic state machine fed one window of statistics at a time.

Every rank runs it on the same gathered data, so every rank reaches the same decision without any
further communication. It targets throughput, not the step-time CV: lowering the CV by slowing fast
ranks is not a win, so pacing is kept only while an A/B comparison shows shorter steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.records import Decision, PolicyState
from pace_strategy.core.skew import WindowStats
from pace_strategy.core.state import STATE_VERSION, PacingStateError, check_state

__all__ = ["PacingPolicy", "ab_gain_needed_ms", "ab_noise_ms", "next_cooldown_windows"]


def ab_noise_ms(baseline_medians: Sequence[float], arm_windows: int) -> float:
    """Standard deviation (ms) of an A/B difference that noise alone would give.

    Each arm of the check is a median of ``arm_windows`` window medians, so its difference has about
    ``sqrt(2 / arm_windows)`` times the spread of single windows; ``baseline_medians`` are window
    medians measured before the trial (the run's own window-to-window noise). Shared by pacing's and
    rebalancing's A/B checks."""
    spread = statistics.stdev(baseline_medians) if len(baseline_medians) >= 2 else 0.0
    return spread * math.sqrt(2.0 / arm_windows)


def ab_gain_needed_ms(config: PacingConfig, baseline_ms: float, noise_ms: float) -> float:
    """The gain (ms) a trial arm must show over ``baseline_ms`` to be kept: ``min_gain_fraction`` of
    the baseline and ``ab_noise_factor`` times the comparison's noise ``noise_ms``."""
    return max(config.min_gain_fraction * baseline_ms, config.ab_noise_factor * noise_ms)


def next_cooldown_windows(previous: int, failed_in_row: int, first: int, growth: float, bound: int) -> int:
    """Length (windows) of the cool-down after one more failed check: ``first`` after a kept check
    (``failed_in_row`` 0), else ``previous`` times ``growth``, at most ``bound``."""
    if failed_in_row == 0:
        return first
    # from the previous length, not growth**n: no float overflow however long the run
    return min(math.ceil(previous * growth), bound)


@dataclass(frozen=True)
class _Window:
    """What every state's update needs from one window with usable steps."""

    index: int  #: the window's number
    median_step_ms: float  #: median step time of the window, milliseconds
    delays_ms: tuple[float, ...]  #: per-rank delays this window's leads call for, milliseconds
    note: str  #: the window's skew, in words, for the decision's reason
    was_paced: bool  #: the window's steps ran under delays (the previous decision paced some rank)


_NUMBER = (int, float)
_OPTIONAL_NUMBER = (int, float, type(None))
#: the fields of PacingPolicy.state_dict() and their types
_POLICY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "world_size": int,
    "state": str,
    "smoothed_lead_ms": (list, type(None)),
    "severe_streak": int,
    "calm_streak": int,
    "unpaced_medians": list,
    "paced_medians": list,
    "paced_since_probe": int,
    "state_windows": int,
    "failed_checks": int,
    "cooldown_len": int,
    "baseline_ms": _OPTIONAL_NUMBER,
    "noise_ms": _NUMBER,
    "last_decision": dict,
}
_DECISION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "window": int,
    "state": str,
    "delays_ms": list,
    "reason": str,
    "baseline_step_ms": _OPTIONAL_NUMBER,
    "paced_step_ms": _OPTIONAL_NUMBER,
}


class PacingPolicy:
    """Turns windows of per-rank leads into per-rank delays.

    States: ``MONITOR`` until the unpaced skew has been at least ``activate_skew_fraction`` of the step
    time for ``activate_windows`` windows *and* some rank has a persistent pacable lead; then
    ``PACING`` for ``ab_windows`` windows, whose median step time is compared with the unpaced
    baseline. Pacing is kept only if it is ``min_gain_fraction`` faster and the gain exceeds
    ``ab_noise_factor`` standard deviations of the noise of that comparison (from the spread of the
    unpaced window medians before the trial); otherwise ``COOLDOWN`` for
    ``cooldown_windows``, multiplied by ``cooldown_growth`` for each further failed check in a row
    (bounded by ``max_cooldown_windows``; a kept check resets it). While kept, every
    ``probe_every_windows`` paced windows a ``PROBE`` of ``ab_windows`` unpaced windows refreshes
    the baseline and the check is repeated. Calm windows
    (skew below ``deactivate_skew_fraction``) for ``deactivate_windows`` in a row end pacing.
    """

    def __init__(self, config: PacingConfig, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.state = PolicyState.MONITOR
        self._smoothed_lead_ms: torch.Tensor | None = None
        self._severe_streak = 0
        self._calm_streak = 0
        self._unpaced_medians: list[float] = []  # recent unpaced window medians (baseline candidates)
        self._paced_medians: list[float] = []  # paced window medians of the current A/B trial
        self._paced_since_probe = 0
        self._state_windows = 0  # windows spent in the current PROBE / COOLDOWN
        self._failed_checks = 0  # failed A/B checks in a row (sets the length of the cool-down)
        self._cooldown_len = config.cooldown_windows
        self._baseline_ms: float | None = None
        self._noise_ms = 0.0  # standard deviation of the A/B difference from noise alone
        self._update_in: dict[PolicyState, Callable[[_Window], Decision]] = {
            PolicyState.MONITOR: self._update_monitor,
            PolicyState.PACING: self._update_pacing,
            PolicyState.PROBE: self._update_probe,
            PolicyState.COOLDOWN: self._update_cooldown,
        }
        self._last = self._decision(-1, "start: monitoring")

    @property
    def last_decision(self) -> Decision:
        return self._last

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything the next decision depends on, as plain JSON-able data (versioned).

        Floats are written as they are (JSON round-trips a float64 exactly), so a policy restored
        with :meth:`load_state_dict` takes the same decisions from the same windows as this one.
        The configuration is not part of it: the restoring run's own config applies.
        """
        last = self._last
        return {
            "version": STATE_VERSION,
            "world_size": self.world_size,
            "state": self.state.value,
            "smoothed_lead_ms": None if self._smoothed_lead_ms is None else self._smoothed_lead_ms.tolist(),
            "severe_streak": self._severe_streak,
            "calm_streak": self._calm_streak,
            "unpaced_medians": list(self._unpaced_medians),
            "paced_medians": list(self._paced_medians),
            "paced_since_probe": self._paced_since_probe,
            "state_windows": self._state_windows,
            "failed_checks": self._failed_checks,
            "cooldown_len": self._cooldown_len,
            "baseline_ms": self._baseline_ms,
            "noise_ms": self._noise_ms,
            "last_decision": {
                "window": last.window,
                "state": last.state.value,
                "delays_ms": list(last.delays_ms),
                "reason": last.reason,
                "baseline_step_ms": last.baseline_step_ms,
                "paced_step_ms": last.paced_step_ms,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Raises :class:`PacingStateError` (and changes
        nothing) for a newer version, a missing or mistyped field, or another world size."""
        s = check_state(state, "the pacing controller's state", _POLICY_FIELDS)
        if s["world_size"] != self.world_size:
            raise PacingStateError(
                f"the pacing controller's state was saved with world_size {s['world_size']}, this run has "
                f"{self.world_size}: per-rank leads and delays do not carry over; the controller starts "
                "fresh (monitoring)."
            )
        lead = s["smoothed_lead_ms"]
        last = check_state(
            {"version": STATE_VERSION, **s["last_decision"]}, "last_decision", _DECISION_FIELDS
        )
        for name, values in (("smoothed_lead_ms", lead), ("last_decision.delays_ms", last["delays_ms"])):
            if values is not None and len(values) != self.world_size:
                raise PacingStateError(
                    f"the pacing controller's state field {name!r} has {len(values)} values, not one per "
                    f"rank of {self.world_size}"
                )
        try:
            state_now = PolicyState(s["state"])
            decision = Decision(
                window=last["window"],
                state=PolicyState(last["state"]),
                delays_ms=tuple(float(d) for d in last["delays_ms"]),
                reason=last["reason"],
                baseline_step_ms=last["baseline_step_ms"],
                paced_step_ms=last["paced_step_ms"],
            )
            smoothed = None if lead is None else torch.tensor(lead, dtype=torch.float64)
            unpaced = [float(v) for v in s["unpaced_medians"]]
            paced = [float(v) for v in s["paced_medians"]]
        except (TypeError, ValueError) as error:
            raise PacingStateError(f"the pacing controller's state does not load: {error}") from error
        self.state = state_now
        self._smoothed_lead_ms = smoothed
        self._severe_streak = s["severe_streak"]
        self._calm_streak = s["calm_streak"]
        self._unpaced_medians = unpaced
        self._paced_medians = paced
        self._paced_since_probe = s["paced_since_probe"]
        self._state_windows = s["state_windows"]
        self._failed_checks = s["failed_checks"]
        self._cooldown_len = s["cooldown_len"]
        self._baseline_ms = None if s["baseline_ms"] is None else float(s["baseline_ms"])
        self._noise_ms = float(s["noise_ms"])
        self._last = decision

    def update(self, stats: WindowStats) -> Decision:
        """Consume one window and return the decision for the steps that follow it."""
        if stats.steps == 0:
            return self._keep_last(stats.window)
        w = self._observe(stats)
        if self.config.mode == "monitor":
            return self._set(w.index, PolicyState.MONITOR, f"monitor mode; {w.note}")
        if self.config.mode == "forced":
            return self._set(w.index, PolicyState.PACING, f"forced mode; {w.note}", delays=w.delays_ms)
        return self._update_in[self.state](w)

    # ------------------------------------------------------------------ one method per state
    def _update_monitor(self, w: _Window) -> Decision:
        """Measure the unpaced baseline; start an A/B trial after ``activate_windows`` severe windows."""
        self._remember_unpaced(w.median_step_ms)
        if self._severe_streak < self.config.activate_windows:
            return self._set(w.index, PolicyState.MONITOR, f"monitoring; {w.note}")
        self._start_trial()
        return self._set(
            w.index,
            PolicyState.PACING,
            f"severe for {self._severe_streak} windows ({w.note}): pacing on, A/B trial starts",
            delays=w.delays_ms,
        )

    def _update_pacing(self, w: _Window) -> Decision:
        """Pace; once ``ab_windows`` paced windows are in, run the A/B check. Calm windows end pacing."""
        if self._calm_streak >= self.config.deactivate_windows:
            return self._set(w.index, PolicyState.MONITOR, f"calm ({w.note}): pacing off")
        if w.was_paced:  # a PACING decision whose delays all came out 0 left the window unpaced
            self._paced_medians.append(w.median_step_ms)
            self._paced_since_probe += 1
        if len(self._paced_medians) < self.config.ab_windows:
            return self._set(w.index, PolicyState.PACING, f"pacing; {w.note}", delays=w.delays_ms)
        return self._ab_check(w)

    def _update_probe(self, w: _Window) -> Decision:
        """Withhold delays for ``ab_windows`` unpaced windows, then pace again on the fresh baseline."""
        if not w.was_paced:
            self._count_unpaced(w.median_step_ms)
        if self._state_windows < self.config.ab_windows:
            return self._set(w.index, PolicyState.PROBE, f"probing unpaced; {w.note}")
        self._start_trial()
        return self._set(
            w.index,
            PolicyState.PACING,
            f"probe done: unpaced baseline {self._baseline_ms:.2f} ms; pacing again",
            delays=w.delays_ms,
        )

    def _update_cooldown(self, w: _Window) -> Decision:
        """Stay unpaced for the cool-down's length, then monitor again from a fresh severity streak."""
        self._count_unpaced(w.median_step_ms)
        if self._state_windows < self._cooldown_len:
            return self._set(
                w.index, PolicyState.COOLDOWN, f"cool-down {self._state_windows}/{self._cooldown_len}"
            )
        self._severe_streak = 0
        return self._set(w.index, PolicyState.MONITOR, "cool-down over: monitoring")

    # ------------------------------------------------------------------ the A/B check
    def _ab_check(self, w: _Window) -> Decision:
        """Compare the trial's paced median with the unpaced baseline: keep pacing, probe, or back off."""
        cfg = self.config
        paced = statistics.median(self._paced_medians)
        base = self._baseline_ms if self._baseline_ms is not None else w.median_step_ms
        self._paced_medians = []
        needed = ab_gain_needed_ms(cfg, base, self._noise_ms)
        if base - paced < needed:
            return self._back_off(w.index, paced, base, needed)
        self._failed_checks = 0
        if self._paced_since_probe >= cfg.probe_every_windows:
            self._state_windows = 0
            return self._set(
                w.index,
                PolicyState.PROBE,
                f"A/B: paced {paced:.2f} ms vs {base:.2f} ms kept; probing unpaced again",
                paced_ms=paced,
            )
        return self._set(
            w.index,
            PolicyState.PACING,
            f"A/B: paced {paced:.2f} ms vs unpaced {base:.2f} ms ({paced / base - 1:+.2%}): kept",
            delays=w.delays_ms,
            paced_ms=paced,
        )

    def _back_off(self, window: int, paced_ms: float, base_ms: float, needed_ms: float) -> Decision:
        """The check failed: cool down, for longer after each failed check in a row."""
        cfg = self.config
        self._state_windows = 0
        self._cooldown_len = self._next_cooldown()
        self._failed_checks += 1
        return self._set(
            window,
            PolicyState.COOLDOWN,
            f"A/B: paced {paced_ms:.2f} ms vs unpaced {base_ms:.2f} ms ({paced_ms / base_ms - 1:+.2%}); "
            f"no gain of {needed_ms:.2f} ms ({cfg.min_gain_fraction:.1%} of the step, or "
            f"{cfg.ab_noise_factor:g} x the comparison's noise {self._noise_ms:.2f} ms): "
            f"backing off for {self._cooldown_len} windows (failed check "
            f"{self._failed_checks} in a row)",
            paced_ms=paced_ms,
        )

    def _start_trial(self) -> None:
        """Fix the unpaced baseline and the noise of the coming A/B comparison; pacing starts."""
        cfg = self.config
        unpaced = self._unpaced_medians
        self._baseline_ms = statistics.median(unpaced[-cfg.ab_windows :])
        self._noise_ms = ab_noise_ms(unpaced, cfg.ab_windows)
        self._paced_medians = []
        self._paced_since_probe = 0

    def _next_cooldown(self) -> int:
        """Length of the cool-down after one more failed check: grows geometrically, bounded."""
        cfg = self.config
        return next_cooldown_windows(
            self._cooldown_len,
            self._failed_checks,
            cfg.cooldown_windows,
            cfg.cooldown_growth,
            cfg.max_cooldown_windows,
        )

    # ------------------------------------------------------------------ shared by every state
    def _observe(self, stats: WindowStats) -> _Window:
        """This window's delays and the severe / calm streaks (kept in every mode and state)."""
        cfg = self.config
        delays = self._delays(stats)
        pacable = any(map((0.0).__lt__, delays))  # some d > 0.0
        frac = stats.skew_fraction
        severe = frac >= cfg.activate_skew_fraction and pacable
        calm = frac < cfg.deactivate_skew_fraction or not pacable
        self._severe_streak = self._severe_streak + 1 if severe else 0
        self._calm_streak = self._calm_streak + 1 if calm else 0
        median = stats.median_step_ms
        return _Window(
            index=stats.window,
            median_step_ms=median,
            delays_ms=delays,
            note=f"skew {frac:.1%} of step ({stats.median_unpaced_skew_ms:.2f} of {median:.2f} ms)",
            was_paced=self._last.pacing_active,
        )

    def _keep_last(self, window: int) -> Decision:
        """A window without usable steps says nothing: same state and delays, no streak moves."""
        self._last = Decision(
            window=window,
            state=self.state,
            delays_ms=self._last.delays_ms,
            reason="no usable steps in window (warm-up or sync point not seen): decision unchanged",
            baseline_step_ms=self._baseline_ms,
        )
        return self._last

    def _count_unpaced(self, median_ms: float) -> None:
        """One more unpaced window of the current PROBE / COOLDOWN, kept as a baseline candidate."""
        self._remember_unpaced(median_ms)
        self._state_windows += 1

    def _remember_unpaced(self, median_ms: float) -> None:
        self._unpaced_medians.append(median_ms)
        keep = max(self.config.ab_windows, self.config.activate_windows)
        del self._unpaced_medians[:-keep]

    def _delays(self, stats: WindowStats) -> tuple[float, ...]:
        """Per-rank delay from this window: a bounded fraction of each rank's smoothed pacable lead."""
        cfg = self.config
        leads = stats.pacable_lead_ms
        median_lead, noise = stats.lead_spread
        if self._smoothed_lead_ms is None:
            self._smoothed_lead_ms = median_lead.clone()
        else:
            a = cfg.lead_smoothing
            self._smoothed_lead_ms = a * median_lead + (1.0 - a) * self._smoothed_lead_ms
        margin = cfg.noise_margin_factor * noise
        persistent = (leads > margin.unsqueeze(1)).double().mean(dim=1) >= cfg.persist_fraction
        raw = cfg.gain * (self._smoothed_lead_ms - margin)
        cap = min(cfg.max_delay_ms, cfg.max_delay_step_fraction * stats.median_step_ms)
        delays = torch.where(persistent, raw, torch.zeros_like(raw)).clamp(0.0, cap)
        delays = delays - delays.min()  # a delay every rank shares buys nothing
        delays = torch.where(delays >= cfg.min_delay_ms, delays, torch.zeros_like(delays))
        return tuple(delays.tolist())  # float64: Python floats already

    def _decision(
        self, window: int, reason: str, delays: tuple[float, ...] | None = None, paced_ms: float | None = None
    ) -> Decision:
        """A decision in the current state; no ``delays``: nobody is paced."""
        return Decision(
            window=window,
            state=self.state,
            delays_ms=(0.0,) * self.world_size if delays is None else delays,
            reason=reason,
            baseline_step_ms=self._baseline_ms,
            paced_step_ms=paced_ms,
        )

    def _set(
        self,
        window: int,
        state: PolicyState,
        reason: str,
        delays: tuple[float, ...] | None = None,
        paced_ms: float | None = None,
    ) -> Decision:
        """Move to ``state`` and make the decision that goes with it the last one."""
        self.state = state
        self._last = self._decision(window, reason, delays=delays, paced_ms=paced_ms)
        return self._last
