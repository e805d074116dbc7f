"""Error types raised by pace_strategy: user configuration errors and distributed runtime errors."""

from __future__ import annotations

__all__ = ["PaceDistributedError", "PaceHangError", "PaceTimeoutError", "PacingConfigError"]


class PacingConfigError(ValueError):
    """A configuration value is invalid.

    The message names the field, echoes the value received, says what is allowed and how to fix it.
    """


class PaceDistributedError(RuntimeError):
    """A collective issued by pace_strategy failed (a peer died, the group broke).

    The message starts with ``[rank r/N]`` so that logs from many ranks can be told apart.
    """

    def __init__(self, rank: int, world_size: int, message: str) -> None:
        self.rank = rank
        self.world_size = world_size
        super().__init__(f"[rank {rank}/{world_size}] {message}")


class PaceTimeoutError(PaceDistributedError):
    """A collective issued by pace_strategy did not complete within the configured timeout."""


class PaceHangError(PaceDistributedError):
    """The hang watchdog named ranks that stopped arriving (the run record's ``hung`` status).

    ``ranks``, ``hosts`` and ``pids`` name the hung ranks (for a launcher or a callback to act on, e.g.
    to exclude a host on restart); empty when not known.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        hosts: tuple[str, ...] = (),
        pids: tuple[int | None, ...] = (),
    ) -> None:
        super().__init__(rank, world_size, message)
        self.ranks, self.hosts, self.pids = ranks, hosts, pids
