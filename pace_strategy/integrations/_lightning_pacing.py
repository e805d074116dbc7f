"""The session side of the paced Lightning strategies, for both ``lightning.pytorch`` and
``pytorch_lightning`` (imports neither): :class:`StrategyPacing` turns a strategy's step events
into calls on this rank's :class:`~pace_strategy.session.PacingSession`.

It reads its strategy through :class:`StrategyView`, a protocol of the few Lightning attributes
it needs: the concrete strategy classes pass themselves, so mypy checks each package's real types
against it.

Switching ``ddp`` for ``paced_ddp`` changes nothing a user can see but the ``pace/`` tags and the run
record, and those only where Lightning itself writes: no session under ``fast_dev_run`` or with one
process (unless a run directory is asked for), and the record in the logger's ``log_dir`` (see
:func:`_record_dir`). Two more things it does: checkpoints carry the pacing state under
``"pace_strategy"`` (restored by ``trainer.fit(ckpt_path=...)``), and SIGTERM during training is
handled without a collective in the signal handler (:meth:`StrategyPacing.guard_sigterm`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.state import CHECKPOINT_KEY
from pace_strategy.driver import PacingDriver
from pace_strategy.hooks.ddp import CommHook, attach_paced_ddp
from pace_strategy.integrations._preemption import SigtermHandler
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
from pace_strategy.telemetry.topology import mesh_coordinates

__all__ = [
    "CommHookWrapper",
    "RunDirArg",
    "StrategyPacing",
    "StrategyView",
    "UserCommHook",
]

log = logging.getLogger(__name__)

#: A DDP comm-hook wrapper (e.g. torch's ``fp16_compress_wrapper``): a hook in, a hook out.
CommHookWrapper: TypeAlias = Callable[[CommHook], CommHook]
#: What a strategy's ``run_dir=`` takes: the run record's directory, or None (see :func:`_record_dir`).
RunDirArg: TypeAlias = "str | os.PathLike[str] | None"


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


class StrategyPacing(PacingDriver):
    """The pacing of one strategy: a :class:`~pace_strategy.driver.PacingDriver` whose session runs
    from setup to teardown, driven by the strategy's step events (steps labelled by the trainer's
    global step).

    Args:
        pacing: the strategy's ``pacing=`` argument; validated here, in the constructor, so that bad
            configuration fails before any process starts.
        strategy: the strategy that holds this object.
        run_dir: the strategy's ``run_dir=`` argument: the run record's directory, before the
            logger's (see :func:`_record_dir`).
    """

    rebalance: DataRebalance | None  #: the rebalanced training data (``rebalance=True``, DDP only)

    def __init__(self, pacing: PacingArg, strategy: StrategyView, run_dir: RunDirArg = None) -> None:
        super().__init__(as_pacing_config(pacing))
        if run_dir is not None and (not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir)):
            raise PacingConfigError(
                f"run_dir={run_dir!r} is invalid: expected the path of a directory for the run record "
                "(a str or os.PathLike), or None for the logger's log_dir."
            )
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._strategy = strategy
        self.received_sigterm = False  #: SIGTERM arrived while this strategy trained
        self._sigterm: SigtermHandler | None = None
        self._sigterm_before: object = None  # the SIGTERM handler before Lightning installed its own

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
        if runs_alone(strategy.world_size, self.run_dir, record_alone=True, runs_as="running as plain DDP"):
            return None
        sink, unlock = loggers_sink(trainer.loggers if strategy.global_rank == 0 else ())
        self.on_detach(unlock)
        # the tags as often as the job's own metrics (Trainer(log_every_n_steps=...)) unless set
        self.config = self.config.tagging_every(getattr(trainer, "log_every_n_steps", 1))
        session = PacingSession.with_side_group(
            self.config,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
            framework="lightning",
            log_dir=_record_dir(trainer, self.run_dir) if strategy.global_rank == 0 else None,
            metrics_sink=sink,
            dashboard=custom_scalars_sink(lambda: tensorboard_loggers(trainer.loggers)),
            node_rank=strategy.node_rank,
            local_rank=strategy.local_rank,
            coordinates=_mesh_coordinates(strategy),
        )
        self.adopt(session)  # a checkpoint loaded first (DDP restores before setup) is restored now
        # Lightning installs its SIGTERM handler after setup, chaining what it finds; remember that.
        self._sigterm_before = signal.getsignal(signal.SIGTERM)
        if strategy.global_rank == 0:
            log.info(
                "pace_strategy: %s mode, exchange every %d steps, run record %s",
                self.config.mode,
                self.config.exchange_every_steps,
                session.record_path or "off",
            )
        return session

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, checkpoint: MutableMapping[str, Any]) -> None:
        """Add the pacing state to a checkpoint Lightning is about to write, under
        ``"pace_strategy"`` (every rank holds the same state; rank 0's file is the one written).
        Without a session, a state restored into this strategy is carried on unchanged."""
        step = checkpoint.get("global_step")
        state = self.state_dict(step if isinstance(step, int) else -1)
        if state:
            checkpoint[CHECKPOINT_KEY] = state

    def load_state(self, checkpoint: Mapping[str, Any], path: str | os.PathLike[str] | None) -> None:
        """A checkpoint was loaded (``trainer.fit(ckpt_path=...)``, before or after the session
        started): restore the pacing state from it, now or when the session starts. A checkpoint
        without ``"pace_strategy"`` (written by another strategy) restores nothing, with one info line."""
        state = checkpoint.get(CHECKPOINT_KEY)
        step = checkpoint.get("global_step")
        source = None if path is None else os.fspath(path)
        if state is None and self._strategy.global_rank == 0:
            log.info("pace_strategy: checkpoint %s has no pacing state: the controller starts fresh", source)
        self.load_state_dict(state, source=source, step=step if isinstance(step, int) else None)

    # ------------------------------------------------------------------ SIGTERM
    def guard_sigterm(self) -> None:
        """Training starts (Lightning has installed its SIGTERM handler): take SIGTERM over from it
        until teardown, without its collective.

        Lightning 2.6's handler broadcasts a tensor on the default process group *inside* the signal
        handler. When every rank is signalled (a scheduler's preemption), each rank runs that
        broadcast wherever the signal found it, one rank's broadcast meets the other's DDP
        all-reduce, and the job deadlocks until the process-group timeout (seen here with 2 gloo
        ranks; Lightning-AI/pytorch-lightning#20825 added the broadcast). This handler does the rest of
        what Lightning's does, locally: it forwards the signal to the launcher's child processes once,
        and sets the trainer's ``received_sigterm``, so that Lightning's own per-step check (a
        broadcast from rank 0 at the start of each step, in step order on every rank) stops every
        rank with ``SIGTERMException`` at the same step. A handler that was installed before
        Lightning's still runs after ours, as under Lightning.
        """
        if self.session is None or self._strategy.world_size < 2 or self._sigterm is not None:
            return
        before = self._sigterm_before
        self._sigterm = SigtermHandler(
            self._on_sigterm, chain_to=before if callable(before) else signal.SIG_IGN
        )
        self._sigterm.install()

    def _on_sigterm(self, signum: int) -> None:
        self.received_sigterm = True
        module = self._strategy.lightning_module
        trainer: Any = None if module is None else module.trainer
        # The one place Lightning's private signal connector is touched: Trainer.received_sigterm is
        # read-only. tests/integration/test_preempt_resume.py fails when it moves.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None or not connector.received_sigterm:
            launcher: Any = getattr(self._strategy, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)  # the popen launcher's children, as Lightning's handler does
            log.info(
                "[rank %d/%d] pace_strategy: SIGTERM: training stops at Lightning's next step check",
                self._strategy.global_rank,
                self._strategy.world_size,
            )
        if connector is not None:
            connector.received_sigterm = True

    def attach_ddp(self, user_hook: UserCommHook) -> None:
        """Start the session and monitor the just-wrapped DDP model; the user's hook (if any) keeps
        doing the communication, on every device (CPU too), with or without a session."""
        model = self._strategy.model
        assert isinstance(model, DistributedDataParallel), "configure_ddp has wrapped the model"
        inner_hook = user_hook.inner_hook()
        session = self.start()
        if session is not None:
            attach_paced_ddp(model, session.pacer, inner_hook, user_hook.state)
            if self.config.splits_batches:
                self.rebalance = self._data_rebalance(session)
                session.state.register(STATE_NAME, self.rebalance)
        elif inner_hook is not None:
            model.register_comm_hook(state=user_hook.state, hook=inner_hook)

    def attach_fsdp(self) -> None:
        """Start the session and route every FSDP2 all-gather and reduce-scatter through the pacer
        (without a session, FSDP2 runs untouched)."""
        from pace_strategy.hooks.fsdp import register_paced_collectives

        model = self._strategy.model
        assert model is not None, "ModelParallelStrategy.setup keeps the (sharded) model"
        if self.config.splits_batches:
            raise PacingConfigError(
                "rebalance=True and balance=True are supported with paced_ddp (and paced_ddp_spawn), not "
                "paced_fsdp yet; use paced_ddp or set them off."
            )
        session = self.start()
        if session is not None:
            register_paced_collectives(model, session.pacer)

    def _data_rebalance(self, session: PacingSession) -> DataRebalance:
        module = self._strategy.lightning_module
        assert module is not None, "a strategy is set up with its LightningModule"
        trainer = module.trainer
        return DataRebalance(
            session.pacer,
            self._strategy.global_rank,
            self._strategy.world_size,
            step_source=lambda: trainer.global_step,
            framework_prefetch=1,  # the fit loop's data fetcher holds one batch ahead
            micro_batches=int(getattr(trainer, "accumulate_grad_batches", 1)),
            balance=self.config.balance,
        )

    def prepare_dataloader(self, dataloader: object) -> object:
        """The training loader, rebuilt around the rebalancing batch sampler when rebalancing (the
        loaders of validation and the others are left as they are)."""
        if self.rebalance is not None and self._training() is not None:
            return self.rebalance.replace(dataloader)
        return dataloader

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the strategy backwards: times this rank's share factor while rebalancing
        (:func:`~pace_strategy.data.share_loss_scale`), else ``loss`` itself."""
        if self.rebalance is not None and self._training() is not None:
            return self.rebalance.scale(loss)
        return loss

    def _training(self) -> _Trainer | None:
        module = self._strategy.lightning_module
        if module is None or not module.trainer.training:
            return None
        return module.trainer

    def begin_batch(self, batch: Any = None) -> None:
        """A training batch goes to the device: the step starts, at the trainer's global step (a
        batch of validation or the others begins nothing), and takes the batch's tokens (its
        ``input_ids``, where it has them; summed over an accumulated step's micro-batches)."""
        if (trainer := self._training()) is not None:
            self.begin_step(trainer.global_step)
            tokens = forward_tokens((batch,), {})
            if tokens and self.session is not None:
                self.session.pacer.add_tokens(tokens)

    def time_dataloader(self, dataloader: object) -> None:
        """Count the time a training loader's iterators block as this rank's data wait (only while
        a session runs: otherwise the loader is left as it is)."""
        if self.session is not None and self._training() is not None:
            self.session.note_dataloader_workers(loader_workers(dataloader))
            time_dataloader(dataloader, lambda: self.session)

    def fail(self, error: BaseException) -> None:
        """Training raised: record the failure and close locally (no collective). After a SIGTERM
        (Lightning's ``SIGTERMException``, or any error once the signal came: a peer that stopped
        first), the record is closed as ``terminated`` instead."""
        if self.session is not None and (self.received_sigterm or type(error).__name__ == "SIGTERMException"):
            self.session.terminate(f"SIGTERM ({type(error).__name__} in training)")
        else:
            super().fail(error)

    def close(self) -> None:
        """Teardown: close a session that training did not finish (stopped early, or never trained),
        and give SIGTERM back to Lightning's handler."""
        if self._sigterm is not None:
            self._sigterm.remove()
            self._sigterm = None
        if self.session is not None:
            self.session.close()
        self.session = None
        self._loaded = None


@dataclass(frozen=True)
class UserCommHook:
    """A user's DDP communication hook, as ``DDPStrategy`` takes it (``ddp_comm_state``,
    ``ddp_comm_hook``, ``ddp_comm_wrapper``); the paced strategy registers it itself."""

    state: object = None
    hook: CommHook | None = None
    wrapper: CommHookWrapper | None = None

    @classmethod
    def take(cls, arguments: MutableMapping[str, Any]) -> UserCommHook:
        """The hook named in a ``DDPStrategy``'s bound ``arguments``, removed from them."""
        return cls(
            *(arguments.pop(name, None) for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"))
        )

    def inner_hook(self) -> CommHook | None:
        """The hook that does the communication: ``wrapper(hook)`` when both are given."""
        if self.hook is not None and self.wrapper is not None:
            return self.wrapper(self.hook)
        return self.hook


def _mesh_coordinates(strategy: Any) -> dict[str, int] | None:
    """This rank's coordinates in the strategy's device mesh (``paced_fsdp``: Lightning's
    ModelParallelStrategy, ``data_parallel`` x ``tensor_parallel``), or ``None`` (DDP has none).

    A ``configure_model`` that shards over a mesh of its own with a replicate dimension (HSDP: its
    dimensions named ``dp_replicate`` and ``dp_shard``, as torchtitan names them) trains on that
    mesh, not the strategy's: its coordinates are recorded, read from the sharded parameters."""
    if not isinstance(getattr(type(strategy), "device_mesh", None), property):
        return None
    try:
        mesh = strategy.device_mesh
    except RuntimeError:  # Lightning raises while the mesh is not built yet
        return None
    sharded = _parameter_mesh(getattr(strategy, "model", None))
    if sharded is not None and "dp_replicate" in (getattr(sharded, "mesh_dim_names", None) or ()):
        mesh = sharded
    return mesh_coordinates(mesh)


def _parameter_mesh(model: Any) -> Any | None:
    """The device mesh the model's first sharded parameter (a ``DTensor``) lives on, if any."""
    from torch.distributed.tensor import DTensor

    parameters = model.parameters() if model is not None else ()
    return next((p.device_mesh for p in parameters if isinstance(p, DTensor)), None)


def _record_dir(trainer: _Trainer, run_dir: Path | None) -> Path | None:
    """Where rank 0's run record goes: ``run_dir=`` > the logger's ``log_dir`` (where Lightning
    writes the logger's own files) > ``$PACE_RUN_DIR`` > ``./pace_runs/<date-time>`` for a logger
    without a directory (W&B, MLflow) > nowhere (``logger=False``: no record, as ``ddp`` writes no
    log files). Explicit arguments beat the environment, as in ``attach_pacing``
    (:func:`~pace_strategy.integrations.env.logger_record_dir`).

    Reading ``log_dir`` creates nothing (TensorBoardLogger and CSVLogger make it at their first
    write); the record itself is created at its first write too.
    """
    return logger_record_dir(run_dir, trainer.logger)
