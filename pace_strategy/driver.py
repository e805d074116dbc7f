"""The pacing driver: what every adapter does with a session, once.

An adapter translates its framework's events into these calls and nothing more:

- :meth:`PacingDriver.begin_step` when a step's batch is in hand (and, rebalancing, each batch's
  share is taken), :meth:`PacingDriver.end_step` after the synchronizing optimizer step (collective);
- :meth:`PacingDriver.state_dict` / :meth:`PacingDriver.load_state_dict` with the checkpoint (a
  state restored before the session exists is kept until it does);
- :meth:`PacingDriver.finish` at the normal end (collective: the last window), :meth:`PacingDriver.fail`
  on an exception and :meth:`PacingDriver.detach` to stop early (both local); the hooks the adapter
  registered (:meth:`PacingDriver.on_detach`) are undone in reverse order either way;
- used as a context manager: a normal exit finishes, an exception fails.

A run that ends without any of them is closed by the one exit handler of the session layer
(:mod:`pace_strategy.session`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.exchange import WindowResult
from pace_strategy.session import PacingSession

__all__ = ["BatchShares", "PacingDriver", "WindowTally"]


@dataclass
class WindowTally:
    """What a run's decided windows add up to, in a few numbers per window."""

    windows: int = 0  #: windows decided
    steps: int = 0  #: usable steps in them (valid, past warm-up)
    straggler_counts: list[int] = field(default_factory=list)  #: how often each rank arrived last
    skew_ms: list[float] = field(default_factory=list)  #: each window's median unpaced skew
    step_ms: list[float] = field(default_factory=list)  #: each window's median step time

    def add(self, result: WindowResult) -> None:
        stats = result.stats
        self.windows += 1
        if stats.steps == 0:
            return
        self.steps += stats.steps
        counts = list(stats.straggler_counts)
        if len(self.straggler_counts) != len(counts):
            self.straggler_counts = [0] * len(counts)
        self.straggler_counts = [a + b for a, b in zip(self.straggler_counts, counts, strict=True)]
        self.skew_ms.append(stats.median_unpaced_skew_ms)
        self.step_ms.append(stats.median_step_ms)


class BatchShares(Protocol):
    """Rebalancing's data path as the driver sees it
    (:class:`~pace_strategy.integrations.rebalance.DataRebalance`)."""

    def begin_batch(self) -> None: ...
    def end_step(self) -> None: ...


class PacingDriver:
    """One rank's pacing as an adapter drives it.

    Args:
        config: the validated configuration in effect.
        session: this rank's session, or ``None`` (one process: every call does nothing; or an
            adapter that starts it later and sets :attr:`session` then).
    """

    def __init__(self, config: PacingConfig, session: PacingSession | None = None) -> None:
        self.config = config  #: the configuration in effect
        self.session = session  #: ``None``: nothing is measured (one process, or not started yet)
        self.steps = 0  #: optimizer steps ended through this driver
        #: rebalancing's data path (``rebalance=True``, set by the adapter that rebuilt the loader)
        self.rebalance: BatchShares | None = None
        #: a running tally of the windows this rank decided (a few numbers each: a window's gathered
        #: rows are not kept, they would grow with W x steps)
        self.tally = WindowTally()
        self._undo: list[Callable[[], object]] = []
        #: the one buffer of a state restored while there is no session: (state, step, source)
        self._loaded: tuple[dict[str, Any] | None, int, str | None] | None = None

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int | None = None) -> None:
        """The step's batch is in hand (label: ``step``, default the steps ended so far); with
        rebalancing, the batch's share is taken. Local."""
        if self.session is None:
            return
        self.session.pacer.begin_step(self.steps if step is None else step)
        if self.rebalance is not None:
            self.rebalance.begin_batch()

    def begin_forward(self, step: int | None = None) -> None:
        """A training forward: the step begins here unless its batch began it (a loop that feeds the
        model itself; no batch share is taken). Local."""
        if self.session is not None:
            self.session.pacer.begin_step(self.steps if step is None else step)

    def interrupt(self) -> None:
        """Something other than training ran (validation, evaluation): the step in progress, if any,
        is not a training step, and the next does not follow the last. Local."""
        if self.session is not None:
            self.session.pacer.interrupt()

    def end_step(self, samples: int | None = None, tokens: int | None = None) -> WindowResult | None:
        """The synchronizing optimizer step is done; ``samples``: what this rank trained on (the
        rebalancing loader reports it itself); ``tokens``: the tokens it trained on, where inputs differ
        in length (replaces what the model's forwards counted). Collective: every rank, every step."""
        self.steps += 1
        if self.session is None:
            return None
        if samples is not None and self.rebalance is None:
            self.session.pacer.set_samples(samples)
        if tokens is not None:
            self.session.pacer.set_tokens(tokens)
        result = self.session.end_step()
        if result is not None:
            self.tally.add(result)
        if self.rebalance is not None:
            self.rebalance.end_step()
        return result

    @property
    def live_session(self) -> PacingSession | None:
        """The session while it is open (``None`` once finished or closed)."""
        session = self.session
        return None if session is None or session.finished else session

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The pacing state after ``step`` steps (default :attr:`steps`): plain JSON-able data, the
        same on every rank (a restored one while there is no session; empty before either). Local."""
        if self.session is not None:
            return self.session.state.state_dict(self.steps if step is None else step)
        restored = self._loaded[0] if self._loaded is not None else None
        return dict(restored) if restored is not None else {}

    def load_state_dict(
        self, state: Mapping[str, Any] | None, source: str | None = None, step: int | None = None
    ) -> None:
        """Restore what :meth:`state_dict` saved (every rank, the same state; local): now, or, without
        a session, when :meth:`adopt` gets one. The step count continues from the saved one (``step``:
        the framework's own count, for the ``resume`` line when the state has none); ``source``: the
        checkpoint's path. A state that cannot be restored is skipped with a warning; an empty one
        restores nothing (the ``resume`` line says so)."""
        loaded = dict(state) if state else None
        if loaded is not None and type(loaded.get("step")) is int:
            self.steps = loaded["step"]
        at = self.steps if step is None else step
        if self.session is None:
            self._loaded = (loaded, at, source)
        else:
            self.session.state.load(loaded, source=source, step=at)

    def adopt(self, session: PacingSession) -> None:
        """The adapter started ``session`` (adapters that cannot start it at construction): a state
        restored before is loaded now."""
        self.session = session
        if self._loaded is not None:
            (loaded, step, source), self._loaded = self._loaded, None
            session.state.load(loaded, source=source, step=step)

    # ------------------------------------------------------------------ ending
    def on_detach(self, undo: Callable[[], object]) -> None:
        """Undo ``undo`` (a hook's remover) when the driver detaches; undone in reverse order."""
        self._undo.append(undo)

    def finish(self) -> None:
        """The normal end of training, every rank (collective): the last window exchanged and
        published, the record closed (``completed``); then :meth:`detach`. Idempotent."""
        try:
            if self.session is not None and not self.session.finished:
                for result in self.session.finish():
                    self.tally.add(result)
        finally:
            self.detach()

    def fail(self, error: BaseException) -> None:
        """Training failed on this rank: the record closed as ``failed``, locally (the peers may be
        gone); then :meth:`detach`."""
        if self.session is not None:
            self.session.fail(error)
        self.detach()

    def detach(self) -> None:
        """Undo every registered hook (local) and close a session that is still open as
        ``detached``. Idempotent."""
        while self._undo:
            self._undo.pop()()
        if self.session is not None:
            self.session.close(status="detached")

    def __enter__(self) -> PacingDriver:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is None:
            self.finish()
        else:
            self.fail(error)
