"""Lightning adapter: ``paced_ddp`` / ``paced_ddp_spawn`` / ``paced_fsdp`` and the straggler callback.

Each strategy is one subclass below Lightning's own (``DDPStrategy``, ``ModelParallelStrategy`` for
FSDP2); everything it adds is forwarding of step events to a
:class:`~pace_strategy.session.PacingSession`. The same body serves
``lightning.pytorch`` and the standalone ``pytorch_lightning`` package (their classes differ).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.hooks.ddp import attach_paced_ddp
from pace_strategy.inject import Straggler, sleep_injected
from pace_strategy.integrations.data import time_dataloader
from pace_strategy.session import PacingSession

log = logging.getLogger(__name__)

__all__ = ["InjectStraggler", "PacedDDPStrategy", "PacedFSDPStrategy", "register_lightning_strategies"]

#: (registry name, start method) of every strategy registered on import.
STRATEGY_NAMES: tuple[tuple[str, str], ...] = (("paced_ddp", "popen"), ("paced_ddp_spawn", "spawn"))


def _as_config(pacing: PacingConfig | Mapping[str, Any] | None) -> PacingConfig:
    if pacing is None:
        return PacingConfig()
    if isinstance(pacing, PacingConfig):
        return pacing
    if isinstance(pacing, Mapping):
        return PacingConfig.from_dict(pacing)
    raise PacingConfigError(
        f"pacing={pacing!r} is invalid: expected a PacingConfig, a mapping of its fields, or None."
    )


class _PacedBody:
    """Step events -> PacingSession; shared by every paced strategy of both Lightning packages."""

    # Declared for the type checker; provided by Lightning's strategies.
    model: Any
    lightning_module: Any
    root_device: Any
    global_rank: int
    world_size: int
    node_rank: int
    local_rank: int

    def _init_pacing(self, pacing: PacingConfig | Mapping[str, Any] | None) -> None:
        # Validated here, in the constructor: bad configuration fails before any process starts.
        self.pacing_config = _as_config(pacing)
        self.pacing_session: PacingSession | None = None

    def _start_session(self) -> PacingSession:
        """Collective on every rank: the session on its own side group, telemetry to the loggers."""
        trainer = self.lightning_module.trainer
        session = PacingSession.with_side_group(
            self.pacing_config,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            framework="lightning",
            log_dir=_log_dir(trainer) if self.global_rank == 0 else None,
            metrics_sink=_metrics_sink(trainer),
            node_rank=self.node_rank,
            local_rank=self.local_rank,
        )
        self.pacing_session = session
        if self.global_rank == 0:
            log.info(
                "pace_strategy: %s mode, exchange every %d steps, run record %s",
                self.pacing_config.mode,
                self.pacing_config.exchange_every_steps,
                session.record_path,
            )
        return session

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        session = self.pacing_session
        if session is not None and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            if trainer.training:
                session.pacer.begin_step(trainer.global_step)
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = self.lightning_module
        if module is not None and module.trainer.training:
            time_dataloader(dataloader, lambda: self.pacing_session)
        return dataloader

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        if self.pacing_session is not None:
            self.pacing_session.end_step()
        return output

    def on_validation_start(self) -> None:
        if self.pacing_session is not None:
            self.pacing_session.pacer.interrupt()
        super().on_validation_start()  # type: ignore[misc]

    def on_train_end(self) -> None:
        if self.pacing_session is not None:
            self.pacing_session.finish()
        super().on_train_end()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        if self.pacing_session is not None:
            self.pacing_session.fail(exception)
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        if self.pacing_session is not None:
            # Teardown without on_train_end (fit stopped early, or never trained): close locally.
            self.pacing_session.close()
        self.pacing_session = None
        super().teardown()  # type: ignore[misc]


class _PacedDDPBody(_PacedBody):
    """DDP: the monitor of ``ddp_monitor`` (see :func:`~pace_strategy.hooks.ddp.attach_paced_ddp`);
    a user's ``ddp_comm_hook`` keeps doing the communication."""

    _ddp_comm_hook: Any
    _ddp_comm_state: Any
    _ddp_comm_wrapper: Any

    def _register_ddp_hooks(self) -> None:
        # Stock DDPStrategy registers comm hooks on CUDA only and silently drops them on CPU; the
        # user's hook is registered here on every device (wrapped by ours with ddp_monitor=comm_hook).
        inner_hook = self._ddp_comm_hook
        if inner_hook is not None and self._ddp_comm_wrapper is not None:
            inner_hook = self._ddp_comm_wrapper(inner_hook)
        session = self._start_session()
        attach_paced_ddp(self.model, session.pacer, inner_hook, self._ddp_comm_state)


