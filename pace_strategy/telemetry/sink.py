"""The protocol of rank 0's telemetry sinks and the window they receive (:mod:`pace_strategy.telemetry.sinks`
builds and runs them).

Every exchanged window goes to every sink as one :class:`Published` window, its per-step summaries made
once for all of them; a hang verdict goes to every sink too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pace_strategy.core.exchange import WindowResult
from pace_strategy.core.records import StepSummary

__all__ = ["Published", "Sink"]


@dataclass(frozen=True)
class Published:
    """One exchanged window as every sink receives it."""

    result: WindowResult
    summaries: Sequence[StepSummary]  #: one per step of the window, in step order
    #: ``False``: the tag writer fell behind and this window's per-step tags are dropped (a sink that
    #: keeps every step, the run record, writes it all the same)
    tags: bool = True


class Sink(Protocol):
    """Where rank 0's telemetry goes. Called on the telemetry thread (``write``, ``close``) and on the
    watchdog's (``hang``); an exception turns telemetry off for the run, never training."""

    def write(self, window: Published) -> None:
        """One exchanged window, in order."""

    def hang(self, line: Mapping[str, Any]) -> None:
        """The watchdog named hung ranks (``line``: the run record's ``hang`` line)."""

    def close(self) -> None:
        """The run ended: every window was written (idempotent)."""
