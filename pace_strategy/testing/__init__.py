"""Deterministic fault injection for tests, demos and benchmarks: not part of the training API.

:class:`Straggler` (framework-agnostic, seeded) says which rank is slowed, by how much and how often;
:class:`~pace_strategy.testing.lightning.InjectStraggler` applies it inside a Lightning training step.
``InjectStraggler`` is imported on first use, so ``import pace_strategy.testing`` needs no Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pace_strategy.testing.inject import (
    Straggler,
    batch_samples,
    injected_delay_ms,
    parse_slow_devices,
    parse_stragglers,
    sleep_injected,
)

if TYPE_CHECKING:
    from pace_strategy.testing.lightning import InjectStraggler

__all__ = [
    "InjectStraggler",
    "Straggler",
    "batch_samples",
    "injected_delay_ms",
    "parse_slow_devices",
    "parse_stragglers",
    "sleep_injected",
]


def __getattr__(name: str) -> Any:
    if name == "InjectStraggler":
        from pace_strategy.testing.lightning import InjectStraggler

        return InjectStraggler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
