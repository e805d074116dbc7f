"""The ``pace/`` tags into an Accelerator's trackers (``log_with=...``), rank 0.

A TensorBoard tracker's writer takes each step's tags as one event, from the session's telemetry
thread (its events go through a queue under a lock: safe to share, and a step costs the training
thread nothing). Every other tracker (MLflow, W&B, Comet, Aim, ClearML, DVCLive, ...) is a client that
promises nothing about a second thread, and is also called by the training thread's own
``accelerator.log``: its tags wait in a queue that :meth:`TrackerTags.flush` empties on the training
thread, after each optimizer step and when pacing finishes.

Steps: the tags describe steps up to a window before the one being trained. Most trackers take a
step in any order (``tracker.log(metrics, step=step)``). W&B does not: a ``step`` below its run's
current one is dropped, and every series of a run shares that step. So W&B gets the tags without a
step, into the run's current row (``commit=False``: W&B's step never moves for them, whatever the
script's own ``accelerator.log(step=)`` does), with their own step as ``pace/step``, which the run
is told to plot them against (``define_metric("pace/*", step_metric="pace/step")``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pace_strategy.integrations.dashboard import add_scalars
from pace_strategy.integrations.loggers import TagHandOver

__all__ = ["TrackerTags", "is_tensorboard_tracker", "tensorboard_writers"]

#: the series W&B plots the tags against (the pace step each describes)
WANDB_STEP = "pace/step"


def is_tensorboard_tracker(tracker: Any) -> bool:
    """One of accelerate's TensorBoard trackers (``log_with="tensorboard"``), with its writer."""
    return getattr(tracker, "name", None) == "tensorboard" and hasattr(tracker, "writer")


def tensorboard_writers(accelerator: Any) -> list[Any]:
    """The writers of the accelerator's TensorBoard trackers."""
    return [t.writer for t in getattr(accelerator, "trackers", []) if is_tensorboard_tracker(t)]


class TrackerTags:
    """The session's metrics sink into ``accelerator``'s trackers (:meth:`write`, telemetry thread)
    and the hand-over to the non-TensorBoard ones (:meth:`flush`, training thread)."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        self._handover = TagHandOver()  # the non-TensorBoard trackers' tags
        self._wandb_runs: set[int] = set()  # runs told what to plot the tags against

    def _trackers(self) -> list[Any]:
        return list(getattr(self._accelerator, "trackers", []))

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's tags (telemetry thread): into each TensorBoard writer now, the rest queued."""
        queued = False
        for tracker in self._trackers():
            if is_tensorboard_tracker(tracker):
                add_scalars(tracker.writer, metrics, step)
            elif not queued:
                self._handover.put(step, metrics)
                queued = True

    def flush(self, *_: Any) -> None:
        """Hand the queued tags to the non-TensorBoard trackers, in step order (training thread;
        also an optimizer step post hook, hence the ignored arguments)."""
        if not self._handover:  # the common case, after every optimizer step
            return
        others = [t for t in self._trackers() if not is_tensorboard_tracker(t)]
        for step, metrics in self._handover.drain():
            for tracker in others:
                self._log(tracker, metrics, step)

    def _log(self, tracker: Any, metrics: dict[str, float], step: int) -> None:
        if getattr(tracker, "name", None) != "wandb":
            tracker.log(dict(metrics), step=step)
            return
        run = tracker.run
        if id(run) not in self._wandb_runs:
            run.define_metric(WANDB_STEP)
            run.define_metric("pace/*", step_metric=WANDB_STEP)
            self._wandb_runs.add(id(run))
        run.log({**metrics, WANDB_STEP: step}, commit=False)
