"""Lightning Fabric adapter (``lightning.fabric``): the ``paced_ddp`` / ``paced_ddp_spawn`` strategies of
``Fabric(strategy=...)``, and :func:`finish_pacing`, the end of a paced run.

:class:`PacedFabricDDPStrategy` is Fabric's own ``DDPStrategy`` plus :class:`FabricPacing`, which turns
the strategy's events into calls on this rank's :class:`~pace_strategy.session.PacingSession`:
``fabric.setup(model)`` starts the session and attaches the DDP monitor (``setup_module``), a step
begins at its first batch (a loader from ``fabric.setup_dataloaders``) or at the model's first
training forward, and ends at the optimizer step (``optimizer.step()`` reaches the strategy's
``optimizer_step``). Importing this module registers the strategies (:func:`register_fabric_strategies`,
idempotent); ``import pace_strategy`` imports it as soon as ``lightning.fabric`` is imported.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.types import Optimizable
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from pace_strategy.core.config import PacingConfig
from pace_strategy.driver import PacingDriver
from pace_strategy.hooks.ddp import attach_paced_ddp
from pace_strategy.integrations._arguments import parent_arguments
from pace_strategy.integrations._lightning_mixins import StrategyRegistry, register_paced_ddp
from pace_strategy.integrations.dashboard import custom_scalars_sink, tensorboard_loggers
from pace_strategy.integrations.data import forward_tokens, loader_workers, time_dataloader
from pace_strategy.integrations.env import (
    PacingArg,
    as_pacing_config,
    logger_record_dir,
    runs_alone,
)
from pace_strategy.integrations.loggers import loggers_sink
from pace_strategy.integrations.rebalance import STATE_NAME, DataRebalance
from pace_strategy.session import PacingSession

__all__ = ["FabricPacing", "PacedFabricDDPStrategy", "finish_pacing", "register_fabric_strategies"]

log = logging.getLogger(__name__)

#: How far up the stack :func:`_calling_fabric` looks: Fabric.setup -> setup_module_and_optimizers
#: -> setup_module is two calls.
_SETUP_FRAMES = 4


class FabricPacing(PacingDriver):
    """The pacing of one Fabric strategy: a :class:`~pace_strategy.driver.PacingDriver` whose session
    runs from ``fabric.setup`` to :func:`finish_pacing`, on the model it paces (the first one set up).

    Args:
        config: the validated pacing configuration.
        run_dir: the run record's directory (rank 0); ``None``: the first logger's ``log_dir``, else
            ``$PACE_RUN_DIR``, else no record.
    """

    rebalance: DataRebalance | None  #: the rebalanced training data (``rebalance=True``, 2+ processes)

    def __init__(self, config: PacingConfig, run_dir: str | os.PathLike[str] | None) -> None:
        super().__init__(config)  # no session before setup, nor without monitoring
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._model: DistributedDataParallel | None = None
        self._loader_workers: list[int | None] = []  #: of the loaders set up so far

    def attach(self, model: DistributedDataParallel, strategy: DDPStrategy, fabric: Fabric | None) -> None:
        """Start the session (collective on every rank) and monitor ``model``; only the first model
        set up is paced, later ones train as with ``ddp``."""
        if self._model is not None:
            log.info("pace_strategy: only the first model set up is paced; this one trains as with ddp")
            return
        self._model = model
        if runs_alone(strategy.world_size, self.run_dir, record_alone=True, runs_as="running as ddp"):
            return
        if fabric is None:
            log.warning("pace_strategy: set up outside Fabric.setup; pace/* telemetry goes to no logger")
        rank = strategy.global_rank
        sink, unlock = loggers_sink(fabric.loggers if fabric is not None and rank == 0 else ())
        self.on_detach(unlock)
        session = PacingSession.with_side_group(
            self.config,
            rank=rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
            framework="fabric",
            log_dir=self._record_dir(fabric) if rank == 0 else None,
            metrics_sink=sink,
            dashboard=custom_scalars_sink(lambda: tensorboard_loggers(fabric.loggers if fabric else [])),
            node_rank=strategy.node_rank,
            local_rank=strategy.local_rank,
        )
        self.adopt(session)
        for workers in self._loader_workers:
            session.note_dataloader_workers(workers)
        attach_paced_ddp(model, session.pacer)
        if self.rebalance is not None:  # its loader was set up before the model
            self.rebalance.attach(session.pacer)
            session.state.register(STATE_NAME, self.rebalance)
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        if rank == 0:
            log.info("pace_strategy: %s mode, run record %s", self.config.mode, session.record_path or "off")

    def _record_dir(self, fabric: Fabric | None) -> Path | None:
        """Explicit ``run_dir`` > the first logger's directory > ``$PACE_RUN_DIR`` > a new
        ``./pace_runs/<date-time>`` for a logger without one > none without a logger."""
        logger = fabric.loggers[0] if fabric is not None and fabric.loggers else None
        return logger_record_dir(self.run_dir, logger)

    def _live(self) -> PacingSession | None:
        """The session while it runs and the paced model trains (not in eval mode, not under
        ``torch.no_grad``): a validation loop is no training step."""
        session, model = self.session, self._model
        if session is None or session.finished or model is None:
            return None
        return session if model.training and torch.is_grad_enabled() else None

    # A step begins when its first batch is ready (a timed loader) or, for a loop that feeds the model
    # itself, at its first training forward; it ends after the optimizer step. So an accumulated step
    # spans all its micro-batches (``begin_step`` is ignored while one is open), and only steps with an
    # optimizer step, the synchronizing ones under ``fabric.no_backward_sync``, count.
    def _forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if (session := self._live()) is not None:
            self.begin_forward(session.pacer.steps_seen)
            if tokens := forward_tokens(args, kwargs):
                session.pacer.add_tokens(tokens)
        else:
            self.interrupt()  # evaluation: the next step does not follow this one

    def _batch_ready(self, session: PacingSession) -> None:
        # labelled by the steps the pacer saw: an optimizer step after an evaluation-only forward
        # is not a training step
        self.begin_step(session.pacer.steps_seen)

    def prepare_dataloader(self, dataloader: DataLoader[Any], strategy: DDPStrategy) -> DataLoader[Any]:
        """With ``rebalance=True`` on two or more processes: ``dataloader`` rebuilt around the
        rebalancing batch sampler (every loader set up is taken for a training loader: set up
        evaluation loaders with ``use_distributed_sampler=False`` or through another strategy)."""
        if not self.config.splits_batches or strategy.world_size < 2:
            return dataloader
        if self.rebalance is None:
            self.rebalance = DataRebalance(
                self.session.pacer if self.session is not None else None,
                strategy.global_rank,
                strategy.world_size,
                step_source=lambda: self.session.pacer.steps_seen if self.session is not None else 0,
                framework_prefetch=0,  # Fabric's loader wrapper fetches nothing ahead
                balance=self.config.balance,
            )
            if self.session is not None:
                self.session.state.register(STATE_NAME, self.rebalance)
        replaced = self.rebalance.replace(dataloader)
        assert isinstance(replaced, DataLoader)
        return replaced

    def scale_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor ``fabric.backward`` differentiates, times this rank's share factor while
        rebalancing a training step."""
        if self.rebalance is not None and self._live() is not None:
            return self.rebalance.scale(tensor)
        return tensor

    def time_dataloader(self, dataloader: DataLoader[Any]) -> None:
        """Count the time ``dataloader``'s iterators block, while training, as data wait, and note
        its workers for the run record's placements (set up before or after the model)."""
        self._loader_workers.append(loader_workers(dataloader))
        if self.session is not None:
            self.session.note_dataloader_workers(self._loader_workers[-1])
        time_dataloader(dataloader, self._live, on_batch=self._batch_ready)

    def close(self, error: BaseException | None = None) -> None:
        """Close locally, without the final exchange: with ``error``, as failed; else ``incomplete``
        (the steps of the last, unexchanged window are lost). Idempotent."""
        if error is not None:
            self.fail(error)
        elif self.session is not None:
            self.session.close(status="incomplete")


class PacedFabricDDPStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` with barrier-arrival skew monitoring and adaptive pacing.

    ``Fabric(strategy="paced_ddp")`` (or ``"paced_ddp_spawn"``) builds it with the defaults; pass an
    instance for the arguments. End training with :func:`finish_pacing` on every rank.

    Args:
        pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None`` for the
            defaults; validated here, before any process starts.
        run_dir: the run record's directory (rank 0). Default: the first Fabric logger's
            ``log_dir``, else ``$PACE_RUN_DIR``, else no record (an explicit ``run_dir`` wins).
        *args, **kwargs: ``DDPStrategy``'s arguments, in its positions (those it does not name go
            to ``DistributedDataParallel``).
    """

    def __init__(
        self,
        *args: Any,
        pacing: PacingArg = None,
        run_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        named = parent_arguments(DDPStrategy.__init__, args, kwargs)  # DDPStrategy's positions
        self.pacing = FabricPacing(as_pacing_config(pacing), run_dir)
        super().__init__(**named)

    @property
    def pacing_config(self) -> PacingConfig:
        """The validated pacing configuration."""
        return self.pacing.config

    @property
    def pacing_session(self) -> PacingSession | None:
        """This rank's session, from ``fabric.setup`` on (``None`` on a single process without a
        run directory asked for)."""
        return self.pacing.session

    @override
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        self.pacing.attach(ddp, self, _calling_fabric(self))
        return ddp

    @override
    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        dataloader = super().process_dataloader(dataloader)
        dataloader = self.pacing.prepare_dataloader(dataloader, self)  # rebalancing's batch sampler
        self.pacing.time_dataloader(dataloader)
        return dataloader

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(self.pacing.scale_loss(tensor), module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.pacing.end_step()
        return output

    @override
    def teardown(self) -> None:
        self.pacing.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register_paced_ddp(strategy_registry, cls)


def finish_pacing(fabric: Fabric) -> None:
    """End a paced run: exchange and log the last steps and close the run record.

    Call it on every rank (collective) after the training loop, before ``fabric.logger.finalize(...)``
    and before the processes part ways. It does nothing when ``fabric``'s strategy is not paced, on a
    single process, and when called again. Without it, the run record is closed at interpreter exit
    as ``incomplete`` (``failed`` after an uncaught exception), without its last window.
    """
    strategy = fabric.strategy
    if isinstance(strategy, PacedFabricDDPStrategy):
        strategy.pacing.finish()


def register_fabric_strategies() -> None:
    """Register ``paced_ddp`` and ``paced_ddp_spawn`` in ``lightning.fabric``'s strategy registry
    (idempotent)."""
    PacedFabricDDPStrategy.register_strategies(STRATEGY_REGISTRY)


def _calling_fabric(strategy: DDPStrategy) -> Fabric | None:
    """The Fabric whose ``setup`` / ``setup_module`` is calling ``strategy.setup_module``.

    Fabric (2.6) gives its strategy no reference to itself, so no way to its loggers; the one Fabric
    method that holds both is the one calling the strategy. This reads that caller's ``self`` off the
    stack, once per setup, and uses only Fabric's public ``strategy``, ``loggers`` and ``log_dict``.
    It is the only place pace_strategy does so; tests/integration/test_fabric.py fails if it stops
    finding the Fabric. Not found (a strategy set up by hand): no telemetry, and a run record only
    with ``run_dir=`` or ``$PACE_RUN_DIR``.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(_SETUP_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if isinstance(caller, Fabric) and caller.strategy is strategy:
                return caller
    finally:
        del frame  # a frame reference would keep every local of the stack alive
    return None


# Registered as soon as the classes exist: ``import pace_strategy`` imports this module when
# ``lightning.fabric`` is imported, and a program that imports this module first (so that it is this
# module that imports Lightning) gets the names too.
register_fabric_strategies()