class _PacedFSDPBody(_PacedBody):
    """FSDP2 on Lightning's ``ModelParallelStrategy`` (data parallel only by default): every
    all-gather and reduce-scatter is timed, and the model is sharded for the user when
    ``configure_model`` did not do it."""

    _data_parallel_size: Any
    _tensor_parallel_size: Any
    device_mesh: Any
    num_nodes: int
    num_processes: int

    def _init_sharding(self, auto_shard_min_params: int, auto_shard_classes: Sequence[type]) -> None:
        if not isinstance(auto_shard_min_params, int) or auto_shard_min_params < 1:
            raise PacingConfigError(
                f"auto_shard_min_params={auto_shard_min_params!r} is invalid: expected an integer >= 1 "
                "(parameters a block must hold to become its own FSDP shard group)."
            )
        self.auto_shard_min_params = auto_shard_min_params
        self.auto_shard_classes = tuple(auto_shard_classes)
        self.shard_groups: list[str] | None = None  #: what auto-sharding chose (None: the user sharded)

    def setup_environment(self) -> None:
        # Pure data parallelism unless asked otherwise: the whole world is one FSDP shard dimension.
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()  # type: ignore[misc]
        module = self.lightning_module
        if module is not None and not _overrides_configure_model(module):
            # ModelParallelStrategy requires configure_model; a module without one is sharded by
            # auto_shard, called where Lightning calls configure_model (inside its init contexts).
            # An instance attribute, removed at teardown; the user's class is untouched.
            module.configure_model = self._shard_if_needed

    def _shard_if_needed(self) -> None:
        """Shard each top-level submodule of the LightningModule with auto_shard, unless something
        already is. The LightningModule itself is not sharded: ``training_step`` calls its submodules,
        never its own ``forward``, so a group on it would never gather."""
        from pace_strategy.hooks.fsdp import auto_shard, fsdp_modules

        module = self.lightning_module
        if fsdp_modules(module):
            return
        if any(True for _ in module.parameters(recurse=False)):
            raise PacingConfigError(
                f"paced_fsdp cannot auto-shard {type(module).__name__}: it holds parameters directly. "
                "Move them into a submodule, or shard the model yourself in configure_model "
                "(fully_shard or pace_strategy.auto_shard)."
            )
        groups: list[str] = []
        for name, child in module.named_children():
            if any(True for _ in child.parameters()):
                chosen = auto_shard(
                    child,
                    self.device_mesh["data_parallel"],
                    min_params=self.auto_shard_min_params,
                    module_classes=self.auto_shard_classes,
                )
                groups += [f"{name}.{g}" if g else name for g in chosen]
        self.shard_groups = groups
        if self.global_rank == 0:
            log.info("pace_strategy: auto-sharded into %d FSDP groups: %s", len(groups), groups)

    def setup(self, trainer: Any) -> None:
        from pace_strategy.hooks.fsdp import register_paced_collectives

        self._shard_if_needed()  # a configure_model that did not call fully_shard
        super().setup(trainer)  # type: ignore[misc]
        session = self._start_session()
        register_paced_collectives(self.model, session.pacer)

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            module.__dict__.pop("configure_model", None)
        super().teardown()


def _overrides_configure_model(module: Any) -> bool:
    """Whether the user's LightningModule (its class or the instance) defines ``configure_model``."""
    if "configure_model" in vars(module):
        return True
    definer = next(c for c in type(module).__mro__ if "configure_model" in vars(c))
    return not definer.__module__.startswith(("lightning.pytorch.", "pytorch_lightning."))


def _log_dir(trainer: Any) -> str:
    logger = trainer.logger
    if logger is not None and getattr(logger, "log_dir", None):
        return str(logger.log_dir)
    return str(trainer.default_root_dir)


def _metrics_sink(trainer: Any) -> Any:
    loggers = list(trainer.loggers)
    if not loggers:
        return None

    def sink(metrics: Mapping[str, float], step: int) -> None:
        for logger in loggers:
            logger.log_metrics(dict(metrics), step=step)

    return sink


