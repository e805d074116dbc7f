"""Standalone ``pytorch_lightning`` adapter: the same strategies as
:mod:`pace_strategy.integrations.lightning`, on this package's own classes.

The behaviour is shared (:mod:`pace_strategy.integrations._lightning_mixins`); only the classes and
their constructors are this package's. Importing this module registers the strategies
(:func:`register_pytorch_lightning_strategies`, idempotent) and does not import ``lightning``;
``import pace_strategy`` imports it as soon as ``pytorch_lightning`` is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry
from torch import nn

from pace_strategy.integrations._arguments import parent_arguments
from pace_strategy.integrations._lightning_fsdp import FSDPSharding
from pace_strategy.integrations._lightning_mixins import PacedDDPMixin, PacedFSDPMixin
from pace_strategy.integrations._lightning_pacing import (
    RunDirArg,
    StrategyPacing,
    UserCommHook,
)
from pace_strategy.integrations.env import PacingArg

__all__ = ["PacedDDPStrategy", "PacedFSDPStrategy", "register_pytorch_lightning_strategies"]


class PacedDDPStrategy(PacedDDPMixin, DDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with skew monitoring and adaptive pacing; arguments as
    :class:`pace_strategy.integrations.lightning.PacedDDPStrategy`."""

    strategy_name = "paced_ddp"

    def __init__(
        self, *args: Any, pacing: PacingArg = None, run_dir: RunDirArg = None, **kwargs: Any
    ) -> None:
        named = parent_arguments(DDPStrategy.__init__, args, kwargs)  # DDPStrategy's positions
        self.pacing = StrategyPacing(pacing, self, run_dir)
        self.user_comm_hook = UserCommHook.take(named)
        # No hook for Lightning (configure_ddp registers it); the state still goes there, for its
        # post-localSGD model averaging.
        super().__init__(ddp_comm_state=self.user_comm_hook.state, **named)


class PacedFSDPStrategy(PacedFSDPMixin, ModelParallelStrategy):
    """``pytorch_lightning``'s ``ModelParallelStrategy`` (FSDP2) with skew monitoring and adaptive
    pacing; arguments as :class:`pace_strategy.integrations.lightning.PacedFSDPStrategy`."""

    strategy_name = "paced_fsdp"

    def __init__(
        self,
        *args: Any,
        pacing: PacingArg = None,
        run_dir: RunDirArg = None,
        auto_shard_min_params: int = 100_000,
        auto_shard_classes: Sequence[type[nn.Module]] = (),
        **kwargs: Any,
    ) -> None:
        named = parent_arguments(ModelParallelStrategy.__init__, args, kwargs)  # its positions
        self.pacing = StrategyPacing(pacing, self, run_dir)
        self.sharding = FSDPSharding(
            self,
            min_params=auto_shard_min_params,
            module_classes=auto_shard_classes,
            data_parallel_size=named.get("data_parallel_size", "auto"),
            tensor_parallel_size=named.get("tensor_parallel_size", "auto"),
        )
        named["tensor_parallel_size"] = self.sharding.tensor_parallel_size
        super().__init__(**named)


def register_pytorch_lightning_strategies() -> None:
    """Register ``paced_ddp``, ``paced_ddp_spawn`` and ``paced_fsdp`` in ``pytorch_lightning``'s
    ``StrategyRegistry`` (idempotent)."""
    PacedDDPStrategy.register_strategies(StrategyRegistry)
    PacedFSDPStrategy.register_strategies(StrategyRegistry)


# Registered as soon as the classes exist: ``import pace_strategy`` imports this module when
# ``pytorch_lightning`` is imported, and a program that imports this module first (so that it is this module
# that imports Lightning) gets the names too.
register_pytorch_lightning_strategies()
