"""Time the blocking collectives a framework runs outside the gradient sync, as sync points of the step.

A training loop may block in collectives of its own besides the gradient all-reduce: the HF Trainer
gathers each step's label count before the step (``num_items_in_batch``) and the loss for logging
after it. A rank that reaches such a collective late makes the others wait *there*, and then all of
them enter the gradient sync together: measured at the gradient sync alone, the rank that started
late is invisible (the straggler is named by chance). :func:`time_framework_syncs` wraps the
``torch.distributed`` collectives for the duration of a session, and every call that blocks on the
training thread, on a group other than pace_strategy's own side group, is reported to the Pacer
(:meth:`~pace_strategy.core.pacer.Pacer.enter_framework_sync`), which counts its time as wait.

Only calls made through the ``torch.distributed`` namespace are seen (``torch.distributed.all_gather``,
``dist.all_reduce``: how accelerate, transformers and Lightning call them); DDP's own gradient buckets
and buffer broadcasts run in C++ and are not. Asynchronous calls (``async_op=True``) are not timed
(whoever waits on them is not seen), nor calls from other threads, nor calls nested in a timed one
(``all_gather_object`` calls ``all_gather``), nor calls while ``torch.compile`` traces.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy.core.pacer import Pacer

__all__ = ["COLLECTIVES", "time_framework_syncs"]

#: the ``torch.distributed`` functions timed: every blocking collective a training loop may call
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)


def time_framework_syncs(pacer: Pacer, side_group: dist.ProcessGroup | None) -> Callable[[], None]:
    """Wrap :data:`COLLECTIVES` in ``torch.distributed`` so that the calling (training) thread's
    blocking calls are timed by ``pacer``; returns the function that unwraps them (idempotent; a
    function someone else has replaced since is left as it is)."""
    owner = threading.get_ident()
    nested = threading.local()
    wrapped: dict[str, Callable[..., Any]] = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if callable(original):
            wrapped[name] = _timed(original, pacer, side_group, owner, nested)
            setattr(dist, name, wrapped[name])

    def restore() -> None:
        for name, wrapper in wrapped.items():
            if getattr(dist, name, None) is wrapper:
                setattr(dist, name, wrapper.__wrapped__)
        wrapped.clear()

    return restore


def _timed(
    original: Callable[..., Any],
    pacer: Pacer,
    side_group: dist.ProcessGroup | None,
    owner: int,
    nested: threading.local,
) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if (
            threading.get_ident() != owner
            or getattr(nested, "active", False)
            or torch.compiler.is_compiling()
        ):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # let the collective raise its own error
            return original(*args, **kwargs)
        if bound.get("async_op", False) or (side_group is not None and bound.get("group") is side_group):
            return original(*args, **kwargs)
        nested.active = True
        start = pacer.enter_framework_sync()
        try:
            return original(*args, **kwargs)
        finally:
            pacer.exit_framework_sync(start)
            nested.active = False

    return collective
