"""The adaptive pacing controller: a deterministic state machine fed one window of statistics at a time.

Every rank runs it on the same gathered data, so every rank reaches the same decision without any
further communication. It targets throughput, not the step-time CV: lowering the CV by slowing fast
ranks is not a win, so pacing is kept only while an A/B comparison shows shorter steps.
"""

from __future__ import annotations

import math
import statistics

import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.records import Decision, PolicyState
from pace_strategy.core.skew import WindowStats

__all__ = ["PacingPolicy"]


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
        self._last = self._decision(-1, "start: monitoring", zeros=True)

    @property
    def last_decision(self) -> Decision:
        return self._last

    def update(self, stats: WindowStats) -> Decision:
        """Consume one window and return the decision for the steps that follow it."""
        cfg = self.config
        if stats.steps == 0:
            self._last = Decision(
                window=stats.window,
                state=self.state,
                delays_ms=self._last.delays_ms,
                reason="no usable steps in window (warm-up or sync point not seen): decision unchanged",
                baseline_step_ms=self._baseline_ms,
            )
            return self._last

        delays = self._delays(stats)
        pacable = any(d > 0.0 for d in delays)
        frac = stats.skew_fraction
        severe = frac >= cfg.activate_skew_fraction and pacable
        calm = frac < cfg.deactivate_skew_fraction or not pacable
        self._severe_streak = self._severe_streak + 1 if severe else 0
        self._calm_streak = self._calm_streak + 1 if calm else 0
        median = stats.median_step_ms
        skew_note = f"skew {frac:.1%} of step ({stats.median_unpaced_skew_ms:.2f} of {median:.2f} ms)"

        if cfg.mode == "monitor":
            return self._set(stats.window, PolicyState.MONITOR, f"monitor mode; {skew_note}", zeros=True)
        if cfg.mode == "forced":
            return self._set(stats.window, PolicyState.PACING, f"forced mode; {skew_note}", delays=delays)

        window_was_paced = self._last.pacing_active
        if self.state is PolicyState.MONITOR:
            self._remember_unpaced(median)
            if self._severe_streak >= cfg.activate_windows:
                self._start_trial()
                return self._set(
                    stats.window,
                    PolicyState.PACING,
                    f"severe for {self._severe_streak} windows ({skew_note}): pacing on, A/B trial starts",
                    delays=delays,
                )
            return self._set(stats.window, PolicyState.MONITOR, f"monitoring; {skew_note}", zeros=True)

        if self.state is PolicyState.PACING:
            if self._calm_streak >= cfg.deactivate_windows:
                return self._set(
                    stats.window, PolicyState.MONITOR, f"calm ({skew_note}): pacing off", zeros=True
                )
            if window_was_paced:
                self._paced_medians.append(median)
                self._paced_since_probe += 1
            if len(self._paced_medians) >= cfg.ab_windows:
                paced = statistics.median(self._paced_medians)
                base = self._baseline_ms if self._baseline_ms is not None else median
                self._paced_medians = []
                needed = max(cfg.min_gain_fraction * base, cfg.ab_noise_factor * self._noise_ms)
                if base - paced < needed:
                    self._state_windows = 0
                    self._cooldown_len = self._next_cooldown()
                    self._failed_checks += 1
                    return self._set(
                        stats.window,
                        PolicyState.COOLDOWN,
                        f"A/B: paced {paced:.2f} ms vs unpaced {base:.2f} ms ({paced / base - 1:+.2%}); "
                        f"no gain of {needed:.2f} ms ({cfg.min_gain_fraction:.1%} of the step, or "
                        f"{cfg.ab_noise_factor:g} x the comparison's noise {self._noise_ms:.2f} ms): "
                        f"backing off for {self._cooldown_len} windows (failed check "
                        f"{self._failed_checks} in a row)",
                        zeros=True,
                        paced_ms=paced,
                    )
                self._failed_checks = 0
                if self._paced_since_probe >= cfg.probe_every_windows:
                    self._state_windows = 0
                    return self._set(
                        stats.window,
                        PolicyState.PROBE,
                        f"A/B: paced {paced:.2f} ms vs {base:.2f} ms kept; probing unpaced again",
                        zeros=True,
                        paced_ms=paced,
                    )
                return self._set(
                    stats.window,
                    PolicyState.PACING,
                    f"A/B: paced {paced:.2f} ms vs unpaced {base:.2f} ms ({paced / base - 1:+.2%}): kept",
                    delays=delays,
                    paced_ms=paced,
                )
            return self._set(stats.window, PolicyState.PACING, f"pacing; {skew_note}", delays=delays)

        if self.state is PolicyState.PROBE:
            if not window_was_paced:
                self._remember_unpaced(median)
                self._state_windows += 1
            if self._state_windows >= cfg.ab_windows:
                self._start_trial()
                return self._set(
                    stats.window,
                    PolicyState.PACING,
                    f"probe done: unpaced baseline {self._baseline_ms:.2f} ms; pacing again",
                    delays=delays,
                )
            return self._set(stats.window, PolicyState.PROBE, f"probing unpaced; {skew_note}", zeros=True)

        # COOLDOWN
        self._remember_unpaced(median)
        self._state_windows += 1
        if self._state_windows >= self._cooldown_len:
            self._severe_streak = 0
            return self._set(stats.window, PolicyState.MONITOR, "cool-down over: monitoring", zeros=True)
        return self._set(
            stats.window,
            PolicyState.COOLDOWN,
            f"cool-down {self._state_windows}/{self._cooldown_len}",
            zeros=True,
        )

    def _start_trial(self) -> None:
        """Fix the unpaced baseline and the noise of the coming A/B comparison; pacing starts."""
        cfg = self.config
        unpaced = self._unpaced_medians
        self._baseline_ms = statistics.median(unpaced[-cfg.ab_windows :])
        # Each side of the comparison is a median of ab_windows window medians: its difference has
        # about sqrt(2 / ab_windows) times the spread of single windows when noise alone moves them.
        spread = statistics.stdev(unpaced) if len(unpaced) >= 2 else 0.0
        self._noise_ms = spread * math.sqrt(2.0 / cfg.ab_windows)
        self._paced_medians = []
        self._paced_since_probe = 0

    def _next_cooldown(self) -> int:
        """Length of the cool-down after one more failed check: grows geometrically, bounded."""
        cfg = self.config
        if self._failed_checks == 0:
            return cfg.cooldown_windows
        # from the previous length, not growth**n: no float overflow however long the run
        return min(math.ceil(self._cooldown_len * cfg.cooldown_growth), cfg.max_cooldown_windows)

    def _remember_unpaced(self, median_ms: float) -> None:
        self._unpaced_medians.append(median_ms)
        keep = max(self.config.ab_windows, self.config.activate_windows)
        del self._unpaced_medians[:-keep]

    def _delays(self, stats: WindowStats) -> tuple[float, ...]:
        """Per-rank delay from this window: a bounded fraction of each rank's smoothed pacable lead."""
        cfg = self.config
        leads = stats.pacable_lead_ms
        median_lead = leads.median(dim=1).values
        if self._smoothed_lead_ms is None:
            self._smoothed_lead_ms = median_lead.clone()
        else:
            a = cfg.lead_smoothing
            self._smoothed_lead_ms = a * median_lead + (1.0 - a) * self._smoothed_lead_ms
        noise = leads.std(dim=1, correction=0) if leads.shape[1] > 1 else torch.zeros_like(median_lead)
        margin = cfg.noise_margin_factor * noise
        persistent = (leads > margin.unsqueeze(1)).double().mean(dim=1) >= cfg.persist_fraction
        raw = cfg.gain * (self._smoothed_lead_ms - margin)
        cap = min(cfg.max_delay_ms, cfg.max_delay_step_fraction * stats.median_step_ms)
        delays = torch.where(persistent, raw, torch.zeros_like(raw)).clamp(0.0, cap)
        delays = delays - delays.min()  # a delay every rank shares buys nothing
        delays = torch.where(delays >= cfg.min_delay_ms, delays, torch.zeros_like(delays))
        return tuple(float(d) for d in delays.tolist())

    def _decision(
        self,
        window: int,
        reason: str,
        delays: tuple[float, ...] | None = None,
        zeros: bool = False,
        paced_ms: float | None = None,
    ) -> Decision:
        return Decision(
            window=window,
            state=self.state,
            delays_ms=(0.0,) * self.world_size if zeros or delays is None else delays,
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
        zeros: bool = False,
        paced_ms: float | None = None,
    ) -> Decision:
        self.state = state
        self._last = self._decision(window, reason, delays=delays, zeros=zeros, paced_ms=paced_ms)
        return self._last
