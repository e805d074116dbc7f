"""Lightning adapter: ``paced_ddp`` / ``paced_ddp_spawn`` strategies and the straggler-injection callback.

The strategy is one subclass below Lightning's ``DDPStrategy``; everything it adds is forwarding of
step events to a :class:`~pace_strategy.session.PacingSession`. The same body serves
``lightning.pytorch`` and the standalone ``pytorch_lightning`` package (their classes differ).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.hooks.ddp import register_paced_hook
from pace_strategy.inject import Straggler, sleep_injected
from pace_strategy.integrations.data import time_dataloader
from pace_strategy.session import PacingSession

log = logging.getLogger(__name__)

__all__ = ["InjectStraggler", "PacedDDPStrategy", "register_lightning_strategies"]

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


class _PacedDDPBody:
    """Methods shared by the ``lightning.pytorch`` and ``pytorch_lightning`` strategy classes."""

    # Declared for the type checker; provided by DDPStrategy.
    model: Any
    lightning_module: Any
    root_device: Any
    global_rank: int
    world_size: int
    node_rank: int
    local_rank: int
    _ddp_comm_hook: Any
    _ddp_comm_state: Any
    _ddp_comm_wrapper: Any

    def _init_pacing(self, pacing: PacingConfig | Mapping[str, Any] | None) -> None:
        # Validated here, in the constructor: bad configuration fails before any process starts.
        self.pacing_config = _as_config(pacing)
        self.pacing_session: PacingSession | None = None

    def _register_ddp_hooks(self) -> None:
        # Stock DDPStrategy registers comm hooks on CUDA only and silently drops them on CPU; ours is
        # registered on every device, wrapping the user's hook (or the default all-reduce).
        inner_hook = self._ddp_comm_hook
        if inner_hook is not None and self._ddp_comm_wrapper is not None:
            inner_hook = self._ddp_comm_wrapper(inner_hook)
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
        register_paced_hook(self.model, session.pacer, inner_hook, self._ddp_comm_state)
        if self.global_rank == 0:
            log.info(
                "pace_strategy: %s mode, exchange every %d steps, run record %s",
                self.pacing_config.mode,
                self.pacing_config.exchange_every_steps,
                session.record_path,
            )

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


def _make_strategy_class(pl_module: str) -> Any:
    strategies = importlib.import_module(f"{pl_module}.strategies")
    ddp_cls = strategies.DDPStrategy

    class PacedDDPStrategy(_PacedDDPBody, ddp_cls):  # type: ignore[valid-type, misc]
        """Lightning ``DDPStrategy`` with barrier-arrival skew monitoring and adaptive pacing.

        Args:
            pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None`` for
                the defaults. Every other argument is ``DDPStrategy``'s; a ``ddp_comm_hook`` is kept
                and runs inside the pacing hook.
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

    PacedDDPStrategy.__module__ = __name__
    PacedDDPStrategy.__qualname__ = (
        "PacedDDPStrategy" if pl_module == "lightning.pytorch" else ("PLPacedDDPStrategy")
    )
    return PacedDDPStrategy


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


PacedDDPStrategy = _make_strategy_class("lightning.pytorch")
InjectStraggler = _make_inject_callback("lightning.pytorch")

try:  # the standalone package, when installed, gets its own classes
    PLPacedDDPStrategy: Any = _make_strategy_class("pytorch_lightning")
    PLInjectStraggler: Any = _make_inject_callback("pytorch_lightning")
except ImportError:
    PLPacedDDPStrategy = None
    PLInjectStraggler = None


def register_lightning_strategies() -> list[str]:
    """Register the paced strategies in ``lightning.pytorch`` (and ``pytorch_lightning``); idempotent."""
    from lightning.pytorch.strategies import StrategyRegistry

    PacedDDPStrategy.register_strategies(StrategyRegistry)
    packages = ["lightning.pytorch"]
    if PLPacedDDPStrategy is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PLStrategyRegistry

        PLPacedDDPStrategy.register_strategies(PLStrategyRegistry)
        packages.append("pytorch_lightning")
    return packages
