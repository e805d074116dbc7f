"""Input-wait timing for any framework: a DataLoader whose iterators report blocked time to a session."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from pace_strategy.session import PacingSession

__all__ = ["time_dataloader"]


class _TimedIterator:
    """Forwards a DataLoader iterator and reports the time each ``next`` blocked as data wait."""

    def __init__(
        self,
        iterator: Any,
        session: Callable[[], PacingSession | None],
        on_batch: Callable[[PacingSession], None] | None,
    ) -> None:
        self._iterator = iterator
        self._session = session
        self._on_batch = on_batch

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter_ns()
        try:
            batch = next(self._iterator)
        finally:
            session = self._session()
            if session is not None:
                session.pacer.add_data_wait((time.perf_counter_ns() - started) / 1e6)
        if session is not None and self._on_batch is not None:
            self._on_batch(session)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def time_dataloader(
    dataloader: Any,
    session: Callable[[], PacingSession | None],
    on_batch: Callable[[PacingSession], None] | None = None,
) -> None:
    """Make ``dataloader``'s iterators report input wait to the session (in place; keeps its type).

    ``on_batch`` runs after each batch is returned (a framework without a "batch ready" event uses it
    to begin the step).

    The loader's class is swapped for a subclass whose ``__iter__`` wraps the iterator, so every
    ``isinstance(loader, DataLoader)`` check the framework makes still holds.
    """
    if not isinstance(dataloader, DataLoader) or getattr(dataloader, "_pace_timed", False):
        return
    base = type(dataloader)

    def __iter__(self: Any) -> Any:
        return _TimedIterator(base.__iter__(self), session, on_batch)

    timed = type(f"Timed{base.__name__}", (base,), {"__iter__": __iter__, "_pace_timed": True})
    # object's own __class__ slot: some loaders (accelerate's DataLoaderShard) shadow __class__ with a
    # read-only property to look like a plain DataLoader.
    object.__dict__["__class__"].__set__(dataloader, timed)
