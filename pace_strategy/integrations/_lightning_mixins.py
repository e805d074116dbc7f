"""The mixins of the paced Lightning strategies, for both ``lightning.pytorch`` and
``pytorch_lightning`` (imports neither): each Lightning hook becomes a call on the strategy's
:class:`~pace_strategy.integrations._lightning_pacing.StrategyPacing` (and, for FSDP, its
:class:`~pace_strategy.integrations._lightning_fsdp.FSDPSharding`), then Lightning's own.

A package's module declares its classes as ``class PacedDDPStrategy(PacedDDPMixin, DDPStrategy)``,
whose constructor sets the objects the mixin uses. The mixins are typed against protocols of the
Lightning methods they extend: only for the type checker (at run time they derive from ``object``,
and ``super()`` reaches the Lightning class), so that mypy checks every ``@override`` against the
protocol and, in each concrete class, the mixin against that package's real methods.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from pace_strategy.core.config import PacingConfig
from pace_strategy.integrations._arguments import parent_arguments
from pace_strategy.integrations._lightning_fsdp import FSDPSharding, FSDPStrategyView
from pace_strategy.integrations._lightning_pacing import RunDirArg, StrategyPacing, StrategyView, UserCommHook
from pace_strategy.integrations.env import PacingArg
from pace_strategy.session import PacingSession

__all__ = [
    "PacedDDPMixin",
    "PacedFSDPMixin",
    "PacedStrategyMixin",
    "StrategyRegistry",
    "register_paced_ddp",
]

#: (registry name, start method) of the paced DDP strategies.
DDP_STRATEGY_NAMES: tuple[tuple[str, str], ...] = (
    ("paced_ddp", "popen"),
    ("paced_ddp_spawn", "spawn"),
    ("paced_ddp_fork", "fork"),
)


def register_paced_ddp(strategy_registry: StrategyRegistry, strategy: type) -> None:
    """Register ``strategy`` as ``paced_ddp`` (popen start), ``paced_ddp_spawn`` (spawn start) and
    ``paced_ddp_fork`` (fork start, as Lightning's ``ddp_fork``: CPU, or CUDA not yet initialized), as a
    Lightning Trainer's or Fabric's strategy registry takes it."""
    for name, start_method in DDP_STRATEGY_NAMES:
        strategy_registry.register(
            name,
            strategy,
            description=f"DDP with skew monitoring and adaptive pacing ({start_method!r} start)",
            override=True,
            start_method=start_method,
        )


class StrategyRegistry(Protocol):
    """Lightning's ``StrategyRegistry`` (``_StrategyRegistry`` in both packages)."""

    def register(
        self,
        name: str,
        strategy: Callable[..., Any] | None = None,
        description: str | None = None,
        override: bool = False,
        **init_params: Any,
    ) -> Callable[..., Any]: ...


class _StrategyHooks(Protocol):
    """The methods of Lightning's ``Strategy`` that :class:`PacedStrategyMixin` extends."""

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any: ...
    def process_dataloader(self, dataloader: object) -> object: ...
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor: ...
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any: ...
    def on_validation_start(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None: ...
    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]: ...
    def on_exception(self, exception: BaseException) -> None: ...
    def teardown(self) -> None: ...


class _DDPHooks(Protocol):
    """The methods of Lightning's ``DDPStrategy`` that :class:`PacedDDPMixin` extends."""

    def configure_ddp(self) -> None: ...
    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None: ...


class _FSDPHooks(Protocol):
    """The methods of Lightning's ``ModelParallelStrategy`` that :class:`PacedFSDPMixin` extends."""

    def setup_environment(self) -> None: ...
    def setup(self, trainer: object) -> None: ...  # the trainer of the strategy's own package
    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None: ...


if TYPE_CHECKING:
    _StrategyBase = _StrategyHooks
    _DDPBase = _DDPHooks
    _FSDPBase = _FSDPHooks
else:
    _StrategyBase = _DDPBase = _FSDPBase = object


def lightning_init(cls: type, mixin: type) -> Callable[..., Any]:
    """The constructor of the Lightning strategy class that follows ``mixin`` in ``cls``'s bases
    (``DDPStrategy`` or ``ModelParallelStrategy``, of whichever package the concrete class is built
    on): the arguments the paced strategy takes, in their positions."""
    mro = cls.__mro__
    for parent in mro[mro.index(mixin) + 1 :]:
        if parent.__module__.split(".")[0] in ("lightning", "pytorch_lightning"):
            init: Callable[..., Any] = parent.__init__  # type: ignore[misc]  # a class's, read as such
            return init
    raise TypeError(f"{cls.__name__} has no Lightning strategy after {mixin.__name__} in its bases")


class PacedStrategyMixin(_StrategyBase):
    """Step events -> :attr:`pacing`; shared by every paced strategy of both Lightning packages.

    Goes before the Lightning strategy class in the bases; the DDP and FSDP mixins' constructors set
    :attr:`pacing`.
    """

    pacing: StrategyPacing

    @property
    def pacing_config(self) -> PacingConfig:
        """The validated pacing configuration."""
        return self.pacing.config

    @property
    def pacing_session(self) -> PacingSession | None:
        """This rank's session, from setup to teardown."""
        return self.pacing.session

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # The last strategy event before the batch's compute: the step starts here.
        self.pacing.begin_batch(batch)
        return cast(_StrategyHooks, super()).batch_to_device(batch, device, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = cast(_StrategyHooks, super()).process_dataloader(dataloader)
        dataloader = self.pacing.prepare_dataloader(dataloader)  # rebalancing's batch sampler
        self.pacing.time_dataloader(dataloader)
        return dataloader

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Automatic and manual optimization both backward through here: the one place to scale the
        # loss by the rank's share when rebalancing (the loss the module logs stays its own).
        scaled = self.pacing.scale_loss(closure_loss)
        output = cast(_StrategyHooks, super()).backward(scaled, optimizer, *args, **kwargs)
        return output if scaled is closure_loss else closure_loss

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        output = cast(_StrategyHooks, super()).optimizer_step(optimizer, closure, model, **kwargs)
        self.pacing.end_step()
        return output

    @override
    def on_validation_start(self) -> None:
        self.pacing.interrupt()
        cast(_StrategyHooks, super()).on_validation_start()

    @override
    def on_train_start(self) -> None:
        # Lightning has just installed its SIGTERM handler: ours replaces it while training runs.
        self.pacing.guard_sigterm()
        cast(_StrategyHooks, super()).on_train_start()

    @override
    def on_train_end(self) -> None:
        self.pacing.finish()
        cast(_StrategyHooks, super()).on_train_end()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        # Every checkpoint Lightning writes (ModelCheckpoint, trainer.save_checkpoint) passes here.
        self.pacing.save_state(checkpoint)
        cast(_StrategyHooks, super()).save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Lightning before 2.5 has no weights_only: passed on only when the caller gave it
        load = cast(_StrategyHooks, super()).load_checkpoint
        checkpoint = load(checkpoint_path) if weights_only is None else load(checkpoint_path, weights_only)
        self.pacing.load_state(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.pacing.fail(exception)
        cast(_StrategyHooks, super()).on_exception(exception)

    @override
    def teardown(self) -> None:
        self.pacing.close()
        cast(_StrategyHooks, super()).teardown()


class PacedDDPMixin(PacedStrategyMixin, _DDPBase):
    """DDP: the monitor of ``PacingConfig.ddp_monitor`` on the wrapped model (see
    :func:`~pace_strategy.hooks.ddp.attach_paced_ddp`); a user's comm hook keeps doing the
    communication. The constructor sets :attr:`user_comm_hook` and gives Lightning no hook."""

    user_comm_hook: UserCommHook

    def __init__(
        self, *args: Any, pacing: PacingArg = None, run_dir: RunDirArg = None, **kwargs: Any
    ) -> None:
        named = parent_arguments(lightning_init(type(self), PacedDDPMixin), args, kwargs)  # its positions
        self.pacing = StrategyPacing(pacing, cast(StrategyView, self), run_dir)
        self.user_comm_hook = UserCommHook.take(named)
        # No hook for Lightning (configure_ddp registers it); the state still goes there, for its
        # post-localSGD model averaging.
        cast(Any, super()).__init__(ddp_comm_state=self.user_comm_hook.state, **named)

    @override
    def configure_ddp(self) -> None:
        # Lightning wraps the model in DDP here and registers comm hooks right after (stock
        # DDPStrategy only on CUDA, silently dropping them on CPU): ours go on every device.
        cast(_DDPHooks, super()).configure_ddp()
        self.pacing.attach_ddp(self.user_comm_hook)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register_paced_ddp(strategy_registry, cls)


class PacedFSDPMixin(PacedStrategyMixin, _FSDPBase):
    """FSDP2 on ``ModelParallelStrategy``: every all-gather and reduce-scatter is timed, and the model
    is sharded for the user when ``configure_model`` did not do it. The constructor sets
    :attr:`sharding`."""

    sharding: FSDPSharding

    def __init__(
        self,
        *args: Any,
        pacing: PacingArg = None,
        run_dir: RunDirArg = None,
        auto_shard_min_params: int = 100_000,
        auto_shard_classes: Sequence[type[nn.Module]] = (),
        **kwargs: Any,
    ) -> None:
        named = parent_arguments(lightning_init(type(self), PacedFSDPMixin), args, kwargs)  # its positions
        self.pacing = StrategyPacing(pacing, cast(StrategyView, self), run_dir)
        self.sharding = FSDPSharding(
            cast(FSDPStrategyView, self),
            min_params=auto_shard_min_params,
            module_classes=auto_shard_classes,
            data_parallel_size=named.get("data_parallel_size", "auto"),
            tensor_parallel_size=named.get("tensor_parallel_size", "auto"),
        )
        named["tensor_parallel_size"] = self.sharding.tensor_parallel_size
        cast(Any, super()).__init__(**named)

    @property
    def auto_shard_min_params(self) -> int:
        """Parameters a block must hold to become its own shard group."""
        return self.sharding.min_params

    @property
    def auto_shard_classes(self) -> tuple[type[nn.Module], ...]:
        """Module classes that are each a shard group."""
        return self.sharding.module_classes

    @property
    def shard_groups(self) -> list[str] | None:
        """What auto-sharding chose (``None``: the user sharded, or not set up yet)."""
        return self.sharding.groups

    @override
    def setup_environment(self) -> None:
        self.sharding.resolve_data_parallel_size()
        cast(_FSDPHooks, super()).setup_environment()

    @override
    def setup(self, trainer: object) -> None:
        with self.sharding.around_setup():  # shards the model, unless configure_model did
            cast(_FSDPHooks, super()).setup(trainer)
        self.pacing.attach_fsdp()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            "paced_fsdp",
            cls,
            description="FSDP2 with skew monitoring and adaptive pacing, auto-sharded when needed",
            override=True,
        )
