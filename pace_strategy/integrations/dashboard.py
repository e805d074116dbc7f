"""The TensorBoard dashboard (a custom-scalars layout of the ``pace/`` tags) into a framework's own
TensorBoard writers: every adapter says where its writers are, this module writes the layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["add_scalars", "custom_scalars_sink", "is_tensorboard_logger", "tensorboard_loggers"]


def add_scalars(writer: Any, metrics: Mapping[str, float], step: int) -> None:
    """Each tag of ``metrics`` into ``writer`` (a ``SummaryWriter``, or anything with ``add_scalar``)."""
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
