"""The TensorBoard dashboard (a custom-scalars layout of the ``pace/`` tags) into a framework's own
TensorBoard writers: every adapter says where its writers are, this module writes the layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["add_scalars", "custom_scalars_sink", "is_tensorboard_logger", "tensorboard_loggers"]


def add_scalars(writer: Any, metrics: Mapping[str, float], step: int) -> None:
    """Every tag of ``metrics`` at ``step`` into ``writer``: one TensorBoard event holding them all
    where ``writer`` is torch's ``SummaryWriter``, else one ``add_scalar`` per tag (anything with
    ``add_scalar``). One event, because each event is a hand-over to the writer's thread through a
    queue of 10: 13 tags one by one took 1.9 ms of rank 0's CPU per step (docs/telemetry.md, "What
    the tags cost"). TensorBoard reads the values of one event as it reads them one per event."""
    if type(writer).__module__.startswith("torch.utils.tensorboard") and hasattr(writer, "_get_file_writer"):
        from tensorboard.compat.proto.summary_pb2 import Summary

        # what SummaryWriter.add_scalar writes for a float (``simple_value``), one value per tag
        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in metrics.items()]
        writer._get_file_writer().add_summary(Summary(value=values), step)
        return
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, step)


def custom_scalars_sink(writers: Callable[[], Iterable[Any]]) -> Callable[[Mapping[str, Any]], None]:
    """A session's ``dashboard``: the layout goes to every writer ``writers()`` returns that has
    ``add_custom_scalars`` (torch's and tensorboardX's ``SummaryWriter``); others are skipped."""

    def write(layout: Mapping[str, Any]) -> None:
        for writer in writers():
            add = getattr(writer, "add_custom_scalars", None)
            if callable(add):
                add(dict(layout))

    return write


def is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` is one of Lightning's (or Fabric's) TensorBoard loggers, told by its class
    name so that neither Lightning package need be imported."""
    return "TensorBoard" in type(logger).__name__


def tensorboard_loggers(loggers: Iterable[Any]) -> list[Any]:
    """The writers of Lightning's (or Fabric's) TensorBoard loggers among ``loggers`` (their
    ``experiment``); the other loggers are not touched (reading ``experiment`` may start one)."""
    return [logger.experiment for logger in loggers if is_tensorboard_logger(logger)]
