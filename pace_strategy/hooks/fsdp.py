"""FSDP2 (``fully_shard``): time every all-gather and reduce-scatter (and, under HSDP, the replicate
dimension's gradient all-reduce) and pace the step's first one.

With FSDP each collective is a sync point: a rank that is late to the forward all-gathers or to the
gradient reduce-scatters makes the others wait there. torch's FSDP2 (2.13 here) lets a sharded
module use a custom all-gather and reduce-scatter; the wrappers below compose over whatever the
module used before (torch's default, or the user's own), hand every call to the real collective unchanged, and
bracket it with the pacer's ``enter_collective`` / ``exit_collective``. So pacing never changes the
math, only when the rank issues its first collective of the step.

On a host clock (CPU, gloo) a synchronous call (FSDP's default, ``async_op=False``) returns when the
collective is done, so the call is the time the rank was held by it; an asynchronous one
(``unshard_async_op=True``) is counted as a hand-off only.

On a device clock (CUDA events) FSDP2 issues each collective inside ``torch.cuda.stream`` of its own
(the all-gather stream, the reduce-scatter stream), where it overlaps compute and the other
collectives: marks around the call would time the side stream. What the step waits for is where the
*compute stream* waits: FSDP's ``wait_for_unshard`` (before a group's forward, and its backward when
it was resharded), ``post_backward`` (where it waits for an older reduce-scatter to bound memory) and
``finalize_backward`` (for the last reduce-scatters). Those three methods of each parameter group are
bracketed with ``Pacer.enter_wait`` / ``exit_wait``, marks on the compute stream; the last one is the
step's completion. The delay is spun on the stream that issues the step's first collective (the
current stream inside FSDP's ``torch.cuda.stream`` block), once: later all-gathers, prefetches
included, queue behind it on that stream and are not delayed again. The model is in
docs/telemetry.md ("FSDP on a device").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch's FSDP2 with custom collectives; an ImportError here means a torch too old for paced FSDP.
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.pacer import Pacer

__all__ = [
    "STEP_METHODS",
    "WAIT_METHODS",
    "PacedAllGather",
    "PacedReduceScatter",
    "auto_shard",
    "auto_shard_steps",
    "fsdp_modules",
    "register_paced_collectives",
    "unregister_paced_collectives",
]


class _PacedComm:
    """What both wrappers share: the wrapped collective, its allocator, and the timing around a call."""

    def __init__(self, pacer: Pacer, inner: Any) -> None:
        self.pacer = pacer
        self.inner = inner

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _timed(self, async_op: bool, *args: Any) -> dist.Work | None:
        start = self.pacer.enter_collective()
        work = self.inner(*args, async_op)
        if not async_op:
            self.pacer.exit_collective(start)
        return work


class PacedAllGather(_PacedComm, AllGather):
    """An FSDP2 all-gather that times the wrapped one and applies the step's pacing delay."""

    def __init__(self, pacer: Pacer, inner: Any | None = None) -> None:
        super().__init__(pacer, inner if inner is not None else DefaultAllGather())

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self._timed(async_op, output_tensor, input_tensor, group)


class PacedReduceScatter(_PacedComm, ReduceScatter):
    """An FSDP2 reduce-scatter that times the wrapped one (the gradient sync of a parameter group).

    Under HSDP (``param_group`` sharded over a replicate x shard mesh) FSDP issues the replicate
    dimension's gradient all-reduce right after this call returns, on the same thread and with no
    hook before it: its start is marked here, its end where FSDP calls the group's all-reduce hook
    (:class:`_TimedAllReduce`), right after the all-reduce."""

    def __init__(self, pacer: Pacer, inner: Any | None = None, param_group: Any | None = None) -> None:
        super().__init__(pacer, inner if inner is not None else DefaultReduceScatter())
        self.param_group = param_group
        #: the mark of the replicate all-reduce FSDP is about to issue (HSDP), until its hook runs
        self.all_reduce_start: Any | None = None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = self._timed(async_op, output_tensor, input_tensor, group, op)
        if _all_reduces_next(self.param_group):
            self.all_reduce_start = self.pacer.enter_collective()
        return work


def _all_reduces_next(param_group: Any | None) -> bool:
    """Whether FSDP follows this group's reduce-scatter with the replicate dimension's all-reduce:
    HSDP, and not a step that only accumulates (``set_requires_all_reduce(False)``)."""
    return bool(getattr(param_group, "_is_hsdp", False) and getattr(param_group, "all_reduce_grads", True))


