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
    results: list[Any] = [None] * world_size

    def body(rank: int) -> None:
        try:
            # One store client per thread: a TCPStore client is not safe to share between threads.
            client = dist.TCPStore(
                "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, client), rank, world_size, timedelta(seconds=timeout_s)
            )
            results[rank] = fn(rank, group)
        except BaseException as error:  # returned to the test, which decides
            results[rank] = error

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"ranks still running after {timeout_s + 30} s: {alive}"
    return results


def raise_first(results: list[Any]) -> list[Any]:
    for rank, value in enumerate(results):
        if isinstance(value, BaseException):
            raise AssertionError(f"rank {rank} failed: {value!r}") from value
    return results
