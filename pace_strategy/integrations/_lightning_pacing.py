"""The session side of the paced Lightning strategies, for both ``lightning.pytorch`` and
``pytorch_lightning`` (imports neither): :class:`StrategyPacing` turns a strategy's step events
into calls on this rank's :class:`~pace_strategy.session.PacingSession`.

It reads its strategy through :class:`StrategyView`, a protocol of the few Lightning attributes
it needs: the concrete strategy classes pass themselves, so mypy checks each package's real types
against it.

Switching ``ddp`` for ``paced_ddp`` changes nothing a user can see but the ``pace/`` tags and the run
record, and those only where Lightning itself writes: no session under ``fast_dev_run`` or with one
process (unless a run directory is asked for), and the record in the logger's ``log_dir`` (see
:func:`_record_dir`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.hooks.ddp import CommHook, attach_paced_ddp
from pace_strategy.integrations.accelerate.env import RUN_DIR_ENV, run_dir_from_env
from pace_strategy.integrations.data import loader_workers, time_dataloader
from pace_strategy.session import MetricsSink, PacingSession

__all__ = [
    "CommHookWrapper",
    "PacingArg",
    "RunDirArg",
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
#: What a strategy's ``run_dir=`` takes: the run record's directory, or None (see :func:`_record_dir`).
RunDirArg: TypeAlias = "str | os.PathLike[str] | None"


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
        run_dir: the strategy's ``run_dir=`` argument: the run record's directory, before the
            logger's (see :func:`_record_dir`).
    """

    def __init__(self, pacing: PacingArg, strategy: StrategyView, run_dir: RunDirArg = None) -> None:
        self.config = as_pacing_config(pacing)
        if run_dir is not None and (not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir)):
            raise PacingConfigError(
                f"run_dir={run_dir!r} is invalid: expected the path of a directory for the run record "
                "(a str or os.PathLike), or None for the logger's log_dir."
            )
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.session: PacingSession | None = None  #: this rank's session, while one runs
        self._strategy = strategy

    def start(self) -> PacingSession | None:
        """Start this rank's session: collective on every rank (its own side group), with telemetry
        to the trainer's loggers and, on rank 0, the run record in :func:`_record_dir`.

        No session (``None``, on every rank alike) under ``fast_dev_run``, or with a single process
        and no run directory asked for: there is no skew to see, and nothing may be written.
        """
        strategy = self._strategy
        module = strategy.lightning_module
        assert module is not None, "a strategy is set up with its LightningModule"
        trainer = module.trainer
        # Lightning sets fast_dev_run on the Trainer in a connector; mypy does not see it declared.
        if getattr(trainer, "fast_dev_run", False):
            log.info("pace_strategy: fast_dev_run: no monitoring, nothing written")
            return None
        if strategy.world_size < 2 and self.run_dir is None and run_dir_from_env() is None:
            log.info(
                "pace_strategy: a single process has no skew to monitor; running as plain DDP "
                "(pass run_dir= or set %s for a run record anyway)",
                RUN_DIR_ENV,
            )
            return None
        session = PacingSession.with_side_group(
            self.config,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
            framework="lightning",
            log_dir=_record_dir(trainer, self.run_dir) if strategy.global_rank == 0 else None,
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
                session.record_path or "off",
            )
        return session

    def attach_ddp(self, user_hook: UserCommHook) -> None:
        """Start the session and monitor the just-wrapped DDP model; the user's hook (if any) keeps
        doing the communication, on every device (CPU too), with or without a session."""
        model = self._strategy.model
        assert isinstance(model, DistributedDataParallel), "configure_ddp has wrapped the model"
        inner_hook = user_hook.inner_hook()
        session = self.start()
        if session is not None:
            attach_paced_ddp(model, session.pacer, inner_hook, user_hook.state)
        elif inner_hook is not None:
            model.register_comm_hook(state=user_hook.state, hook=inner_hook)

    def attach_fsdp(self) -> None:
        """Start the session and route every FSDP2 all-gather and reduce-scatter through the pacer
        (without a session, FSDP2 runs untouched)."""
        from pace_strategy.hooks.fsdp import register_paced_collectives

        model = self._strategy.model
        assert model is not None, "ModelParallelStrategy.setup keeps the (sharded) model"
        session = self.start()
        if session is not None:
            register_paced_collectives(model, session.pacer)

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
        """Count the time a training loader's iterators block as this rank's data wait (only while
        a session runs: otherwise the loader is left as it is)."""
        if self.session is not None and self._training() is not None:
            self.session.note_dataloader_workers(loader_workers(dataloader))
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


def _record_dir(trainer: _Trainer, run_dir: Path | None) -> Path | None:
    """Where rank 0's run record goes: ``run_dir=`` > the logger's ``log_dir`` (where Lightning
    writes the logger's own files) > ``$PACE_RUN_DIR`` > nowhere (``logger=False``: no record, as
    ``ddp`` writes no log files). Explicit arguments beat the environment, as in ``attach_pacing``.

    Reading ``log_dir`` creates nothing (TensorBoardLogger and CSVLogger make it at their first
    write); the record itself is created at its first write too.
    """
    if run_dir is not None:
        return run_dir
    logger = trainer.logger
    if logger is not None and logger.log_dir:
        return Path(logger.log_dir)
    return run_dir_from_env()


def _metrics_sink(trainer: _Trainer) -> MetricsSink | None:
    loggers = list(trainer.loggers)
    if not loggers:
        return None

    def sink(metrics: Mapping[str, float], step: int) -> None:
        for logger in loggers:
            logger.log_metrics(dict(metrics), step=step)

    return sink
