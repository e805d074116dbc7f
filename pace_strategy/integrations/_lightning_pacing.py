"""The session side of the paced Lightning strategies, for both ``lightning.pytorch`` and
``pytorch_lightning`` (imports neither): :class:`StrategyPacing` turns a strategy's step events
into calls on this rank's :class:`~pace_strategy.session.PacingSession`.

It reads its strategy through :class:`StrategyView`, a protocol of the few Lightning attributes
it needs: the concrete strategy classes pass themselves, so mypy checks each package's real types
against it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.hooks.ddp import CommHook, attach_paced_ddp
from pace_strategy.integrations.data import time_dataloader
from pace_strategy.session import MetricsSink, PacingSession

__all__ = [
    "CommHookWrapper",
    "PacingArg",
    "StrategyPacing",
    "StrategyView",
    "UserCommHook",
    "as_pacing_config",
]

log = logging.getLogger(__name__)

#: What a strategy's ``pacing=`` takes: a config, a mapping of its fields, or None for the defaults.
PacingArg: TypeAlias = "PacingConfig | Mapping[str, Any] | None"
#: A DDP comm-hook wrapper (e.g. torch's ``fp16_compress_wrapper``): a hook in, a hook out.
CommHookWrapper: TypeAlias = Callable[[CommHook], CommHook]


def as_pacing_config(pacing: PacingArg) -> PacingConfig:
    """Validate a strategy's ``pacing=`` argument into a :class:`PacingConfig`."""
    if pacing is None:
        return PacingConfig()
    if isinstance(pacing, PacingConfig):
        return pacing
    if isinstance(pacing, Mapping):
        return PacingConfig.from_dict(pacing)
    raise PacingConfigError(
        f"pacing={pacing!r} is invalid: expected a PacingConfig, a mapping of its fields, or None."
    )


class _Logger(Protocol):
    @property
    def log_dir(self) -> str | None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


class _Trainer(Protocol):
    @property
    def training(self) -> bool: ...
    @property
    def global_step(self) -> int: ...
    @property
    def default_root_dir(self) -> str: ...
    @property
    def logger(self) -> _Logger | None: ...
    @property
    def loggers(self) -> Sequence[_Logger]: ...


class _LightningModule(Protocol):
    @property
    def trainer(self) -> _Trainer: ...


class StrategyView(Protocol):
    """What :class:`StrategyPacing` reads from its strategy (any Lightning ``ParallelStrategy``)."""

    @property
    def lightning_module(self) -> _LightningModule | None: ...
    @property
    def model(self) -> nn.Module | None: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...


class StrategyPacing:
    """The pacing of one strategy: its validated config and, from setup to teardown, this rank's
    :class:`~pace_strategy.session.PacingSession`, driven by the strategy's step events.

    Args:
        pacing: the strategy's ``pacing=`` argument; validated here, in the constructor, so that bad
            configuration fails before any process starts.
        strategy: the strategy that holds this object.
    """

    def __init__(self, pacing: PacingArg, strategy: StrategyView) -> None:
        self.config = as_pacing_config(pacing)
        self.session: PacingSession | None = None  #: this rank's session, while one runs
        self._strategy = strategy

    def start(self) -> PacingSession:
        """Start this rank's session: collective on every rank (its own side group), with telemetry
        to the trainer's loggers and, on rank 0, the run record in the logger's directory."""
        strategy = self._strategy
        module = strategy.lightning_module
        assert module is not None, "a strategy is set up with its LightningModule"
        trainer = module.trainer
        session = PacingSession.with_side_group(
            self.config,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
            framework="lightning",
            log_dir=_log_dir(trainer) if strategy.global_rank == 0 else None,
            metrics_sink=_metrics_sink(trainer),
            node_rank=strategy.node_rank,
            local_rank=strategy.local_rank,
        )
        self.session = session
        if strategy.global_rank == 0:
            log.info(
                "pace_strategy: %s mode, exchange every %d steps, run record %s",
                self.config.mode,
                self.config.exchange_every_steps,
                session.record_path,
            )
        return session

    def attach_ddp(self, user_hook: UserCommHook) -> None:
        """Start the session and monitor the just-wrapped DDP model; the user's hook (if any) keeps
        doing the communication, on every device (CPU too)."""
        model = self._strategy.model
        assert isinstance(model, DistributedDataParallel), "configure_ddp has wrapped the model"
        inner_hook = user_hook.inner_hook()
        attach_paced_ddp(model, self.start().pacer, inner_hook, user_hook.state)

    def attach_fsdp(self) -> None:
        """Start the session and route every FSDP2 all-gather and reduce-scatter through the pacer."""
        from pace_strategy.hooks.fsdp import register_paced_collectives

        model = self._strategy.model
        assert model is not None, "ModelParallelStrategy.setup keeps the (sharded) model"
        register_paced_collectives(model, self.start().pacer)

    def _training(self) -> _Trainer | None:
        module = self._strategy.lightning_module
        if module is None or not module.trainer.training:
            return None
        return module.trainer

    def begin_step(self) -> None:
        """A training batch goes to the device: the step starts, at the trainer's global step."""
        if self.session is not None and (trainer := self._training()) is not None:
            self.session.pacer.begin_step(trainer.global_step)

    def time_dataloader(self, dataloader: object) -> None:
        """Count the time a training loader's iterators block as this rank's data wait."""
        if self._training() is not None:
            time_dataloader(dataloader, lambda: self.session)

    def end_step(self) -> None:
        """The optimizer stepped: the step ends (and a window may be exchanged)."""
        if self.session is not None:
            self.session.end_step()

    def interrupt(self) -> None:
        """Validation starts: the step in progress, if any, is not a training step."""
        if self.session is not None:
            self.session.pacer.interrupt()

    def finish(self) -> None:
        """Training ended normally: flush and close the session (collective on every rank)."""
        if self.session is not None:
            self.session.finish()

    def fail(self, error: BaseException) -> None:
        """Training raised: record the failure and close locally (no collective)."""
        if self.session is not None:
            self.session.fail(error)

    def close(self) -> None:
        """Teardown: close a session that training did not finish (stopped early, or never trained)."""
        if self.session is not None:
            self.session.close()
        self.session = None


@dataclass(frozen=True)
class UserCommHook:
    """A user's DDP communication hook, as ``DDPStrategy`` takes it (``ddp_comm_state``,
    ``ddp_comm_hook``, ``ddp_comm_wrapper``); the paced strategy registers it itself."""

    state: object = None
    hook: CommHook | None = None
    wrapper: CommHookWrapper | None = None

    def inner_hook(self) -> CommHook | None:
        """The hook that does the communication: ``wrapper(hook)`` when both are given."""
        if self.hook is not None and self.wrapper is not None:
            return self.wrapper(self.hook)
        return self.hook


def _log_dir(trainer: _Trainer) -> str:
    logger = trainer.logger
    if logger is not None and logger.log_dir:
        return str(logger.log_dir)
    return str(trainer.default_root_dir)


def _metrics_sink(trainer: _Trainer) -> MetricsSink | None:
    loggers = list(trainer.loggers)
    if not loggers:
        return None

    def sink(metrics: Mapping[str, float], step: int) -> None:
        for logger in loggers:
            logger.log_metrics(dict(metrics), step=step)

    return sink
