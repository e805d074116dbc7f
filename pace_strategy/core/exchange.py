"""The window exchange as the Pacer sees it: one interface, two implementations.

Each window, every rank launches the exchange of its rows (``start``), waits for it a step later on a
side thread (``wait_window``), and either decides the window from the gathered rows (``decides``) and
hands its decision on (``publish``), or receives the decision taken for it (``receive``). Both
implementations take every decision with the same code, on the same rows, so their decisions are
identical:

- :class:`FlatExchange` (``exchange_topology: flat``): one all-gather of every rank's rows to every
  rank; every rank decides, nothing is handed on;
- :class:`~pace_strategy.core.hierarchy.NodeLeaderExchange` (``exchange_topology: node_leaders``):
  the node leaders gather the whole window and decide; each sends its decision to its node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pace_strategy.core.comm import PendingGather, WindowExchange
from pace_strategy.core.rebalance import RebalanceDecision
from pace_strategy.core.records import Decision
from pace_strategy.core.skew import WindowStats

__all__ = ["Exchange", "FlatExchange", "WindowResult"]


@dataclass(frozen=True)
class WindowResult:
    """What one exchanged window produced: the gathered window, its statistics and the new decision.

    Per-step records for telemetry: ``StepSummarizer.summarize(result.gathered, nodes=result.node_steps)``.
    """

    window: int
    gathered: torch.Tensor  #: the raw window, ``[world_size, steps, NUM_FIELDS]`` float64
    stats: WindowStats
    decision: Decision
    warnings: tuple[str, ...] = ()  #: straggler warnings to log (rate-limited)
    #: the rebalancing decision (``None``: no share schedule attached, or ``config.rebalance.enabled`` off)
    rebalance: RebalanceDecision | None = None
    #: a node leader's: every node's per-step reductions (:func:`~pace_strategy.core.summary.node_steps`,
    #: ``[nodes, steps, NUM_FIELDS]``), for ``StepSummarizer.summarize(gathered, nodes=node_steps)``
    node_steps: torch.Tensor | None = None


class Exchange(Protocol):
    """One rank's side of the window exchange (module doc). ``start`` and the waits are collective
    over the exchange's groups; every rank calls them once per window, in order."""

    #: whether this rank decides windows (it waits for the whole window); else it receives decisions
    decides: bool

    def start(self, rows: torch.Tensor, first_step: int, last_step: int) -> PendingGather:
        """Launch the exchange of this rank's rows ``[steps, fields]`` (float64) without waiting."""
        ...

    def wait_window(self, pending: PendingGather) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Wait (bounded) for the launched exchange. A rank that decides: the whole window
        ``[world_size, steps, fields]`` and the nodes' per-step reductions (``None`` when flat); any
        other rank: ``None``."""
        ...

    def completed(self, pending: PendingGather, waited: bool) -> bool:
        """Whether this rank holds the whole window without waiting any longer (``waited``: the side
        thread's wait returned): a rank that stops alone may decide it."""
        ...

    def publish(self, result: WindowResult) -> None:
        """A rank that decides: hand the window's decision to the ranks that receive it."""
        ...

    def receive(self) -> WindowResult:
        """A rank that does not decide: the decision taken for the window it launched last (its
        statistics, not its rows)."""
        ...


class FlatExchange:
    """Every rank's rows to every rank with one all-gather; every rank decides (module doc)."""

    decides = True

    def __init__(self, exchange: WindowExchange) -> None:
        self.exchange = exchange

    def start(self, rows: torch.Tensor, first_step: int, last_step: int) -> PendingGather:
        return self.exchange.start(rows, first_step, last_step)

    def wait_window(self, pending: PendingGather) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.exchange.wait(pending), None

    def completed(self, pending: PendingGather, waited: bool) -> bool:
        return waited or pending.work is None or bool(pending.work.is_completed())

    def publish(self, result: WindowResult) -> None:
        pass  # every rank decided the same

    def receive(self) -> WindowResult:
        raise RuntimeError("every rank of the flat exchange decides: there is no decision to receive")
