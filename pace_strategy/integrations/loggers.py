"""The ``pace/`` tags into a Lightning or Fabric run's own loggers, from the telemetry thread.

A run's loggers are called by the training thread (its own metrics, ``save``, ``finalize``) and, for
the tags, by the session's telemetry thread. TensorBoard's writer is safe to share (its events go
through a queue under a lock); the other loggers promise nothing: Lightning's ``CSVLogger`` keeps a
list of rows that ``save`` writes and then replaces, so a row appended meanwhile is lost, and a row
whose columns the header lacks makes the CSV writer raise in the training thread. Each such logger's
methods are therefore serialized by a lock of its own (the instance's methods wrapped, unwrapped at
the end of the session): the training thread waits at most while one step's tags are logged.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from pace_strategy.integrations.dashboard import add_scalars, is_tensorboard_logger
from pace_strategy.telemetry.sinks import MetricsSink

__all__ = ["LOCKED_METHODS", "TagHandOver", "loggers_sink"]

#: the logger methods the lock serializes (those that touch what ``log_metrics`` writes)
LOCKED_METHODS = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")


def loggers_sink(loggers: Iterable[Any]) -> tuple[MetricsSink | None, Callable[[], None]]:
    """The session's metrics sink into ``loggers`` (each step's tags as one event into the writer of
    a TensorBoard logger without a ``prefix``, into every other logger's ``log_metrics``), and the
    function that undoes the locking (idempotent). ``None`` without loggers."""
    loggers = list(loggers)
    # TensorBoard's writer queues every event under its own lock: safe to share as it is
    undo = [_serialize(logger) for logger in loggers if not is_tensorboard_logger(logger)]
    one_event = [is_tensorboard_logger(logger) and not getattr(logger, "_prefix", "") for logger in loggers]

    def sink(metrics: Mapping[str, float], step: int) -> None:
        for logger, whole in zip(loggers, one_event, strict=True):
            if whole:  # its writer read at the call: Lightning makes it at the first use
                add_scalars(logger.experiment, metrics, step)
            else:
                logger.log_metrics(dict(metrics), step=step)

    def unlock() -> None:
        while undo:
            undo.pop()()

    return (sink if loggers else None), unlock


def _serialize(logger: Any) -> Callable[[], None]:
    """Wrap ``logger``'s :data:`LOCKED_METHODS` (the instance's) in one re-entrant lock; returns the
    undo, which leaves a method someone replaced since as it is."""
    lock = threading.RLock()
    wrapped: dict[str, Callable[..., Any]] = {}
    for name in LOCKED_METHODS:
        method = getattr(logger, name, None)
        if not callable(method) or name in vars(logger):
            continue

        def locked(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            with lock:
                return _method(*args, **kwargs)

        wrapped[name] = functools.update_wrapper(locked, method)
        setattr(logger, name, wrapped[name])

    def undo() -> None:
        for name, wrapper in wrapped.items():
            if vars(logger).get(name) is wrapper:
                delattr(logger, name)
        wrapped.clear()

    return undo


class TagHandOver:
    """Tagged steps from the telemetry thread, handed to loggers on the training thread.

    Where a logger is also called by the training thread and promises nothing about a second one
    (the HF Trainer's reporting callbacks, Accelerate's trackers other than TensorBoard), the tags
    wait here (:meth:`put`) and the training thread takes them in step order (:meth:`drain`) at
    the end of a step. Bounded: beyond :attr:`QUEUE` waiting steps the oldest are dropped."""

    #: tagged steps kept (a window's worth many times over)
    QUEUE = 4096

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=self.QUEUE)
        self._draining = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step's tags (telemetry thread)."""
        self._queue.append((step, dict(metrics)))

    def drain(self) -> Iterator[tuple[int, dict[str, float]]]:
        """The waiting steps and their tags, oldest first (training thread). Not re-entered: a
        SIGTERM handler that detaches while this thread is in a logger's call gets nothing."""
        if not self._queue or not self._draining.acquire(blocking=False):
            return
        try:
            while self._queue:
                yield self._queue.popleft()
        finally:
            self._draining.release()

    def clear(self) -> None:
        """Drop what waits (the loggers have ended)."""
        self._queue.clear()