class _TimedAllReduce:
    """An HSDP parameter group's all-reduce hook (FSDP calls it right after the replicate dimension's
    all-reduce, with the reduced gradient shard): ends the all-reduce's interval that the group's
    :class:`PacedReduceScatter` began, then calls the hook the group had (the user's own, or none).

    On a host clock the all-reduce call blocked until it completed, so the interval is the time the
    rank was held by it, a sync point like the reduce-scatter before it: a replica late to it makes
    the other replicas wait there. On a device clock the interval is not timed (FSDP runs the
    all-reduce on its own stream); the compute stream's wait for it is, in ``post_backward`` and
    ``finalize_backward`` (:data:`WAIT_METHODS`), which wait for the all-reduce's event under HSDP."""

    def __init__(self, comm: PacedReduceScatter, previous: Any | None) -> None:
        self.comm = comm
        self.previous = previous

    def __call__(self, output: torch.Tensor) -> None:
        start, self.comm.all_reduce_start = self.comm.all_reduce_start, None
        self.comm.pacer.exit_collective(start)
        if self.previous is not None:
            self.previous(output)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to, in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_group(module: nn.Module) -> Any | None:
    # The module's current collectives live on its parameter group (private in torch; read only to
    # compose over a user's custom collective instead of silently replacing it).
    state = module._get_fsdp_state()  # type: ignore[operator]
    return getattr(state, "_fsdp_param_group", None)


def register_paced_collectives(model: nn.Module, pacer: Pacer) -> int:
    """Route every FSDP2 all-gather and reduce-scatter of ``model`` through the pacer.

    Idempotent per module. Returns the number of parameter groups instrumented; raises when ``model``
    has none (``fully_shard`` was not applied).
    """
    count = 0
    for module in fsdp_modules(model):
        if not hasattr(module, "set_custom_all_gather"):
            raise PacingConfigError(
                f"this torch ({torch.__version__}) cannot give FSDP2 modules custom collectives "
                "(FSDPModule.set_custom_all_gather); paced FSDP needs a newer torch."
            )
        group = _param_group(module)
        if group is None:  # a root that holds no parameters of its own: no collectives to time
            continue
        all_gather = getattr(group, "_all_gather_comm", None)
        reduce_scatter = getattr(group, "_reduce_scatter_comm", None)
        if isinstance(all_gather, PacedAllGather):
            all_gather = all_gather.inner
        if isinstance(reduce_scatter, PacedReduceScatter):
            reduce_scatter = reduce_scatter.inner
        paced_reduce_scatter = PacedReduceScatter(pacer, reduce_scatter, group)
        module.set_custom_all_gather(PacedAllGather(pacer, all_gather))  # type: ignore[operator]
        module.set_custom_reduce_scatter(paced_reduce_scatter)  # type: ignore[operator]
        if getattr(group, "_is_hsdp", False):  # the replicate dimension's all-reduce: timed too
            group._all_reduce_hook = _TimedAllReduce(paced_reduce_scatter, _user_all_reduce_hook(group))
        _unbracket_waits(group)  # a bracket from an earlier registration times for its own pacer
        if not pacer.clock_is_host_time:
            _bracket_waits(group, pacer)
        count += 1
    if count == 0:
        raise PacingConfigError(
            f"{type(model).__name__} has no FSDP2 parameter group: apply fully_shard (or "
            "pace_strategy.auto_shard) to the model before pacing it."
        )
    return count


#: the methods of an FSDP2 parameter group in which the compute stream waits for its collectives
WAIT_METHODS = ("wait_for_unshard", "post_backward", "finalize_backward")


class _WaitBracket:
    """A parameter group's method, bracketed with compute-stream marks (``Pacer.enter_wait`` /
    ``exit_wait``); set on the group instance, so FSDP's own calls (``self.wait_for_unshard()``)
    go through it, and removed again by :func:`unregister_paced_collectives`."""

    def __init__(self, pacer: Pacer, method: Any) -> None:
        self.pacer = pacer
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = self.pacer.enter_wait()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.pacer.exit_wait(start)


def _bracket_waits(group: Any, pacer: Pacer) -> None:
    for name in WAIT_METHODS:
        method = getattr(group, name, None)
        if method is not None:  # None: a torch without this wait point, nothing of it to time
            setattr(group, name, _WaitBracket(pacer, method))


def _unbracket_waits(group: Any) -> None:
    for name in WAIT_METHODS:
        if isinstance(group.__dict__.get(name), _WaitBracket):
            delattr(group, name)  # back to the class's method


