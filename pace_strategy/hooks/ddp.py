"""How DDP's sync point is timed and paced: the grad-ready monitor (default) or a comm hook.

:func:`attach_paced_ddp` picks one by ``PacingConfig.ddp_monitor``.

Both measure a rank's **arrival** at the end of its local backward, when its last gradient is ready
for the collective: the step is set by the last bucket, and in a real model most of the compute is
backward, so a rank slow anywhere in backward arrives late. Both apply the pacing delay earlier, at
the step's first gradient (or first bucket), the last moment that still holds the rank before its
first collective.

The grad-ready monitor (:class:`GradReadyMonitor`) puts no Python on the communication path: one
hook on the parameter whose gradient is ready first applies the delay (before DDP can launch any
bucket) and queues autograd-engine callbacks: the first marks the arrival once the engine has run
the whole backward, a second marks completion once DDP has waited for every bucket. A user's comm
hook is registered as it is.

The comm hook (:func:`paced_comm_hook`) wraps any other hook and counts every bucket; the last
bucket's hand-off is the arrival. It composes: the wrapped hook (a user's hook such as fp16
compression, or by default the mean all-reduce) does the communication and its result is returned
unchanged, so pacing never changes the gradients. Its hot path is a counter per bucket (clock marks
at the first and the last only); the default all-reduce is issued on the process group directly
and needs one Python callback per bucket (to turn the work's tensor list into the tensor DDP
expects), the last bucket's also marking completion. On a CPU-starved machine that Python on gloo's
thread costs about as much as torch's own ``allreduce_hook`` (docs/overhead.md).

Both also time DDP's **buffer broadcast** (:class:`BufferSyncTimer`): with ``broadcast_buffers`` (the
default) and a model that has buffers (BERT's position ids, BatchNorm's statistics), DDP broadcasts
them from rank 0 at the start of every forward, a blocking collective in which an early rank waits
for a late one. Counted as compute, that wait made a rank slow before its forward (an HF Trainer
callback at ``on_step_begin``) look on time and its peers as slow as it.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from pace_strategy.core.pacer import Pacer

__all__ = [
    "BufferSyncTimer",
    "CommHook",
    "GradReadyMonitor",
    "PacedHookState",
    "attach_paced_ddp",
    "paced_comm_hook",
    "register_paced_hook",
]

log = logging.getLogger(__name__)

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class PacedHookState:
    """State of :func:`paced_comm_hook`: the pacer, and the wrapped hook with its own state.

    ``inner_hook=None`` is the built-in mean all-reduce on the process group ``inner_state``: the same
    multiplication by ``1 / W``, then sum, as DDP's own reducer, so the same bits at every world size.
    """

    pacer: Pacer
    inner_hook: CommHook | None
    inner_state: Any = None
    enabled: bool = True  #: ``False`` after :meth:`remove`: the hook only communicates
    buffers: "BufferSyncTimer | None" = None  #: the model's buffer broadcast, timed

    def remove(self) -> None:
        """Stop timing and pacing. DDP cannot unregister a comm hook (it takes one per model, once),
        so the hook stays and only does the wrapped hook's communication; the model cannot be given
        another comm hook afterwards."""
        self.enabled = False
        if self.buffers is not None:
            self.buffers.remove()


class BufferSyncTimer:
    """Times DDP's broadcast of its buffers at the start of a forward as a framework sync
    (:meth:`Pacer.enter_framework_sync`): a wait, not compute.

    The one reach into DDP's private code for it: ``DistributedDataParallel._sync_buffers``, which
    its forward calls when it will sync buffers (``tests/integration/test_ddp_hook.py`` pins it). The
    wrapper is set on the model instance, so nothing else is touched; :meth:`remove` takes it off.
    """

    def __init__(self, model: DistributedDataParallel, pacer: Pacer) -> None:
        self._model = model
        found = getattr(model, "_sync_buffers", None)
        self._installed = callable(found)
        if found is None or not self._installed:
            log.warning(
                "pace_strategy: this torch's DDP has no _sync_buffers; its buffer broadcast is not timed"
            )
            return
        sync: Callable[..., Any] = found

        @functools.wraps(sync)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                return sync(*args, **kwargs)  # an evaluation forward's: no training step's wait
            start = pacer.enter_framework_sync()
            try:
                return sync(*args, **kwargs)
            finally:
                pacer.exit_framework_sync(start)

        model._sync_buffers = timed  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._installed:
            self._installed = False
            del self._model._sync_buffers


def _first(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


def paced_comm_hook(state: PacedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Enter the sync point through the pacer, then delegate to the wrapped hook.

    Bucket 0 is the first one DDP hands to the collective (the reducer launches buckets in index
    order), so the pacing delay goes there: just before the rank's first gradient collective. The
    last bucket's hand-off is the rank's arrival: its local backward has produced every gradient.
    """
    if not state.enabled:
        return _communicate(state, bucket)
    pacer = state.pacer
    if bucket.index() == 0:
        pacer.enter_sync()
    else:
        pacer.note_bucket()
    if not bucket.is_last():
        return _communicate(state, bucket)
    pacer.arrive()
    done = pacer.sync_done_callback()
    if state.inner_hook is not None:
        return state.inner_hook(state.inner_state, bucket).then(done)
    work = _allreduce_mean(state.inner_state, bucket)
    return work.then(lambda f: done(f)[0])  # one callback: mark completion and unwrap


