"""Zero-code pacing in a worker that ``pace launch`` started: attach after ``Accelerator.prepare``,
finish before ``Accelerator.end_training``, and a ``PacingCallback`` on every ``transformers.Trainer``.

Only :mod:`~pace_strategy.integrations.accelerate.bootstrap` calls :func:`install`, in the worker
process it runs the user's script in. The hooks wrap methods of the framework classes of that
process, the moment the script imports the framework; nothing is written to the user's environment,
and a process that ``pace launch`` did not start (a plain ``accelerate launch``, the script's own
subprocesses, which are not started through the bootstrap) is never touched.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pace_strategy._imports import when_imported

if TYPE_CHECKING:
    from pace_strategy.integrations.accelerate.attach import PacingHandle

__all__ = ["fail_attached", "finish_attached", "install"]

log = logging.getLogger(__name__)


class _ZeroCode:
    """What the hooks of this process share."""

    def __init__(self) -> None:
        self.installed = False
        self.attached = False  #: the one automatic attach of this process happened
        #: a prepared model that waits for its optimizer (``prepare(model)``, later ``prepare(opt)``)
        self.pending: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None
        #: accelerators that a Trainer owns: its PacingCallback attaches, not the prepare hook
        self.trainer_accelerators: weakref.WeakSet[Any] = weakref.WeakSet()
        self.warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(message, *args)


_STATE = _ZeroCode()


def install() -> None:
    """Hook ``accelerate`` and ``transformers`` in this process once they are imported; idempotent."""
    if _STATE.installed:
        return
    _STATE.installed = True
    when_imported("accelerate", _guarded(_hook_accelerate, "accelerate.Accelerator.prepare"))
    when_imported("transformers.trainer", _guarded(_hook_trainer, "transformers.Trainer"))


def _guarded(hook: Callable[[], None], what: str) -> Callable[[], None]:
    def run() -> None:
        try:
            hook()
        except Exception:
            log.warning("pace launch: cannot hook %s; this run is not paced", what, exc_info=True)

    return run


def _hook_accelerate() -> None:
    from accelerate import Accelerator

    prepare, end_training = Accelerator.prepare, Accelerator.end_training

    @functools.wraps(prepare)
    def paced_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = prepare(self, *args, **kwargs)
        _after_prepare(self, prepared if len(args) > 1 else (prepared,))
        return prepared

    @functools.wraps(end_training)
    def paced_end_training(self: Any) -> Any:
        finish_attached()  # before the trackers the last steps go to, and the process group, end
        return end_training(self)

    Accelerator.prepare = paced_prepare
    Accelerator.end_training = paced_end_training


def _hook_trainer() -> None:
    from transformers.trainer import Trainer

    init = Trainer.__init__

    @functools.wraps(init)
    def paced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _add_callback(self)

    Trainer.__init__ = paced_init


def _add_callback(trainer: Any) -> None:
    from pace_strategy.integrations.huggingface import PacingCallback

    _STATE.trainer_accelerators.add(trainer.accelerator)
    if any(isinstance(c, PacingCallback) for c in trainer.callback_handler.callbacks):
        return
    callback = PacingCallback(trainer)
    callback._automatic = True
    trainer.add_callback(callback)


def _after_prepare(accelerator: Any, outputs: Sequence[Any]) -> None:
    """Attach to the DDP or FSDP2 model among ``outputs``: once per process, on every rank (the
    same script makes the same ``prepare`` calls everywhere, so the collective attach lines up)."""
    if _STATE.attached or accelerator in _STATE.trainer_accelerators or accelerator.num_processes < 2:
        return
    from accelerate.optimizer import AcceleratedOptimizer

    from pace_strategy.integrations.accelerate.attach import is_paceable

    models = [o for o in outputs if is_paceable(o)]
    optimizers = [o for o in outputs if isinstance(o, AcceleratedOptimizer)]
    if not models:
        unsupported = [type(o).__name__ for o in outputs if _is_module(o)]
        if unsupported:
            _STATE.warn_once(
                "model", "pace launch: accelerator.prepare returned %s, neither DDP nor FSDP2: not paced",
                ", ".join(unsupported),
            )  # fmt: skip
        pending = _STATE.pending
        if pending is not None and pending[0]() is accelerator and len(optimizers) == 1:
            model = pending[1]()
            _STATE.pending = None
            if model is not None:
                _attach(accelerator, model, optimizers[0])
        return
    # This call's optimizer, else the one prepared before; none yet: the optimizer is made from the
    # prepared model's parameters and prepared next.
    earlier = 0 if optimizers else _prepared_optimizers(accelerator)
    if len(models) > 1 or len(optimizers) > 1 or earlier > 1:
        _STATE.warn_once(
            "several",
            "pace launch: accelerator.prepare returned %d models and %d optimizers: not paced (which one "
            "ends a step?); call attach_pacing(accelerator, model, optimizer=...) in the script",
            len(models),
            len(optimizers) or earlier,
        )
        _STATE.attached = True
    elif optimizers or earlier:
        _attach(accelerator, models[0], optimizers[0] if optimizers else None)
    else:
        _STATE.pending = (weakref.ref(accelerator), weakref.ref(models[0]))


def _attach(accelerator: Any, model: Any, optimizer: Any | None) -> PacingHandle:
    from pace_strategy.integrations.accelerate.attach import attach_pacing

    _STATE.attached = True
    handle = attach_pacing(accelerator, model, optimizer=optimizer)
    handle._automatic = True
    log.info("pace launch: pacing attached to the prepared %s", type(model).__name__)
    return handle


def _prepared_optimizers(accelerator: Any) -> int:
    from pace_strategy.core.errors import PacingConfigError
    from pace_strategy.integrations.accelerate.attach import _prepared

    try:
        return len(_prepared(accelerator, "optimizer"))
    except PacingConfigError:  # a later accelerate moved its list: wait for prepare(optimizer)
        return 0


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _attached_handles() -> list[PacingHandle]:
    # attach_pacing lives in its own module; unless it was imported, nothing is attached.
    attach = sys.modules.get("pace_strategy.integrations.accelerate.attach")
    return [] if attach is None else list(attach._ATTACHED.values())


def finish_attached() -> None:
    """Finish every handle still attached in this process (collective: every rank calls it, at
    ``end_training`` or when the script returns). A failure is logged, never raised: pacing must not
    fail a training that has ended."""
    for handle in _attached_handles():
        try:
            handle.finish()
        except Exception:
            log.warning("pace launch: finishing pacing failed; its run record is closed", exc_info=True)
            handle.detach()


def fail_attached(error: BaseException) -> None:
    """The script raised on this rank: close every attached record as failed, locally."""
    for handle in _attached_handles():
        if handle.session is not None:
            handle.session.fail(error)
        handle.detach()
