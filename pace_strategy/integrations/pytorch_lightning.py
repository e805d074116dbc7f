"""Standalone ``pytorch_lightning`` adapter: the same strategies as
:mod:`pace_strategy.integrations.lightning`, on this package's own classes.

The behaviour is shared (:mod:`pace_strategy.integrations._lightning_mixins`); only the classes and
their constructors are this package's. Importing this module registers the strategies
(:func:`register_pytorch_lightning_strategies`, idempotent) and does not import ``lightning``;
``import pace_strategy`` imports it as soon as ``pytorch_lightning`` is imported.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry

from pace_strategy.integrations._lightning_mixins import PacedDDPMixin, PacedFSDPMixin

__all__ = ["PacedDDPStrategy", "PacedFSDPStrategy", "register_pytorch_lightning_strategies"]


class PacedDDPStrategy(PacedDDPMixin, DDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with skew monitoring and adaptive pacing; arguments as
    :class:`pace_strategy.integrations.lightning.PacedDDPStrategy`."""

    strategy_name = "paced_ddp"


class PacedFSDPStrategy(PacedFSDPMixin, ModelParallelStrategy):
    """``pytorch_lightning``'s ``ModelParallelStrategy`` (FSDP2) with skew monitoring and adaptive
    pacing; arguments as :class:`pace_strategy.integrations.lightning.PacedFSDPStrategy`."""

    strategy_name = "paced_fsdp"


def register_pytorch_lightning_strategies() -> None:
    """Register ``paced_ddp``, ``paced_ddp_spawn`` and ``paced_fsdp`` in ``pytorch_lightning``'s
    ``StrategyRegistry`` (idempotent)."""
    PacedDDPStrategy.register_strategies(StrategyRegistry)
    PacedFSDPStrategy.register_strategies(StrategyRegistry)


# Registered as soon as the classes exist: ``import pace_strategy`` imports this module when
# ``pytorch_lightning`` is imported, and a program that imports this module first (so that it is this module
# that imports Lightning) gets the names too.
register_pytorch_lightning_strategies()
