"""Communication on an explicit process group: the batched window all-gather and a small object gather.

The group is always passed in, never looked up globally. Every call has a timeout and turns a failure
into a ``PaceDistributedError`` / ``PaceTimeoutError`` that says which rank, which step and what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy.core.errors import PaceDistributedError, PaceTimeoutError

__all__ = ["PendingGather", "WindowExchange", "field_major", "gather_json"]


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@dataclass
class PendingGather:
    """An all-gather in flight; ``WindowExchange.wait`` completes it."""

    work: Any
    outputs: list[torch.Tensor]
    first_step: int
    last_step: int


class WindowExchange:
    """Exchanges each rank's window of step records with one all-gather (CPU tensors, any backend group).

    With ``group=None`` the run is single-process and the exchange is the identity.
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, timeout_s: float) -> None:
        if group is not None and group.size() != world_size:
            raise ValueError(f"process group has {group.size()} ranks but world_size is {world_size}")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)

    def start(self, rows: torch.Tensor, first_step: int, last_step: int) -> PendingGather:
        """Launch the all-gather of ``rows`` ([steps, fields], float64) without waiting for it."""
        rows = rows.T.contiguous()  # field-major on the wire: see :meth:`wait`
        if self.group is None:
            return PendingGather(work=None, outputs=[rows], first_step=first_step, last_step=last_step)
        outputs = [torch.empty_like(rows) for _ in range(self.world_size)]
        try:
            work = self.group.allgather([outputs], [rows])
        except RuntimeError as error:
            raise self._error(error, first_step, last_step) from error
        return PendingGather(work=work, outputs=outputs, first_step=first_step, last_step=last_step)

    def wait(self, pending: PendingGather) -> torch.Tensor:
        """Wait (at most the timeout) and return the gathered window, ``[world_size, steps, fields]``.

        The window is a view of field-major memory (:func:`field_major`): one field of every rank,
        ``window[:, :, f]``, is ``world_size`` runs of ``steps`` contiguous numbers."""
        if pending.work is not None:
            try:
                pending.work.wait(self.timeout)
            except RuntimeError as error:
                raise self._error(error, pending.first_step, pending.last_step) from error
        return torch.stack(pending.outputs).transpose(1, 2)

    def gather(self, rows: torch.Tensor, first_step: int, last_step: int) -> torch.Tensor:
        """Blocking all-gather of one window."""
        return self.wait(self.start(rows, first_step, last_step))

    def _error(self, error: BaseException, first_step: int, last_step: int) -> PaceDistributedError:
        what = f"pace_strategy window exchange for steps {first_step}..{last_step}"
        if _is_timeout(error):
            return PaceTimeoutError(
                self.rank,
                self.world_size,
                f"{what} did not complete within {self.timeout.total_seconds():g} s: a peer rank is probably "
                f"dead or hung. Check the other ranks' logs; raise PacingConfig.exchange_timeout_s only if "
                f"steps are legitimately that slow. ({error})",
            )
        return PaceDistributedError(
            self.rank,
            self.world_size,
            f"{what} failed: a peer rank probably died (its connection closed). Check the other ranks' "
            f"logs for the first error. ({error})",
        )


def field_major(ranks: int, steps: int, fields: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An empty window ``[ranks, steps, fields]`` laid out as the exchange lays out what it gathers:
    each rank's fields one after another, each field's steps contiguous.

    Everything that reads a window reads it a field at a time (``window[:, :, Field.WAIT_MS]`` over
    every rank). Stored step-major, one field of 8,192 ranks is 262,144 numbers 17 apart, and reading
    it streams the whole 36 MB window through the cache; a decision and a summary read about ten
    fields. Field-major, a field is 8,192 runs of 32 adjacent numbers: the same values, read in
    about a tenth of the time (``benchmarks/scale.py``)."""
    return torch.empty(ranks, fields, steps, dtype=dtype).transpose(1, 2)


def gather_json(
    group: dist.ProcessGroup | None, rank: int, world_size: int, value: Any, timeout_s: float
) -> list[Any]:
    """Gather one JSON-serializable value from every rank (used once at start, for the topology)."""
    if group is None:
        return [value]
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    exchange = WindowExchange(group, rank, world_size, timeout_s)
    size = torch.tensor([[float(payload.numel())]], dtype=torch.float64)
    sizes = exchange.gather(size, -1, -1)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    outputs = [torch.empty_like(padded) for _ in range(world_size)]
    work = group.allgather([outputs], [padded])
    try:
        work.wait(exchange.timeout)
    except RuntimeError as error:
        raise exchange._error(error, -1, -1) from error
    return [json.loads(bytes(out[: int(sizes[r, 0, 0])].tolist()).decode()) for r, out in enumerate(outputs)]
