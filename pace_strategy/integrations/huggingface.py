"""Hugging Face ``transformers.Trainer`` adapter: :class:`PacingCallback`, pacing for the model a Trainer
trains, with the ``pace/`` tags in the Trainer's own TensorBoard logs.

The Trainer runs on an Accelerator of its own, so the callback delegates to
:func:`~pace_strategy.integrations.accelerate.attach_pacing` (the same hooks: the DDP monitor or the
FSDP2 collectives, a step from the first batch to the optimizer step that synchronizes gradients,
input wait in the training dataloader). Only its telemetry differs: the Trainer reports through its
callbacks, not ``accelerator.log``, so the tags go wherever ``report_to`` points: into the writer
of its ``TensorBoardCallback`` (one event per step, from the telemetry thread) and through every
other reporting callback's ``on_log`` (MLflow, W&B, Comet, ...) on the training thread.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from typing_extensions import override

from pace_strategy.core.config import PacingConfig
from pace_strategy.integrations.accelerate.attach import (
    PacingHandle,
    RebalanceLoop,
    _config_of,
    attach_pacing,
    is_paceable,
)
from pace_strategy.integrations.dashboard import add_scalars
from pace_strategy.integrations.env import record_dir
from pace_strategy.integrations.loggers import TagHandOver

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["PacingCallback"]

log = logging.getLogger(__name__)


class PacingCallback(TrainerCallback):
    """Monitor and pace the model ``trainer`` trains (DDP or FSDP2, two processes or more).

    ::

        trainer = Trainer(model=model, args=args, train_dataset=train)
        trainer.add_callback(PacingCallback(trainer))
        trainer.train()

    At ``on_train_begin`` (every rank) it attaches to ``trainer.model_wrapped``, with the Trainer's
    optimizer and training dataloader; at ``on_train_end`` it finishes (every rank). A step is an
    optimizer step: with ``gradient_accumulation_steps`` only the synchronizing micro-batch ends one.
    The ``pace/`` tags go wherever ``report_to`` points, at the Trainer's ``global_step`` of the step
    they describe, beside its ``train/loss``: into its TensorBoard writer, and through the ``on_log``
    of every other reporting callback (MLflow, W&B, Comet, ClearML, ...) on the training thread at
    the end of a step (each tag's steps in increasing order; the Trainer's own metrics untouched).
    With ``report_to="none"`` only the run record is written. Under ``pace launch`` every Trainer
    gets one without any code.

    Args:
        trainer: the Trainer this callback is added to (the callback needs its accelerator and its
            wrapped model, which a callback's arguments do not carry).
        config: the pacing configuration; default: the ``PACE_*`` variables (``pace launch`` sets
            them from ``pacing_config:``), else the defaults.
        run_dir: the run record's directory (rank 0). Default: the Trainer's TensorBoard directory,
            else ``$PACE_RUN_DIR``, else ``args.output_dir``.
    """

    def __init__(
        self,
        trainer: Any,
        config: PacingConfig | None = None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.trainer = trainer
        self.config = config
        self.run_dir = run_dir
        self.handle: PacingHandle | None = None  #: while training: what attach_pacing returned
        self._tags = _TrainerTags(trainer)
        self._automatic = False  # added by pace launch: gives way to one the script added itself

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = self.trainer.model_wrapped
        if self._automatic and not self._automatic_attaches(model):
            return
        loader, optimizer = kwargs.get("train_dataloader"), kwargs.get("optimizer")
        self._tags.start(state.global_step)
        self.handle = attach_pacing(
            self.trainer.accelerator,
            model,
            _config_of(self.config).tagging_every(logging_interval(args, state)),
            optimizer=self.trainer.optimizer if optimizer is None else optimizer,
            dataloaders=None if loader is None else [loader],
            run_dir=self._run_dir(args),
            metrics_sink=self._tags.write,
            dashboard=self._tags.layout,
            rebalance_loop=trainer_loop(self.trainer, args),
        )
        time_trainer_syncs(self.handle)

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.handle is None:
            return
        if control.should_training_stop:
            # The last step (the Trainer's own flow callback, first in line, said so on every rank
            # alike): finish here, while the other callbacks' trackers are still open, so that the
            # last windows' tags reach them too. Their on_train_end comes before this callback's.
            handle, self.handle = self.handle, None
            handle.finish()  # collective: every rank ends training at this step
        self._tags.flush(args, state, control)

    @override
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Evaluation ran between two steps: its collectives are not the next step's sync points.
        if self.handle is not None:
            self.handle.interrupt()

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        handle, self.handle = self.handle, None
        if handle is None:  # finished at the last step already (on_step_end)
            self._tags.close()
            return
        try:
            handle.finish()  # collective: every rank ends training here
        finally:
            # the trackers of the other callbacks are ended by now: what is left goes to TensorBoard
            # and the record only
            self._tags.close()

    def _automatic_attaches(self, model: Any) -> bool:
        """The one pace launch added attaches unless the script added its own, there is a single
        process, or the model is neither DDP nor FSDP2 (DeepSpeed, ...)."""
        callbacks = self.trainer.callback_handler.callbacks
        if any(isinstance(c, PacingCallback) and not c._automatic for c in callbacks):
            return False
        if self.trainer.accelerator.num_processes < 2:
            return False
        if not is_paceable(model):
            log.warning("pace launch: the Trainer's model is a %s, neither DDP nor FSDP2: not paced",
                        type(model).__name__)  # fmt: skip
            return False
        return True

    def _run_dir(self, args: TrainingArguments) -> Path:
        log_dir = self._tags.log_dir()  # rank 0, where the Trainer writes TensorBoard events
        found = record_dir(self.run_dir, log_dir, fallback=Path(args.output_dir or "."))
        assert found is not None, "a fallback is given"
        return found


def logging_interval(args: Any, state: Any) -> int:
    """Steps between the Trainer's own logs: ``logging_steps`` under ``logging_strategy="steps"``
    (a fraction below 1 is of the run's ``max_steps``, as the Trainer reads it), else 1."""
    if str(getattr(args, "logging_strategy", "steps")).lower().rsplit(".", 1)[-1] != "steps":
        return 1
    steps = float(getattr(args, "logging_steps", 1) or 1)
    if steps < 1:
        steps = math.ceil(steps * max(1, int(getattr(state, "max_steps", 1) or 1)))
    return max(1, int(steps))


def time_trainer_syncs(handle: PacingHandle) -> None:
    """Time the Trainer's own collectives as sync points of the step (see
    :mod:`pace_strategy.hooks.framework_sync`).

    Besides the gradient sync, the Trainer blocks in collectives of its own on every step: before
    it, for a model that takes loss kwargs (``num_items_in_batch``) with
    ``average_tokens_across_devices``, it gathers the step's label count from every rank; after it,
    every ``logging_steps``, it gathers the loss. That is where the ranks wait for one that starts
    its step late (the others are blocked there, then all enter backward together), so their time
    counts as wait. Collectives of evaluation are dropped (:meth:`PacingCallback.on_evaluate`).
    Undone by the handle's ``detach``."""
    session = handle.session
    if session is None:
        return
    from pace_strategy.hooks.framework_sync import time_framework_syncs

    handle.on_detach(time_framework_syncs(session.pacer, session.pacer.exchange.group))


def trainer_loop(trainer: Any, args: Any) -> RebalanceLoop:
    """How ``trainer``'s training loop draws batches and normalizes its loss, for ``rebalance=True``.

    The Trainer accumulates gradients itself (its Accelerator is told one step), fetching all
    ``gradient_accumulation_steps`` batches of an optimizer step before it trains the first (to count
    their label items), one more held by accelerate's DataLoaderShard. It normalizes the loss by the
    label items of the whole global batch, gathered from every rank, under its own rule: with
    ``average_tokens_across_devices`` when the model takes loss kwargs (``num_items_in_batch``) or a
    ``compute_loss_func`` is given. Then every item already weighs the same whatever the shares, and
    no share factor is applied; otherwise the loss is each rank's mean and the factor is applied. The
    rule assumes what the Trainer assumes: that such a model uses ``num_items_in_batch``. A model
    that takes ``**kwargs`` but computes a mean loss of its own should say so with
    ``model.accepts_loss_kwargs = False``, for the Trainer's sake as much as for rebalancing's.
    ``args``: the Trainer's TrainingArguments.
    """
    accumulate = int(getattr(args, "gradient_accumulation_steps", 1))
    global_loss = bool(getattr(args, "average_tokens_across_devices", False)) and bool(
        getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)
    )
    return RebalanceLoop(
        micro_batches=accumulate, prefetch=accumulate + 1, loss_over_global_batch=global_loss
    )


#: reporting callbacks whose ``on_log`` does more than log the values given: DVCLive's advances its
#: own step counter on every call (the Trainer's steps would drift from DVCLive's); CodeCarbon's
#: logs nothing
NOT_LOGGED_THROUGH = ("DVCLiveCallback", "CodeCarbonCallback")


class _TrainerTags:
    """The ``pace/`` tags into the Trainer's reporting callbacks (rank 0).

    TensorBoard: written into the writer of the Trainer's ``TensorBoardCallback`` on the session's
    telemetry thread, so a step costs the training thread nothing. The Trainer closes its writer in
    its own ``on_train_end``, before this callback's (callbacks run in the order added) and so
    possibly before the last window is published: from then on the tags go to a writer of our own
    in the same directory, a later event file that TensorBoard reads after the Trainer's. One file
    is written at a time, so TensorBoard's live reload misses nothing.

    Every other reporting callback (``report_to``: MLflow, W&B, Comet, ...): its trackers' clients
    promise nothing about a second thread, so the tags wait in a queue and :meth:`flush` hands them
    to its ``on_log`` on the training thread at the end of a step, each with a copy of the
    Trainer's state whose ``global_step`` is the step they describe. No step argument reaches a
    tracker that drops steps behind its own (W&B plots against ``train/global_step``).
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._lock = threading.Lock()
        self._first_step = 0
        self._log_dir: str | None = None
        self._used: Any | None = None  # the Trainer's writer, last seen open
        self._own: Any | None = None
        self._others: list[Any] = []  # the reporting callbacks other than TensorBoard's
        self._handover = TagHandOver()  # the other reporting callbacks' tags

    def start(self, global_step: int) -> None:
        self._first_step = global_step
        self._log_dir = self.log_dir()  # while the Trainer's writer is open (on_train_begin)
        self._others = self._reporting_callbacks()

    def _reporting_callbacks(self) -> list[Any]:
        """The Trainer's reporting callbacks (``report_to``) other than TensorBoard's."""
        from transformers.integrations import INTEGRATION_TO_CALLBACK, TensorBoardCallback

        kinds = tuple(
            kind
            for kind in INTEGRATION_TO_CALLBACK.values()
            if kind is not TensorBoardCallback and kind.__name__ not in NOT_LOGGED_THROUGH
        )
        return [c for c in self._trainer.callback_handler.callbacks if isinstance(c, kinds)]

    def flush(self, args: Any, state: Any, control: Any) -> None:
        """Hand the queued tags to the other reporting callbacks (training thread, rank 0)."""
        for global_step, metrics in self._handover.drain():
            at_step = copy.copy(state)  # shallow: the log history stays the Trainer's own
            at_step.global_step = global_step
            for callback in self._others:
                callback.on_log(args, at_step, control, logs=dict(metrics))

    def _trainer_writer(self) -> Any | None:
        # Imported here: transformers.integrations costs seconds, and a Trainer that reports to
        # TensorBoard has imported it already.
        from transformers.integrations import TensorBoardCallback

        for callback in self._trainer.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                return callback.tb_writer
        return None

    def log_dir(self) -> str | None:
        writer = self._trainer_writer()
        return None if writer is None else str(writer.get_logdir())

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        # pace step i (from 0) is the Trainer's (i + 1)-th optimizer step: global_step i + 1
        global_step = self._first_step + step + 1
        if self._others:
            self._handover.put(global_step, metrics)
        with self._lock:
            writer = self._trainer_writer()
            if writer is not None:
                self._used, self._log_dir = writer, str(writer.get_logdir())
                try:
                    add_scalars(writer, metrics, global_step)
                    return
                except Exception:  # closed by the Trainer between the look-up and the write
                    pass
            own = self._own_writer()
            if own is not None:  # None: the Trainer has no TensorBoard writer, the run record only
                add_scalars(own, metrics, global_step)

    def _own_writer(self) -> Any | None:
        """Our writer in the Trainer's TensorBoard directory, for what comes after the Trainer closed
        its own (``None`` when the Trainer had none). Under the lock."""
        if self._own is None and self._log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._own = SummaryWriter(log_dir=self._log_dir)
        return self._own

    def layout(self, layout: Mapping[str, Any]) -> None:
        """The dashboard layout, into the Trainer's writer (or, once it is closed, our own in its
        directory)."""
        with self._lock:
            writer = self._trainer_writer() or self._own_writer()
            if writer is not None:
                writer.add_custom_scalars(dict(layout))

    def close(self) -> None:
        self._handover.clear()  # the other callbacks' trackers are ended (their on_train_end came first)
        with self._lock:
            if self._own is not None:
                self._own.close()
                self._own = None
            if self._used is not None and self._used is not self._trainer_writer():
                # A write that raced the Trainer's close reopened its writer (torch's SummaryWriter
                # does on a write after close): close it again. A no-op otherwise.
                self._used.close()
            self._used = None
