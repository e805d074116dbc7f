"""Ranks grouped for the tags and the Prometheus endpoint above ``per_rank_tag_limit``.

Up to ``per_rank_tag_limit`` ranks every rank has its own lead line. Above it one line per rank stops
being readable, and the lead's median and min..max band alone do not say where the late ranks are. So
the ranks are grouped by their place, and each group gets one lead: the lead of its last member to
arrive (the smallest of its members' leads: 0 for the group that holds the step's straggler). The
grouping follows the job's layout, first found:

- ``replica``: a device mesh with a replicate dimension (HSDP): the ranks of each data-parallel
  replica (its ``dp_replicate`` coordinate), usually a node or a few;
- ``dp``: a mesh with a tensor-parallel dimension: each tensor-parallel group (the ranks that share
  every data-parallel coordinate and differ in ``tp`` only), which arrives as one data-parallel rank;
- ``node``: otherwise the ranks of each node (``node_rank``).

No grouping when that gives fewer than two groups or more than ``per_rank_tag_limit``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pace_strategy.telemetry.topology import group_numbers, tensor_parallel_groups

__all__ = ["TagGroups", "tag_groups"]


@dataclass(frozen=True)
class TagGroups:
    """``kind`` of grouping and each rank's group (``index[rank]``, dense from 0, in order of first
    rank)."""

    kind: str
    index: tuple[int, ...]

    @property
    def count(self) -> int:
        return max(self.index) + 1

    def label(self, group: int) -> str:
        """The group's name in tags and Prometheus labels: ``replica_0``, ``dp_3``, ``node_12``."""
        return f"{self.kind}_{group}"


def tag_groups(
    topology: Sequence[Mapping[str, Any]], world_size: int, per_rank_tag_limit: int
) -> TagGroups | None:
    """The grouping of the module's rules for ``topology`` (every rank's placement, by rank), or
    ``None``: up to ``per_rank_tag_limit`` ranks (each rank has its own tags), without a placement
    for every rank, or when no rule gives 2 to ``per_rank_tag_limit`` groups."""
    if world_size <= per_rank_tag_limit or len(topology) != world_size:
        return None
    places = sorted(topology, key=lambda p: int(p.get("rank", 0)))

    def values(key: str) -> list[Any]:
        return [p.get(key) for p in places]

    replicas = values("dp_replicate")
    candidates: list[tuple[str, list[Any]]] = []
    if None not in replicas and len(set(replicas)) > 1:
        candidates.append(("replica", replicas))
    tensor_groups = tensor_parallel_groups(places)
    if tensor_groups is not None:
        candidates.append(("dp", [tuple(sorted(g.items())) for g in tensor_groups]))
    nodes = values("node_rank")
    if all(isinstance(n, int) and n >= 0 for n in nodes):
        candidates.append(("node", nodes))
    for kind, keys in candidates:
        index = group_numbers(keys)
        if 2 <= max(index) + 1 <= per_rank_tag_limit:
            return TagGroups(kind, index)
    return None
