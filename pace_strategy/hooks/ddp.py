"""A DDP communication hook that wraps any other hook: times the buckets and applies the pacing delay.

It composes: the wrapped hook (the default all-reduce, or a user's hook such as fp16 compression)
does the communication and its result is returned unchanged, so pacing never changes the gradients.
The hot path is one clock mark and an append per bucket; only the last bucket gets a Python callback.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.pacer import Pacer

__all__ = ["CommHook", "PacedHookState", "paced_comm_hook", "register_paced_hook"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class PacedHookState:
    """State of :func:`paced_comm_hook`: the pacer, and the wrapped hook with its own state."""

    pacer: Pacer
    inner_hook: CommHook
    inner_state: Any = None


def paced_comm_hook(state: PacedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Enter the sync point through the pacer, then delegate to the wrapped hook.

    Bucket 0 is the first one DDP hands to the collective (the reducer launches buckets in index
    order), so the pacing delay goes there: just before the rank's first gradient collective.
    """
    pacer = state.pacer
    if bucket.index() == 0:
        pacer.enter_sync()
    else:
        pacer.note_bucket()
    fut = state.inner_hook(state.inner_state, bucket)
    if bucket.is_last():
        return fut.then(pacer.sync_done_callback())
    return fut


def register_paced_hook(
    model: DistributedDataParallel,
    pacer: Pacer,
    inner_hook: CommHook | None = None,
    inner_state: Any = None,
) -> PacedHookState:
    """Register :func:`paced_comm_hook` on a DDP model, wrapping ``inner_hook`` (default: all-reduce).

    With no ``inner_hook`` the wrapped hook is torch's ``allreduce_hook`` on the model's process group
    (``inner_state``; ``None`` means the default group), which computes the same average as DDP's
    built-in reduction.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register_paced_hook needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap the model in DDP first."
        )
    if inner_hook is None:
        inner_hook = default_hooks.allreduce_hook
        if inner_state is None:
            inner_state = model.process_group
    state = PacedHookState(pacer=pacer, inner_hook=inner_hook, inner_state=inner_state)
    model.register_comm_hook(state=state, hook=paced_comm_hook)
    return state
