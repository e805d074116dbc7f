"""Deterministic fault injection for tests, demos and benchmarks: not part of the training API.

:class:`Straggler` (framework-agnostic, seeded) says which rank is slowed, by how much and how often;
:class:`~pace_strategy.testing.lightning.InjectStraggler` applies it inside a Lightning training step,
:class:`~pace_strategy.testing.slow.InjectionPoint` inside the model's forward and backward.
``InjectStraggler`` and the injection point are imported on first use, so ``import
pace_strategy.testing`` needs neither Lightning nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pace_strategy.testing.inject import (
    PHASES,
    Straggler,
    batch_samples,
    injected_delay_ms,
    parse_slow_devices,
    parse_stragglers,
    sleep_injected,
    spend_ms,
)

if TYPE_CHECKING:
    from pace_strategy.testing.lightning import InjectStraggler
    from pace_strategy.testing.slow import InjectionPoint, arm_injection_points

__all__ = [
    "PHASES",
    "InjectStraggler",
    "InjectionPoint",
    "Straggler",
    "arm_injection_points",
    "batch_samples",
    "injected_delay_ms",
    "parse_slow_devices",
    "parse_stragglers",
    "sleep_injected",
    "spend_ms",
]


def __getattr__(name: str) -> Any:
    if name == "InjectStraggler":
        from pace_strategy.testing.lightning import InjectStraggler

        return InjectStraggler
    if name in ("InjectionPoint", "arm_injection_points"):  # torch, loaded on first use
        from pace_strategy.testing import slow

        return getattr(slow, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
