"""What the adapters that take a wrapped model do alike (Accelerate's ``attach_pacing``, the plain
PyTorch ``attach``): check the model, hook its gradient sync into the pacer, rebuild the training
data for rebalancing. Each step goes on the driver's undo list, so :meth:`PacingDriver.detach` takes
it back in reverse order."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.driver import PacingDriver
from pace_strategy.hooks.ddp import attach_paced_ddp
from pace_strategy.integrations.rebalance import STATE_NAME, DataRebalance, share_scaled_allreduce
from pace_strategy.session import PacingSession

__all__ = ["data_rebalance", "is_fsdp2", "is_paceable", "model_is_fsdp2", "pace_model"]


def is_fsdp2(model: Any) -> bool:
    """Whether ``model`` has modules sharded with FSDP2's ``fully_shard``."""
    try:
        from pace_strategy.hooks.fsdp import fsdp_modules
    except ImportError:
        return False
    return bool(fsdp_modules(model))


def is_paceable(obj: Any) -> bool:
    """A DistributedDataParallel model, or a module sharded with FSDP2."""
    if isinstance(obj, DistributedDataParallel):
        return True
    return isinstance(obj, torch.nn.Module) and is_fsdp2(obj)


def model_is_fsdp2(model: Any, needs: str) -> bool:
    """Whether ``model`` is sharded with FSDP2 (else it is DDP); anything else raises a TypeError that
    says what ``needs`` (the call, and which model it wants)."""
    fsdp = is_fsdp2(model)
    if not fsdp and not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"{needs}, wrapped in DistributedDataParallel or sharded with FSDP2, got {type(model).__name__}."
        )
    return fsdp


def pace_model(
    driver: PacingDriver, model: Any, session: PacingSession, fsdp: bool, scale_gradient: bool = True
) -> None:
    """Hook ``model``'s gradient sync into ``session``'s pacer: FSDP2's collectives, or DDP's monitor,
    whose comm hook also scales the gradient by the rank's share when the driver rebalances and
    ``scale_gradient`` (the loop's loss is each rank's own mean)."""
    undo = driver.on_detach
    if fsdp:
        from pace_strategy.hooks.fsdp import register_paced_collectives, unregister_paced_collectives

        register_paced_collectives(model, session.pacer)
        undo(functools.partial(unregister_paced_collectives, model))
    elif driver.rebalance is not None and scale_gradient:
        rebalance = driver.rebalance
        assert isinstance(rebalance, DataRebalance)
        undo(attach_paced_ddp(model, session.pacer, share_scaled_allreduce, rebalance).remove)
        rebalance.rescale_accumulated = functools.partial(_scale_gradients, model)
        undo(functools.partial(setattr, rebalance, "rescale_accumulated", None))
    else:
        undo(attach_paced_ddp(model, session.pacer).remove)


def _scale_gradients(model: Any, factor: float) -> None:
    """Multiply every gradient ``model`` holds by ``factor`` (one fused pass per device and dtype)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def data_rebalance(
    driver: PacingDriver,
    session: PacingSession,
    fsdp: bool,
    step_source: Callable[[], int],
    prefetch: int,
    micro_batches: int = 1,
) -> DataRebalance:
    """``rebalance=True``: the driver's rebalanced training data (its loader is rebuilt later by the
    adapter), checkpointed with the session, back to factor 1.0 at detach. FSDP is refused."""
    if fsdp:
        raise PacingConfigError(
            "rebalance=True and balance=True are supported with DDP, not FSDP yet; set them off for this "
            "model."
        )
    rebalance = DataRebalance(
        session.pacer,
        session.pacer.rank,
        session.pacer.world_size,
        step_source=step_source,
        framework_prefetch=prefetch,
        micro_batches=micro_batches,
        balance=session.config.balance,
    )
    session.state.register(STATE_NAME, rebalance)
    driver.on_detach(rebalance.stop)
    driver.rebalance = rebalance
    return rebalance
