"""A DDP communication hook that wraps any other hook: times the buckets and applies the pacing delay.

It composes: the wrapped hook (a user's hook such as fp16 compression, or by default the mean
all-reduce) does the communication and its result is returned unchanged, so pacing never changes the
gradients. The hot path is one clock mark and an append per bucket. The default all-reduce is issued
on the process group directly and needs one Python callback per bucket (to turn the work's tensor
list into the tensor DDP expects), the last bucket's also marking completion. Measured, that costs
less than wrapping torch's ``allreduce_hook`` and chaining a second callback (docs/overhead.md).
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.pacer import Pacer

__all__ = ["CommHook", "PacedHookState", "paced_comm_hook", "register_paced_hook"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class PacedHookState:
    """State of :func:`paced_comm_hook`: the pacer, and the wrapped hook with its own state.

    ``inner_hook=None`` is the built-in mean all-reduce on the process group ``inner_state`` (the
    same division by the group size, then sum, as torch's ``allreduce_hook``, so the same bits).
    """

    pacer: Pacer
    inner_hook: CommHook | None
    inner_state: Any = None


def _first(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


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
    if state.inner_hook is not None:
        fut = state.inner_hook(state.inner_state, bucket)
        if bucket.is_last():
            return fut.then(pacer.sync_done_callback())
        return fut
    group = state.inner_state
    tensor = bucket.buffer()
    tensor.div_(group.size())
    work = group.allreduce([tensor]).get_future()
    if bucket.is_last():
        done = pacer.sync_done_callback()
        return work.then(lambda f: done(f)[0])  # one callback: mark completion and unwrap
    return work.then(_first)


def register_paced_hook(
    model: DistributedDataParallel,
    pacer: Pacer,
    inner_hook: CommHook | None = None,
    inner_state: Any = None,
) -> PacedHookState:
    """Register :func:`paced_comm_hook` on a DDP model, wrapping ``inner_hook`` (default: all-reduce).

    With no ``inner_hook`` the communication is the built-in mean all-reduce on the model's process
    group (``inner_state``; ``None`` means the model's own group), the same average, bit for bit,
    as torch's ``allreduce_hook`` and DDP's built-in reduction.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register_paced_hook needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap the model in DDP first."
        )
    if inner_hook is None and inner_state is None:
        inner_state = model.process_group
    state = PacedHookState(pacer=pacer, inner_hook=inner_hook, inner_state=inner_state)
    model.register_comm_hook(state=state, hook=paced_comm_hook)
    return state