def _user_all_reduce_hook(group: Any) -> Any | None:
    """The all-reduce hook the group had before pace_strategy's (FSDP's ``set_all_reduce_hook``)."""
    hook = getattr(group, "_all_reduce_hook", None)
    return hook.previous if isinstance(hook, _TimedAllReduce) else hook


def unregister_paced_collectives(model: nn.Module) -> int:
    """Undo :func:`register_paced_collectives`: every FSDP2 module of ``model`` gets back the
    collectives it had before (torch's default or the user's own). Returns the number of parameter
    groups restored; idempotent."""
    count = 0
    for module in fsdp_modules(model):
        group = _param_group(module)
        if group is None:
            continue
        _unbracket_waits(group)
        if isinstance(getattr(group, "_all_reduce_hook", None), _TimedAllReduce):
            group._all_reduce_hook = _user_all_reduce_hook(group)
        all_gather = getattr(group, "_all_gather_comm", None)
        reduce_scatter = getattr(group, "_reduce_scatter_comm", None)
        if isinstance(all_gather, PacedAllGather):
            module.set_custom_all_gather(all_gather.inner)  # type: ignore[operator]
            count += 1
        if isinstance(reduce_scatter, PacedReduceScatter):
            module.set_custom_reduce_scatter(reduce_scatter.inner)  # type: ignore[operator]
    return count


def auto_shard(
    model: nn.Module,
    mesh: Any | None = None,
    *,
    min_params: int = 100_000,
    module_classes: Iterable[type[nn.Module]] = (),
    **fully_shard_kwargs: Any,
) -> list[str]:
    """Apply ``fully_shard`` to the blocks of ``model`` and then to ``model`` itself.

    The policy, when ``module_classes`` is empty, is size-based and bottom-up (the same rule as FSDP1's
    ``size_based_auto_wrap_policy``): a submodule becomes its own shard group when it holds at least
    ``min_params`` parameters that no descendant group took; containers (``ModuleList``,
    ``Sequential``, ``ModuleDict``) are never groups themselves, so a stack of blocks gives one group
    per block. With ``module_classes``, every instance of those classes is a group (e.g. the
    transformer block class). The root always becomes a group and holds what is left. Returns the
    qualified names of the groups, root last (``""``). ``mesh`` and ``fully_shard_kwargs`` go to
    ``fully_shard``.
    """
    if fsdp_modules(model):
        raise PacingConfigError(
            f"{type(model).__name__} is already sharded (fully_shard was applied); auto_shard would "
            "shard it twice. Shard it yourself or let auto_shard do it, not both."
        )
    if min_params < 1:
        raise PacingConfigError(f"auto_shard min_params={min_params!r} is invalid: expected an integer >= 1.")
    classes = tuple(module_classes)
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        """Parameters of ``module`` not taken by a group below it."""
        free = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            free += visit(f"{name}.{child_name}" if name else child_name, child)
        if module is model:
            return free
        if classes:
            take = isinstance(module, classes)
        else:
            take = free >= min_params and not isinstance(module, containers)
        if take:
            chosen.append((name, module))
            return 0
        return free

    visit("", model)
    kwargs = dict(fully_shard_kwargs)
    if mesh is not None:
        kwargs["mesh"] = mesh
    for _, module in chosen:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return [name for name, _ in chosen] + [""]


#: the methods of a LightningModule that run its model in place of ``forward``
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def auto_shard_steps(
    module: nn.Module,
    mesh: Any | None = None,
    *,
    min_params: int = 100_000,
    module_classes: Iterable[type[nn.Module]] = (),
    methods: Iterable[str] = STEP_METHODS,
) -> list[str]:
    """:func:`auto_shard` a module that is trained through step methods rather than ``forward`` (a
    LightningModule): ``module`` itself is the root group, and each of ``methods`` it has is
    registered as an FSDP forward method, so the root gathers its parameters when a step runs.

    A root group on a submodule (``self.net``) gathers only when *its* ``forward`` runs, and a
    ``training_step`` that calls the layers one by one (``self.net[0](x)``) would meet sharded
    parameters. With the LightningModule as root every parameter no block group took is the root's,
    gathered for the whole step; the block groups gather in their own ``forward`` as usual. Returns
    the qualified names of the groups, root last (``""``).
    """
    groups = auto_shard(module, mesh, min_params=min_params, module_classes=module_classes)
    for name in methods:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return groups
