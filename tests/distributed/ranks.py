"""Thread ranks, each with a real gloo process group on a ``TCPStore(port=0)`` (no fixed ports)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def run_ranks(
    world_size: int, fn: Callable[[int, dist.ProcessGroup], Any], timeout_s: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, group)`` on ``world_size`` threads; returns each rank's result or exception."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = uuid.uuid4().hex

    def body(rank: int) -> Any:
        # One store client per thread: a TCPStore client is not safe to share between threads.
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, client), rank, world_size, timedelta(seconds=timeout_s)
        )
        return fn(rank, group)

    return _run_threads(world_size, body, timeout_s)


def _run_threads(world_size: int, body: Callable[[int], Any], timeout_s: float) -> list[Any]:
    """``body(rank)`` on ``world_size`` threads; each rank's result or exception."""
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # returned to the test, which decides
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"ranks still running after {timeout_s + 30} s: {alive}"
    return results


def run_node_ranks(
    nodes: list[int], fn: Callable[[int, dist.ProcessGroup, Any], Any], timeout_s: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, group, hierarchy)`` on thread ranks placed on nodes of ``nodes[i]`` ranks each
    (ranks numbered node after node): ``group`` spans every rank, ``hierarchy`` is the rank's
    :class:`~pace_strategy.core.hierarchy.HierarchicalExchange` over real node and leader gloo groups
    built on the same store."""
    from pace_strategy.core.hierarchy import HierarchicalExchange, NodeLayout

    layout = NodeLayout.from_topology(
        [
            {"rank": r, "node_rank": n}
            for n, size in enumerate(nodes)
            for r in range(sum(nodes[:n]), sum(nodes[: n + 1]))
        ]
    )
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = uuid.uuid4().hex
    world_size = sum(nodes)

    def body(rank: int) -> Any:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        timeout = timedelta(seconds=timeout_s)
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, world_size, timeout)
        node = layout.node_of(rank)
        members = layout.nodes[node]
        node_group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/node{node}", client), members.index(rank), len(members), timeout
        )
        leaders = None
        if rank == members[0]:
            leaders = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{prefix}/leaders", client), node, len(layout.nodes), timeout
            )
        return fn(rank, group, HierarchicalExchange(layout, rank, node_group, leaders, timeout_s))

    return _run_threads(world_size, body, timeout_s)


def raise_first(results: list[Any]) -> list[Any]:
    for rank, value in enumerate(results):
        if isinstance(value, BaseException):
            raise AssertionError(f"rank {rank} failed: {value!r}") from value
    return results
