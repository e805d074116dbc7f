"""The process groups pace_strategy builds for itself: the gloo side group of the window exchange and,
with ``exchange_topology: node_leaders``, each node's group and the node leaders' group.

Every group is gloo (a few floats per step on the CPU, off the NCCL streams) with its own timeout, so
that a dead or hung peer is reported by pace_strategy instead of hanging, and connects each pair of
ranks at its first message (:func:`lazy_gloo_connections`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PaceDistributedError
from pace_strategy.core.hierarchy import HierarchicalExchange, NodeLayout, check_layout
from pace_strategy.core.netif import GLOO_IFNAME_VARIABLE, gloo_interface

__all__ = ["LAZY_GLOO_VARIABLE", "lazy_gloo_connections", "node_leader_exchange", "side_group"]

log = logging.getLogger(__name__)

#: torch's switch for gloo groups that connect each pair of ranks at its first message
LAZY_GLOO_VARIABLE = "TORCH_GLOO_LAZY_INIT"


def side_group(config: PacingConfig) -> dist.ProcessGroup | None:
    """A gloo group over all ranks for the window exchange (``None`` when not distributed).

    Collective on every rank. gloo keeps the few floats per step on the CPU, off the NCCL streams, and
    gets its own timeout so that a dead or hung peer is reported by pace_strategy instead of hanging.
    Its interface is the one the job's own traffic takes (:func:`~pace_strategy.core.netif.gloo_interface`):
    ``GLOO_SOCKET_IFNAME`` when set, else the one that routes to ``MASTER_ADDR``, which is then set
    while the side group is built (gloo binds a group's device to an interface when it builds the
    group) and removed again, so that the job's own gloo groups choose theirs as they would without
    pace_strategy. A side group that cannot connect fails here, naming the interface and the
    variable to set.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    interface, why = gloo_interface()
    if interface is not None and not os.environ.get(GLOO_IFNAME_VARIABLE):
        log.debug("pace_strategy: gloo side group over %s (%s)", interface, why)
    try:
        with side_groups_built(interface):
            return dist.new_group(backend="gloo", timeout=timedelta(seconds=config.exchange_timeout_s))
    except Exception as error:
        where = (
            f"interface {interface} ({why})"
            if interface is not None
            else f"the host name's interface ({why})"
        )
        raise PaceDistributedError(
            dist.get_rank(),
            dist.get_world_size(),
            f"the gloo side group of pace_strategy could not connect over {where}: {error}. Set "
            f"{GLOO_IFNAME_VARIABLE} to the network interface the ranks reach each other through (the "
            "one NCCL_SOCKET_IFNAME or MASTER_ADDR uses), on every rank.",
        ) from error


def node_leader_exchange(
    config: PacingConfig, topology: Sequence[Mapping[str, Any]], rank: int, world_size: int
) -> HierarchicalExchange | None:
    """``exchange_topology: node_leaders``: this rank's node group and, on a node leader, the leaders'
    group (gloo, lazily connected, each built by its members only), or ``None`` where the placements
    give one node, or one rank per node (then the exchange runs flat). Collective over each group."""
    layout = NodeLayout.from_topology(topology)
    check_layout(layout, rank, world_size)
    if len(layout.nodes) in (1, world_size):
        if rank == 0:
            log.info(
                "pace_strategy: exchange_topology node_leaders, %d node(s) of %d ranks: the exchange is flat",
                len(layout.nodes),
                world_size,
            )
        return None
    timeout = timedelta(seconds=config.exchange_timeout_s)
    members = layout.nodes[layout.node_of(rank)]
    with side_groups_built(gloo_interface()[0]):
        # each group is built by its members only: no rank takes part in the other nodes' groups
        node_group = dist.new_group(
            list(members), backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        leader_group = None
        if rank == members[0]:
            leader_group = dist.new_group(
                list(layout.leaders), backend="gloo", timeout=timeout, use_local_synchronization=True
            )
    assert node_group is not None
    return HierarchicalExchange(layout, rank, node_group, leader_group, config.exchange_timeout_s)


@contextlib.contextmanager
def side_groups_built(interface: str | None) -> Iterator[None]:
    """While pace_strategy's own gloo groups are built (the side group, the node-leader groups):
    lazily connected (:func:`lazy_gloo_connections`), over ``interface`` unless the user set
    ``GLOO_SOCKET_IFNAME``; the job's own groups, built before or after, are left as they are."""
    with lazy_gloo_connections(), _while_built(GLOO_IFNAME_VARIABLE, interface):
        yield


@contextlib.contextmanager
def _while_built(variable: str, value: str | None) -> Iterator[None]:
    """``variable`` set to ``value`` while a group is built, unless the user set it (or no value)."""
    if value is None or os.environ.get(variable):
        yield
        return
    os.environ[variable] = value
    try:
        yield
    finally:
        os.environ.pop(variable, None)


@contextlib.contextmanager
def lazy_gloo_connections() -> Iterator[None]:
    """Build gloo groups that connect a pair of ranks at its first message, not all pairs up front.

    An eager gloo group opens a connection to each of the W - 1 other ranks when it is built: 8,191
    sockets per rank at 8,192 ranks, before the first step. The side group's collectives (the ring
    all-gather of each window, a few gathers at start and end) reach a handful of peers, so with
    ``TORCH_GLOO_LAZY_INIT`` a rank opens those only (measured with 8 processes: 1 socket at
    creation instead of 8, 2 more at the first all-gather). Set only while the side group is built,
    so the job's own gloo groups are left as they are; a value the user set is kept."""
    if LAZY_GLOO_VARIABLE in os.environ:
        yield
        return
    os.environ[LAZY_GLOO_VARIABLE] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_GLOO_VARIABLE, None)