def _allreduce_mean(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[list[torch.Tensor]]:
    """DDP's default reduction of one bucket, issued on the process group itself (same bits).

    DDP's reducer multiplies each gradient by ``1 / W`` as it copies it into the bucket, then sums;
    so does this (a division by ``W``, as torch's ``allreduce_hook`` does, differs in the last bit for
    about a third of the values at W = 3)."""
    tensor = bucket.buffer()
    tensor.mul_(1.0 / group.size())
    return group.allreduce([tensor]).get_future()


def _communicate(state: PacedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The wrapped hook's communication alone: every bucket but the last, and all of them after
    :meth:`PacedHookState.remove`."""
    if state.inner_hook is not None:
        return state.inner_hook(state.inner_state, bucket)
    return _allreduce_mean(state.inner_state, bucket).then(_first)


def register_paced_hook(
    model: DistributedDataParallel,
    pacer: Pacer,
    inner_hook: CommHook | None = None,
    inner_state: Any = None,
) -> PacedHookState:
    """Register :func:`paced_comm_hook` on a DDP model, wrapping ``inner_hook`` (default: all-reduce).

    With no ``inner_hook`` the communication is the built-in mean all-reduce on the model's process
    group (``inner_state``; ``None`` means the model's own group), the same average, bit for bit,
    as DDP's built-in reduction (multiplied by ``1 / W``; torch's ``allreduce_hook`` divides, which
    differs in the last bit at world sizes that are not powers of two).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register_paced_hook needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap the model in DDP first."
        )
    if inner_hook is None and inner_state is None:
        inner_state = model.process_group
    state = PacedHookState(
        pacer=pacer, inner_hook=inner_hook, inner_state=inner_state, buffers=BufferSyncTimer(model, pacer)
    )
    model.register_comm_hook(state=state, hook=paced_comm_hook)
    return state


class GradReadyMonitor:
    """Times and paces DDP's sync point with no Python on the communication path.

    **The delay** goes at the step's first gradient: a post-accumulate-grad hook, which autograd runs
    inside the parameter's ``AccumulateGrad`` node before the node's post-hooks, among them DDP's,
    which marks the gradient ready for its bucket. A bucket is launched only once all its gradients
    are ready and buckets are launched in order, so the first gradient of a backward comes before any
    collective. **Arrival**: that hook queues an autograd-engine callback. The engine runs callbacks
    once the whole graph has been executed, in the order queued, and DDP queues its own
    end-of-backward callback (which waits for every bucket's collective) only when its last bucket
    becomes ready, after the first gradient. So ours runs first, at the end of this rank's local
    backward, before any waiting: it marks the arrival (on CUDA, an event on the stream the engine
    hands its callbacks, which has waited for the backward's streams). **Completion**: it queues a
    second callback; callbacks queued while callbacks run go to the back of the queue, so the second
    runs after DDP's wait.

    One parameter carries the hook: the last one that requires grad (DDP's own guess for the first
    gradient). In the first ``warmup_steps`` synchronized backwards the monitor checks the guess: a
    parameter that already holds a gradient when the hooked one fires (gradients are reset to
    ``None`` between steps by ``zero_grad()``) came earlier and gets the hook too, so after warm-up
    the hooked set holds the first gradient of a static graph. If a later step's graph differs, the
    arrival can be marked at a later gradient (the delay then still precedes that gradient's bucket);
    ``ddp_monitor: comm_hook`` times the buckets themselves.

    Backwards inside ``no_sync`` (gradient accumulation) are ignored: DDP does not communicate there.
    :meth:`remove` takes the hooks off again.
    """

    def __init__(self, model: DistributedDataParallel, pacer: Pacer) -> None:
        self._model = model
        self._pacer = pacer
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("GradReadyMonitor: the DDP model has no parameter that requires grad")
        self._engine = torch.autograd.Variable._execution_engine
        self._task = -1  # graph task of the backward whose first gradient was seen
        self._checks = max(pacer.config.warmup_steps, 1)  # synchronized backwards left to check
        self._hooked: set[int] = set()
        self._handles: list[RemovableHandle] = []
        self._hook(len(self._params) - 1)
        self._buffers = BufferSyncTimer(model, pacer)

    @property
    def hooked_parameters(self) -> tuple[int, ...]:
        """Indices (into the model's parameters that require grad) of the parameters hooked."""
        return tuple(sorted(self._hooked))

    def _hook(self, index: int) -> None:
        self._hooked.add(index)
        hook = functools.partial(self._ready, index)
        self._handles.append(self._params[index].register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        """Remove every hook the monitor registered; the model trains as if it was never attached."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._buffers.remove()

    def _ready(self, index: int, param: torch.Tensor) -> None:
        if not self._model.require_backward_grad_sync:
            return  # a no_sync backward: no collective, not a sync point
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return  # a later hooked gradient of the same backward
        self._task = task
        if self._checks:
            self._checks -= 1
            self._check(index)
        self._pacer.enter_sync(bucketed=False)
        self._engine.queue_callback(self._queue_done)

    def _check(self, index: int) -> None:
        """Hook the parameters whose gradients were ready before this one (warm-up only)."""
        hooked = self._hooked
        earlier = [i for i, p in enumerate(self._params) if p.grad is not None and i not in hooked]
        # Every other gradient already there: accumulated from a previous backward, not evidence.
        if earlier and len(earlier) < len(self._params) - len(self._hooked):
            for i in earlier:
                self._hook(i)
            log.debug("GradReadyMonitor: gradients %s came before %d; hooked too", earlier, index)

    def _queue_done(self) -> None:
        # Queued from the first gradient, so it runs before DDP's end-of-backward callback, once the
        # engine has run the whole backward: the arrival. Completion is queued behind DDP's wait.
        self._pacer.arrive()
        self._engine.queue_callback(self._pacer.sync_done)


def attach_paced_ddp(
    model: DistributedDataParallel,
    pacer: Pacer,
    inner_hook: CommHook | None = None,
    inner_state: Any = None,
) -> GradReadyMonitor | PacedHookState:
    """Monitor and pace a DDP model as ``pacer.config.ddp_monitor`` says; ``inner_hook`` (a user's comm
    hook, with ``inner_state``) does the communication either way.

    ``"grad_ready"`` (default): registers ``inner_hook`` on the model as it is, if given, and attaches
    a :class:`GradReadyMonitor`. ``"comm_hook"``: registers :func:`paced_comm_hook` wrapping it.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"attach_paced_ddp needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap the model in DDP first."
        )
    if pacer.config.ddp_monitor == "comm_hook":
        return register_paced_hook(model, pacer, inner_hook, inner_state)
    if inner_hook is not None:
        model.register_comm_hook(state=inner_state, hook=inner_hook)
    return GradReadyMonitor(model, pacer)
