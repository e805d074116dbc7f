"""The node-leader window exchange (``exchange_topology: node_leaders``).

The flat exchange all-gathers every rank's rows of a window to every rank: each rank receives
``(W - 1) x K x 17`` float64 and decides on all of them, and the ring takes W - 1 hops. Here:

1. **within each node**, the ranks all-gather their rows over a node-local gloo group (launched at
   the window's end and collected one step later, as the flat exchange is);
2. **the node leaders** (the lowest rank of each node) all-gather their nodes' blocks over a leader
   group: every leader then holds the whole window, the same on every leader, and takes the window's
   decision with the same code as the flat exchange (so the decisions are identical to it). Each
   block carries one more row: the node's per-step reductions for the step summaries
   (:func:`~pace_strategy.core.summary.node_steps`), from which rank 0 summarizes each step over the
   N nodes instead of the W ranks (1/8 more bytes at 8 ranks per node);
3. **each leader broadcasts the decision** (a few hundred bytes plus a number per rank) to its node.

A rank that is not a leader receives its node's rows and one decision per window, and decides
nothing. Per-rank detail crosses nodes only between leaders. The ring of leaders takes N - 1 hops
for N nodes. What it costs: the leaders' all-gather runs on the window's side thread while training
goes on, a leader's part of the decision on its training thread, and every rank of a node waits for
its leader's decision (benchmarks in docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy.core.comm import PendingGather, WindowExchange, field_major
from pace_strategy.core.errors import PaceDistributedError
from pace_strategy.core.exchange import WindowResult
from pace_strategy.core.rebalance import RebalanceDecision, RebalanceState
from pace_strategy.core.records import NUM_FIELDS, Decision, GcCollect, PolicyState
from pace_strategy.core.skew import WindowStats
from pace_strategy.core.summary import node_steps

__all__ = ["DecisionMessage", "HierarchicalExchange", "NodeLayout", "result_of", "verdict_of"]


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks share a node: ``nodes[i]`` are node ``i``'s ranks, ascending; nodes are
    ordered by their lowest rank, whose rank is the node's leader."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_topology(cls, topology: Sequence[Mapping[str, Any]]) -> NodeLayout:
        """From the gathered placements (``node_rank``, else ``host``)."""
        by_node: dict[Any, list[int]] = {}
        for placement in topology:
            key = placement.get("node_rank")
            key = ("host", placement.get("host")) if key is None else ("node", key)
            by_node.setdefault(key, []).append(int(placement["rank"]))
        return cls(tuple(sorted((tuple(sorted(ranks)) for ranks in by_node.values()), key=lambda n: n[0])))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(n[0] for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")


class HierarchicalExchange:
    """This rank's side of the node-leader exchange (module doc), an
    :class:`~pace_strategy.core.exchange.Exchange`: the leaders decide.

    Args:
        layout: the job's nodes.
        rank: this rank's global rank.
        node_group: a gloo group of this node's ranks (in ``layout`` order: group rank = index).
        leader_group: on a leader, a gloo group of the leaders (group rank = node index); else ``None``.
        timeout_s: every wait's limit (``exchange_timeout_s``).
    """

    def __init__(
        self,
        layout: NodeLayout,
        rank: int,
        node_group: dist.ProcessGroup,
        leader_group: dist.ProcessGroup | None,
        timeout_s: float,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.node = layout.node_of(rank)
        members = layout.nodes[self.node]
        self.is_leader = members[0] == rank
        if self.is_leader != (leader_group is not None):
            raise ValueError(f"rank {rank}: a leader group is given to the node leaders, and only to them")
        self._node = WindowExchange(node_group, members.index(rank), len(members), timeout_s)
        self._leaders = (
            WindowExchange(leader_group, self.node, len(layout.nodes), timeout_s) if leader_group else None
        )
        self._widest = max(len(n) for n in layout.nodes)
        self.world_size = layout.world_size
        self.decides = self.is_leader

    def start(self, rows: torch.Tensor, first_step: int, last_step: int) -> PendingGather:
        """Launch the node-local all-gather of this rank's rows ``[steps, fields]``."""
        return self._node.start(rows, first_step, last_step)

    def wait_window(self, pending: PendingGather) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A leader: the whole window ``[world_size, steps, fields]`` in global rank order (after the
        leaders' all-gather) and every node's :func:`~pace_strategy.core.summary.node_steps`
        ``[nodes, steps, fields]``. Any other rank: ``None``, once its node's gather has completed."""
        block = self._node.wait(pending)  # [node size, steps, fields]
        if self._leaders is None:
            return None
        steps, fields = block.shape[1], block.shape[2]
        widest = self._widest
        padded = torch.full((widest + 1, steps, fields), float("nan"), dtype=block.dtype)
        padded[: block.shape[0]] = block
        padded[widest] = node_steps(block, self.layout.nodes[self.node])
        blocks = self._leaders.gather(padded.reshape((widest + 1) * steps, fields), pending.first_step,
                                      pending.last_step)  # fmt: skip
        blocks = blocks.reshape(len(self.layout.nodes), widest + 1, steps, fields)
        window = field_major(self.world_size, steps, fields, block.dtype)  # as the flat exchange's
        for node, ranks in enumerate(self.layout.nodes):
            window[list(ranks)] = blocks[node, : len(ranks)]
        return window, blocks[:, widest]

    def completed(self, pending: PendingGather, waited: bool) -> bool:
        """Never: a completed node gather is not the window (the leaders' gather may not be done)."""
        return False

    def publish(self, result: WindowResult) -> None:
        """A leader: send the window's decision to its node (:func:`verdict_of`)."""
        self.send_verdict(*verdict_of(result))

    def receive(self) -> WindowResult:
        """Not a leader: the decision its leader sent for the window (:func:`result_of`)."""
        return result_of(self.receive_verdict(), self.world_size)

    def send_verdict(self, meta: Mapping[str, Any], vectors: Mapping[str, Sequence[float]]) -> None:
        """A leader: its node's ranks receive ``meta`` (JSON-able) and ``vectors`` (one number per
        rank each, sent as float64 rows: exact, and read without parsing) from :meth:`receive_verdict`."""
        payload = torch.tensor(
            list(json.dumps({**meta, "$vectors": list(vectors)}).encode()), dtype=torch.uint8
        )
        rows = torch.tensor([list(v) for v in vectors.values()], dtype=torch.float64).reshape(
            len(vectors), self.world_size
        )
        self._broadcast(torch.tensor([payload.numel(), len(vectors)], dtype=torch.int64))
        self._broadcast(payload)
        if len(vectors):
            self._broadcast(rows)

    def receive_verdict(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Not a leader: what its leader sent for the window (:meth:`send_verdict`)."""
        sizes = torch.zeros(2, dtype=torch.int64)
        self._broadcast(sizes)
        payload = torch.zeros(int(sizes[0]), dtype=torch.uint8)
        self._broadcast(payload)
        meta: dict[str, Any] = json.loads(bytes(payload.tolist()).decode())
        rows = torch.zeros(int(sizes[1]), self.world_size, dtype=torch.float64)
        if len(rows):
            self._broadcast(rows)
        return meta, dict(zip(meta.pop("$vectors"), rows, strict=True))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        exchange = self._node
        assert exchange.group is not None
        options = dist.BroadcastOptions()
        options.rootRank = 0  # the leader is the node group's first rank
        try:
            exchange.group.broadcast([tensor], options).wait(exchange.timeout)
        except RuntimeError as error:
            raise exchange._error(error, -1, -1) from error


def check_layout(layout: NodeLayout, rank: int, world_size: int) -> None:
    """Raise (naming ``rank``, the rank that checks) when the placements do not cover every rank once."""
    ranks = sorted(r for n in layout.nodes for r in n)
    if ranks != list(range(world_size)):
        raise PaceDistributedError(
            rank, world_size, f"the placements give nodes {layout.nodes}, not {world_size} ranks"
        )


#: what a node leader sends its node of a window's decision: scalars and text (JSON), and the per-rank
#: vectors (one float64 row each: no per-number parsing at thousands of ranks)
DecisionMessage = tuple[dict[str, Any], Mapping[str, "Sequence[float] | torch.Tensor"]]


def verdict_of(r: WindowResult) -> tuple[dict[str, Any], dict[str, Sequence[float]]]:
    """The message a node leader sends its node of one window's result (:func:`result_of` reads it)."""
    d, collect, rebalance = r.decision, r.decision.gc_collect, r.rebalance
    vectors: dict[str, Sequence[float]] = {
        "delays_ms": d.delays_ms,
        "straggler_counts": r.stats.straggler_counts,
    }
    meta: dict[str, Any] = {
        "window": r.window,
        "decision": {
            "window": d.window,
            "state": d.state.value,
            "reason": d.reason,
            "baseline_step_ms": d.baseline_step_ms,
            "paced_step_ms": d.paced_step_ms,
            "gc_collect": None if collect is None else collect.after_step,
        },
        "stats": {
            "steps": r.stats.steps,
            "median_step_ms": r.stats.median_step_ms,
            "median_unpaced_skew_ms": r.stats.median_unpaced_skew_ms,
        },
        "rebalance": None,
    }
    if collect is not None:
        vectors["gc_due"] = collect.due
    if rebalance is not None:
        # the scalar fields only (asdict would deep-copy the per-rank tuples the vectors carry)
        meta["rebalance"] = {
            f.name: getattr(rebalance, f.name)
            for f in dataclasses.fields(rebalance)
            if f.name not in ("shares", "per_sample_ms")
        }
        meta["rebalance"]["state"] = rebalance.state.value
        vectors["shares"] = rebalance.shares
        if rebalance.per_sample_ms:  # empty before the first measured window
            vectors["per_sample_ms"] = rebalance.per_sample_ms
    return meta, vectors


def result_of(message: DecisionMessage, world_size: int) -> WindowResult:
    """The :class:`WindowResult` a non-leader keeps of a verdict: the decisions and the window's
    statistics, not its rows (``gathered`` is empty: only rank 0, a leader, writes telemetry)."""
    meta, vectors = message

    def floats(name: str) -> tuple[float, ...]:
        found = vectors.get(name, ())
        return tuple(found.tolist() if isinstance(found, torch.Tensor) else found)

    def ints(name: str) -> tuple[int, ...]:
        found = vectors.get(name, ())
        if isinstance(found, torch.Tensor):  # counts and samples: exact in float64, converted in C
            return tuple(found.to(torch.int64).tolist())
        return tuple(int(v) for v in found)

    d = meta["decision"]
    decision = Decision(
        window=d["window"],
        state=PolicyState(d["state"]),
        delays_ms=floats("delays_ms"),
        reason=d["reason"],
        baseline_step_ms=d["baseline_step_ms"],
        paced_step_ms=d["paced_step_ms"],
        gc_collect=None if d["gc_collect"] is None else GcCollect(d["gc_collect"], floats("gc_due")),
    )
    s = meta["stats"]
    stats = WindowStats(
        window=meta["window"],
        world_size=world_size,
        steps=s["steps"],
        median_step_ms=s["median_step_ms"],
        median_unpaced_skew_ms=s["median_unpaced_skew_ms"],
        pacable_lead_ms=torch.zeros(world_size, 0, dtype=torch.float64),
        straggler_counts=ints("straggler_counts"),
    )
    rebalance = None
    if (r := meta["rebalance"]) is not None:
        rebalance = RebalanceDecision(
            **{**r, "state": RebalanceState(r["state"])},
            shares=ints("shares"),
            per_sample_ms=floats("per_sample_ms"),
        )
    return WindowResult(
        window=meta["window"],
        gathered=torch.empty(0, 0, NUM_FIELDS, dtype=torch.float64),
        stats=stats,
        decision=decision,
        rebalance=rebalance,
    )
