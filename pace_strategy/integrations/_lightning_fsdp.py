"""The FSDP2 layout of ``paced_fsdp`` for both Lightning packages (imports neither): pure data
parallelism by default, and auto-sharding of a LightningModule that did not shard itself.

The two places where ``paced_fsdp`` has to reach behind Lightning 2.6's public API live here, each
in one small helper that says why: :func:`_set_data_parallel_size` and
:func:`configure_model_stand_in`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, Protocol

from torch import nn

from pace_strategy.core.errors import PacingConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDPSharding", "FSDPStrategyView", "configure_model_stand_in"]

log = logging.getLogger(__name__)


class FSDPStrategyView(Protocol):
    """What :class:`FSDPSharding` reads from its ``ModelParallelStrategy``."""

    @property
    def lightning_module(self) -> nn.Module | None: ...
    @property
    def device_mesh(self) -> DeviceMesh: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_processes(self) -> int: ...

    _data_parallel_size: int | Literal["auto"]  # private: see _set_data_parallel_size


class FSDPSharding:
    """How ``paced_fsdp`` lays out FSDP2: pure data parallelism by default (data parallel size =
    world size, tensor parallel size 1) and, for a LightningModule whose ``configure_model`` did not
    shard (or that has none), :func:`~pace_strategy.hooks.fsdp.auto_shard_steps` on the whole
    LightningModule (its blocks by size, itself the root group, gathered for every step method).

    Args:
        strategy: the ``ModelParallelStrategy`` that holds this object.
        min_params: parameters a block must hold to become its own shard group.
        module_classes: module classes that are each a shard group (overrides the size rule).
        data_parallel_size: the FSDP shard dimension; ``"auto"``: world size / tensor parallel size.
        tensor_parallel_size: ``"auto"`` means 1 (pure data parallelism).
    """

    def __init__(
        self,
        strategy: FSDPStrategyView,
        *,
        min_params: int,
        module_classes: Sequence[type[nn.Module]],
        data_parallel_size: int | Literal["auto"],
        tensor_parallel_size: int | Literal["auto"],
    ) -> None:
        if not isinstance(min_params, int) or min_params < 1:
            raise PacingConfigError(
                f"auto_shard_min_params={min_params!r} is invalid: expected an integer >= 1 "
                "(parameters a block must hold to become its own FSDP shard group)."
            )
        self.min_params = min_params
        self.module_classes = tuple(module_classes)
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = 1 if tensor_parallel_size == "auto" else tensor_parallel_size
        self.groups: list[str] | None = None  #: what auto-sharding chose (None: the user sharded)
        self._strategy = strategy

    def resolve_data_parallel_size(self) -> None:
        """Before the device mesh is built: an ``"auto"`` data parallel size becomes the world size
        over the tensor parallel size (Lightning's own "auto" would be the number of nodes)."""
        if self.data_parallel_size == "auto":
            strategy = self._strategy
            world_size = strategy.num_nodes * strategy.num_processes
            _set_data_parallel_size(strategy, world_size // self.tensor_parallel_size)

    @contextmanager
    def around_setup(self) -> Iterator[None]:
        """Around ``ModelParallelStrategy.setup``, which comes after Lightning's ``configure_model``
        call (if any, inside its init contexts): a LightningModule that is not sharded yet is
        sharded first, before Lightning materializes and moves it, and ``setup``'s check for a
        ``configure_model`` is satisfied for one that has none (:func:`configure_model_stand_in`)."""
        module = self._strategy.lightning_module
        assert module is not None, "a strategy is set up with its LightningModule"
        self._shard_if_needed(module)
        with configure_model_stand_in(module):
            yield

    def _shard_if_needed(self, module: nn.Module) -> None:
        """Shard the LightningModule with :func:`~pace_strategy.hooks.fsdp.auto_shard_steps`, unless
        something already is: its blocks become groups by the size rule, the LightningModule itself
        the root group, gathered whenever one of its step methods runs. So a ``training_step`` that
        calls submodules, or single layers of them, trains as under ``ddp``."""
        from pace_strategy.hooks.fsdp import auto_shard_steps, fsdp_modules

        if fsdp_modules(module):
            return
        if not any(True for _ in module.parameters()):
            raise PacingConfigError(
                f"paced_fsdp cannot shard {type(module).__name__}: it has no parameters (build the model "
                "in __init__ or in configure_model)."
            )
        mesh = self._strategy.device_mesh["data_parallel"]
        self.groups = auto_shard_steps(
            module, mesh, min_params=self.min_params, module_classes=self.module_classes
        )
        if self._strategy.global_rank == 0:
            log.info("pace_strategy: auto-sharded into %d FSDP groups: %s", len(self.groups), self.groups)


def _set_data_parallel_size(strategy: FSDPStrategyView, size: int) -> None:
    # The one write to a private Lightning attribute. Lightning 2.6's ModelParallelStrategy resolves
    # data_parallel_size="auto" in setup_environment to the number of nodes (with tensor parallel
    # over each node's devices) and offers no public way to ask for data parallelism over the whole
    # world: the world size is known only then, not at construction. mypy (FSDPStrategyView) and
    # tests/unit/test_registry.py fail if Lightning renames the attribute or stops reading it there.
    strategy._data_parallel_size = size


def _already_configured() -> None:
    """``configure_model`` stand-in: the model was already sharded by ``paced_fsdp``."""


@contextmanager
def configure_model_stand_in(module: nn.Module) -> Iterator[None]:
    """Give ``module`` a no-op ``configure_model`` (an instance attribute) for the duration, unless
    it defines its own.

    The one patch of a user's object. Lightning 2.6's ``ModelParallelStrategy.setup`` raises
    ``TypeError`` unless the LightningModule overrides ``configure_model`` (``is_overridden``
    compares the method's code with ``LightningModule``'s), and there is no other way to pass that
    check. ``paced_fsdp`` shards such a module itself just before, so the check may pass: the
    stand-in exists only while ``setup`` runs (which never calls the hook) and is removed whatever
    happens. The user's class is never touched.
    """
    if _overrides_configure_model(module):
        yield
        return
    module.__dict__["configure_model"] = _already_configured
    try:
        yield
    finally:
        module.__dict__.pop("configure_model", None)


def _overrides_configure_model(module: nn.Module) -> bool:
    """Whether the user's LightningModule (its class or the instance) defines ``configure_model``."""
    if "configure_model" in vars(module):
        return True
    definer = next(c for c in type(module).__mro__ if "configure_model" in vars(c))
    return not definer.__module__.startswith(("lightning.pytorch.", "pytorch_lightning."))
