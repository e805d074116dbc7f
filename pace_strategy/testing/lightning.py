"""``InjectStraggler``: a Lightning callback that applies :class:`~pace_strategy.testing.Straggler`
injections inside the measured compute of each training batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback
from typing_extensions import override

from pace_strategy.testing.inject import Straggler, batch_samples, sleep_injected
from pace_strategy.testing.slow import arm_injection_points

__all__ = ["InjectStraggler"]


class InjectStraggler(Callback):
    """Slow the chosen ranks in each training batch (inside the measured compute; a per-sample
    injection counts the batch's samples): ``"step"``-phase stragglers at the start of the batch,
    ``"backward"`` and ``"forward_backward"`` ones at the module's
    :class:`~pace_strategy.testing.slow.InjectionPoint` (armed at the start of the batch).

    Args:
        stragglers: the injections (see :class:`pace_strategy.testing.Straggler`).
    """

    def __init__(self, stragglers: Sequence[Straggler] | Straggler) -> None:
        self.stragglers = (stragglers,) if isinstance(stragglers, Straggler) else tuple(stragglers)
        self.injected_ms = 0.0  #: milliseconds slept on this rank so far

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rank, step, samples = trainer.global_rank, trainer.global_step, batch_samples(batch)
        self.injected_ms += sleep_injected(self.stragglers, rank, step, samples)
        self.injected_ms += arm_injection_points(pl_module, self.stragglers, rank, step, samples)