def _make_strategy_classes(pl_module: str) -> tuple[Any, Any]:
    """``(PacedDDPStrategy, PacedFSDPStrategy)`` built on ``pl_module``'s own strategy classes."""
    strategies = importlib.import_module(f"{pl_module}.strategies")
    ddp_cls = strategies.DDPStrategy
    fsdp_cls = strategies.ModelParallelStrategy
    prefix = "" if pl_module == "lightning.pytorch" else "PL"

    class PacedDDPStrategy(_PacedDDPBody, ddp_cls):  # type: ignore[valid-type, misc]
        """Lightning ``DDPStrategy`` with barrier-arrival skew monitoring and adaptive pacing.

        Args:
            pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None`` for
                the defaults. Every other argument is ``DDPStrategy``'s; a ``ddp_comm_hook`` is kept
                (registered on every device, CPU too) and does the communication.
        """

        strategy_name = "paced_ddp"

        def __init__(self, *args: Any, pacing: PacingConfig | Mapping[str, Any] | None = None, **kwargs: Any):
            self._init_pacing(pacing)
            super().__init__(*args, **kwargs)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            for name, start_method in STRATEGY_NAMES:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"DDP with skew monitoring and adaptive pacing ({start_method!r} start)",
                    override=True,
                    start_method=start_method,
                )

    class PacedFSDPStrategy(_PacedFSDPBody, fsdp_cls):  # type: ignore[valid-type, misc]
        """FSDP2 (``fully_shard``) with skew monitoring and adaptive pacing, on Lightning's
        ``ModelParallelStrategy``.

        Every forward/backward all-gather and every gradient reduce-scatter is timed; the pacing delay
        goes before the step's first collective. When the LightningModule's ``configure_model`` does
        not call ``fully_shard`` (or there is none), the model is sharded by
        :func:`pace_strategy.auto_shard`.

        Args:
            pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None``.
            auto_shard_min_params: parameters a block must hold to become its own shard group.
            auto_shard_classes: module classes that are each a shard group (overrides the size rule).
            data_parallel_size: FSDP shard dimension; ``"auto"`` = world size / tensor parallel size.
            tensor_parallel_size: ``"auto"`` means 1 here (pure data parallelism).
            **kwargs: ``ModelParallelStrategy``'s other arguments.
        """

        strategy_name = "paced_fsdp"

        def __init__(
            self,
            *,
            pacing: PacingConfig | Mapping[str, Any] | None = None,
            auto_shard_min_params: int = 100_000,
            auto_shard_classes: Sequence[type] = (),
            **kwargs: Any,
        ):
            self._init_pacing(pacing)
            self._init_sharding(auto_shard_min_params, auto_shard_classes)
            super().__init__(**kwargs)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register(
                "paced_fsdp",
                cls,
                description="FSDP2 with skew monitoring and adaptive pacing, auto-sharded when needed",
                override=True,
            )

    for cls, name in ((PacedDDPStrategy, "PacedDDPStrategy"), (PacedFSDPStrategy, "PacedFSDPStrategy")):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__ = prefix + name
    return PacedDDPStrategy, PacedFSDPStrategy


def _make_inject_callback(pl_module: str) -> Any:
    callback_cls = importlib.import_module(pl_module).Callback

    class InjectStraggler(callback_cls):  # type: ignore[valid-type, misc]
        """Sleep on the chosen ranks at the start of each training batch (inside the measured compute).

        Args:
            stragglers: the injections (see :class:`pace_strategy.inject.Straggler`).
        """

        def __init__(self, stragglers: Sequence[Straggler] | Straggler) -> None:
            self.stragglers = (stragglers,) if isinstance(stragglers, Straggler) else tuple(stragglers)
            self.injected_ms = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.injected_ms += sleep_injected(self.stragglers, trainer.global_rank, trainer.global_step)

    InjectStraggler.__module__ = __name__
    InjectStraggler.__qualname__ = (
        "InjectStraggler" if pl_module == "lightning.pytorch" else ("PLInjectStraggler")
    )
    return InjectStraggler


PacedDDPStrategy, PacedFSDPStrategy = _make_strategy_classes("lightning.pytorch")
InjectStraggler = _make_inject_callback("lightning.pytorch")

try:  # the standalone package, when installed, gets its own classes
    PLPacedDDPStrategy, PLPacedFSDPStrategy = _make_strategy_classes("pytorch_lightning")
    PLInjectStraggler: Any = _make_inject_callback("pytorch_lightning")
except ImportError:
    PLPacedDDPStrategy = PLPacedFSDPStrategy = None
    PLInjectStraggler = None


def register_lightning_strategies() -> list[str]:
    """Register the paced strategies in ``lightning.pytorch`` (and ``pytorch_lightning``); idempotent."""
    from lightning.pytorch.strategies import StrategyRegistry

    PacedDDPStrategy.register_strategies(StrategyRegistry)
    PacedFSDPStrategy.register_strategies(StrategyRegistry)
    packages = ["lightning.pytorch"]
    if PLPacedDDPStrategy is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PLStrategyRegistry

        PLPacedDDPStrategy.register_strategies(PLStrategyRegistry)
        PLPacedFSDPStrategy.register_strategies(PLStrategyRegistry)
        packages.append("pytorch_lightning")
    return packages
