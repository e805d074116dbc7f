"""Input-wait timing for any framework: a DataLoader whose iterators report blocked time to a session."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from pace_strategy.session import PacingSession

__all__ = ["DataWaitHook", "forward_tokens", "loader_workers", "time_dataloader"]


def forward_tokens(args: Any, kwargs: Any) -> int:
    """The tokens a forward (or a batch, as ``(batch,)``) computes on: the size of its ``input_ids``
    (a keyword argument, as Hugging Face models take it; a batch dict's; the first positional integer
    tensor, or the first element of a tuple batch), padding included, since a padded batch computes on
    every position; 0 when it has none. Read from the shape only: never a device synchronization."""
    ids = kwargs.get("input_ids") if isinstance(kwargs, dict) else None
    if ids is None and args:
        first = args[0]
        if isinstance(first, (tuple, list)) and first:
            first = first[0]
        if isinstance(first, dict):
            ids = first.get("input_ids")
        elif getattr(first, "dtype", None) in (torch.int64, torch.int32):
            ids = first
    numel = getattr(ids, "numel", None)
    return int(numel()) if callable(numel) else 0


def loader_workers(loader: object) -> int | None:
    """The worker processes of a DataLoader (accelerate's prepared loaders are DataLoaders too), or
    ``None`` for anything else."""
    workers = getattr(loader, "num_workers", None) if isinstance(loader, DataLoader) else None
    return workers if isinstance(workers, int) else None


@dataclass(frozen=True)
class _Timing:
    session: Callable[[], PacingSession | None]
    on_batch: Callable[[PacingSession], None] | None
    base: type[DataLoader[Any]]  #: the loader's own class


#: loader -> its current timing; read by the timed class's ``__iter__`` once per epoch.
_TIMINGS: weakref.WeakKeyDictionary[Any, _Timing] = weakref.WeakKeyDictionary()


class _TimedIterator:
    """Forwards a DataLoader iterator and reports the time each ``next`` blocked as data wait."""

    def __init__(self, iterator: Iterator[Any], timing: _Timing) -> None:
        self._iterator = iterator
        self._timing = timing

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter_ns()
        try:
            batch = next(self._iterator)
        finally:
            session = self._timing.session()
            if session is not None:
                session.pacer.add_data_wait((time.perf_counter_ns() - started) / 1e6)
        if session is not None and self._timing.on_batch is not None:
            self._timing.on_batch(session)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


#: loader class -> its timed subclass, made once per class.
_TIMED_CLASSES: dict[type, type] = {}


def _timed_class(base: type[DataLoader[Any]]) -> type:
    """The subclass of ``base`` whose iterators are timed."""
    timed = _TIMED_CLASSES.get(base)
    if timed is None:

        def __iter__(self: Any) -> Any:
            iterator = base.__iter__(self)
            timing = _TIMINGS.get(self)
            return iterator if timing is None else _TimedIterator(iterator, timing)

        namespace = {"__iter__": __iter__, "__module__": __name__}
        timed = _TIMED_CLASSES[base] = type(f"Timed{base.__name__}", (base,), namespace)
    return timed


def _set_class(loader: Any, cls: type) -> None:
    """The one place a live loader's class changes (to the timed subclass and back).

    Neither torch's ``DataLoader`` nor accelerate's ``DataLoaderShard`` has a public hook on the
    iterator it returns, and the loader object is already held by the framework (Lightning) or by the
    user's script (Accelerate, after ``prepare``), so a wrapper cannot be handed out instead. A
    subclass keeps every ``isinstance(loader, DataLoader)`` check true. ``object``'s own ``__class__``
    slot is used because accelerate's ``DataLoaderShard`` shadows ``__class__`` with a read-only
    property (to look like a plain DataLoader).
    """
    object.__dict__["__class__"].__set__(loader, cls)


class DataWaitHook:
    """What :func:`time_dataloader` returns: :meth:`remove` gives the loader its own class back."""

    def __init__(self, loader: Any, timing: _Timing) -> None:
        self._loader = weakref.ref(loader)
        self._timing = timing

    def remove(self) -> None:
        """Stop timing; a no-op once a later :func:`time_dataloader` call took the loader over."""
        loader = self._loader()
        if loader is not None and _TIMINGS.get(loader) is self._timing:
            del _TIMINGS[loader]
            _set_class(loader, self._timing.base)


def time_dataloader(
    dataloader: Any,
    session: Callable[[], PacingSession | None],
    on_batch: Callable[[PacingSession], None] | None = None,
) -> DataWaitHook | None:
    """Make ``dataloader``'s iterators report input wait to ``session()`` (in place; keeps its type).

    ``session`` is called at every batch; ``None`` means "not now" (nothing is reported). ``on_batch``
    runs after each batch is returned (a framework without a "batch ready" event uses it to begin the
    step). Calling it again on the same loader replaces ``session`` and ``on_batch`` (never times
    twice). Returns the hook that undoes it, or ``None`` (and does nothing) when ``dataloader`` is not
    a ``torch.utils.data.DataLoader``; the caller may ignore it.
    """
    if not isinstance(dataloader, DataLoader):
        return None
    previous = _TIMINGS.get(dataloader)
    # type(), not __class__: accelerate's DataLoaderShard's __class__ property says DataLoader.
    base = type(dataloader) if previous is None else previous.base
    timing = _TIMINGS[dataloader] = _Timing(session, on_batch, base)
    if previous is None:
        _set_class(dataloader, _timed_class(base))
    return DataWaitHook(dataloader, timing)
